"""`manage.py bench_accounting`: the runtime figures of issue 5 on a farm of its own.

Seeds `--jobs` jobs with `--frames` frames each (default 10,000 x 10), starts every frame
as a 1-core proc (100,000 procs), then measures the recompute cycle, the commit-to-Store
delay of single releases and the reconnect-to-healed time; purges the farm at the end.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from accounting import bench, db
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm


class Command(BaseCommand):
    help = "Measure recompute cycle time, notification-to-Store delay and reconnect-to-healed time."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--jobs", type=int, default=10_000)
        parser.add_argument("--frames", type=int, default=10, help="Frames (and so procs) per job.")
        parser.add_argument("--hosts", type=int, default=2_000)
        parser.add_argument("--releases", type=int, default=1_000)
        parser.add_argument("--repeats", type=int, default=5)
        parser.add_argument("--prefix", default="benchacct")
        parser.add_argument("--keep", action="store_true", help="Leave the farm in place afterwards.")

    def handle(self, *args: Any, **opts: Any) -> None:
        prefix = opts["prefix"]
        purge_farm(prefix)
        spec = FarmSpec(
            prefix=prefix,
            hosts=opts["hosts"],
            jobs=opts["jobs"],
            layers=1,
            frames_per_layer=opts["frames"],
            host_cores_choices=(128,),
            host_mem_gb_choices=(256,),
            managed=True,
            allocs=3,
        )
        farm = seed_farm(spec)
        self.stdout.write(f"seeded {sum(farm.rows.values())} rows in {farm.seconds:.1f}s")
        try:
            with db.connect(application_name="cuesched-bench") as conn:
                procs = bench.book_all(conn, prefix, opts["jobs"] * opts["frames"])
            self.stdout.write(f"started {procs} procs over {opts['jobs']} jobs")
            rc = bench.measure_recompute(opts["repeats"])
            self.stdout.write(
                f"recompute cycle with {rc.procs} procs over {rc.jobs} jobs: {rc.cycle.fmt()}\n"
                f"  store side {rc.store_side.fmt()}\n  pg side    {rc.pg_side.fmt()}"
            )
            nd = bench.measure_notify_delay(prefix, opts["releases"])
            self.stdout.write(
                f"notification-to-Store delay over {nd.releases} releases: p50 {nd.p50_ms:.2f} ms, "
                f"p99 {nd.p99_ms:.2f} ms, max {nd.max_ms:.2f} ms"
            )
            heal = bench.measure_reconnect_heal(prefix, opts["repeats"])
            self.stdout.write(f"reconnect-to-healed (listener backend killed): {heal.fmt('ms', 1000, 0)}")
        finally:
            if not opts["keep"]:
                purge_farm(prefix)
