"""The stress suite: the production path under load and faults, each phase audited.

Every phase seeds its own farm with `seed_farm` (prefix `<prefix>_<phase letters>`), runs the
real runtime against it (accounting service with listener, recompute and limit loops; the
dispatch loop; the simulated launcher; completions through the release triggers), applies
its perturbation while frames book, then audits and purges. A cap watchdog on its own
connection samples SUM(proc) against every cap of the phase's farm throughout.

Why each phase exists:
- drain: throughput and exactness when capacity exceeds demand (>= 90% must book).
- saturation: the caps, not the hosts, stop the bookings; they must stop exactly there.
- straddle / drops / listener_kill / caps / flip / sigkill: the failure modes of
  accounting-design.md §6 under load, each one must end with the Store equal to SUM(proc)
  and no cap ever exceeded.

The watchdog's breach rule: a key over its current cap is a breach unless its cap was
lowered during the phase and every proc of the key was decided before the decrease reached
the Store (`proc.ts_dispatched`, stamped by the dispatcher just before the Store's check,
against the listener's `recent_caps` time, stamped just after the cap was applied): those
procs were legal when booked, and the scheduler never preempts. `proc.ts_booked` (the
INSERT) is not used: in a batch of hundreds it can follow the decision by tens of
milliseconds, which made bookings checked against the old cap look like breaches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from accounting import db, live
from accounting.service import AccountingService
from accounting.units import centicores_to_cores
from dispatch.completion import kill_frames
from dispatch.launchers.simulated import SimulatedLauncher
from dispatch.loop import DispatchLoop
from dispatch.seeding import FarmSeed, FarmSpec, farm_counts, purge_farm, seed_farm

PHASES: tuple[str, ...] = ("drain", "saturation", "straddle", "drops", "listener_kill", "caps", "flip", "sigkill")
PERTURBATIONS = PHASES[2:]

# SUM(proc) of the farm's shows against every cap, in one statement (one snapshot); only the
# rows over the cap come back: (vertex, key, booked centicores, cap centicores, newest booking).
WATCH_SQL = """
WITH p AS (
  SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.int_cores_reserved AS c, p.ts_dispatched AS decided
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local AND p.pk_show = ANY(%(shows)s)
)
SELECT 'sub', x.pk_show || ':' || x.pk_alloc, x.c, s.int_burst, EXTRACT(EPOCH FROM x.last)::float8
FROM (SELECT pk_show, pk_alloc, SUM(c) AS c, max(decided) AS last FROM p GROUP BY 1, 2) x
JOIN subscription s ON s.pk_show = x.pk_show AND s.pk_alloc = x.pk_alloc
WHERE x.c > s.int_burst
UNION ALL
SELECT 'folder', x.pk_folder, x.c, fr.int_max_cores, EXTRACT(EPOCH FROM x.last)::float8
FROM (SELECT pk_folder, SUM(c) AS c, max(decided) AS last FROM p GROUP BY 1) x
JOIN folder_resource fr ON fr.pk_folder = x.pk_folder
WHERE fr.int_max_cores > 0 AND x.c > fr.int_max_cores
UNION ALL
SELECT 'job', x.pk_job, x.c, jr.int_max_cores, EXTRACT(EPOCH FROM x.last)::float8
FROM (SELECT pk_job, SUM(c) AS c, max(decided) AS last FROM p GROUP BY 1) x
JOIN job_resource jr ON jr.pk_job = x.pk_job
WHERE jr.int_max_cores > 0 AND x.c > jr.int_max_cores
"""

# SUM(proc) per Store key of the farm: (vertex, key, centicores, gpus).
BOOKED_BY_KEY_SQL = """
WITH p AS (
  SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.int_cores_reserved AS c, p.int_gpus_reserved AS g
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local AND p.pk_show = ANY(%(shows)s)
)
SELECT 'sub', pk_show || ':' || pk_alloc, SUM(c), SUM(g) FROM p GROUP BY pk_show, pk_alloc
UNION ALL SELECT 'folder', pk_folder, SUM(c), SUM(g) FROM p GROUP BY pk_folder
UNION ALL SELECT 'job', pk_job, SUM(c), SUM(g) FROM p GROUP BY pk_job
"""

# The database-side invariants of the audit, scoped to the farm: (what, key, seen, expected).
AUDIT_SQL = """
SELECT 'host_ledger', h.pk_host, h.int_cores - h.int_cores_idle, COALESCE(x.c, 0)
FROM host h LEFT JOIN (SELECT pk_host, SUM(int_cores_reserved) AS c FROM proc GROUP BY 1) x ON x.pk_host = h.pk_host
WHERE h.pk_host = ANY(%(hosts)s) AND h.int_cores - h.int_cores_idle <> COALESCE(x.c, 0)
UNION ALL
SELECT 'host_negative', h.pk_host, LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle), 0
FROM host h WHERE h.pk_host = ANY(%(hosts)s)
  AND LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle) < 0
