"""`manage.py bench_life`: the frame's life on real hosts, in seconds (issue 29's figures).

Two figures, each the median of `--runs` samples with the spread (min-max):

* **timeout -> processes gone**, per launcher (`rqd`: a real `python -m rqd` daemon reporting to a
  gateway in this process; `agent`: `run_agent --transport q2` in a subprocess). One job of two
  layers, `--runs` frames each, all running at once on one host: `busy` prints a line every half
  second and runs past its layer's `timeout` of 1 minute; `silent` prints one line and then
  nothing, past its `timeout_llu` of 1 minute. A watcher reads the machine's process table every
  0.1 s; a frame's sample is the time its last process was gone, less its start (the booking's
  `frame.ts_started`) and the 60 s limit. What it measures: the host report that sees the limit
  passed (RQD: the rqd launcher's status poll, every `CUESCHED_LOST_HOST_SWEEP_INTERVAL` s, or
  RQD's own pushes; agent: its check every `CUESCHED_AGENT_KILL_POLL` s), the kill, and the
  process group's exit (the agent: SIGTERM, then SIGKILL after `CUESCHED_AGENT_KILL_GRACE` s).
  Run with this process's environment, so those knobs are whatever it sets: the production
  defaults unless told otherwise (they are printed).
* **NimbyOn -> unbookable** (`rqd` only): a real RQD started with its own NIMBY on, watching a
  headless X display (Xvfb), with the dispatch loop and its rqd launcher polling as in production.
  The sample: from `xdotool mousemove` on that display (a user sitting down: RQD's pynput listener
  turns its NIMBY lock on) to the host row reading `NIMBY_LOCKED`, which placement and the booking
  guard refuse. RQD 1.37 unlocks only with 1 GB of swap free, so each sample restarts the daemon
  (its startup report reopens the host). Needs `Xvfb` and `xdotool` on PATH.

Writes bench_life.json into --out. Not a timed assertion: figures for the notes and docs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from argparse import ArgumentParser
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from accounting import db
from accounting.service import AccountingService
from cuesched_project.dburl import url_from_settings
from dispatch import conf
from dispatch.engine.launcher import get_launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.rqd_gateway import start_gateway
from dispatch.jobs.submit import submit_job
from dispatch.lab.rqdfarm import pids_of, start_daemons, wait_registered
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm, show_name
from dispatch.lab.stress import QUIET_LOOPS, env

LIMIT = 60.0  # the layers' timeout and timeout_llu: 1 minute, the least a job spec can ask
STARTED_SQL = """
SELECT l.str_name, f.int_number, EXTRACT(EPOCH FROM f.ts_started)::float8, f.str_state, COALESCE(f.str_reason, '')
FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer WHERE f.pk_job = %s
"""
LOCK_SQL = "SELECT str_lock_state FROM host WHERE str_name = %s"
AGENT_UP_SQL = """
SELECT count(*) FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE h.str_name = %s AND hs.ts_ping > now() - interval '3 seconds'
"""


STARTED = "Starting NimbyPynput thread"  # RQD 1.37's log lines (rqd/rqnimby.py)
ACTIVE = "Nimby: User activity detected"


def said(log: Path, text: str) -> int:
    """How many times the daemon's log (appended to across its restarts) has the line."""
    try:
        return log.read_text(errors="replace").count(text)
    except OSError:
        return 0


def lock(conn: Any, host: str) -> str:
    row = conn.execute(LOCK_SQL, (host,)).fetchone()
    return str(row[0]) if row else ""


def spread(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "samples": 0}
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": len(samples),
    }


