"""`manage.py submit_job SPEC.json` (or `-` for standard input): submit a job spec.

Prints the new job's id, name and frame count. A refused spec prints every reason on stderr,
one per line, and exits non-zero. The spec format is docs/jobs.md (validated by dispatch.jobs.spec).
"""

from __future__ import annotations

import getpass
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dispatch.jobs.plan import SpecError
from dispatch.jobs.spec import load_spec
from dispatch.jobs.submit import submit_job


class Command(BaseCommand):
    help = (
        "Submit a job from a JSON spec file (or - for standard input); prints the job id and frame count."
        " The spec format, field by field: docs/jobs.md."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("spec", help="the JSON job spec file (docs/jobs.md), or - to read standard input")
        parser.add_argument("--user", help="owner of the job when the spec names no user (default: your login name)")

    def handle(self, *args: Any, spec: str, user: str | None, **options: Any) -> None:
        try:
            if spec == "-":
                text = sys.stdin.buffer.read()
            else:
                with open(spec, "rb") as fh:
                    text = fh.read()
        except OSError as exc:
            raise CommandError(f"cannot read {spec}: {exc.strerror}") from None
        owner = user or getpass.getuser()
        try:
            result = submit_job(load_spec(text), user=owner, actor=f"cli:{getpass.getuser()}")
        except SpecError as exc:
            for error in exc.errors:
                self.stderr.write(f"error: {error}")
            raise CommandError(f"the spec was refused ({len(exc.errors)} error(s)); nothing was submitted") from None
        self.stdout.write(f"{result.job_id} {result.name}: {result.frames} frames in {result.layers} layers")