UNION ALL
SELECT 'running_frames_vs_procs', '', (SELECT count(*) FROM frame WHERE str_state = 'RUNNING'
   AND pk_job = ANY(%(jobs)s)), (SELECT count(*) FROM proc WHERE pk_job = ANY(%(jobs)s))
WHERE (SELECT count(*) FROM frame WHERE str_state = 'RUNNING' AND pk_job = ANY(%(jobs)s))
   <> (SELECT count(*) FROM proc WHERE pk_job = ANY(%(jobs)s))
UNION ALL
SELECT 'procs_per_running_frame', f.pk_frame, count(p.pk_proc), 1
FROM frame f LEFT JOIN proc p ON p.pk_frame = f.pk_frame
WHERE f.pk_job = ANY(%(jobs)s) AND f.str_state = 'RUNNING' GROUP BY f.pk_frame HAVING count(p.pk_proc) <> 1
UNION ALL
SELECT 'proc_on_frame_not_running', p.pk_proc, 0, 0
FROM proc p JOIN frame f ON f.pk_frame = p.pk_frame WHERE p.pk_job = ANY(%(jobs)s) AND f.str_state <> 'RUNNING'
UNION ALL
SELECT 'job_stat_' || x.state, x.pk_job, x.kept, x.counted FROM (
  SELECT js.pk_job, s.state,
         CASE s.state WHEN 'WAITING' THEN js.int_waiting_count WHEN 'RUNNING' THEN js.int_running_count
              WHEN 'DEAD' THEN js.int_dead_count WHEN 'SUCCEEDED' THEN js.int_succeeded_count
              WHEN 'EATEN' THEN js.int_eaten_count WHEN 'DEPEND' THEN js.int_depend_count
              ELSE js.int_total_count END AS kept,
         (SELECT count(*) FROM frame f WHERE f.pk_job = js.pk_job AND (s.state = 'TOTAL' OR f.str_state = s.state))
           AS counted
  FROM job_stat js CROSS JOIN (VALUES ('WAITING'), ('RUNNING'), ('DEAD'), ('SUCCEEDED'), ('EATEN'), ('DEPEND'),
                                      ('TOTAL')) s(state)
  WHERE js.pk_job = ANY(%(jobs)s)) x
WHERE x.kept <> x.counted
UNION ALL
SELECT 'layer_stat_' || x.state, x.pk_layer, x.kept, x.counted FROM (
  SELECT ls.pk_layer, s.state,
         CASE s.state WHEN 'WAITING' THEN ls.int_waiting_count WHEN 'RUNNING' THEN ls.int_running_count
              WHEN 'SUCCEEDED' THEN ls.int_succeeded_count ELSE ls.int_total_count END AS kept,
         (SELECT count(*) FROM frame f WHERE f.pk_layer = ls.pk_layer AND (s.state = 'TOTAL' OR f.str_state = s.state))
           AS counted
  FROM layer_stat ls CROSS JOIN (VALUES ('WAITING'), ('RUNNING'), ('SUCCEEDED'), ('TOTAL')) s(state)
  WHERE ls.pk_layer = ANY(%(layers)s)) x
