"""`manage.py run_rqd_gateway`: answer OpenCue RQD daemons where they expect Cuebot.

A process of its own, not a thread of `run_scheduler`: its writes are the agents' (host
registration, pings, completions through the release path, on its own connections), so it
needs nothing from the Store; it can run beside a scheduler standby, be restarted without a
Store reseed, and a flood of reports from a big farm never competes with the dispatch loop
for the scheduler's GIL. Stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import conf
from dispatch.hosts.rqd_gateway import start_gateway


class Command(BaseCommand):
    help = "Serve RQD's report protocol (RqdReportInterface) for OpenCue render nodes."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--bind", default=None, help="Address to listen on (env CUESCHED_RQD_GATEWAY_BIND).")
        parser.add_argument(
            "--port", type=int, default=None, help="gRPC port, RQD's CUEBOT_GRPC_PORT (env CUESCHED_RQD_GATEWAY_PORT)."
        )
        parser.add_argument("--workers", type=int, default=16, help="Report handler threads.")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            gateway = start_gateway(opts["bind"], opts["port"], workers=max(1, opts["workers"]))
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        bind = opts["bind"] or conf.rqd_gateway_bind()
        self.stdout.write(f"rqd gateway on {bind}:{gateway.port}", ending="\n")
        self.stdout.flush()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        gateway.stop()
        self.stdout.write(f"rqd gateway stopped: {gateway.servicer.counts}")