def wait_until(what: str, predicate: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise CommandError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


class Command(BaseCommand):
    help = "Seconds from a layer timeout to the frame's processes gone (RQD, run_agent); from NimbyOn to unbookable."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--runs", type=int, default=3, help="samples per case (median, min, max)")
        parser.add_argument("--cases", default="timeout,nimby", help="comma list of timeout, nimby")
        parser.add_argument("--launchers", default="rqd,agent", help="the timeout case's launchers: rqd, agent")
        parser.add_argument("--prefix", default="blife")
        parser.add_argument("--out", default="artifacts/bench/")
        parser.add_argument("--timeout", type=float, default=240.0, help="seconds one case may take")

    def handle(self, *args: Any, **opts: Any) -> None:
        cases = [c.strip() for c in opts["cases"].split(",") if c.strip()]
        launchers = [x.strip() for x in opts["launchers"].split(",") if x.strip()]
        if bad := [c for c in cases if c not in ("timeout", "nimby")] + [
            x for x in launchers if x not in ("rqd", "agent")
        ]:
            raise CommandError(f"unknown case or launcher: {', '.join(bad)}")
        if opts["runs"] < 1:
            raise CommandError("--runs must be at least 1")
        knobs = {
            "CUESCHED_LOST_HOST_SWEEP_INTERVAL": conf.lost_host_sweep_interval(),
            "CUESCHED_AGENT_KILL_POLL": conf.agent_kill_poll(),
            "CUESCHED_AGENT_KILL_GRACE": conf.agent_kill_grace(),
        }
        self.stdout.write("knobs: " + ", ".join(f"{k}={v:g}" for k, v in knobs.items()))
        figures: dict[str, dict[str, float]] = {}
        gateway = start_gateway("127.0.0.1", 0, workers=8)
        try:
            if "timeout" in cases:
                for name in launchers:
                    for layer, samples in self._timeouts(name, opts, gateway.port).items():
                        figures[f"timeout_{name}_{layer}"] = spread(samples)
                        self._row(f"timeout -> gone, {name}, {layer}", samples)
            if "nimby" in cases:
                samples = self._nimby(opts, gateway.port)
                figures["nimby_rqd"] = spread(samples)
                self._row("NimbyOn -> unbookable, rqd", samples)
        finally:
            gateway.stop()
        results = {
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "knobs": knobs,
            "options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str))},
            "figures": figures,
        }
        out = Path(opts["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_life.json").write_text(json.dumps(results, indent=2))
        self.stdout.write(f"wrote {out / 'bench_life.json'}")

    def _row(self, what: str, samples: list[float]) -> None:
        s = spread(samples)
        each = ", ".join(f"{x:.2f}" for x in samples)
        self.stdout.write(f"{what}: median {s['median']:.2f}s (min {s['min']:.2f}, max {s['max']:.2f}; {each})")

    # --- the farm ----------------------------------------------------------------------------

    @contextmanager
    def _farm(self, prefix: str) -> Iterator[tuple[str, str, Path]]:
        """A fresh farm with no host (one managed show, one allocation): (alloc, its tag, a temp dir)."""
        purge_farm(prefix)
        seed_farm(FarmSpec(prefix=prefix, managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-life-{prefix}-"))
        try:
            with db.connect(autocommit=True, application_name="cuesched-bench-life") as conn:
                alloc, tag = conn.execute(
                    "SELECT a.str_name, a.str_tag FROM alloc a WHERE a.str_name LIKE %s", (f"{prefix}\\_a%",)
                ).fetchone()
            yield alloc, tag, tmp
        finally:
            purge_farm(prefix)
            shutil.rmtree(tmp, ignore_errors=True)

    @contextmanager
    def _dispatching(self, launcher_name: str) -> Iterator[DispatchLoop]:
        """The Store and the dispatch loop (never exiting when idle), as run_scheduler runs them."""
        stop_service, stop = threading.Event(), threading.Event()
        service = AccountingService()
        service.start(stop_service, bootstrap_timeout=30)
        launcher = get_launcher(launcher_name)
        loop = DispatchLoop(service, launcher)
        thread = threading.Thread(target=loop.run, args=(stop,), name="bench-life-loop", daemon=True)
        thread.start()
        try:
            yield loop
        finally:
            stop.set()
            thread.join(30)
            launcher.close()
            stop_service.set()
            service.join()

    def _agent(self, host: str, alloc: str, tag: str, cores: int, tmp: Path) -> subprocess.Popen[bytes]:
        child_env = dict(os.environ)
        child_env.update(
            DATABASE_URL=url_from_settings(connection.settings_dict),
            CUESCHED_AGENT_LOG_ROOT=str(tmp / "agent-logs"),
            CUESCHED_LOG_LEVEL="WARNING",
        )
        argv = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "run_agent", "--host", host]
        argv += ["--transport", "q2", "--alloc", alloc, "--tags", tag, "--cores", str(cores), "--memory", "8G"]
        out = open(tmp / f"{host}.out", "ab")  # the child keeps its own copy of the descriptor
        try:
            return subprocess.Popen(
                argv, cwd=settings.BASE_DIR, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            out.close()

    @staticmethod
    def _stop_agent(child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(5)

    # --- timeout -> processes gone ------------------------------------------------------------

    def _timeouts(self, name: str, opts: dict[str, Any], gateway_port: int) -> dict[str, list[float]]:
        n = opts["runs"]
        prefix = f"{opts['prefix']}t{name[0]}"
        marker = f"{prefix}-{os.getpid()}"
        with self._farm(prefix) as (alloc, tag, tmp):
            host = f"{prefix}_h0"
            children: list[Any] = []
            launcher = "rqd" if name == "rqd" else "q2"
            with env(**QUIET_LOOPS, CUESCHED_RQD_DEFAULT_ALLOC=alloc, CUESCHED_RQD_LOG_DIR=str(tmp / "logs" / "{job}")):
                try:
                    with db.connect(autocommit=True, application_name="cuesched-bench-life") as conn:
                        if name == "rqd":
                            daemons = start_daemons(
                                [host], gateway_port, tmp, tags=[tag], cores=2 * n, memory_kb=8 * 1024 * 1024
                            )
                            children = list(daemons.values())
                            wait_registered(conn, daemons[host], 60)
                        else:
                            children = [self._agent(host, alloc, tag, 2 * n, tmp)]
                            wait_until(
                                "the agent to register",
                                lambda: conn.execute(AGENT_UP_SQL, (host,)).fetchone()[0] > 0,
                                60,
                            )
                        with self._dispatching(launcher):
                            job = submit_job(self._timeout_spec(prefix, marker, n), user="bench").job_id
                            samples = self._watch_gone(conn, job, marker, n, opts["timeout"])
                            rows = conn.execute(STARTED_SQL, (job,)).fetchall()
                finally:
                    for child in children:
                        if hasattr(child, "stop"):
                            child.stop()
                        else:
                            self._stop_agent(child)
        bad = [r for r in rows if r[3] != "DEAD" or not r[4].startswith("timeout:")]
        if bad:
            raise CommandError(f"{name}: frames not DEAD by their timeout: {bad}")
        return samples

    @staticmethod
    def _timeout_spec(prefix: str, marker: str, n: int) -> dict[str, Any]:
        busy = (
            "python3 -c \"import time\nwhile True: print('busy', flush=True); time.sleep(0.5)\" "
            f"{marker}-busy-#IFRAME#-"
        )
        silent = (
            f"python3 -c \"import time; print('one line', flush=True); time.sleep(3600)\" {marker}-silent-#IFRAME#-"
        )
        # Not threadable: RQD pins a threadable frame (CUE_THREADABLE=1) to physical cores, and the
        # lab RQD claims more cores than a small machine has, so they would not all run at once.
        return {
            "show": show_name(prefix, 0),
            "name": f"{prefix}-timeouts",
            "user": "bench",
            "max_retries": 0,
            "layers": [
                {
                    "name": "busy",
                    "command": busy,
                    "range": f"1-{n}",
                    "cores": 1,
                    "memory": "128MB",
                    "timeout": 1,
                    "threadable": False,
                },
                {
                    "name": "silent",
                    "command": silent,
                    "range": f"1-{n}",
                    "cores": 1,
                    "memory": "128MB",
                    "timeout_llu": 1,
                    "threadable": False,
                },
            ],
        }

    @staticmethod
    def _watch_gone(conn: Any, job: str, marker: str, n: int, timeout: float) -> dict[str, list[float]]:
        """Until every frame's processes have come and gone: seconds past each one's 60 s limit."""
        seen: set[tuple[str, int]] = set()
        gone: dict[tuple[str, int], float] = {}
        deadline = time.monotonic() + timeout
        while len(gone) < 2 * n:
            if time.monotonic() > deadline:
                raise CommandError(f"only {len(gone)} of {2 * n} frames were killed within {timeout:.0f}s")
            now = time.time()
            started = {(layer, num): ts for layer, num, ts, _s, _r in conn.execute(STARTED_SQL, (job,)) if ts}
            for key, ts in started.items():
                if key in gone:
                    continue
                if pids_of(f"{marker}-{key[0]}-{key[1]}-"):
                    seen.add(key)
                elif key in seen:
                    gone[key] = now - ts - LIMIT
            time.sleep(0.1)
        out: dict[str, list[float]] = {"busy (timeout)": [], "silent (timeout_llu)": []}
        for (layer, _num), seconds in sorted(gone.items()):
            out["busy (timeout)" if layer == "busy" else "silent (timeout_llu)"].append(seconds)
        return out

    # --- NimbyOn -> unbookable -----------------------------------------------------------------

    @contextmanager
    def _xvfb(self) -> Iterator[str]:
        if not (shutil.which("Xvfb") and shutil.which("xdotool")):
            raise CommandError("the nimby case needs Xvfb and xdotool (apt-get install xvfb xdotool)")
        display = f":{100 + os.getpid() % 800}"
        xvfb = subprocess.Popen(
            ["Xvfb", display, "-screen", "0", "640x480x16", "-nolisten", "tcp"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            probe = ["xdotool", "getmouselocation"]
            wait_until(
                "Xvfb to accept clients",
                lambda: (
                    subprocess.run(probe, env={**os.environ, "DISPLAY": display}, capture_output=True).returncode == 0
                ),
                10,
            )
            yield display
        finally:
            xvfb.terminate()
            with suppress(subprocess.TimeoutExpired):
                xvfb.wait(10)

    @staticmethod
    def _sit_down(xenv: dict[str, str], log: Path, i: int) -> float:
        """Input on the display until RQD's NIMBY has seen it (its log says so for the i+1-th time);
        returns the monotonic time of the input it saw (an input before its listener was up is
        lost, and the clock starts again at the next one)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            moved = time.monotonic()
            subprocess.run(["xdotool", "mousemove", "50", "50"], env=xenv, check=True)
            subprocess.run(["xdotool", "mousemove", "120", "90"], env=xenv, check=True)
            while time.monotonic() - moved < 1.0:
                if said(log, ACTIVE) > i:
                    return moved
                time.sleep(0.02)
        raise CommandError("RQD's NIMBY did not see the input within 30s")

    def _nimby(self, opts: dict[str, Any], gateway_port: int) -> list[float]:
        prefix = f"{opts['prefix']}n"
        host = f"{prefix}_h0"
        samples: list[float] = []
        with self._xvfb() as display, self._farm(prefix) as (alloc, tag, tmp):
            xenv = {**os.environ, "DISPLAY": display}
            with env(**QUIET_LOOPS, CUESCHED_RQD_DEFAULT_ALLOC=alloc, CUESCHED_RQD_LOG_DIR=str(tmp / "logs" / "{job}")):
                daemons = start_daemons(
                    [host], gateway_port, tmp, tags=[tag], cores=2, memory_kb=4 * 1024 * 1024,
                    nimby_display=display, nimby_idle=3600,
                )  # fmt: skip
                rqd = daemons[host]
                try:
                    with db.connect(autocommit=True, application_name="cuesched-bench-life") as conn:
                        wait_registered(conn, rqd, 60)
                        with self._dispatching("rqd"):
                            for i in range(opts["runs"]):
                                if i:
                                    rqd.stop()  # RQD 1.37 unlocks only with swap free: restart it
                                    rqd.start()
                                    wait_registered(conn, rqd, 60)
                                wait_until("the host to be OPEN", lambda: lock(conn, host) == "OPEN", 60)
                                # RQD's NIMBY thread is up once it logged so (its listeners start next).
                                wait_until("RQD's NIMBY thread", lambda i=i: said(rqd.log, STARTED) > i, 60)
                                started = self._sit_down(xenv, rqd.log, i)
                                wait_until("NIMBY_LOCKED", lambda: lock(conn, host) == "NIMBY_LOCKED", opts["timeout"])
                                samples.append(time.monotonic() - started)
                finally:
                    rqd.stop()
        return samples