WHERE x.kept <> x.counted
"""

CAPS_SQL = """
SELECT 'sub', s.pk_show || ':' || s.pk_alloc, s.int_burst FROM subscription s WHERE s.pk_show = ANY(%(shows)s)
UNION ALL SELECT 'folder', fr.pk_folder, fr.int_max_cores FROM folder_resource fr WHERE fr.pk_folder = ANY(%(folders)s)
UNION ALL SELECT 'job', jr.pk_job, jr.int_max_cores FROM job_resource jr WHERE jr.pk_job = ANY(%(jobs)s)
"""

PROC_COUNT_SQL = "SELECT count(*) FROM proc WHERE pk_show = ANY(%s)"
WAITING_SQL = "SELECT count(*) FROM frame WHERE pk_job = ANY(%s) AND str_state = 'WAITING'"
STARTED_SQL = (
    "SELECT count(*), EXTRACT(EPOCH FROM max(ts_started) - min(ts_started))::float8 FROM frame"
    " WHERE pk_job = ANY(%s) AND ts_started IS NOT NULL"
)


# --- configuration -------------------------------------------------------------------------
@dataclass(frozen=True)
class StressConfig:
    """Sizes of the three farm shapes; caps in whole cores (the spec stores centicores)."""

    prefix: str = "stress"
    seed: int = 0x0C0FFEE
    phases: tuple[str, ...] = PHASES
    # drain (the reference's defaults)
    hosts: int = 1200
    jobs: int = 300
    layers: int = 4
    frames_per_layer: int = 5
    # saturation
    sat_hosts: int = 400
    sat_jobs: int = 150
    sat_layers: int = 2
    sat_frames_per_layer: int = 10
    sat_burst: int = 150  # cores per subscription
    sat_job_max_cores: int = 20
    sat_seconds: float = 4.0  # the phase never drains: how long frames are offered
    # perturbations: a farm whose caps bind while frames complete and release
    pert_hosts: int = 200
    pert_jobs: int = 60
    pert_layers: int = 2
    pert_frames_per_layer: int = 10
    pert_burst: int = 120  # cores per subscription
    pert_folder_max_cores: int = 300
    pert_job_max_cores: int = 12
    runtime_min: float = 0.02  # simulated frame runtime in the perturbation phases, s
    runtime_max: float = 0.15
    phase_timeout: float = 300.0
    watch_interval: float = 0.02  # s between watchdog samples

    def drain_spec(self) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_d",
            seed=self.seed,
            hosts=self.hosts,
            jobs=self.jobs,
            layers=self.layers,
            frames_per_layer=self.frames_per_layer,
        )

    def saturation_spec(self) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_s",
            seed=self.seed,
            hosts=self.sat_hosts,
            jobs=self.sat_jobs,
            layers=self.sat_layers,
            frames_per_layer=self.sat_frames_per_layer,
            manual_tags=4,
            host_cores_choices=(8, 16, 32),
            host_mem_gb_choices=(32, 64),
            layer_cores_choices=(2, 4),
            layer_mem_gb_choices=(2, 4),
            sub_burst=self.sat_burst * 100,
            job_max_cores=self.sat_job_max_cores * 100,
        )

    def perturbation_spec(self, phase: str) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_{phase[:2]}",
            seed=self.seed,
            hosts=self.pert_hosts,
            jobs=self.pert_jobs,
            layers=self.pert_layers,
            frames_per_layer=self.pert_frames_per_layer,
            manual_tags=4,
            host_cores_choices=(8, 16, 32),
            host_mem_gb_choices=(32, 64),
            layer_cores_choices=(1, 2, 4),
            layer_mem_gb_choices=(1, 2),
            sub_burst=self.pert_burst * 100,
            folder_max_cores=self.pert_folder_max_cores * 100,
            job_max_cores=self.pert_job_max_cores * 100,
            managed=phase != "flip",
        )

    def frames(self, spec: FarmSpec) -> int:
        return spec.jobs * spec.layers * spec.frames_per_layer


# --- the cap watchdog ----------------------------------------------------------------------
@dataclass
class Breach:
    vertex: str
    key: str
    booked: int  # centicores
    cap: int  # centicores


class CapWatchdog:
    """Samples SUM(proc) against every cap of a farm from its own connection, in a thread.

    `applied_at(vertex, key, since)` answers when a cap decrease registered with `lowering`
    reached the Store (unix time), or None while it is in transit.
    """

    def __init__(
        self,
        show_ids: list[str],
        *,
        interval: float = 0.02,
        applied_at: Callable[[str, str, float], float | None] | None = None,
    ) -> None:
        self.show_ids = show_ids
        self.interval = interval
        self.applied_at = applied_at
        self.samples = 0
        self.breaches: list[Breach] = []
        self.over_lowered = 0  # over a lowered cap, every proc booked before it reached the Store
        self.errors = 0
        self._lowered: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def lowering(self, keys: list[tuple[str, str]]) -> Iterator[None]:
        """Wrap the transaction that lowers caps: registered before its commit."""
        now = time.time()
        for key in keys:
            self._lowered[key] = now
        yield

    def start(self) -> CapWatchdog:
        self._thread = threading.Thread(target=self._run, name="stress-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        conn = db.connect(autocommit=True, application_name="cuesched-stress-watchdog")
        try:
            while not self._stop.is_set():
                try:
                    rows = conn.execute(WATCH_SQL, {"shows": self.show_ids}).fetchall()
                except psycopg.Error:
                    self.errors += 1
                    conn.close()
                    conn = db.connect(autocommit=True, application_name="cuesched-stress-watchdog")
                    continue
                self.samples += 1
                for vertex, key, booked, cap, last in rows:
                    self._judge(vertex, key, int(booked), int(cap), float(last))
                self._stop.wait(self.interval)
        finally:
            conn.close()

    def _judge(self, vertex: str, key: str, booked: int, cap: int, last_booked: float) -> None:
        since = self._lowered.get((vertex, key))
        if since is not None:
            reached = self.applied_at(vertex, key, since) if self.applied_at else None
            if reached is None or last_booked < reached:
                self.over_lowered += 1
                return
        self.breaches.append(Breach(vertex, key, booked, cap))

    def breach_keys(self) -> set[tuple[str, str]]:
        return {(b.vertex, b.key) for b in self.breaches}


def recent_caps_lookup(service: AccountingService) -> Callable[[str, str, float], float | None]:
    """When the listener applied a cap change of (vertex, key) at or after `since`."""

    def applied_at(vertex: str, key: str, since: float) -> float | None:
        for v, k, _field, _value, at in list(service.listener.stats.recent_caps):
            if v == vertex and k == key and at >= since:
                return at
        return None

    return applied_at


# --- the audit -----------------------------------------------------------------------------
Counters = dict[tuple[str, str], tuple[int, int]]  # (vertex, key) -> (whole cores, gpus)


def store_counters(service: AccountingService, seed: FarmSeed) -> tuple[Counters, Counters]:
    """(live, in-flight) counters of the farm's keys, from the in-process Store."""
    shows, folders, jobs = set(seed.show_ids), set(seed.folder_ids), set(seed.job_ids)
    out: list[Counters] = []
    for snap in (service.store.audit_snapshot(), service.store.inflight_snapshot()):
        c: Counters = {}
        c.update({("sub", f"{s}:{a}"): v for (s, a), v in snap.sub.items() if s in shows})
        c.update({("folder", k): v for k, v in snap.folder.items() if k in folders})
        c.update({("job", k): v for k, v in snap.job.items() if k in jobs})
        out.append(c)
    return out[0], out[1]


