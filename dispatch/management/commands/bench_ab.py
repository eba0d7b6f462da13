"""`manage.py bench_ab`: `bench` of another revision against this checkout, alternated, figure by figure.

The method (scratch tree and databases, alternation, medians, per-round ratios) is in
dispatch/lab/abbench.py and docs/benchmarks.md.
"""

from __future__ import annotations

import json
import tempfile
from argparse import REMAINDER, ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from cuesched_project.dburl import url_from_settings
from dispatch.lab import abbench


class Command(BaseCommand):
    help = (
        "A/B bench: `bench` of a git revision (--against) and of this checkout, alternated for --rounds "
        "rounds on scratch databases; each figure's medians, new/old ratio and per-round spread."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--against", required=True, help="the old side: a git revision (sha, branch, HEAD~1)")
        parser.add_argument(
            "--new", default=None, help="the new side: a git revision (default: this checkout as it is)"
        )
        parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs bench once per side, old first")
        parser.add_argument(
            "--python", default=None, help="interpreter for a side whose requirements.txt differs from this one's"
        )
        parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one bench (or migrate) may take")
        parser.add_argument("--out", default="artifacts/bench-ab/", help="where ab.json (the comparison) is written")
        parser.add_argument("--keep", action="store_true", help="keep the scratch tree and the bench logs")
        parser.add_argument(
            "bench_args",
            nargs=REMAINDER,
            help="after `--`: bench's own arguments, the same for both sides (e.g. -- --runs 3 --skip releases)",
        )

    @staticmethod
    def _kept(scratch: Path) -> str:
        """Where the logs of a failed run are (an empty scratch directory is removed)."""
        if any(scratch.iterdir()):
            return f"\n(scratch tree and logs kept in {scratch})"
        abbench.cleanup(scratch)
        return ""

    def handle(self, *args: Any, **opts: Any) -> None:
        bench_args = list(opts["bench_args"])
        if bench_args[:1] == ["--"]:
            bench_args = bench_args[1:]
        repo = Path(settings.BASE_DIR)
        scratch = Path(tempfile.mkdtemp(prefix="cuesched-bench-ab-"))
        try:
            result = abbench.run_ab(
                repo,
                against=opts["against"],
                new_revision=opts["new"],
                rounds=opts["rounds"],
                bench_args=bench_args,
                base_url=url_from_settings(connection.settings_dict),
                scratch=scratch,
                python=opts["python"],
                timeout=opts["timeout"],
                emit=self.stdout.write,
            )
        except abbench.ABError as exc:
            raise CommandError(f"{exc}{self._kept(scratch)}") from exc
        except BaseException:
            self.stderr.write(f"bench_ab interrupted{self._kept(scratch)}")
            raise
        for line in abbench.report_lines(result):
            self.stdout.write(line)
        out = Path(opts["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.json").write_text(json.dumps(abbench.result_json(result), indent=2))
        self.stdout.write(f"wrote {out / 'ab.json'}")
        if opts["keep"]:
            self.stdout.write(f"scratch tree and logs kept in {scratch}")
        else:
            abbench.cleanup(scratch)
