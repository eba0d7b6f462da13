"""Install cuesched on an existing Cuebot (OpenCue) database, adding only what is missing.

`--check` prints the plan and writes nothing; `--apply` carries it out in one transaction. Run
again after upgrading cuesched, it also replaces or drops cuesched's own out-of-date functions
and triggers (only those certainly cuesched's; see dispatch/adoption.py). Why
this is its own command and not `migrate`, and the rules it follows: `dispatch/adoption.py` and
docs/runbook.md ("Install on a Cuebot database").
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch.adoption import AdoptionError, adopt


class Command(BaseCommand):
    help = (
        "Adopt a Cuebot database: compare it with cuesched's schema (a scratch reference database migrated "
        "on the same server), add only missing tables, nullable or defaulted columns, indexes, functions and "
        "triggers, upgrade cuesched's own out-of-date functions and triggers, never drop, retype, re-index or "
        "replace a Cuebot object, and record Django's migrations as applied."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        mode = parser.add_mutually_exclusive_group(required=True)
        mode.add_argument("--check", action="store_true", help="print what adoption would do; write nothing")
        mode.add_argument("--apply", action="store_true", help="carry the plan out, in one transaction")
        parser.add_argument("--database", default="default", help="database alias (default: default)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = adopt(apply=options["apply"], using=options["database"])
        except AdoptionError as exc:
            raise CommandError(f"cannot adopt this database, nothing was written: {exc}") from exc
        for line in result.lines():
            self.stdout.write(line)
