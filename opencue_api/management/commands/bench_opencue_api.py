"""Latency of JobInterface.GetJobs with many jobs, through a raw gRPC client (issue 30's figure).

Seeds a farm of `--jobs` jobs (dispatch.lab.seeding, prefix `--prefix`, once: a second run reuses
it) in the database DATABASE_URL names, so run it on a scratch database. Then serves the API on a
free loopback port and times, from one client, `--calls` GetJobs of the whole show (cueadmin -lj,
a pycue getJobs(show=...)) and of 50 ids (CueGUI's job monitor polls in batches of 50).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import grpc
from django.core.management.base import BaseCommand
from opencue_proto import job_pb2, job_pb2_grpc

from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from dispatch.models import Job
from opencue_api import server


def _percentiles(seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms ({len(ms)} calls)"


class Command(BaseCommand):
    help = "Time GetJobs with --jobs jobs (default 10,000) through a raw gRPC client; seeds a scratch farm."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--jobs", type=int, default=10_000, help="jobs in the seeded show")
        parser.add_argument("--calls", type=int, default=50, help="timed calls per request kind")
        parser.add_argument("--prefix", default="benchapi", help="name prefix of the seeded farm (reused if seeded)")

    def handle(self, *args: Any, **opts: Any) -> None:
        prefix, n = opts["prefix"], opts["jobs"]
        show = show_name(prefix, 0)
        have = Job.objects.filter(str_show=show).count() or Job.objects.filter(show__str_name=show).count()
        if have < n:
            started = time.monotonic()
            seed_farm(
                FarmSpec(
                    prefix=prefix, shows=1, allocs=1, hosts=10, jobs=n, layers=1, frames_per_layer=2, managed=False
                )
            )
            self.stdout.write(f"seeded {n:,} jobs in {time.monotonic() - started:.1f} s")
        ids = list(Job.objects.filter(show__str_name=show).values_list("pk", flat=True)[:50])
        api = server.start("127.0.0.1:0")
        try:
            options = [("grpc.max_receive_message_length", server.MAX_MESSAGE_BYTES)]
            with grpc.insecure_channel(f"127.0.0.1:{api.port}", options=options) as channel:
                stub = job_pb2_grpc.JobInterfaceStub(channel)
                for label, criteria in (
                    (f"GetJobs(shows=[{show}])", job_pb2.JobSearchCriteria(shows=[show])),
                    ("GetJobs(ids=50)", job_pb2.JobSearchCriteria(ids=ids, include_finished=True)),
                ):
                    stub.GetJobs(job_pb2.JobGetJobsRequest(r=criteria))  # warm up
                    times, count = [], 0
                    for _ in range(opts["calls"]):
                        t0 = time.perf_counter()
                        count = len(stub.GetJobs(job_pb2.JobGetJobsRequest(r=criteria)).jobs.jobs)
                        times.append(time.perf_counter() - t0)
                    self.stdout.write(f"{label}: {count:,} jobs returned; {_percentiles(times)}")
        finally:
            api.stop()
