"""Running a phase: seed its farm, run the real runtime against it, perturb, audit, purge.

What every in-process phase shares (`run_inprocess`, the `Run` a perturbation sees, the
launchers, the heal that reconciles), and the statements more than one phase runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from accounting import db
from accounting.service import AccountingService
from dispatch.engine.launcher import Launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSeed, FarmSpec, farm_counts, purge_farm, seed_farm
from dispatch.lab.stress.audit import audit, audit_database, store_counters
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import CapWatchdog, recent_caps_lookup

PROC_COUNT_SQL = "SELECT count(*) FROM proc WHERE pk_show = ANY(%s)"
WAITING_SQL = "SELECT count(*) FROM frame WHERE pk_job = ANY(%s) AND str_state = 'WAITING'"
STARTED_SQL = (
    "SELECT count(*), EXTRACT(EPOCH FROM max(ts_started) - min(ts_started))::float8 FROM frame"
    " WHERE pk_job = ANY(%s) AND ts_started IS NOT NULL"
)
LOWER_JOB_SQL = "UPDATE job_resource SET int_max_cores = %s WHERE pk_job = ANY(%s) RETURNING pk_job"


@contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The backstops run rarely, so the audit proves the hot path kept the Store exact on its own
# (the reference suite sets them to an hour); phases that need one say so.
QUIET_LOOPS = {
    "CUESCHED_RECOMPUTE_INTERVAL": "3600",
    "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
    "CUESCHED_MANAGED_SHOWS_TTL": "0.5",
    "CUESCHED_LOST_HOST_TIMEOUT": "3600",
}


@dataclass
class Run:
    """What a perturbation sees while the loop runs."""

    cfg: StressConfig
    seed: FarmSeed
    service: AccountingService
    loop: DispatchLoop
    watchdog: CapWatchdog
    report: PhaseReport
    stop_loop: threading.Event

    def procs(self) -> int:
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            row = conn.execute(PROC_COUNT_SQL, (list(self.seed.show_ids),)).fetchone()
        return int(row[0]) if row else 0

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        self.report.failed.append(f"timed out waiting for {what}")
        return False

    def under_load(self, procs: int = 20) -> bool:
        return self.wait_for(f"{procs} procs running", lambda: self.procs() >= procs or not self.loop_alive())

    def loop_alive(self) -> bool:
        return not self.stop_loop.is_set()


def fresh_farm(spec: FarmSpec) -> FarmSeed:
    purge_farm(spec.prefix)
    seed = seed_farm(spec)
    with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
        conn.execute("ANALYZE frame, proc, host, host_stat, job, layer, job_stat, layer_stat")
    return seed


def teardown(spec: FarmSpec, report: PhaseReport) -> None:
    purge_farm(spec.prefix)
    left = {t: n for t, n in farm_counts(spec.prefix).items() if n}
    if left:
        report.failed.append(f"teardown left rows: {left}")


def run_inprocess(
    cfg: StressConfig,
    name: str,
    spec: FarmSpec,
    *,
    launcher: Launcher,
    perturb: Callable[[Run], None] | None = None,
    duration: float | None = None,
    loop_env: dict[str, str] | None = None,
    heal: Callable[[Run], None] | None = None,
    listener_connect: Callable[[], psycopg.Connection] | None = None,
    prepare: Callable[[FarmSeed], Callable[[], None] | None] | None = None,
) -> PhaseReport:
    """Seed, run the service and the loop (to idle, or for `duration`), perturb, audit, purge.

    `prepare` runs once the farm is seeded, before anything books (hosts to start); what it
    returns runs after the audit, before the purge."""
    report = PhaseReport(name=name, frames=cfg.frames(spec))
    seed = fresh_farm(spec)
    cleanup = prepare(seed) if prepare is not None else None
    stop_service = threading.Event()
    stop_loop = threading.Event()
    with env(**{**QUIET_LOOPS, **(loop_env or {})}):
        service = AccountingService(listener_connect=listener_connect)
        service.start(stop_service, bootstrap_timeout=30)
        watchdog = CapWatchdog(list(seed.show_ids), interval=cfg.watch_interval, applied_at=recent_caps_lookup(service))
        loop = DispatchLoop(service, launcher)
    run = Run(cfg, seed, service, loop, watchdog, report, stop_loop)
    totals: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            totals.append(loop.run(stop_loop, exit_when_idle=duration is None))
        except BaseException as exc:  # reported, never swallowed
            errors.append(exc)
        finally:
            stop_loop.set()

    try:
        watchdog.start()
        started = time.perf_counter()
        thread = threading.Thread(target=target, name=f"stress-{name}", daemon=True)
        thread.start()
        if perturb is not None:
            perturb(run)
        if duration is not None:
            stop_loop.wait(duration)
            stop_loop.set()
        thread.join(cfg.phase_timeout)
        if thread.is_alive():
            report.failed.append(f"the loop did not finish within {cfg.phase_timeout:.0f}s")
            stop_loop.set()
            thread.join(30)
        report.wall = time.perf_counter() - started
        if errors:
            report.failed.append(f"loop raised {type(errors[0]).__name__}: {errors[0]}")
        if heal is not None:
            heal(run)
        report.failed.extend(audit(seed, lambda: store_counters(service, seed)))
    finally:
        watchdog.stop()
        stop_loop.set()
        stop_service.set()
        service.join()
        launcher.close()
        if cleanup is not None:
            cleanup()
    report.booked = loop.totals.booked
    report.window = loop.booking_window()
    report.rejected = dict(loop.totals.rejected)
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    watchdog_notes(watchdog, report)
    if loop.totals.db_errors:
        report.notes.append(f"dispatch database errors (retried): {loop.totals.db_errors}")
    teardown(spec, report)
    return report


def watchdog_notes(watchdog: CapWatchdog, report: PhaseReport) -> None:
    if watchdog.over_lowered:
        report.notes.append(
            f"over a lowered cap but booked before the decrease reached the Store (not breaches): "
            f"{watchdog.over_lowered} samples"
        )
    if watchdog.over_outside:
        report.notes.append(
            f"over a cap an outside write took it over, no booking since the Store had the write "
            f"(not breaches): {watchdog.over_outside} samples"
        )


def sim_launcher(cfg: StressConfig, *, runtime: bool) -> SimulatedLauncher:
    return SimulatedLauncher(
        runtime_min=cfg.runtime_min if runtime else 0.0,
        runtime_max=cfg.runtime_max if runtime else 0.0,
        failure_rate=0.0,
        launch_failure_rate=0.0,
        seed=cfg.seed,
    )


def reconcile(run: Run) -> None:
    """After the load: no counter may read LOW; what reads HIGH is reported, then one pass heals it.

    A release the listener applies between a recompute's (or a managed-flip seed's) snapshot
    read and its overwrite is lost to the overwrite: the counter reads high (under-books,
    never over-books) until the next pass, which production runs every 15 s. The audit that
    follows is strict again.
    """
    with db.connect(autocommit=True, application_name="cuesched-stress-audit") as conn:
        _failed, booked = audit_database(conn, run.seed)
        live_c, _infl = store_counters(run.service, run.seed)
        for key in sorted(booked):
            have, want = live_c.get(key, (0, 0)), booked[key]
            if have[0] < want[0]:
                run.report.failed.append(f"counter LOW {key[0]} {key[1]}: store {have} < SUM(proc) {want}")
        high = {k: v[0] - booked.get(k, (0, 0))[0] for k, v in live_c.items() if v[0] > booked.get(k, (0, 0))[0]}
        run.report.notes.append(
            f"over-count after the load (lost releases, safe side): {len(high)} keys, "
            f"{sum(v for (vx, _k), v in high.items() if vx == 'folder')} folder cores; reconciled by one recompute pass"
        )
        run.service.recomputer.run_once(conn)


def int_launcher(cfg: StressConfig, seed_offset: int = 0) -> SimulatedLauncher:
    return SimulatedLauncher(
        runtime_min=cfg.int_runtime_min,
        runtime_max=cfg.int_runtime_max,
        failure_rate=0.0,
        launch_failure_rate=0.0,
        seed=cfg.seed + seed_offset,
    )