def view_counters(view: dict[str, Any], seed: FarmSeed) -> tuple[Counters, Counters]:
    """The same from a published live view (another process's Store)."""
    shows, folders, jobs = set(seed.show_ids), set(seed.folder_ids), set(seed.job_ids)
    live_c: Counters = {}
    infl: Counters = {}
    for vertex, keep in (
        ("sub", lambda k: k.split(":", 1)[0] in shows),
        ("folder", folders.__contains__),
        ("job", jobs.__contains__),
    ):
        for key, row in view.get(vertex, {}).items():
            if keep(key):
                live_c[(vertex, key)] = (row["cores"], row["gpus"])
                infl[(vertex, key)] = (row["inflight_cores"], row["inflight_gpus"])
    return live_c, infl


def _db_counters(conn: psycopg.Connection, seed: FarmSeed, managed: set[str]) -> Counters:
    out: Counters = {}
    for vertex, key, cc, gg in conn.execute(BOOKED_BY_KEY_SQL, {"shows": list(managed)}).fetchall():
        out[(vertex, key)] = (centicores_to_cores(int(cc)), int(gg))
    return out


def counter_mismatches(store: Counters, inflight: Counters, booked: Counters) -> list[str]:
    """Every Store counter equals SUM(proc); no leaked (nonzero, no procs) or in-flight counters."""
    failed = []
    for key in sorted(store.keys() | booked.keys()):
        have, want = store.get(key, (0, 0)), booked.get(key, (0, 0))
        if have != want:
            what = "leaked counter" if want == (0, 0) else "store != SUM(proc)"
            failed.append(f"{what} {key[0]} {key[1]}: store {have} vs SUM(proc) {want} (cores, gpus)")
    for key, value in sorted(inflight.items()):
        if value != (0, 0):
            failed.append(f"in-flight left {key[0]} {key[1]}: {value}")
    return failed


