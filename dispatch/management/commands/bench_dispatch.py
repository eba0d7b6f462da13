"""`manage.py bench_dispatch`: drain a seeded farm with the simulated launcher and print frames/s.

The full production path: the accounting service (listener, bootstrap from the database),
the dispatch loop on its own connection, the simulated launcher, completions through the
release triggers. Prints the figures in the stress report's words:

    throughput: <N> frames/s over a <S>s booking window (wall <W>s)

where the booking window runs from the first booking transaction's start to the last one's
commit, measured in the loop. `--unmanaged` seeds the same farm with b_scheduler_managed =
false, so the run uses the database-enforced accounting instead of the Store.
"""

from __future__ import annotations

import threading
import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django.db import connection

from accounting.service import AccountingService
from dispatch.engine.launcher import get_launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm

VACUUMED = (
    "frame",
    "proc",
    "host",
    "host_stat",
    "job",
    "job_stat",
    "job_resource",
    "layer",
    "layer_stat",
    "layer_resource",
    "subscription",
    "folder_resource",
    "point",
)


class Command(BaseCommand):
    help = "Seed a farm, drain it with the simulated launcher, print booking throughput."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--prefix", default="benchd")
        parser.add_argument("--hosts", type=int, default=1200)
        parser.add_argument("--jobs", type=int, default=300)
        parser.add_argument("--layers", type=int, default=4)
        parser.add_argument("--frames-per-layer", type=int, default=5)
        parser.add_argument("--unmanaged", action="store_true", help="database-enforced accounting")
        parser.add_argument(
            "--contended",
            action="store_true",
            help="one show, one allocation, one folder: every booking hits the same subscription and folder "
            "caps (--sub-burst, --folder-max-cores, in cores)",
        )
        parser.add_argument("--sub-burst", type=int, default=600, help="cores (contended workload)")
        parser.add_argument("--folder-max-cores", type=int, default=400, help="cores (contended workload)")
        parser.add_argument("--runtime", type=float, default=None, help="simulated max runtime (s); 0: at once")
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument("--repeat", type=int, default=1)
        parser.add_argument("--keep", action="store_true", help="leave the farm in place afterwards")
        parser.add_argument("--profile", action="store_true", help="cProfile the dispatch loop's thread")

    def handle(self, *args: Any, **opts: Any) -> None:
        figures = []
        for i in range(opts["repeat"]):
            figures.append(self._one(opts, i))
        if len(figures) > 1:
            rates = sorted(f for f in figures)
            self.stdout.write(f"median {rates[len(rates) // 2]:.0f} frames/s (min {rates[0]:.0f}, max {rates[-1]:.0f})")

    def _one(self, opts: dict[str, Any], run: int) -> float:
        prefix = opts["prefix"]
        purge_farm(prefix)
        contended = (
            {
                "allocs": 1,
                "sub_burst": opts["sub_burst"] * 100,
                "folder_max_cores": opts["folder_max_cores"] * 100,
            }
            if opts["contended"]
            else {}
        )
        spec = FarmSpec(
            prefix=prefix,
            hosts=opts["hosts"],
            jobs=opts["jobs"],
            layers=opts["layers"],
            frames_per_layer=opts["frames_per_layer"],
            managed=not opts["unmanaged"],
            **contended,
        )
        seed = seed_farm(spec)
        frames = opts["jobs"] * opts["layers"] * opts["frames_per_layer"]
        with connection.cursor() as cur:
            # Dead rows from earlier runs (purge, reseed) would otherwise be measured too.
            cur.execute(f"VACUUM ANALYZE {', '.join(VACUUMED)}")
        stop = threading.Event()
        service = AccountingService()
        service.start(stop, bootstrap_timeout=30)
        runtime = opts["runtime"]
        launcher_opts: dict[str, Any] = {"failure_rate": 0.0, "launch_failure_rate": 0.0}
        if runtime is not None:
            launcher_opts.update(runtime_min=min(runtime, 0.05), runtime_max=runtime)
        launcher = get_launcher("simulated", **launcher_opts)
        loop = DispatchLoop(service, launcher, batch_size=opts["batch_size"])
        started = time.perf_counter()
        if opts["profile"]:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            totals = loop.run(stop, exit_when_idle=True)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        else:
            totals = loop.run(stop, exit_when_idle=True)
        wall = time.perf_counter() - started
        stop.set()
        service.join()
        window = loop.booking_window()
        rate = totals.booked / window if window > 0 else 0.0
        self.stdout.write(
            f"run {run + 1}: {'unmanaged' if opts['unmanaged'] else 'managed'}"
            f"{' contended' if opts['contended'] else ''} farm {opts['hosts']} hosts, "
            f"{frames} frames ({seed.seconds:.1f}s to seed)"
        )
        self.stdout.write(f"throughput: {rate:.0f} frames/s over a {window:.2f}s booking window (wall {wall:.2f}s)")
        self.stdout.write(
            f"booked {totals.booked}, completed {totals.completed}, batches {totals.batches}, "
            f"rejected {dict(totals.rejected)}, launch failures {totals.launch_failures}, cycles {loop.cycles}"
        )
        self.stdout.write("seconds by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(totals.seconds.items())))
        if not opts["keep"]:
            purge_farm(prefix)
        return rate
