"""`manage.py bench_rqd`: frames through real OpenCue RQD daemons, against q2 host agents, same run.

Per run and per launcher (alternating, so both meet the same machine load): a fresh farm (one
managed show, one allocation, no seeded host), `--daemons` hosts - real `python -m rqd`
daemons reporting to a gateway in this process for `rqd`, `run_agent --transport q2`
subprocesses for `q2` -, `--cores` cores each, one job of `--frames` 1-core frames running
`true`, then the dispatch loop (Store, listener, the launcher) until the job drains.

Figures, from the frames' own timestamps (the booking's `ts_started`, the completion's
`ts_stopped`, both the database's clock):
- started/s: frames / (last booking - first booking);
- completed/s: frames / (last completion - first booking);
- booking-to-end latency p50/p99 of one frame: from its booking commit to its end recorded by the
  release path. A `true` frame ends as soon as it runs, so this is launch-to-running plus the
  report of the end (an upper bound of launch-to-running).
Each is the median of `--runs` runs (min and max beside). Writes bench_rqd.json into --out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from accounting import db
from accounting.bench import Spread
from accounting.service import AccountingService
from cuesched_project.dburl import url_from_settings
from dispatch.engine.launcher import get_launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.rqd_gateway import start_gateway
from dispatch.jobs.submit import submit_job
from dispatch.lab.rqdfarm import start_daemons, wait_registered
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm, show_name
from dispatch.lab.stress import QUIET_LOOPS, env

FIGURES_SQL = """
SELECT count(*),
       EXTRACT(EPOCH FROM max(ts_started) - min(ts_started))::float8,
       EXTRACT(EPOCH FROM max(ts_stopped) - min(ts_started))::float8,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM ts_stopped - ts_started)),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM ts_stopped - ts_started)),
       count(*) FILTER (WHERE str_state = 'SUCCEEDED')
