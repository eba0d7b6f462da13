"""`manage.py run_scheduler`: the one long-running process that owns the accounting Store."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from accounting.scheduler import SchedulerOptions, SchedulerProcess
from accounting.singleton import SchedulerAlreadyRunning
from cuesched_project import conf


class Command(BaseCommand):
    help = (
        "Run the scheduler: bootstrap the accounting Store from PostgreSQL, keep it in sync "
        "(LISTEN/NOTIFY, recompute, limit reseed, managed shows), publish its live view and dispatch."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=conf.env_int("CUESCHED_METRICS_PORT", 9090),
            help="Prometheus /metrics port on 127.0.0.1 (0 disables; env CUESCHED_METRICS_PORT, default 9090).",
        )
        parser.add_argument(
            "--no-dispatch",
            action="store_true",
            help="Keep accounting in sync and published, but book nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()

        def _stop(signum: int, _frame: object) -> None:
            self.stderr.write(f"received {signal.Signals(signum).name}, stopping")
            stop.set()

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        process = SchedulerProcess(SchedulerOptions(metrics_port=options["metrics_port"]), stop=stop)
        try:
            process.run()
        except SchedulerAlreadyRunning as exc:
            raise CommandError(str(exc)) from None
