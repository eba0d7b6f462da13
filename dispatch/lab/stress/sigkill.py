"""Phase `sigkill`: `run_scheduler` as its own process, SIGKILLed under load and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from accounting import db, live
from dispatch.engine.completion import kill_frames
from dispatch.lab.stress.audit import audit, view_counters
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import QUIET_LOOPS, STARTED_SQL, WAITING_SQL, fresh_farm, teardown
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import CapWatchdog


def _database_url() -> str:
    from django.db import connection

    from cuesched_project.dburl import url_from_settings

    return url_from_settings(connection.settings_dict)


def _start_scheduler(cfg: StressConfig, log: Path) -> subprocess.Popen[bytes]:
    manage = Path(__file__).resolve().parents[3] / "manage.py"
    environ = {
        **os.environ,
        **QUIET_LOOPS,
        "DATABASE_URL": _database_url(),
        "CUESCHED_SIM_SEED": str(cfg.seed),
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                str(manage),
                "run_scheduler",
                "--launcher",
                "simulated",
                "--runtime",
                f"{cfg.runtime_min}-{cfg.runtime_max}",
                "--metrics-port",
                "0",
            ],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def phase_sigkill(cfg: StressConfig, log_dir: Path | None = None) -> PhaseReport:
    """The scheduler as its own process (run_scheduler), SIGKILLed under load and restarted.

    The killed process's simulated launcher dies with it: its procs stay RUNNING (a real RQD
    would report them). The restarted scheduler bootstraps them from SUM(proc); the harness
    then kills those frames through the completion path, as an agent's report would release
    them, and the restarted scheduler books them again.
    """
    spec = cfg.perturbation_spec("sigkill")
    report = PhaseReport(name="sigkill", frames=cfg.frames(spec))
    seed = fresh_farm(spec)
    log = (log_dir or Path(os.environ.get("TMPDIR", "/tmp"))) / f"{spec.prefix}-scheduler.log"
    log.write_bytes(b"")
    watchdog = CapWatchdog(list(seed.show_ids), interval=cfg.watch_interval).start()
    jobs = list(seed.job_ids)
    conn = db.connect(autocommit=True, application_name="cuesched-stress")
    procs: list[subprocess.Popen[bytes]] = []
    views: list[dict[str, Any]] = []

    def count(sql: str) -> int:
        row = conn.execute(sql, (jobs,)).fetchone()
        return int(row[0]) if row else 0

    def fresh_view(after: float) -> dict[str, Any] | None:
        with conn.cursor() as cur:
            view = live.read_view(cur)
        if view is None or view.get("pid") != procs[-1].pid or view["published_at"] < after:
            return None
        return view

    started = time.perf_counter()
    try:
        procs.append(_start_scheduler(cfg, log))
        deadline = time.monotonic() + cfg.phase_timeout
        half = report.frames // 3
        while count(STARTED_SQL) < half and time.monotonic() < deadline and procs[-1].poll() is None:
            time.sleep(0.02)
        before_kill = fresh_view(0.0)
        if before_kill is not None:
            views.append(before_kill)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(30)
        orphans = [f for (f,) in conn.execute("SELECT pk_frame FROM proc WHERE pk_job = ANY(%s)", (jobs,))]
        report.notes.append(
            f"scheduler SIGKILLed with {count(STARTED_SQL)} frames started, {len(orphans)} procs running"
        )
        procs.append(_start_scheduler(cfg, log))
        # The killed launcher's frames have no process to report them: the harness plays the
        # agent and kills them the completion way (release triggers -> NOTIFY -> the new
        # Store), frames back to WAITING for the restarted scheduler to book again.
        while fresh_view(0.0) is None and time.monotonic() < deadline and procs[-1].poll() is None:
            time.sleep(0.05)
        killed = kill_frames(conn, orphans)
        report.notes.append(
            f"orphaned frames released through the completion path: {len(orphans)} (released {killed.released})"
        )
        # Done when nothing waits, the proc count is stable and a view published after that
        # matches SUM(proc).
        view: dict[str, Any] | None = None
        while time.monotonic() < deadline and procs[-1].poll() is None:
            if count(WAITING_SQL) == 0:
                n = count("SELECT count(*) FROM proc WHERE pk_job = ANY(%s)")
                time.sleep(0.5)
                if n == count("SELECT count(*) FROM proc WHERE pk_job = ANY(%s)"):
                    mark = time.time()
                    while time.monotonic() < deadline and (view := fresh_view(mark)) is None:
                        time.sleep(0.1)
                    break
            time.sleep(0.1)
        if procs[-1].poll() is not None:
            report.failed.append(f"restarted scheduler exited with {procs[-1].returncode} (log {log})")
        if view is None:
            report.failed.append("no live view from the restarted scheduler")
        else:
            views.append(view)
            report.failed.extend(audit(seed, lambda: view_counters(fresh_view(0.0) or view, seed), settle=5.0))
        n_started, window = conn.execute(STARTED_SQL, (jobs,)).fetchone() or (0, 0.0)
        report.booked = int(n_started or 0)
        report.window = float(window or 0.0)
        report.wall = time.perf_counter() - started
        rejected: Counter[str] = Counter()
        for v in views:
            rejected.update(v.get("extra", {}).get("dispatch", {}).get("rejected", {}))
        report.rejected = dict(rejected)
        report.notes.append("booking window from frame.ts_started across both processes (the kill gap included)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        watchdog.stop()
        conn.close()
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    teardown(spec, report)
    return report
