"""`manage.py run_scheduler`: the one long-running process that owns the accounting Store."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from accounting.cuebot import CuebotModeError
from accounting.metrics import MetricsPortError
from accounting.scheduler import LeaseSettingsError, SchedulerOptions, SchedulerProcess
from accounting.singleton import SchedulerAlreadyRunning
from accounting.trigger_health import describe, trigger_problems
from cuesched_project import conf
from dispatch import conf as dispatch_conf


def _runtime(value: str) -> tuple[float, float]:
    """`0`, `2.5` or `0.05-0.5`: the simulated launcher's frame runtime in seconds."""
    lo, _, hi = value.partition("-")
    try:
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise ValueError(f"--runtime takes SECONDS or MIN-MAX, got {value!r}") from None
    if low < 0 or high < low:
        raise ValueError(f"--runtime needs 0 <= MIN <= MAX, got {value!r}")
    return low, high


class Command(BaseCommand):
    help = (
        "Run the scheduler: bootstrap the accounting Store from PostgreSQL, keep it in sync "
        "(LISTEN/NOTIFY, recompute, limit reseed, managed shows), publish its live view, and dispatch "
        "waiting frames onto hosts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--launcher",
            default=None,
            help="How frames run: q2, celery, rqd or simulated (env CUESCHED_LAUNCHER, default q2).",
        )
        parser.add_argument(
            "--runtime",
            type=_runtime,
            default=None,
            metavar="SECONDS|MIN-MAX",
            help="Simulated launcher only: how long a frame runs (env CUESCHED_SIM_RUNTIME_MIN/MAX).",
        )
        parser.add_argument(
            "--exit-when-idle",
            action="store_true",
            help="Exit 0 once no frame is WAITING or RUNNING (scripts, CI, benchmarks).",
        )
        parser.add_argument(
            "--managed-only",
            action="store_true",
            default=None,
            help="Dispatch only scheduler-managed shows, for a database shared with a running Cuebot "
            "(env CUESCHED_DISPATCH_MANAGED_ONLY; always on in Cuebot mode, CUESCHED_CUEBOT_MODE).",
        )
        parser.add_argument(
            "--workers",
            type=int,
            default=None,
            help="Dispatch loops, each on its own share of hosts and jobs (env CUESCHED_DISPATCH_WORKERS, default 1).",
        )
        parser.add_argument(
            "--no-dispatch",
            action="store_true",
            help="Keep accounting in sync and published, but book nothing.",
        )
        parser.add_argument(
            "--standby",
            action="store_true",
            help="Wait for the scheduler lock instead of refusing to start; on takeover, take the lease "
            "(which waits for the old scheduler's last booking), bootstrap, then book (a hot standby).",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=conf.env_int("CUESCHED_METRICS_PORT", 9090),
            help="Prometheus /metrics port on 127.0.0.1 (0 disables; env CUESCHED_METRICS_PORT, default 9090).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from dispatch.engine.loop import dispatch_main

        # Before anything is taken: a Store bootstrapped from counters a missing or disabled
        # trigger stopped keeping would book past a cap (accounting/trigger_health.py).
        problems = trigger_problems(connection)
        if problems:
            raise CommandError(f"{describe(problems)}; the scheduler did not start")
        # Every session this process keeps is opened by accounting.db.connect, tagged with its
        # lease: a standby fencing it finds them all (accounting/singleton.py).
        connection.close()
        stop = threading.Event()

        def _stop(signum: int, _frame: object) -> None:
            self.stderr.write(f"received {signal.Signals(signum).name}, stopping")
            stop.set()

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        main = None
        if options["workers"] is not None and options["workers"] < 1:
            raise CommandError("--workers must be at least 1")
        if not options["no_dispatch"]:
            launcher = options["launcher"] or dispatch_conf.launcher_name()
            launcher_options: dict[str, Any] = {}
            if options["runtime"] is not None:
                if launcher != "simulated":
                    raise CommandError("--runtime applies to the simulated launcher only")
                launcher_options["runtime_min"], launcher_options["runtime_max"] = options["runtime"]
            main = dispatch_main(
                launcher,
                exit_when_idle=options["exit_when_idle"],
                loop_options={"managed_only": True} if options["managed_only"] else None,
                workers=options["workers"],
                **launcher_options,
            )
        try:
            process = SchedulerProcess(
                SchedulerOptions(metrics_port=options["metrics_port"], standby=options["standby"]), stop=stop
            )
        except LeaseSettingsError as exc:
            raise CommandError(str(exc)) from None
        try:
            process.run(main)
        except (SchedulerAlreadyRunning, MetricsPortError, CuebotModeError) as exc:
            raise CommandError(str(exc)) from None
        if process.lock_lost or process.service.lease_lost.is_set():
            # Non-zero, so a supervisor sees it: whatever noticed first (the lock guard, a
            # booking transaction's generation check, a failed renewal), the lease is gone.
            raise CommandError("this scheduler lost its lease to another scheduler and stopped booking")
