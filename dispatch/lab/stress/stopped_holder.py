"""Issue 27 row 8: the booking scheduler SIGSTOPped under load with a `--standby` waiting.

The standby must take over within 15 s (the lease deadline passes, it terminates the stopped
holder's sessions), and the holder, woken, must commit nothing and exit non-zero.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accounting import db, live
from dispatch.engine.completion import kill_frames
from dispatch.lab.stress.audit import audit, view_counters
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import STARTED_SQL, WAITING_SQL, fresh_farm, teardown, watchdog_notes
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.sigkill import start_scheduler
from dispatch.lab.stress.split_brain import LEASE_ROW_SQL
from dispatch.lab.stress.watchdog import CapWatchdog

# The line the booking transaction logs (at DEBUG) just before it sends COMMIT.
_COMMIT_LINE = re.compile(rb"booking: COMMIT xid (\d+) under lease")
# The stopped-holder bound of issue 27: a standby holds the lease this soon after the stop.
TAKEOVER_BOUND = 15.0


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] not in "tT":
            return False
    return True


def phase_stopped_holder(cfg: StressConfig, log_dir: Path | None = None) -> PhaseReport:
    """Issue 27 row 8: the holder (a run_scheduler process) SIGSTOPped under load, a standby waiting.

    The standby can only take over by the lease's deadline: the stopped holder keeps its lock
    session and whatever transaction it had open. Measured from the database: stop -> the
    standby's lease (bound 15 s) -> its first booking. The stopped holder's frames stopped with
    its simulated launcher, so the harness reports them ended the completion way (as their
    agents would) once the standby holds the lease. Then the holder is woken: every COMMIT it
    sends after waking is in its log (the booking transaction logs it at DEBUG before sending),
    and none may have committed; it must exit non-zero. The standby books the rest; audit.
    """
    spec = cfg.integrity_spec("stopped_holder")
    report = PhaseReport(name="stopped_holder", frames=cfg.frames(spec))
    seed = fresh_farm(spec)
    root = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    holder_log, standby_log = (root / f"{spec.prefix}-{n}.log" for n in ("holder", "standby"))
    for path in (holder_log, standby_log):
        path.write_bytes(b"")
    watchdog = CapWatchdog(list(seed.show_ids), interval=cfg.watch_interval).start()
    jobs = list(seed.job_ids)
    conn = db.connect(autocommit=True, application_name="cuesched-stress")
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + cfg.phase_timeout

    def count(sql: str) -> int:
        row = conn.execute(sql, (jobs,)).fetchone()
        return int(row[0]) if row else 0

    def generation() -> int:
        row = conn.execute(LEASE_ROW_SQL).fetchone()
        return int(row[0]) if row else 0

    def count_procs_besides(procs: list[str]) -> int:
        sql = "SELECT count(*) FROM proc WHERE pk_job = ANY(%s) AND pk_proc <> ALL(%s)"
        row = conn.execute(sql, (jobs, procs)).fetchone()
        return int(row[0]) if row else 0

    def wait(what: str, predicate: Callable[[], bool], timeout: float) -> float | None:
        t0 = time.monotonic()
        until = min(deadline, t0 + timeout)
        while time.monotonic() < until:
            if predicate():
                return time.monotonic() - t0
            time.sleep(0.01)
        report.failed.append(f"timed out waiting for {what}")
        return None

    def fresh_view() -> dict[str, Any] | None:
        with conn.cursor() as cur:
            view = live.read_view(cur)
        return view if view is not None and view.get("pid") == procs[-1].pid else None

    started = time.perf_counter()
    try:
        env_extra = {"CUESCHED_STANDBY_POLL_INTERVAL": str(cfg.sb_poll)}
        runtime = (cfg.int_runtime_min, cfg.int_runtime_max)  # frames that outlast the standby's start
        initial = generation()
        holder = start_scheduler(
            cfg, holder_log, runtime=runtime, extra_env={**env_extra, "CUESCHED_LOG_LEVEL": "DEBUG"}
        )
        procs.append(holder)
        if wait("the holder's lease", lambda: generation() > initial, 60) is None:
            return report
        before = generation()
        standby = start_scheduler(cfg, standby_log, runtime=runtime, args=("--standby",), extra_env=env_extra)
        procs.append(standby)
        if (
            wait(
                "the standby to wait for the lock",
                lambda: b"waiting for the scheduler lock" in standby_log.read_bytes(),
                60,
            )
            is None
            or wait("the holder booking", lambda: count(STARTED_SQL) > 0, 60) is None
        ):
            return report
        holder.send_signal(signal.SIGSTOP)
        if wait("the holder to stop", lambda: _all_threads_stopped(holder.pid), 10) is None:
            return report
        held = conn.execute("SELECT pk_proc, pk_frame FROM proc WHERE pk_job = ANY(%s)", (jobs,)).fetchall()
        orphans, orphan_procs = [f for _p, f in held], [p for p, _f in held]
        if not orphans and count(WAITING_SQL) == 0:
            report.failed.append("the holder ran every frame before the standby was up: give the farm more frames")
            return report
        takeover = wait("the standby's lease", lambda: generation() > before, TAKEOVER_BOUND + 10)
        if takeover is None:
            return report
        report.notes.append(f"holder SIGSTOPped with {len(orphans)} procs -> the standby's lease: {takeover:.2f}s")
        if takeover > TAKEOVER_BOUND:
            report.failed.append(f"the standby took over {takeover:.2f}s after the stop (bound {TAKEOVER_BOUND:.0f}s)")
        released = kill_frames(conn, orphans).released
        # A proc that is not the stopped holder's: the standby's (it may re-book those frames).
        first = wait(
            "the standby's first booking",
            lambda: count_procs_besides(orphan_procs) > 0,
            30,
        )
        if first is not None:
            report.notes.append(
                f"stopped holder's frames released the completion way: {released}; "
                f"the standby's first booking {takeover + first:.2f}s after the stop"
            )
        woke_at = holder_log.stat().st_size  # a stopped process writes nothing
        holder.send_signal(signal.SIGCONT)
        try:
            code = holder.wait(60)
        except subprocess.TimeoutExpired:
            code = None
            report.failed.append("the woken holder did not exit within 60 s")
        with holder_log.open("rb") as fh:
            fh.seek(woke_at)
            after = fh.read()
        sent = [int(x) for x in _COMMIT_LINE.findall(after)]
        committed = [
            x
            for x in sent
            if conn.execute("SELECT pg_xact_status(%s::text::xid8)", (str(x),)).fetchone()[0] == "committed"
        ]
        report.notes.append(
            f"woken holder: exit {code}, {len(sent)} COMMIT(s) sent after waking, {len(committed)} committed"
        )
        if committed:
            report.failed.append(
                f"the woken holder committed {len(committed)} booking transaction(s) after the takeover"
            )
        if code == 0:
            report.failed.append("the woken holder exited 0 after losing its lease")
        # The standby books the rest; done when nothing waits and nothing runs.
        wait(
            "the standby to run every frame",
            lambda: count(WAITING_SQL) == 0 and count("SELECT count(*) FROM proc WHERE pk_job = ANY(%s)") == 0,
            cfg.phase_timeout,
        )
        if standby.poll() is not None:
            report.failed.append(f"the standby exited with {standby.returncode} (log {standby_log})")
        mark = time.time()
        wait("a live view from the standby", lambda: (v := fresh_view()) is not None and v["published_at"] >= mark, 30)
        view = fresh_view()
        if view is not None:
            report.failed.extend(audit(seed, lambda: view_counters(fresh_view() or view, seed), settle=5.0))
            report.rejected = dict(view.get("extra", {}).get("dispatch", {}).get("rejected", {}))
        n_started, window = conn.execute(STARTED_SQL, (jobs,)).fetchone() or (0, 0.0)
        report.booked = int(n_started or 0)
        report.window = float(window or 0.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        watchdog.stop()
        conn.close()
        report.wall = time.perf_counter() - started
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    watchdog_notes(watchdog, report)
    teardown(spec, report)
    return report