def audit_database(conn: psycopg.Connection, seed: FarmSeed) -> tuple[list[str], Counters]:
    """The database invariants and the managed shows' SUM(proc), from one REPEATABLE READ snapshot."""
    params = {
        "shows": list(seed.show_ids),
        "folders": list(seed.folder_ids),
        "jobs": list(seed.job_ids),
        "hosts": list(seed.host_ids),
        "layers": list(seed.layer_ids),
    }
    failed: list[str] = []
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        for what, key, seen, expected in conn.execute(AUDIT_SQL, params).fetchall():
            failed.append(f"{what} {key}: {seen} vs {expected}")
        caps = {(v, k): int(c) for v, k, c in conn.execute(CAPS_SQL, params).fetchall()}
        all_booked = {
            (v, k): int(cc) for v, k, cc, _g in conn.execute(BOOKED_BY_KEY_SQL, {"shows": params["shows"]}).fetchall()
        }
        managed = {
            s
            for (s,) in conn.execute(
                "SELECT pk_show FROM show WHERE pk_show = ANY(%s) AND b_scheduler_managed", (params["shows"],)
            )
        }
        booked = _db_counters(conn, seed, managed)
    for key, cc in sorted(all_booked.items()):
        cap = caps.get(key)
        if cap is None:
            continue
        if (key[0] == "sub" and cc > cap) or (key[0] != "sub" and cap > 0 and cc > cap):
            failed.append(f"over cap {key[0]} {key[1]}: booked {cc} > cap {cap} centicores")
    return failed, booked


def audit(
    seed: FarmSeed,
    read_store: Callable[[], tuple[Counters, Counters]],
    *,
    settle: float = 10.0,
) -> list[str]:
    """All invariants of the audit; empty when OK.

    Releases reach the Store asynchronously (NOTIFY), so the counter comparison is retried
    until it holds or `settle` seconds pass; the database invariants need no settling.
    """
    deadline = time.monotonic() + settle
    with db.connect(autocommit=True, application_name="cuesched-stress-audit") as conn:
        while True:
            failed, booked = audit_database(conn, seed)
            live_c, infl = read_store()
            mismatches = counter_mismatches(live_c, infl, booked)
            if not mismatches or time.monotonic() > deadline:
                return failed + mismatches
            time.sleep(0.05)


