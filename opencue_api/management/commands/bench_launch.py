"""`manage.py bench_launch`: the time from LaunchSpecAndWait to the job's first booking.

Seeds a small farm (one show, one allocation, idle hosts), starts the accounting service, a
dispatch loop with the simulated launcher (production defaults: its idle sleep is what a new job
waits for) and the OpenCue client API on a free loopback port, then launches `--runs` one-layer
jobs, one at a time, through `JobInterface.LaunchSpecAndWait` with a cjsl 1.15 spec like the one
pyoutline sends. For each it measures, on this process's clock:

    answer: the LaunchSpecAndWait round trip (parse, submit, read the job back)
    booked: from the call to the first proc of the job committed (polled every millisecond)

and prints p50 and max of both. A figure, not a bound: it depends on the loop's sleeps.
"""

from __future__ import annotations

import statistics
import threading
import time
from argparse import ArgumentParser
from typing import Any

import grpc
from django.core.management.base import BaseCommand
from django.db import close_old_connections, connection
from opencue_proto import job_pb2, job_pb2_grpc

from accounting.service import AccountingService
from dispatch.engine.launcher import get_launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.lab.seeding import FarmSpec, facility_name, purge_farm, seed_farm, show_name
from opencue_api import server

SPEC = (
    '<?xml version="1.0"?><!DOCTYPE spec PUBLIC "SPI Cue  Specification Language" '
    '"http://localhost:8080/spcue/dtd/cjsl-1.15.dtd"><spec><facility>{facility}</facility><show>{show}</show>'
    "<shot>bench</shot><user>bench</user><uid>1000</uid>"
    '<job name="launch_{n}"><paused>False</paused><priority>1</priority><maxretries>1</maxretries>'
    '<autoeat>False</autoeat><env/><layers><layer name="main" type="Render"><cmd>echo #IFRAME#</cmd>'
    "<range>1-{frames}</range><chunk>1</chunk><cores>1.0</cores><memory>1g</memory><env/>"
    "<services><service>shell</service></services><outputs/></layer></layers></job><depends/></spec>"
)


class Command(BaseCommand):
    help = "Launch jobs through LaunchSpecAndWait on a seeded farm; print the time to each job's first booking."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--prefix", default="benchl", help="name prefix of the seeded farm (purged first)")
        parser.add_argument("--runs", type=int, default=20, help="jobs launched, one at a time")
        parser.add_argument("--hosts", type=int, default=10, help="idle 16-core hosts")
        parser.add_argument("--frames", type=int, default=4, help="frames per launched job")
        parser.add_argument("--keep", action="store_true", help="leave the farm in place afterwards")

    def handle(self, *args: Any, **opts: Any) -> None:
        prefix = opts["prefix"]
        purge_farm(prefix)
        seed_farm(
            FarmSpec(prefix=prefix, jobs=0, hosts=opts["hosts"], allocs=1, manual_tags=0, host_cores_choices=(16,))
        )
        show, facility = show_name(prefix, 0), facility_name(prefix, 0)
        stop = threading.Event()
        service = AccountingService()
        service.start(stop, bootstrap_timeout=30)
        launcher = get_launcher(
            "simulated", failure_rate=0.0, launch_failure_rate=0.0, runtime_min=0.0, runtime_max=0.05
        )
        loop = DispatchLoop(service, launcher)
        looping = threading.Thread(target=loop.run, args=(stop,), name="bench-launch-loop", daemon=True)
        looping.start()
        api = server.start("127.0.0.1:0", workers=4)
        answers: list[float] = []
        booked: list[float] = []
        try:
            with grpc.insecure_channel(f"127.0.0.1:{api.port}") as channel:
                stub = job_pb2_grpc.JobInterfaceStub(channel)
                for n in range(opts["runs"]):
                    spec = SPEC.format(facility=facility, show=show, n=n, frames=opts["frames"])
                    started = time.perf_counter()
                    reply = stub.LaunchSpecAndWait(job_pb2.JobLaunchSpecAndWaitRequest(spec=spec), timeout=30)
                    answers.append(time.perf_counter() - started)
                    job = reply.jobs.jobs[0].id
                    booked.append(self._first_booking(job, started) - started)
        finally:
            api.stop()
            stop.set()
            looping.join(15)
            service.join()
            close_old_connections()
            if not opts["keep"]:
                purge_farm(prefix)

        def ms(values: list[float]) -> str:
            return f"p50 {statistics.median(values) * 1000:.1f} ms, max {max(values) * 1000:.1f} ms"

        self.stdout.write(f"LaunchSpecAndWait answered: {ms(answers)} over {len(answers)} launches")
        self.stdout.write(f"LaunchSpecAndWait to the job's first booking: {ms(booked)} over {len(booked)} launches")

    def _first_booking(self, job: str, started: float, timeout: float = 30.0) -> float:
        with connection.cursor() as cur:
            while time.perf_counter() - started < timeout:
                cur.execute("SELECT EXISTS (SELECT 1 FROM proc WHERE pk_job = %s)", [job])
                if cur.fetchone()[0]:
                    return time.perf_counter()
                time.sleep(0.001)
        raise RuntimeError(f"job {job} was not booked within {timeout}s")
