"""`manage.py rqd_hosts`: the RQD hosts waiting for an operator, and `admit NAME --alloc ALLOC`.

An RQD whose host is unknown, with `CUESCHED_RQD_DEFAULT_ALLOC` unset, is answered UNAVAILABLE
(RQD 1.37 retries its startup every 15 s on that status, and exits on any other) and waits in
`cuesched_waiting_host` (dispatch.hosts.waiting). Admitting it registers the host into the
allocation, as its last report described it, with an audit row; the daemon's next startup report
then finds it known and it takes frames.
"""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from accounting import db as acct_db
from dispatch.hosts import waiting


class Command(BaseCommand):
    help = "List the RQD hosts waiting to be admitted, or admit one into an allocation."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action")
        sub.add_parser("list", help="the waiting hosts (the default)")
        admit = sub.add_parser("admit", help="register a waiting host into an allocation")
        admit.add_argument("name", help="the host's name, as its RQD reports it")
        admit.add_argument("--alloc", required=True, help="the allocation it joins (alloc.str_name)")
        admit.add_argument("--user", default="", help="who admits it, for the audit row")

    def handle(self, *args: Any, action: str | None = None, **options: Any) -> None:
        if action == "admit":
            try:
                pk_host = waiting.admit(options["name"], options["alloc"], actor=options["user"] or "manage.py")
            except (LookupError, ValueError) as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(
                f"host {options['name']} admitted into {options['alloc']} ({pk_host}); "
                "its RQD registers at its next startup report (within 15 s)"
            )
            return
        with acct_db.connect(autocommit=True, application_name="cuesched-rqd-hosts") as conn:
            rows = waiting.waiting(conn)
        if not rows:
            self.stdout.write("no RQD host is waiting")
            return
        for w in rows:
            self.stdout.write(
                f"{w.name}\t{w.address or '-'}\t{w.cores} cores\t{w.memory_kb // 1024} MB\t{w.gpus} GPUs"
                f"\t{w.reports} report(s)\tsince {w.first_seen:%Y-%m-%d %H:%M:%S}"
            )
