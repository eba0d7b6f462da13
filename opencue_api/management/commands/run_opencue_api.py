"""manage.py run_opencue_api: serve Cuebot's gRPC protocol to pycue, cueadmin, cueman, pyoutline and CueGUI."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from opencue_api.server import DEFAULT_ADDR, OPEN_FLAG, start


class Command(BaseCommand):
    help = "Serve OpenCue's client protocol (Cuebot's gRPC API) on Cuebot's port, loopback by default."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"HOST:PORT to listen on (default {DEFAULT_ADDR}).")
        parser.add_argument("--workers", type=int, default=16, help="Request handler threads.")
        parser.add_argument(
            OPEN_FLAG,
            dest="open_to_network",
            action="store_true",
            help="Listen on a non-loopback address. The protocol has no authentication: anyone who reaches "
            "the port can kill or change every job.",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            api = start(opts["addr"], workers=max(1, opts["workers"]), open_to_network=opts["open_to_network"])
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        host = opts["addr"].rpartition(":")[0]
        self.stdout.write(f"OpenCue client API on {host}:{api.port}")
        self.stdout.flush()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        api.stop()
        self.stdout.write("OpenCue client API stopped")
