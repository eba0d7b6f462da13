"""`manage.py store_status`: the scheduler's published Store view, for scripts and ops at a terminal."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from accounting import blockers, live
from accounting.trigger_health import describe, trigger_problems

# The exit status of a view that is printed but stale: a script or a monitoring check that
# runs `store_status` must not read a dead scheduler's last words as a healthy farm.
EXIT_STALE = 1
# The exit status while one of cuesched's triggers is missing, disabled or doubled (the view may
# look right and still be built on counters going wrong).
EXIT_TRIGGERS = 1


class Command(BaseCommand):
    help = (
        "Print the live Store view the running scheduler publishes (with its age). Exits 1 when the "
        "view is STALE (the scheduler stopped publishing), when no scheduler ever published one, or "
        "when one of cuesched's triggers is missing, disabled or installed twice (each is printed)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="Print the whole view as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        # A view can read healthy while a trigger that stopped counting makes it wrong: said first.
        problems = trigger_problems(connection)
        for problem in problems:
            self.stdout.write(f"TRIGGER PROBLEM: {problem.line()}")
        with connection.cursor() as cursor:
            view = live.read_view(cursor)
        if view is None:
            also = f"; and {describe(problems)}" if problems else ""
            raise CommandError(f"no scheduler has published a view on this database (is run_scheduler running?){also}")
        if options["json"]:
            self.stdout.write(json.dumps(view, indent=2, sort_keys=True, default=str))
        else:
            self._print(view)
        if view["stale"]:
            raise CommandError(
                f"the view is STALE ({view['age_seconds']:.1f}s old): scheduler pid {view['pid']} on "
                f"{view['hostname']} is not publishing (stopped, wedged or cut off from the database)",
                returncode=EXIT_STALE,
            )
        if problems:
            raise CommandError(describe(problems), returncode=EXIT_TRIGGERS)

    def _print(self, view: dict[str, Any]) -> None:
        state = "STALE: the scheduler is not publishing" if view["stale"] else "live"
        self.stdout.write(
            f"scheduler pid {view['pid']} on {view['hostname']}, view {view['age_seconds']:.1f}s old ({state})"
        )
        lst = view["listener"]
        age = lst.get("heartbeat_age_seconds")
        self.stdout.write(
            f"listener {lst['state']}: releases {lst['releases_applied']} applied / {lst['releases_skipped']} "
            f"skipped, caps {lst['limits_applied']} applied / {lst['limits_skipped']} skipped, "
            f"dropped {sum(lst['dropped'].values())}, reconnects {lst['reconnects']}, "
            f"heartbeat {'none yet' if age is None else f'{age:.1f}s old'} "
            f"(deadline {lst.get('heartbeat_deadline_seconds', 0):.1f}s), wedges {lst.get('wedges', 0)}"
        )
        cuebot = view.get("cuebot_mode")
        if cuebot:
            self.stdout.write(f"Cuebot mode {cuebot['description']}")
            if cuebot.get("notifier_releases_dropped"):
                self.stdout.write(
                    f"WARNING: {cuebot['notifier_releases_dropped']} release(s) from Cuebot's AccountingNotifier "
                    "dropped (cuesched's trigger already sent each): set accounting.notify.enabled=false in Cuebot"
                )
        if view.get("enforcing") is False:
            self.stdout.write(f"ACCOUNTING PAUSED: managed shows book nothing: {view.get('paused_reason')}")
        self.stdout.write(
            f"lease generation {view.get('lease_generation')}, server changes {view.get('server_changes', 0)}, "
            f"unmanaged drift at the last reconcile {view.get('reconcile_drift_cores') or {}}"
        )
        for line in blockers.view_lines(view):
            self.stdout.write(f"LOCKED: {line}")
        rc = view.get("recompute")
        if rc:
            self.stdout.write(
                f"last recompute: {rc['keys']} keys in {rc['store_seconds']:.3f}s (store) + "
                f"{rc['pg_seconds']:.3f}s (pg), drift {rc['drift_cores']}"
            )
        self.stdout.write(f"managed shows: {len(view['managed_shows'])}")
        self.stdout.write("subscriptions (show:alloc  booked/burst cores):")
        for key, entry in sorted(view["sub"].items()):
            self.stdout.write(f"  {key}  {entry['cores']}/{entry['burst']}  gpus {entry['gpus']}")
        busy_jobs = sum(1 for e in view["job"].values() if e["cores"] or e["gpus"])
        self.stdout.write(f"folders: {len(view['folder'])}, jobs: {len(view['job'])} ({busy_jobs} booking)")