# --- the report ----------------------------------------------------------------------------
@dataclass
class PhaseReport:
    name: str
    frames: int = 0
    booked: int = 0
    window: float = 0.0
    wall: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)
    breaches: int = 0
    breach_keys: list[str] = field(default_factory=list)
    samples: int = 0
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and self.breaches == 0

    @property
    def throughput(self) -> float:
        return self.booked / self.window if self.window > 0 else 0.0

    def lines(self) -> list[str]:
        out = [
            f"== phase {self.name} ==",
            f"frames: {self.frames} seeded, {self.booked} booked ({100.0 * self.booked / max(self.frames, 1):.1f}%)",
            f"throughput: {self.throughput:.0f} frames/s over a {self.window:.2f}s booking window"
            f" (wall {self.wall:.2f}s)",
            "booked: " + str(self.booked),
            "rejected: " + (", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())) or "none"),
            f"cap breaches: {self.breaches}" + (f" ({', '.join(self.breach_keys[:5])})" if self.breach_keys else ""),
            f"watchdog samples: {self.samples}",
            *self.notes,
        ]
        out.append("audit: OK" if not self.failed else "audit: FAILED")
        out.extend(f"  {f}" for f in self.failed[:50])
        return out


# --- running a phase -----------------------------------------------------------------------
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


def _seed(spec: FarmSpec) -> FarmSeed:
    purge_farm(spec.prefix)
    seed = seed_farm(spec)
    with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
        conn.execute("ANALYZE frame, proc, host, host_stat, job, layer, job_stat, layer_stat")
    return seed


def _teardown(spec: FarmSpec, report: PhaseReport) -> None:
    purge_farm(spec.prefix)
    left = {t: n for t, n in farm_counts(spec.prefix).items() if n}
    if left:
        report.failed.append(f"teardown left rows: {left}")


def run_inprocess(
    cfg: StressConfig,
    name: str,
    spec: FarmSpec,
    *,
    launcher: SimulatedLauncher,
    perturb: Callable[[Run], None] | None = None,
    duration: float | None = None,
    loop_env: dict[str, str] | None = None,
    heal: Callable[[Run], None] | None = None,
) -> PhaseReport:
    """Seed, run the service and the loop (to idle, or for `duration`), perturb, audit, purge."""
    report = PhaseReport(name=name, frames=cfg.frames(spec))
    seed = _seed(spec)
    stop_service = threading.Event()
    stop_loop = threading.Event()
    with env(**{**QUIET_LOOPS, **(loop_env or {})}):
        service = AccountingService()
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
    report.booked = loop.totals.booked
    report.window = loop.booking_window()
    report.rejected = dict(loop.totals.rejected)
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    if watchdog.over_lowered:
        report.notes.append(
            f"over a lowered cap but booked before the decrease reached the Store (not breaches): "
            f"{watchdog.over_lowered} samples"
        )
    if loop.totals.db_errors:
        report.notes.append(f"dispatch database errors (retried): {loop.totals.db_errors}")
    _teardown(spec, report)
    return report


def _launcher(cfg: StressConfig, *, runtime: bool) -> SimulatedLauncher:
    return SimulatedLauncher(
        runtime_min=cfg.runtime_min if runtime else 0.0,
        runtime_max=cfg.runtime_max if runtime else 0.0,
        failure_rate=0.0,
        launch_failure_rate=0.0,
        seed=cfg.seed,
    )


# --- phases --------------------------------------------------------------------------------
def phase_drain(cfg: StressConfig) -> PhaseReport:
    spec = cfg.drain_spec()
    report = run_inprocess(cfg, "drain", spec, launcher=_launcher(cfg, runtime=False))
    if report.booked < 0.9 * report.frames:
        report.failed.append(f"only {report.booked} of {report.frames} frames booked (< 90%)")
    return report


def phase_saturation(cfg: StressConfig) -> PhaseReport:
    spec = cfg.saturation_spec()
    burst = spec.sub_burst
    per_sub: dict[str, int] = {}

    def at_the_caps(run: Run) -> None:
        # Read before the audit: what the caps let in, per subscription (centicores).
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            rows = conn.execute(BOOKED_BY_KEY_SQL, {"shows": list(run.seed.show_ids)}).fetchall()
        per_sub.update({k: int(c) for v, k, c, _g in rows if v == "sub"})

    # Frames never finish: the caps, not completions, decide what runs.
    launcher = SimulatedLauncher(
        runtime_min=3600, runtime_max=3600, failure_rate=0.0, launch_failure_rate=0.0, seed=cfg.seed
    )
    report = run_inprocess(cfg, "saturation", spec, launcher=launcher, duration=cfg.sat_seconds, heal=at_the_caps)
    report.notes.append(
        "booked/burst per subscription (cores): "
        + ", ".join(f"{c // 100}/{burst // 100}" for c in sorted(per_sub.values(), reverse=True))
    )
    total = sum(per_sub.values())
    if total < 0.5 * burst * spec.allocs:
        report.failed.append(f"saturation booked {total // 100} cores, under half the total burst")
    # Exactly at the caps: no subscription keeps room for the smallest frame.
    smallest = min(spec.layer_cores_choices) * 100
    loose = {k: c for k, c in per_sub.items() if burst - c >= smallest}
    if len(per_sub) < spec.allocs or loose:
        report.failed.append(f"subscriptions not stopped at their burst: {loose or 'some booked nothing'}")
    return report


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


def phase_straddle(cfg: StressConfig) -> PhaseReport:
    stalled = Counter[str]()

    def perturb(run: Run) -> None:
        if not run.under_load():
            return
        recomputer = run.service.recomputer

        def stall() -> None:
            before = run.loop.totals.booked
            deadline = time.monotonic() + 2.0
            # Hold the window open until bookings landed inside it (or 2 s passed).
            while run.loop.totals.booked < before + 10 and time.monotonic() < deadline and run.loop_alive():
                time.sleep(0.005)
            stalled["windows"] += 1
            stalled["bookings"] += run.loop.totals.booked - before

        recomputer.before_snapshot = stall
        try:
            with db.connect(application_name="cuesched-stress-recompute") as conn:
                for _ in range(3):
                    if not run.loop_alive():
                        break
                    recomputer.run_once(conn)
                # A booking confirmed inside the window is both in the snapshot and in the
                # kept bucket: counted twice for one pass (a safe over-count, by design); the
                # next pass, as the recompute loop would run it, reconciles.
                recomputer.before_snapshot = None
                recomputer.run_once(conn)
        finally:
            recomputer.before_snapshot = None

    report = run_inprocess(
        cfg,
        "straddle",
        cfg.perturbation_spec("straddle"),
        launcher=_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=reconcile,
    )
    report.notes.append(f"recompute windows stalled: {stalled['windows']}, bookings inside them: {stalled['bookings']}")
    if not stalled["bookings"]:
        report.failed.append("no booking landed inside a stalled recompute window")
    return report


def phase_drops(cfg: StressConfig) -> PhaseReport:
    drops: dict[str, int] = {}

    def perturb(run: Run) -> None:
        run.service.listener.drop_release_ratio = 0.3
        run.wait_for("the load to end", lambda: not run.loop_alive(), cfg.phase_timeout)

    def heal(run: Run) -> None:
        listener = run.service.listener
        listener.drop_release_ratio = 0.0
        drops["dropped"] = listener.stats.injected_drops
        # The backstop heals what was dropped (it also ran every second during the phase).
        with db.connect(application_name="cuesched-stress-recompute") as conn:
            run.service.recomputer.run_once(conn)

    report = run_inprocess(
        cfg,
        "drops",
        cfg.perturbation_spec("drops"),
        launcher=_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=heal,
        loop_env={"CUESCHED_RECOMPUTE_INTERVAL": "1"},
    )
    report.notes.append(f"acct_release messages dropped by the listener: {drops.get('dropped', 0)} (30% injected)")
    if not drops.get("dropped"):
        report.failed.append("no release was dropped")
    return report


def phase_listener_kill(cfg: StressConfig) -> PhaseReport:
    kills: list[int] = []

    def perturb(run: Run) -> None:
        listener = run.service.listener
        for i in range(2):
            if not run.under_load(20 * (i + 1)):
                return
            pid, reconnects = listener.backend_pid, listener.stats.reconnects
            with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            kills.append(pid or 0)
            run.wait_for(
                "the listener to reconnect",
                lambda r=reconnects: listener.stats.reconnects > r and listener.connected.is_set(),
                30,
            )

    report = run_inprocess(
        cfg,
        "listener_kill",
        cfg.perturbation_spec("listener_kill"),
        launcher=_launcher(cfg, runtime=True),
        perturb=perturb,
    )
    report.notes.append(f"listener backends terminated: {len(kills)}, reconnects healed by the reseed")
    if len(kills) < 2:
        report.failed.append("the listener was not killed twice under load")
    return report


LOWER_SUB_SQL = "UPDATE subscription SET int_burst = %s WHERE pk_show = ANY(%s) RETURNING pk_show || ':' || pk_alloc"
LOWER_FOLDER_SQL = "UPDATE folder_resource SET int_max_cores = %s WHERE pk_folder = ANY(%s) RETURNING pk_folder"
LOWER_JOB_SQL = "UPDATE job_resource SET int_max_cores = %s WHERE pk_job = ANY(%s) RETURNING pk_job"


def phase_caps(cfg: StressConfig) -> PhaseReport:
    lowered: list[tuple[str, str]] = []

    def perturb(run: Run) -> None:
        if not run.under_load(40):
            return
        seed = run.seed
        sub_keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
        jobs = list(seed.job_ids[::2])
        keys = [*sub_keys, *(("folder", f) for f in seed.folder_ids), *(("job", j) for j in jobs)]
        with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
            burst = max(cfg.pert_burst // 3, 8) * 100
            lowered.extend(("sub", k) for (k,) in conn.execute(LOWER_SUB_SQL, (burst, list(seed.show_ids))))
            folder_cap = max(cfg.pert_folder_max_cores // 3, 8) * 100
            lowered.extend(
                ("folder", k) for (k,) in conn.execute(LOWER_FOLDER_SQL, (folder_cap, list(seed.folder_ids)))
            )
            lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
            conn.commit()

    report = run_inprocess(
        cfg, "caps", cfg.perturbation_spec("caps"), launcher=_launcher(cfg, runtime=True), perturb=perturb
    )
    report.notes.append(f"caps lowered under load: {len(lowered)} (subscriptions, folders, half the jobs)")
    if not lowered:
        report.failed.append("no cap was lowered")
    return report


def phase_flip(cfg: StressConfig) -> PhaseReport:
    flipped: dict[str, float] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(30):
            return
        show = run.seed.show_ids[0]
        flipped["procs"] = run.procs()
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (show,))
        started = time.monotonic()
        if run.wait_for("the flipped show to be published as managed", lambda: run.service.is_managed(show), 30):
            flipped["seconds"] = time.monotonic() - started

    report = run_inprocess(
        cfg,
        "flip",
        cfg.perturbation_spec("flip"),
        launcher=_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=reconcile,
    )
    report.notes.append(
        f"show flipped to managed with {int(flipped.get('procs', 0))} procs running, "
        f"published after {flipped.get('seconds', float('nan')):.2f}s"
    )
    return report


def _database_url() -> str:
    from django.db import connection

    from cuesched_project.dburl import url_from_settings

    return url_from_settings(connection.settings_dict)


def _start_scheduler(cfg: StressConfig, log: Path) -> subprocess.Popen[bytes]:
    manage = Path(__file__).resolve().parent.parent / "manage.py"
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
    seed = _seed(spec)
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
    _teardown(spec, report)
    return report


RUNNERS: dict[str, Callable[[StressConfig], PhaseReport]] = {
    "drain": phase_drain,
    "saturation": phase_saturation,
    "straddle": phase_straddle,
    "drops": phase_drops,
    "listener_kill": phase_listener_kill,
    "caps": phase_caps,
    "flip": phase_flip,
    "sigkill": phase_sigkill,
}


def run_stress(cfg: StressConfig, emit: Callable[[str], None] = print) -> list[PhaseReport]:
    """Run the chosen phases in order; every phase reports, even after another failed."""
    reports = []
    for name in cfg.phases:
        if name not in RUNNERS:
            raise ValueError(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
        try:
            report = RUNNERS[name](cfg)
        except Exception as exc:
            report = PhaseReport(name=name, failed=[f"phase raised {type(exc).__name__}: {exc}"])
        for line in report.lines():
            emit(line)
        reports.append(report)
    return reports


def small(cfg: StressConfig | None = None, **overrides: Any) -> StressConfig:
    """The configuration the test suite runs: every phase, a few hundred frames each."""
    base = cfg or StressConfig()
    sizes: dict[str, Any] = {
        "hosts": 60,
        "jobs": 20,
        "layers": 2,
        "frames_per_layer": 5,
        "sat_hosts": 40,
        "sat_jobs": 20,
        "sat_layers": 2,
        "sat_frames_per_layer": 5,
        "sat_burst": 30,
        "sat_job_max_cores": 8,
        "sat_seconds": 1.5,
        "pert_hosts": 40,
        "pert_jobs": 20,
        "pert_layers": 2,
        "pert_frames_per_layer": 5,
        "pert_burst": 40,
        "pert_folder_max_cores": 90,
        "pert_job_max_cores": 8,
        "phase_timeout": 60.0,
    }
    sizes.update(overrides)
    return replace(base, **sizes)
