"""`manage.py stress`: the stress suite (dispatch/lab/stress/, one module per phase) with its per-phase report.

Exits non-zero when any phase fails its audit, its pass criteria or sees a cap breach.
"""

from __future__ import annotations

from argparse import ArgumentParser
from dataclasses import fields
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dispatch.lab.stress import PHASES, StressConfig, run_stress, small


def _int(text: str) -> int:
    return int(text, 0)


class Command(BaseCommand):
    help = "Run the stress suite: drain, saturation and perturbation phases, each audited; cap watchdog throughout."

    def add_arguments(self, parser: ArgumentParser) -> None:
        d = StressConfig()
        parser.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
        parser.add_argument("--small", action="store_true", help="the test suite's small sizes")
        for f in fields(StressConfig):
            if f.name in ("phases",):
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _int if isinstance(f.default, int) else type(f.default)
            parser.add_argument(flag, type=kind, default=None, help=f"(default {getattr(d, f.name)})")

    def handle(self, *args: Any, **opts: Any) -> None:
        phases = tuple(p.strip() for p in opts["phases"].split(",") if p.strip())
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise CommandError(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
        cfg = small() if opts["small"] else StressConfig()
        given = {
            f.name: opts[f.name] for f in fields(StressConfig) if f.name != "phases" and opts.get(f.name) is not None
        }
        cfg = StressConfig(
            **{**{f.name: getattr(cfg, f.name) for f in fields(StressConfig)}, **given, "phases": phases}
        )
        reports = run_stress(cfg, emit=self.stdout.write)
        failed = [r.name for r in reports if not r.ok]
        self.stdout.write(f"phases: {len(reports)}, failed: {', '.join(failed) or 'none'}")
        if failed:
            raise CommandError(f"stress failed: {', '.join(failed)}")