FROM frame WHERE pk_job = %s
"""
AGENTS_UP_SQL = """
SELECT count(*) FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE h.str_name = ANY(%s) AND hs.ts_ping > now() - interval '3 seconds'
"""


def _spread(samples: list[float]) -> dict[str, float]:
    s = Spread.of(samples)
    return {"median": s.median, "min": s.low, "max": s.high, "runs": s.runs}


class Command(BaseCommand):
    help = "Frames/s and booking-to-end latency through real RQD daemons, against q2 agents in the same run."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--runs", type=int, default=3, help="runs per launcher (median, min, max)")
        parser.add_argument("--frames", type=int, default=200, help="`true` frames per run")
        parser.add_argument("--daemons", type=int, default=4, help="hosts: RQD daemons, or q2 agents")
        parser.add_argument("--cores", type=int, default=4, help="cores per host (one frame per core)")
        parser.add_argument("--launchers", default="rqd,q2", help="comma list, measured in turn in each run")
        parser.add_argument("--prefix", default="brqd")
        parser.add_argument("--out", default="artifacts/bench/")
        parser.add_argument("--timeout", type=float, default=300.0, help="seconds one drain may take")

    def handle(self, *args: Any, **opts: Any) -> None:
        launchers = [x.strip() for x in opts["launchers"].split(",") if x.strip()]
        if unknown := [x for x in launchers if x not in ("rqd", "q2")]:
            raise CommandError(f"bench_rqd measures rqd and q2, not {', '.join(unknown)}")
        samples: dict[str, dict[str, list[float]]] = {
            name: {"started_per_s": [], "completed_per_s": [], "p50_ms": [], "p99_ms": []} for name in launchers
        }
        gateway = start_gateway("127.0.0.1", 0, workers=16)
        try:
            for run in range(opts["runs"]):
                for name in launchers:
                    fig = self._one(name, run, opts, gateway.port)
                    for key, value in fig.items():
                        samples[name][key].append(value)
                    self.stdout.write(
                        f"run {run + 1} {name}: {fig['started_per_s']:.1f} started/s, "
                        f"{fig['completed_per_s']:.1f} completed/s, booking-to-end p50 {fig['p50_ms']:.0f} ms, "
                        f"p99 {fig['p99_ms']:.0f} ms"
                    )
        finally:
            gateway.stop()
        results = {
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str))},
            "figures": {name: {k: _spread(v) for k, v in figs.items()} for name, figs in samples.items()},
        }
        out = Path(opts["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_rqd.json").write_text(json.dumps(results, indent=2))
        self.stdout.write(
            f"{opts['daemons']} hosts x {opts['cores']} cores, {opts['frames']} `true` frames, "
            f"median of {opts['runs']} runs (min-max):"
        )
        for name, figs in results["figures"].items():
            row = "  ".join(f"{k} {f['median']:.1f} ({f['min']:.1f}-{f['max']:.1f})" for k, f in figs.items())
            self.stdout.write(f"  {name:4s} {row}")
        self.stdout.write(f"wrote {out / 'bench_rqd.json'}")

    def _one(self, name: str, run: int, opts: dict[str, Any], gateway_port: int) -> dict[str, float]:
        prefix = f"{opts['prefix']}{name}"
        purge_farm(prefix)
        seed_farm(FarmSpec(prefix=prefix, managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
        hosts = [f"{prefix}_h{i}" for i in range(opts["daemons"])]
        with db.connect(autocommit=True, application_name="cuesched-bench-rqd") as conn:
            alloc, tag = conn.execute(
                "SELECT a.str_name, a.str_tag FROM alloc a WHERE a.str_name LIKE %s", (f"{prefix}\\_a%",)
            ).fetchone()
            tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
            children: list[Any] = []
            try:
                with env(
                    **QUIET_LOOPS, CUESCHED_RQD_DEFAULT_ALLOC=alloc, CUESCHED_RQD_LOG_DIR=str(tmp / "logs" / "{job}")
                ):
                    if name == "rqd":
                        daemons = start_daemons(
                            hosts, gateway_port, tmp, tags=[tag], cores=opts["cores"], memory_kb=16 * 1024 * 1024
                        )
                        children = list(daemons.values())
                        for d in daemons.values():
                            wait_registered(conn, d, 60)
                    else:
                        children = [self._agent(h, alloc, tag, opts["cores"], tmp) for h in hosts]
                        deadline = time.monotonic() + 60
                        while conn.execute(AGENTS_UP_SQL, (hosts,)).fetchone()[0] < len(hosts):
                            if time.monotonic() > deadline:
                                raise CommandError("the q2 agents did not register within 60s")
                            time.sleep(0.1)
                    return self._drain(conn, name, prefix, opts)
            finally:
                for child in children:
                    if hasattr(child, "stop"):
                        child.stop()
                    elif child.poll() is None:
                        os.killpg(child.pid, signal.SIGTERM)
                        try:
                            child.wait(20)
                        except subprocess.TimeoutExpired:
                            os.killpg(child.pid, signal.SIGKILL)
                            child.wait(5)
                purge_farm(prefix)

    def _agent(self, host: str, alloc: str, tag: str, cores: int, tmp: Path) -> subprocess.Popen[bytes]:
        child_env = dict(os.environ)
        child_env.update(
            DATABASE_URL=url_from_settings(connection.settings_dict),
            CUESCHED_AGENT_LOG_ROOT=str(tmp / "agent-logs"),
            CUESCHED_LOG_LEVEL="WARNING",
        )
        argv = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "run_agent", "--host", host]
        argv += ["--alloc", alloc, "--tags", tag, "--cores", str(cores), "--memory", "16G", "--heartbeat", "1"]
        out = open(tmp / f"{host}.out", "ab")  # the child keeps its own copy of the descriptor
        try:
            return subprocess.Popen(
                argv, cwd=settings.BASE_DIR, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            out.close()

    def _drain(self, conn: Any, name: str, prefix: str, opts: dict[str, Any]) -> dict[str, float]:
        spec = {
            "show": show_name(prefix, 0),
            "name": f"{prefix}-true",
            "user": "bench",
            "max_cores": opts["daemons"] * opts["cores"],
            "layers": [
                {"name": "true", "command": "true", "range": f"1-{opts['frames']}", "cores": 1, "memory": "256MB"}
            ],
        }
        stop_service = threading.Event()
        service = AccountingService()
        service.start(stop_service, bootstrap_timeout=30)
        launcher = get_launcher(name)
        try:
            job = submit_job(spec, user="bench").job_id
            loop = DispatchLoop(service, launcher)
            stop = threading.Event()
            timer = threading.Timer(opts["timeout"], stop.set)
            timer.start()
            try:
                loop.run(stop, exit_when_idle=True)
            finally:
                timer.cancel()
            if stop.is_set():
                raise CommandError(f"{name}: the job did not drain within {opts['timeout']}s")
        finally:
            launcher.close()
            stop_service.set()
            service.join()
        count, start_span, end_span, p50, p99, ok = conn.execute(FIGURES_SQL, (job,)).fetchone()
        if ok != count:
            raise CommandError(f"{name}: {count - ok} of {count} frames did not succeed")
        return {
            "started_per_s": count / start_span if start_span else float("inf"),
            "completed_per_s": count / end_span if end_span else float("inf"),
            "p50_ms": p50 * 1000,
            "p99_ms": p99 * 1000,
        }
