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
- outside_writers (issue 15): writers that are not the scheduler (scripts, a DBA, a Cuebot)
  move hosts and jobs, resize and insert procs, delete and re-create subscriptions, reopen
  jobs and flip shows under a REPEATABLE READ writer, beside a managed and an unmanaged show:
  every change must reach the side that owns the show exactly once.
- split_brain / listener_wedge / flip_roundtrip (issue 16): a second scheduler taking over
  after the first's lock session is killed (the lease must fence the first), the listener's
  path frozen while caps drop (the heartbeat deadline must bound the stale caps), and a show
  flipped out and back faster than the managed-shows tick (its generation must force a seed).
- slow_listener (issue 27): the listener's path merely slow (a steady delay inside the
  heartbeat deadline, so the Store keeps enforcing what it heard late) while caps are lowered
  under booking load: the accounting generation must refuse every booking decided after the
  lowering committed until the Store applied it, whatever the delay.

The watchdog's breach rule: a key over its current cap is a breach unless its cap was
lowered during the phase and every proc of the key was decided before the decrease reached
the Store (`proc.ts_dispatched`, stamped by the dispatcher just before the Store's check,
against the listener's `recent_caps` time, stamped just after the cap was applied): those
procs were legal when booked, and the scheduler never preempts. `proc.ts_booked` (the
INSERT) is not used: in a batch of hundreds it can follow the decision by tens of
milliseconds, which made bookings checked against the old cap look like breaches.
A write from outside the scheduler can also take a managed key over its cap (nothing in the
database checks a managed show's caps: the Store does, for the scheduler's own bookings), so
keys an outside write added to are judged the same way: over the cap is a breach only if the
key's newest booking was decided after the Store surely had that write (`adding`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from accounting import db, live, singleton
from accounting.licences import limit_max_sql
from accounting.scheduler import SchedulerOptions, SchedulerProcess
from accounting.service import AccountingService
from accounting.units import centicores_to_cores
from dispatch.engine.completion import Completion, complete, kill_frames
from dispatch.engine.launcher import Launcher, get_launcher
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.netfreeze import FreezableProxy
from dispatch.lab.seeding import FarmSeed, FarmSpec, farm_counts, purge_farm, seed_farm

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking

PHASES: tuple[str, ...] = (
    "drain",
    "saturation",
    "straddle",
    "drops",
    "listener_kill",
    "caps",
    "flip",
    "sigkill",
    "outside_writers",
    "split_brain",
    "listener_wedge",
    "flip_roundtrip",
    "fairshare",
    "slow_listener",
)
PERTURBATIONS = PHASES[2:]
# The farm prefix letters of each perturbation phase (`<prefix>_<letters>`); the older phases
# use their first two letters, the integrity phases their own (so none shares a prefix).
PHASE_LETTERS: dict[str, str] = {
    **{p: p[:2] for p in PERTURBATIONS},
    "outside_writers": "ow",
    "split_brain": "sb",
    "listener_wedge": "lw",
    "flip_roundtrip": "fr",
    "fairshare": "fs",
    "slow_listener": "sl",
}

# SUM(proc) of the farm's shows against every cap, in one statement (one snapshot); only the
# rows over the cap come back: (vertex, key, booked centicores, cap centicores, newest booking).
WATCH_SQL = f"""
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
WHERE fr.int_max_cores >= 0 AND x.c > fr.int_max_cores
UNION ALL
SELECT 'job', x.pk_job, x.c, jr.int_max_cores, EXTRACT(EPOCH FROM x.last)::float8
FROM (SELECT pk_job, SUM(c) AS c, max(decided) AS last FROM p GROUP BY 1) x
JOIN job_resource jr ON jr.pk_job = x.pk_job
WHERE jr.int_max_cores >= 0 AND x.c > jr.int_max_cores
UNION ALL
-- Licence limits span shows: every limit, counted from proc (frames, or hosts) against its max.
SELECT 'limit', r.pk_limit_record, c.counted, {limit_max_sql("r.int_max_value")}, EXTRACT(EPOCH FROM c.last)::float8
FROM limit_record r CROSS JOIN LATERAL (
  SELECT CASE WHEN r.b_host_limit THEN count(DISTINCT p.pk_host) ELSE count(*) END AS counted,
         max(p.ts_dispatched) AS last
  FROM layer_limit ll JOIN proc p ON p.pk_layer = ll.pk_layer WHERE ll.pk_limit_record = r.pk_limit_record
) c
WHERE {limit_max_sql("r.int_max_value")} >= 0 AND c.counted > {limit_max_sql("r.int_max_value")}
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
# Licence limits: the trigger-kept use of every limit equals its recount from proc.
AUDIT_SQL = """
SELECT 'limit_use', r.pk_limit_record, r.int_running, CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END
FROM limit_record r CROSS JOIN LATERAL (
  SELECT count(*) AS frames, count(DISTINCT p.pk_host) AS hosts
  FROM layer_limit ll JOIN proc p ON p.pk_layer = ll.pk_layer WHERE ll.pk_limit_record = r.pk_limit_record
) c
WHERE r.int_running <> CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END
UNION ALL
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

# The five database counters of the farm's unmanaged shows against SUM(proc), and the proc
# sums no counter row holds: (what, key, counter "cc/g", SUM(proc) "cc/g"), mismatches only.
DB_COUNTERS_SQL = """
WITH u AS (SELECT pk_show FROM show WHERE pk_show = ANY(%(shows)s) AND NOT b_scheduler_managed),
live AS MATERIALIZED (
  SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
         p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local AND p.pk_show IN (SELECT pk_show FROM u)
)
SELECT 'db_subscription', s.pk_show || ':' || s.pk_alloc, s.int_cores || '/' || s.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM subscription s LEFT JOIN live l ON l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc
WHERE s.pk_show IN (SELECT pk_show FROM u) GROUP BY s.pk_subscription
HAVING s.int_cores <> COALESCE(SUM(l.cc), 0) OR s.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_folder_resource', fr.pk_folder, fr.int_cores || '/' || fr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM folder_resource fr JOIN folder f ON f.pk_folder = fr.pk_folder LEFT JOIN live l ON l.pk_folder = fr.pk_folder
WHERE f.pk_show IN (SELECT pk_show FROM u) GROUP BY fr.pk_folder_resource
HAVING fr.int_cores <> COALESCE(SUM(l.cc), 0) OR fr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_job_resource', jr.pk_job, jr.int_cores || '/' || jr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM job_resource jr JOIN job j ON j.pk_job = jr.pk_job LEFT JOIN live l ON l.pk_job = jr.pk_job
WHERE j.pk_show IN (SELECT pk_show FROM u) GROUP BY jr.pk_job_resource
HAVING jr.int_cores <> COALESCE(SUM(l.cc), 0) OR jr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_layer_resource', lr.pk_layer, lr.int_cores || '/' || lr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM layer_resource lr JOIN job j ON j.pk_job = lr.pk_job LEFT JOIN live l ON l.pk_layer = lr.pk_layer
WHERE j.pk_show IN (SELECT pk_show FROM u) GROUP BY lr.pk_layer_resource
HAVING lr.int_cores <> COALESCE(SUM(l.cc), 0) OR lr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_point', pt.pk_show || ':' || pt.pk_dept, pt.int_cores || '/' || pt.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM point pt LEFT JOIN live l ON l.pk_show = pt.pk_show AND l.pk_dept = pt.pk_dept
WHERE pt.pk_show IN (SELECT pk_show FROM u) GROUP BY pt.pk_point
HAVING pt.int_cores <> COALESCE(SUM(l.cc), 0) OR pt.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_subscription_missing', l.pk_show || ':' || l.pk_alloc, 'no row', SUM(l.cc) || '/' || SUM(l.g)
FROM live l
WHERE NOT EXISTS (SELECT 1 FROM subscription s WHERE s.pk_show = l.pk_show AND s.pk_alloc = l.pk_alloc)
GROUP BY l.pk_show, l.pk_alloc
UNION ALL
SELECT 'db_point_missing', l.pk_show || ':' || l.pk_dept, 'no row', SUM(l.cc) || '/' || SUM(l.g)
FROM live l
WHERE NOT EXISTS (SELECT 1 FROM point pt WHERE pt.pk_show = l.pk_show AND pt.pk_dept = l.pk_dept)
GROUP BY l.pk_show, l.pk_dept
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
    # the integrity phases (issues 15 and 16): the perturbation farm's hosts, jobs and caps,
    # with more frames that run longer, so the load outlasts the faults
    int_frames_per_layer: int = 30
    int_runtime_min: float = 0.3
    int_runtime_max: float = 1.0
    # outside_writers: writes in all (bounded), writer threads, mean pause between two writes, s
    ow_ops: int = 1200
    ow_writers: int = 4
    ow_pause: float = 0.02
    # split_brain: the standby's lock poll (CUESCHED_STANDBY_POLL_INTERVAL's default), s
    sb_poll: float = 1.0
    # listener_wedge: hosts and frames per layer of its farm (the hosts, not the caps, bind
    # there, so bookings go on while the Store hears no release); the listener's heartbeat
    # deadline and how long its path stays frozen, s
    lw_hosts: int = 40
    lw_frames_per_layer: int = 25
    lw_deadline: float = 3.0
    lw_freeze: float = 6.0
    # slow_listener: the listener path's steady delay and its heartbeat deadline (the delay plus
    # a heartbeat interval stays inside it), and how long the load runs after the lowering, s
    sl_delay: float = 2.5
    sl_deadline: float = 4.5
    sl_after: float = 6.0
    # flip_roundtrip: round trips, the managed-shows tick (longer than a trip), the recompute
    # (shorter than the 0.1-0.3 s a show stays out, so a recompute sees it unmanaged), s
    fr_trips: int = 10
    fr_ttl: float = 5.0
    fr_recompute: float = 0.1
    # fairshare (issue 19): 8-core hosts, one-core frames of fs_runtime_min-max s; three shows
    # sized 50/30/20% of the farm, each with a burst of fs_burst_share of it, the smallest one at
    # the highest priority; how long the load runs, and from when each show's share of the
    # booked cores, averaged over fs_window, must stay within fs_tolerance (absolute) of its
    # share of the sizes, s
    fs_hosts: int = 100
    fs_jobs_per_show: int = 4
    fs_frames_per_layer: int = 2000
    fs_runtime_min: float = 1.0
    fs_runtime_max: float = 3.0
    fs_burst_share: float = 0.7
    fs_seconds: float = 20.0
    fs_converge_by: float = 6.0
    fs_tolerance: float = 0.1
    fs_window: float = 1.0
    # drain on real frames: `simulated` (default), or `rqd` - the drain farm's first
    # `rqd_daemons` hosts are real OpenCue RQD daemons (one per host, on this machine), its
    # layers run `true`, and the rqd launcher and the gateway carry every frame
    launcher: str = "simulated"
    rqd_daemons: int = 4

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

    def integrity_spec(self, phase: str, **shape: Any) -> FarmSpec:
        """The perturbation farm for an integrity phase; `shape` overrides FarmSpec fields (shows...)."""
        base = replace(
            self.perturbation_spec(phase),
            prefix=f"{self.prefix}_{PHASE_LETTERS[phase]}",
            frames_per_layer=self.int_frames_per_layer,
            managed=True,
        )
        return replace(base, **shape)

    def frames(self, spec: FarmSpec) -> int:
        return spec.jobs * spec.layers * spec.frames_per_layer


# --- the cap watchdog ----------------------------------------------------------------------
@dataclass
class Breach:
    vertex: str
    key: str
    booked: int  # centicores
    cap: int  # centicores


@dataclass(eq=False)
class OutsideWrite:
    """A write from outside the scheduler that added cores to managed keys (`CapWatchdog.adding`)."""

    keys: frozenset[tuple[str, str]]
    committed: float | None = None  # time.monotonic() once its COMMIT returned; None in transit
    aborted: bool = False


class CapWatchdog:
    """Samples SUM(proc) against every cap of a farm from its own connection, in a thread.

    `applied_at(vertex, key, since)` answers when a cap decrease registered with `lowering`
    reached the Store (unix time), or None while it is in transit. `reached_at(t)` answers
    when the Store surely had everything committed up to monotonic time `t` (unix time), or
    None while it may not; it judges the keys outside writes added to (`adding`).
    """

    def __init__(
        self,
        show_ids: list[str],
        *,
        interval: float = 0.02,
        applied_at: Callable[[str, str, float], float | None] | None = None,
        reached_at: Callable[[float], float | None] | None = None,
    ) -> None:
        self.show_ids = show_ids
        self.interval = interval
        self.applied_at = applied_at
        self.reached_at = reached_at
        self.samples = 0
        self.breaches: list[Breach] = []
        self.over_lowered = 0  # over a lowered cap, every proc booked before it reached the Store
        self.over_outside = 0  # over a cap an outside write took it over, before the Store had it
        # The newest decision (proc.ts_dispatched) seen on a key while it was over its lowered cap.
        self.last_over_lowered: dict[tuple[str, str], float] = {}
        self.errors = 0
        self._lowered: dict[tuple[str, str], float] = {}
        self._outside: dict[tuple[str, str], list[OutsideWrite]] = {}
        self._outside_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def adding(self, keys: list[tuple[str, str]]) -> OutsideWrite:
        """Register, before its COMMIT, an outside write that adds to managed `keys`.

        The caller sets `committed` once COMMIT returned, or `aborted` if it rolled back.
        Nothing in the database checks a managed show's caps, so such a write may itself take
        a key over: that is not the scheduler's booking. Until the Store surely had the write,
        a booking decided on the key was checked against a count without it.
        """
        write = OutsideWrite(frozenset(keys))
        with self._outside_lock:
            for key in write.keys:
                self._outside.setdefault(key, []).append(write)
        return write

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
            seen = self.last_over_lowered.get((vertex, key))
            self.last_over_lowered[(vertex, key)] = last_booked if seen is None else max(seen, last_booked)
            reached = self.applied_at(vertex, key, since) if self.applied_at else None
            if reached is None or last_booked < reached:
                self.over_lowered += 1
                return
        with self._outside_lock:
            writes = [w for w in self._outside.get((vertex, key), ()) if not w.aborted]
        if writes:
            reached = self._outside_reached(writes)
            if reached is None or last_booked < reached:
                self.over_outside += 1
                return
        self.breaches.append(Breach(vertex, key, booked, cap))

    def _outside_reached(self, writes: list[OutsideWrite]) -> float | None:
        """When the Store surely had the newest of `writes` (None: one is still in transit)."""
        committed = [w.committed for w in writes]
        if any(c is None for c in committed) or self.reached_at is None:
            return None
        return self.reached_at(max(c for c in committed if c is not None))

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


class StoreReach:
    """When the Store surely had every commit up to a monotonic time, from the listener's heartbeats.

    Notifications arrive in commit order, and the listener's `fresh_as_of` is the send time of
    the newest heartbeat it received (or the start of its last reseed): once it passes `t`,
    everything committed before `t` has been applied. A thread records, for each advance, the
    unix time it was seen (at most `poll` late: lenient by that much).
    """

    def __init__(self, service: AccountingService, poll: float = 0.005) -> None:
        self.listener = service.listener
        self.poll = poll
        self._fresh: list[float] = []
        self._seen: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-reach", daemon=True)

    def start(self) -> StoreReach:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            fresh = self.listener.stats.fresh_as_of
            if fresh is not None and (not self._fresh or fresh > self._fresh[-1]):
                self._seen.append(time.time())
                self._fresh.append(fresh)

    def reached_at(self, committed: float) -> float | None:
        i = bisect.bisect_left(self._fresh, committed)
        return self._seen[i] if i < len(self._seen) else None


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
    """The database invariants and the managed shows' SUM(proc), from one REPEATABLE READ snapshot.

    The invariants include, for the unmanaged shows, the five counter tables the triggers
    keep (subscription, folder_resource, job_resource, layer_resource, point) equal to SUM(proc).
    """
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
        for what, key, seen, expected in conn.execute(DB_COUNTERS_SQL, params).fetchall():
            failed.append(f"{what} {key}: counter {seen} vs SUM(proc) {expected} (centicores/gpus)")
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
        if (key[0] == "sub" and cc > cap) or (key[0] != "sub" and cap >= 0 and cc > cap):
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
    seed = _seed(spec)
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
    _watchdog_notes(watchdog, report)
    if loop.totals.db_errors:
        report.notes.append(f"dispatch database errors (retried): {loop.totals.db_errors}")
    _teardown(spec, report)
    return report


def _watchdog_notes(watchdog: CapWatchdog, report: PhaseReport) -> None:
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
    if cfg.launcher == "rqd":
        # Every layer must fit one of the few hosts: one allocation, no manual tag, hosts big
        # enough for the largest layer, but not so big that a 2-core machine forks hundreds of frames.
        spec = replace(spec, hosts=cfg.rqd_daemons, allocs=1, manual_tags=0, host_cores_choices=(8, 16))
        report = run_inprocess(cfg, "drain", spec, launcher=get_launcher("rqd"), prepare=_rqd_hosts)
    elif cfg.launcher == "simulated":
        report = run_inprocess(cfg, "drain", spec, launcher=_launcher(cfg, runtime=False))
    else:
        raise ValueError(f"the drain phase runs on the simulated or the rqd launcher, not {cfg.launcher!r}")
    if report.booked < 0.9 * report.frames:
        report.failed.append(f"only {report.booked} of {report.frames} frames booked (< 90%)")
    return report


HOSTS_OF_FARM_SQL = """
SELECT h.str_name, h.int_cores, h.int_mem,
       (SELECT array_agg(t.str_tag ORDER BY t.str_tag) FROM host_tag t
        WHERE t.pk_host = h.pk_host AND t.str_tag_type NOT IN ('ALLOC', 'HOSTNAME'))
FROM host h WHERE h.pk_host = ANY(%s::text[]) ORDER BY h.str_name
"""


def _rqd_hosts(seed: FarmSeed) -> Callable[[], None]:
    """Real RQD daemons as the seeded hosts (same names, cores, memory and tags, so each startup
    report updates its host in place), a gateway for their reports, and `true` as every layer's
    command. Returns what stops them."""
    import tempfile

    from dispatch.hosts.rqd_gateway import start_gateway
    from dispatch.lab.rqdfarm import start_daemons, wait_registered

    tmp = Path(tempfile.mkdtemp(prefix="stress-rqd-"))
    gateway = start_gateway("127.0.0.1", 0, workers=16)
    daemons: dict[str, Any] = {}
    try:
        with db.connect(autocommit=True, application_name="cuesched-stress-rqd") as conn:
            conn.execute("UPDATE layer SET str_cmd = 'true' WHERE pk_job = ANY(%s::text[])", (list(seed.job_ids),))
            for name, cores, mem, tags in conn.execute(HOSTS_OF_FARM_SQL, (list(seed.host_ids),)).fetchall():
                daemons.update(
                    start_daemons(
                        [name], gateway.port, tmp, tags=list(tags or []), cores=int(cores) // 100, memory_kb=int(mem)
                    )
                )
            for d in daemons.values():
                wait_registered(conn, d, 60)
    except BaseException:
        for d in daemons.values():
            d.stop()
        gateway.stop()
        raise

    def stop() -> None:
        for d in daemons.values():
            d.stop()
        gateway.stop()

    return stop


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
    manage = Path(__file__).resolve().parents[2] / "manage.py"
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


# --- integrity phases (issues 15 and 16) ---------------------------------------------------
def _int_launcher(cfg: StressConfig, seed_offset: int = 0) -> SimulatedLauncher:
    return SimulatedLauncher(
        runtime_min=cfg.int_runtime_min,
        runtime_max=cfg.int_runtime_max,
        failure_rate=0.0,
        launch_failure_rate=0.0,
        seed=cfg.seed + seed_offset,
    )


class _Skip(Exception):
    """An outside write that found nothing to do (rolled back, counted as skipped)."""


OW_KINDS: tuple[tuple[str, int], ...] = (
    ("host_move", 3),
    ("job_move", 2),
    ("resize", 3),
    ("insert", 3),
    ("sub_cycle", 1),
    ("reopen", 1),
    ("flip_rr", 1),
)

# A proc of the farm at random, with the keys it is booked against and whether its show is managed.
OW_PROC_SQL = """
SELECT p.pk_proc, p.pk_host, p.int_cores_reserved, p.pk_show, p.pk_job
FROM proc p WHERE p.pk_show = ANY(%s) AND NOT p.b_local ORDER BY random() LIMIT 1
"""
OW_PROC_KEYS_SQL = """
SELECT s.b_scheduler_managed, p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job
FROM proc p JOIN show s ON s.pk_show = p.pk_show JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
WHERE p.pk_proc = %s
"""
OW_WAITING_FRAME_SQL = """
SELECT f.pk_frame, f.pk_layer, f.pk_job, j.pk_show, l.int_cores_min, l.int_mem_min
FROM frame f JOIN job j ON j.pk_job = f.pk_job JOIN layer l ON l.pk_layer = f.pk_layer
WHERE f.pk_job = ANY(%s) AND f.str_state = 'WAITING' AND j.str_state = 'PENDING' ORDER BY random() LIMIT 1
"""
OW_HOST_WITH_ROOM_SQL = """
SELECT pk_host FROM host WHERE pk_host = ANY(%s) AND int_cores_idle >= %s AND int_mem_idle >= %s
ORDER BY random() LIMIT 1
"""
OW_START_FRAME_SQL = """
UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1, ts_started = now(), ts_updated = now()
WHERE pk_frame = %s AND str_state = 'WAITING'
"""
OW_INSERT_PROC_SQL = """
INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, int_mem_reserved,
                  int_gpus_reserved)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 0)
"""
OW_TAKE_HOST_SQL = """
UPDATE host SET int_cores_idle = int_cores_idle - %(c)s, int_mem_idle = int_mem_idle - %(m)s, ts_last_updated = now()
WHERE pk_host = %(host)s AND int_cores_idle >= %(c)s AND int_mem_idle >= %(m)s AND int_cores_idle - %(c)s <= int_cores
"""


@dataclass
class _OutsideWriters:
    """The outside writers of `outside_writers`: plain SQL on autocommit connections of their own.

    They know nothing of the scheduler; they write as a script or a DBA would, each write one
    READ COMMITTED transaction (the REPEATABLE READ writer excepted). What they add to managed
    keys is registered with the watchdog (`adding`) before COMMIT, so that only bookings the
    scheduler decided once the Store had the write can count as breaches. Procs they insert
    run on no launcher: an "agent" here completes each after a drawn runtime.
    """

    run: Run
    cfg: StressConfig
    folders: dict[str, list[tuple[str, str | None]]]  # show -> [(folder, dept)]
    counts: Counter[str] = field(default_factory=Counter)
    moved_procs: int = 0
    failures: list[str] = field(default_factory=list)
    flipped: dict[str, bool] = field(default_factory=dict)  # show -> flipped from its seeded state
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Subscription deletes and flips one at a time: a subscription deleted while its show flips
    # to unmanaged would be re-created with a counter of 0 under running procs (see sub_cycle).
    _flip_lock: threading.Lock = field(default_factory=threading.Lock)
    _agent: list[tuple[float, str]] = field(default_factory=list)  # heap of (due, pk_proc)
    _agent_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seed(self) -> FarmSeed:
        return self.run.seed

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    # -- one write ------------------------------------------------------------------------
    def _write(
        self, conn: psycopg.Connection, body: Callable[[psycopg.Connection], tuple[str, list[tuple[str, str]]]]
    ) -> str:
        """Run `body` in one transaction; what it added to managed keys is registered before COMMIT."""
        write: OutsideWrite | None = None
        try:
            with conn.transaction():
                outcome, keys = body(conn)
                if keys:
                    write = self.run.watchdog.adding(keys)
        except _Skip as skip:
            return f"skipped ({skip})"
        except psycopg.OperationalError:
            if write is not None:
                write.committed = time.monotonic()  # COMMIT may have happened: judged as if it had
            raise
        except BaseException:
            if write is not None:
                write.aborted = True
            raise
        if write is not None:
            write.committed = time.monotonic()
        return outcome

    def host_move(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = None
            if rng.random() < 0.75:
                row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            host = row[1] if row else rng.choice(seed.host_ids)
            current = c.execute("SELECT pk_alloc FROM host WHERE pk_host = %s", (host,)).fetchone()
            if current is None:
                raise _Skip("host gone")
            target = rng.choice([a for a in seed.alloc_ids if a != current[0]])
            moved = c.execute(
                "UPDATE host SET pk_alloc = %s, ts_last_updated = now() WHERE pk_host = %s AND pk_alloc = %s",
                (target, host, current[0]),
            ).rowcount
            if not moved:
                raise _Skip("moved meanwhile")
            rows = c.execute(
                "SELECT p.pk_show, s.b_scheduler_managed, count(*) FROM proc p JOIN show s ON s.pk_show = p.pk_show"
                " WHERE p.pk_host = %s AND NOT p.b_local GROUP BY 1, 2",
                (host,),
            ).fetchall()
            with self._lock:
                self.moved_procs += sum(int(n) for _s, _m, n in rows)
            return "done", [("sub", f"{show}:{target}") for show, managed, _n in rows if managed]

        return self._write(conn, body)

    def job_move(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = None
            if rng.random() < 0.75:
                row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            job = row[4] if row else rng.choice(seed.job_ids)
            current = c.execute("SELECT pk_show, pk_folder FROM job WHERE pk_job = %s", (job,)).fetchone()
            if current is None:
                raise _Skip("job gone")
            show, folder = current
            targets = [(f, d) for f, d in self.folders[show] if f != folder]
            if not targets:
                raise _Skip("one folder only")
            target, dept = rng.choice(targets)
            moved = c.execute(
                "UPDATE job SET pk_folder = %s, pk_dept = COALESCE(%s, pk_dept), ts_updated = now()"
                " WHERE pk_job = %s AND pk_folder = %s",
                (target, dept, job, folder),
            ).rowcount
            if not moved:
                raise _Skip("moved meanwhile")
            managed, procs = c.execute(
                "SELECT s.b_scheduler_managed, (SELECT count(*) FROM proc p WHERE p.pk_job = %s AND NOT p.b_local)"
                " FROM show s WHERE s.pk_show = %s",
                (job, show),
            ).fetchone() or (False, 0)
            return "done", [("folder", target)] if managed and procs else []

        return self._write(conn, body)

    def resize(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            if row is None:
                raise _Skip("no proc")
            pk_proc, host, cores, _show, _job = row
            delta = rng.choice((100, -100))
            if cores + delta < 100:
                delta = 100
            if not c.execute(
                "UPDATE proc SET int_cores_reserved = int_cores_reserved + %s"
                " WHERE pk_proc = %s AND int_cores_reserved + %s >= 100",
                (delta, pk_proc, delta),
            ).rowcount:
                raise _Skip("proc gone")
            if not c.execute(OW_TAKE_HOST_SQL, {"c": delta, "m": 0, "host": host}).rowcount:
                raise _Skip("host full")
            keys: list[tuple[str, str]] = []
            if delta > 0:
                managed, show, alloc, folder, job = c.execute(OW_PROC_KEYS_SQL, (pk_proc,)).fetchone()  # type: ignore[misc]
                if managed:
                    keys = [("sub", f"{show}:{alloc}"), ("folder", folder), ("job", job)]
            return ("grown" if delta > 0 else "shrunk"), keys

        return self._write(conn, body)

    def insert(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed
        pk_proc = str(uuid.uuid4())

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(OW_WAITING_FRAME_SQL, (list(seed.job_ids),)).fetchone()
            if row is None:
                raise _Skip("no waiting frame")
            frame, layer, job, show, cores, mem = row
            host = c.execute(OW_HOST_WITH_ROOM_SQL, (list(seed.host_ids), cores, mem)).fetchone()
            if host is None:
                raise _Skip("no host with room")
            if not c.execute(OW_START_FRAME_SQL, (frame,)).rowcount:
                raise _Skip("frame taken")
            c.execute(OW_INSERT_PROC_SQL, (pk_proc, host[0], show, layer, job, frame, cores, mem))
            if not c.execute(OW_TAKE_HOST_SQL, {"c": cores, "m": mem, "host": host[0]}).rowcount:
                raise _Skip("host full")
            managed, show, alloc, folder, job = c.execute(OW_PROC_KEYS_SQL, (pk_proc,)).fetchone()  # type: ignore[misc]
            return "done", [("sub", f"{show}:{alloc}"), ("folder", folder), ("job", job)] if managed else []

        outcome = self._write(conn, body)
        if outcome == "done":
            due = time.monotonic() + rng.uniform(self.cfg.int_runtime_min, self.cfg.int_runtime_max)
            with self._agent_lock:
                heapq.heappush(self._agent, (due, pk_proc))
        return outcome

    def sub_cycle(self, conn: psycopg.Connection, rng: random.Random) -> str:
        """A managed show's subscription deleted, then re-created as it was.

        Managed shows only: an unmanaged show's subscription row IS its database counter, and a
        re-created row starts at 0 under the procs still running (nothing rebuilds it but the
        periodic reconcile), which no trigger can tell from a new subscription.
        """
        with self._flip_lock:
            managed = [
                s
                for (s,) in conn.execute(
                    "SELECT pk_show FROM show WHERE pk_show = ANY(%s) AND b_scheduler_managed",
                    (list(self.seed.show_ids),),
                )
            ]
            if not managed:
                return "skipped (no managed show)"
            show, alloc = rng.choice(managed), rng.choice(self.seed.alloc_ids)
            row = conn.execute(
                "DELETE FROM subscription WHERE pk_show = %s AND pk_alloc = %s"
                " RETURNING pk_subscription, int_size, int_burst, float_tier",
                (show, alloc),
            ).fetchone()
            if row is None:
                return "skipped (no subscription)"
            # Deleted for a moment while the loop books: the Store must refuse the allocation.
            self.run.stop_loop.wait(rng.uniform(0.05, 0.3))
            conn.execute(
                "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst, float_tier)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (row[0], alloc, show, row[1], row[2], row[3]),
            )
        return "done"

    def reopen(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(
                "SELECT pk_job FROM job WHERE pk_job = ANY(%s) AND str_state = 'FINISHED' ORDER BY random() LIMIT 1",
                (list(seed.job_ids),),
            ).fetchone()
            if row is None:
                raise _Skip("no finished job yet")
            frames = c.execute(
                "UPDATE frame SET str_state = 'WAITING', int_version = int_version + 1, ts_updated = now()"
                " WHERE pk_frame IN (SELECT pk_frame FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'"
                " ORDER BY random() LIMIT %s)",
                (row[0], rng.randint(2, 6)),
            ).rowcount
            if not frames:
                raise _Skip("nothing to run again")
            if not c.execute(
                "UPDATE job SET str_state = 'PENDING', ts_stopped = NULL, ts_updated = now()"
                " WHERE pk_job = %s AND str_state = 'FINISHED'",
                (row[0],),
            ).rowcount:
                raise _Skip("reopened meanwhile")
            self.count("reopen frames", frames)
            return "done", []

        return self._write(conn, body)

    def flip_rr(self, conn: psycopg.Connection, rng: random.Random, rr: psycopg.Connection) -> str:
        """A show flipped while a REPEATABLE READ writer, whose snapshot predates it, inserts a proc.

        The writer's snapshot is taken (reading a frame and the show's flag) before the flip
        commits; its INSERT comes after, and must fail with a serialization failure (40001)
        from the accounting epoch guard: committed, it would be accounted by the side its old
        snapshot believes owns the show.
        """
        with self._flip_lock:
            show = rng.choice(self.seed.show_ids)
            rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            try:
                row = rr.execute(
                    OW_WAITING_FRAME_SQL.replace("f.pk_job = ANY(%s)", "j.pk_show = %s"), (show,)
                ).fetchone()
                host = (
                    rr.execute(OW_HOST_WITH_ROOM_SQL, (list(self.seed.host_ids), row[4], row[5])).fetchone()
                    if row
                    else None
                )
                conn.execute(
                    "UPDATE show SET b_scheduler_managed = NOT b_scheduler_managed WHERE pk_show = %s", (show,)
                )
                self.flipped[show] = not self.flipped.get(show, False)
                self.count("flips")
                if row is None or host is None:
                    rr.execute("ROLLBACK")
                    return "flipped (no frame or host for the writer)"
                frame, layer, job, _show, cores, mem = row
                pk_proc = str(uuid.uuid4())
                try:
                    rr.execute(OW_INSERT_PROC_SQL, (pk_proc, host[0], show, layer, job, frame, cores, mem))
                    rr.execute(OW_START_FRAME_SQL, (frame,))
                    rr.execute(OW_TAKE_HOST_SQL, {"c": cores, "m": mem, "host": host[0]})
                    rr.execute("COMMIT")
                except psycopg.errors.SerializationFailure as exc:
                    rr.execute("ROLLBACK")
                    context = exc.diag.context or ""
                    return "serialization (epoch guard)" if "cuesched_accounting_epoch" in context else "serialization"
            except BaseException:
                if rr.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    rr.execute("ROLLBACK")
                raise
        with self._agent_lock:
            heapq.heappush(self._agent, (time.monotonic(), pk_proc))
        self.failures.append(f"a REPEATABLE READ writer inserted proc {pk_proc} across a flip of show {show}")
        return "committed across the flip"

    def restore_flips(self, conn: psycopg.Connection) -> None:
        """Every show back to its seeded state, so the audit sees both kinds."""
        with self._flip_lock:
            for show, flipped in sorted(self.flipped.items()):
                if flipped:
                    conn.execute(
                        "UPDATE show SET b_scheduler_managed = NOT b_scheduler_managed WHERE pk_show = %s", (show,)
                    )
                    self.flipped[show] = False
                    self.count("flips")

    # -- the threads ----------------------------------------------------------------------
    def writer(self, index: int, ops: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/outside_writers/{index}")
        kinds = [k for k, _w in OW_KINDS]
        weights = [w for _k, w in OW_KINDS]
        conn = db.connect(autocommit=True, application_name=f"cuesched-stress-writer-{index}")
        rr = db.connect(autocommit=True, application_name=f"cuesched-stress-rr-{index}")
        try:
            for _ in range(ops):
                if not self.run.loop_alive():
                    break
                kind = rng.choices(kinds, weights)[0]
                try:
                    if kind == "flip_rr":
                        outcome = self.flip_rr(conn, rng, rr)
                    else:
                        outcome = getattr(self, kind)(conn, rng)
                except psycopg.errors.CheckViolation as exc:
                    outcome = f"refused ({exc.diag.constraint_name})"
                except psycopg.errors.SerializationFailure:
                    outcome = "serialization failure"
                except psycopg.errors.UniqueViolation:
                    # The frame this writer read as WAITING was booked by the scheduler meanwhile
                    # (one proc per frame): the database refused the second one, as it should.
                    outcome = "frame booked meanwhile"
                except psycopg.errors.DeadlockDetected:
                    outcome = "deadlock"
                except psycopg.OperationalError as exc:
                    outcome = f"connection lost ({type(exc).__name__})"
                    conn.close()
                    rr.close()
                    conn = db.connect(autocommit=True, application_name=f"cuesched-stress-writer-{index}")
                    rr = db.connect(autocommit=True, application_name=f"cuesched-stress-rr-{index}")
                except psycopg.Error as exc:
                    outcome = f"error {exc.sqlstate}"
                    self.failures.append(f"{kind}: unexpected {type(exc).__name__}: {exc}")
                self.count(f"{kind} {outcome}")
                self.run.stop_loop.wait(rng.uniform(0, 2 * self.cfg.ow_pause))
        finally:
            conn.close()
            rr.close()

    def agent(self, stop: threading.Event) -> None:
        """Completes the procs the writers inserted, each once its runtime is up (all when `stop`)."""
        conn = db.connect(autocommit=True, application_name="cuesched-stress-agent")
        try:
            while True:
                with self._agent_lock:
                    now = time.monotonic()
                    due = []
                    while self._agent and (self._agent[0][0] <= now or stop.is_set()):
                        due.append(heapq.heappop(self._agent)[1])
                    empty = not self._agent
                if due:
                    try:
                        result = complete(conn, [Completion(pk, 0) for pk in due])
                    except psycopg.Error as exc:
                        # A deadlock with a booking (both lock a job_stat row and the show's
                        # database-accounting lock, in opposite orders) rolls it back: retry.
                        self.count(f"agent retries ({type(exc).__name__})")
                        with self._agent_lock:
                            for pk in due:
                                heapq.heappush(self._agent, (time.monotonic() + 0.05, pk))
                        if conn.broken or conn.closed:
                            conn = db.connect(autocommit=True, application_name="cuesched-stress-agent")
                        time.sleep(0.05)
                        continue
                    self.count("agent completions", result.released)
                elif stop.is_set() and empty:
                    return
                else:
                    time.sleep(0.01)
        finally:
            conn.close()


def phase_outside_writers(cfg: StressConfig) -> PhaseReport:
    """Issue 15: every outside write, under booking load, beside a managed and an unmanaged show."""
    spec = cfg.integrity_spec("outside_writers", shows=2, managed_shows=1, folders_per_show=3, depts=2)
    box: dict[str, _OutsideWriters] = {}
    reaches: dict[int, StoreReach] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(20):
            return
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            folders: dict[str, list[tuple[str, str | None]]] = {}
            for folder, show, dept in conn.execute(
                "SELECT pk_folder, pk_show, pk_dept FROM folder WHERE pk_folder = ANY(%s) ORDER BY pk_folder",
                (list(run.seed.folder_ids),),
            ):
                folders.setdefault(show, []).append((folder, dept))
            writers = box["w"] = _OutsideWriters(run, cfg, folders)
            reach = reaches[0] = StoreReach(run.service).start()
            run.watchdog.reached_at = reach.reached_at
            stop_agent = threading.Event()
            agent = threading.Thread(target=writers.agent, args=(stop_agent,), name="stress-agent", daemon=True)
            agent.start()
            per_writer = math.ceil(cfg.ow_ops / max(cfg.ow_writers, 1))
            threads = [
                threading.Thread(target=writers.writer, args=(i, per_writer), name=f"stress-writer-{i}", daemon=True)
                for i in range(cfg.ow_writers)
            ]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(cfg.phase_timeout)
                writers.restore_flips(conn)
            finally:
                stop_agent.set()
                agent.join(30)
                # The recorder keeps running: the watchdog judges with it until the audit is over.

    report = run_inprocess(
        cfg,
        "outside_writers",
        spec,
        launcher=_int_launcher(cfg),
        perturb=perturb,
        # A recompute every second (evictions of finished jobs, which a reopened job must
        # survive); no database reconcile, so the triggers alone must keep unmanaged counters.
        loop_env={"CUESCHED_RECOMPUTE_INTERVAL": "1", "CUESCHED_DB_RECONCILE_INTERVAL": "3600"},
    )
    for reach in reaches.values():
        reach.stop()
    writers = box.get("w")
    if writers is None:
        report.failed.append("the outside writers never ran")
        return report
    counts = writers.counts
    for kind, _w in OW_KINDS:
        mine = {k.split(" ", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith(kind + " ")}
        report.notes.append(f"outside {kind}: " + (", ".join(f"{k} {n}" for k, n in mine.items()) or "none"))
    report.notes.append(
        f"outside writes: {sum(n for k, n in counts.items() if k.split(' ')[0] in dict(OW_KINDS))} "
        f"({cfg.ow_writers} writers), procs moved with their hosts: {writers.moved_procs}, flips: "
        f"{counts['flips']}, frames reopened: {counts['reopen frames']}, outside procs completed by the agent: "
        f"{counts['agent completions']}"
        + "".join(f", {k} {n}" for k, n in sorted(counts.items()) if k.startswith("agent retries"))
    )
    done = {
        "host_move": counts["host_move done"],
        "job_move": counts["job_move done"],
        "resize": counts["resize grown"] + counts["resize shrunk"],
        "insert": counts["insert done"],
        "sub_cycle": counts["sub_cycle done"],
        "reopen": counts["reopen done"],
        "flip_rr": counts["flip_rr serialization (epoch guard)"],
    }
    missing = [k for k, n in done.items() if not n]
    if missing:
        report.failed.append(f"outside writes never done under load: {', '.join(missing)}")
    report.failed.extend(writers.failures)
    return report


class _RecordingLauncher(SimulatedLauncher):
    """The simulated launcher, recording each booking it is handed (its batch has committed)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.booked: list[tuple[str, str, float, float]] = []  # (pk_proc, pk_frame, decided, launched), unix

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        now = time.time()
        self.booked.extend((b.pk_proc, b.frame.pk, b.decided_at or now, now) for b in bookings)
        return super().launch(bookings)


class _InprocScheduler:
    """A real SchedulerProcess (lock, lease, service, publisher) with one dispatch loop, in a thread.

    The same process `run_scheduler` runs (`SchedulerProcess.run(main)`), with a main that is
    `dispatch_main`'s single-worker case on a recording launcher, so the phase knows which
    scheduler booked what and when it decided it.
    """

    def __init__(self, cfg: StressConfig, name: str, *, standby: bool, lock_check_interval: float, offset: int) -> None:
        self.name = name
        self.launcher = _RecordingLauncher(
            runtime_min=cfg.int_runtime_min,
            runtime_max=cfg.int_runtime_max,
            failure_rate=0.0,
            launch_failure_rate=0.0,
            seed=cfg.seed + offset,
        )
        self.process = SchedulerProcess(
            SchedulerOptions(bootstrap_timeout=30, standby=standby, lock_check_interval=lock_check_interval)
        )
        self.loop: DispatchLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"stress-{name}", daemon=True)

    def _main(self, service: AccountingService, stop: threading.Event) -> None:
        loop = self.loop = DispatchLoop(service, self.launcher)
        service.view_providers["dispatch"] = loop.live_view
        try:
            loop.run(stop)
        finally:
            loop.close()
            self.launcher.close()

    def _run(self) -> None:
        try:
            self.process.run(self._main)
        except BaseException as exc:  # reported by the phase
            self.error = exc

    def start(self) -> _InprocScheduler:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.process.stop.set()
        self.thread.join(timeout)

    def decided(self) -> list[float]:
        return [d for _p, _f, d, _l in self.launcher.booked]

    def launched(self) -> list[float]:
        return [launched for _p, _f, _d, launched in self.launcher.booked]


LEASE_ROW_SQL = (
    "SELECT int_generation, EXTRACT(EPOCH FROM ts_acquired)::float8 FROM cuesched_scheduler_lease WHERE id = 1"
)


def phase_split_brain(cfg: StressConfig) -> PhaseReport:
    """Issue 16: a standby takes over after the first scheduler's lock session is killed.

    Both are real SchedulerProcess objects in this process, each with its own Store, listener
    and dispatch loop. The first's lock check is made longer than the phase, so only the lease
    (checked by every booking transaction) can stop it: the lock session dies, the standby takes
    the lock and the lease (which waits for the first's in-flight batch), bootstraps and books;
    the first's next batch must find the lease gone and stop. Its frames, left running on its
    launcher, are released the completion way (as their agents would report them) and the
    second books them again.
    """
    spec = cfg.integrity_spec("split_brain")
    report = PhaseReport(name="split_brain", frames=cfg.frames(spec))
    seed = _seed(spec)
    jobs = list(seed.job_ids)
    started = time.perf_counter()
    with env(**QUIET_LOOPS, CUESCHED_STANDBY_POLL_INTERVAL=str(cfg.sb_poll)):
        watchdog = CapWatchdog(list(seed.show_ids), interval=cfg.watch_interval).start()
        conn = db.connect(autocommit=True, application_name="cuesched-stress")
        first = _InprocScheduler(cfg, "first", standby=False, lock_check_interval=cfg.phase_timeout * 10, offset=0)
        second = _InprocScheduler(cfg, "second", standby=True, lock_check_interval=5.0, offset=1)
        deadline = time.monotonic() + cfg.phase_timeout

        def count(sql: str) -> int:
            row = conn.execute(sql, (jobs,)).fetchone()
            return int(row[0]) if row else 0

        def wait(what: str, predicate: Callable[[], bool], timeout: float) -> bool:
            until = min(deadline, time.monotonic() + timeout)
            while time.monotonic() < until:
                if predicate():
                    return True
                time.sleep(0.01)
            report.failed.append(f"timed out waiting for {what}")
            return False

        moments: dict[str, Any] = {}

        def scenario() -> None:
            first.start()
            if not wait("the first scheduler to be ready", first.process.ready.is_set, 30):
                return
            procs_sql = "SELECT count(*) FROM proc WHERE pk_job = ANY(%s)"
            wait("20 procs booked by the first scheduler", lambda: count(procs_sql) >= 20, 60)
            second.start()
            # The standby is retrying (the issue's case): its first attempts fail, and its poll,
            # not the kill, decides when it takes over, so the first scheduler books on for up
            # to a poll interval without its lock. Only the lease can stop it then.
            time.sleep(1.5 * cfg.sb_poll)
            if second.process.ready.is_set():
                report.failed.append("the standby took over while the first scheduler held the lock")
                return
            holder = conn.execute(singleton.HOLDER_SQL, {"key": singleton.SCHEDULER_LOCK_KEY}).fetchone()
            if holder is None or holder[1] != "cuesched-scheduler-lock":
                report.failed.append(f"no scheduler lock session to kill ({holder})")
                return
            conn.execute("SELECT pg_terminate_backend(%s)", (holder[0],))
            moments["killed"] = time.time()
            if not wait("the standby to take over", second.process.ready.is_set, 30):
                return
            moments["lease"] = conn.execute(LEASE_ROW_SQL).fetchone()
            if not wait("the first scheduler to stop on its lost lease", lambda: not first.thread.is_alive(), 30):
                first.stop()
            # The first's frames still run on its (dead) launcher: release them as their agents would.
            mine = {p for p, _f, _d, _l in first.launcher.booked}
            orphans = [
                f
                for pk, f in conn.execute("SELECT pk_proc, pk_frame FROM proc WHERE pk_job = ANY(%s)", (jobs,))
                if pk in mine
            ]
            released = kill_frames(conn, orphans).released
            report.notes.append(f"the first scheduler's frames left running, released the completion way: {released}")
            wait(
                "the second scheduler to run every frame",
                lambda: count(WAITING_SQL) == 0 and count(procs_sql) == 0,
                cfg.phase_timeout,
            )
            service = second.process.service
            report.failed.extend(audit(seed, lambda: store_counters(service, seed)))

        try:
            scenario()
        finally:
            second.stop()
            first.stop()
            watchdog.stop()
            conn.close()
    report.wall = time.perf_counter() - started
    for sched in (first, second):
        if sched.error is not None:
            report.failed.append(f"the {sched.name} scheduler raised {type(sched.error).__name__}: {sched.error}")
    rejected: Counter[str] = Counter()
    for sched in (first, second):
        if sched.loop is not None:
            rejected.update(sched.loop.totals.rejected)
    report.rejected = dict(rejected)
    a_decided, b_decided = first.decided(), second.decided()
    report.booked = len(a_decided) + len(b_decided)
    everything = a_decided + b_decided
    if everything:
        report.window = max(first.launched() + second.launched()) - min(everything)
    if not first.process.service.lease_lost.is_set():
        report.failed.append("the first scheduler never found its lease gone")
    if not a_decided or not b_decided:
        report.failed.append(f"each scheduler must book: first {len(a_decided)}, second {len(b_decided)}")
    elif "lease" in moments and moments["lease"] is not None and second.process.lease_taken_at is not None:
        killed_at, lease_row = moments["killed"], moments["lease"]
        lease_taken = second.process.lease_taken_at
        a_last_decided, a_last_commit = max(a_decided), max(first.launched())
        b_first = min(b_decided)
        generation, ts_acquired = lease_row
        report.notes.append(
            f"lock session killed -> standby's lease (generation {generation}) committed: "
            f"{lease_taken - killed_at:.3f}s; -> its first booking decided: {b_first - killed_at:.3f}s"
        )
        report.notes.append(
            f"lost lock session -> the first scheduler's last booking committed: {a_last_commit - killed_at:+.3f}s "
            "(it held the lease until the takeover)"
        )
        report.notes.append(
            f"lost lease -> the first scheduler's last booking: committed {a_last_commit - lease_taken:+.3f}s, "
            f"decided {a_last_decided - ts_acquired:+.3f}s after the lease's ts_acquired (<= 0 or tiny: the fence)"
        )
        loop = first.loop
        report.notes.append(
            f"bookings: first {len(a_decided)}, second {len(b_decided)}; first's loop database errors "
            f"(the fence's LeaseLostError among them): {loop.totals.db_errors if loop else 0}"
        )
        # One booker at a time: every decision of the first precedes the lease it lost (the
        # takeover waits for the batch those decisions went into) and the second's first one.
        if a_last_decided >= lease_taken or a_last_decided >= b_first:
            report.failed.append(
                f"two schedulers booked at once: the first decided a booking {a_last_decided - lease_taken:+.3f}s "
                f"after the second took the lease, {a_last_decided - b_first:+.3f}s after the second's first booking"
            )
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    _watchdog_notes(watchdog, report)
    _teardown(spec, report)
    return report


# Each subscription (folder) of the farm's shows lowered to half of what it holds now, whole
# cores, at least `floor` centicores.
HALVE_SUB_SQL = """
UPDATE subscription s SET int_burst = GREATEST(%(floor)s, COALESCE(u.cc, 0) / 200 * 100)
FROM (
  SELECT s2.pk_subscription,
         (SELECT SUM(p.int_cores_reserved) FROM proc p JOIN host h ON h.pk_host = p.pk_host
          WHERE p.pk_show = s2.pk_show AND h.pk_alloc = s2.pk_alloc AND NOT p.b_local) AS cc
  FROM subscription s2 WHERE s2.pk_show = ANY(%(shows)s)
) u
WHERE s.pk_subscription = u.pk_subscription
RETURNING s.pk_show || ':' || s.pk_alloc
"""
HALVE_FOLDER_SQL = """
UPDATE folder_resource fr SET int_max_cores = GREATEST(%(floor)s, COALESCE(u.cc, 0) / 200 * 100)
FROM (
  SELECT f.pk_folder,
         (SELECT SUM(p.int_cores_reserved) FROM proc p JOIN job j ON j.pk_job = p.pk_job
          WHERE j.pk_folder = f.pk_folder AND NOT p.b_local) AS cc
  FROM folder f WHERE f.pk_folder = ANY(%(folders)s)
) u
WHERE fr.pk_folder = u.pk_folder
RETURNING fr.pk_folder
"""


def phase_listener_wedge(cfg: StressConfig) -> PhaseReport:
    """Issue 16: the listener's path frozen while caps are lowered; the heartbeat deadline bounds it.

    The listener connects through a relay this phase freezes (dispatch.lab.netfreeze); the
    heartbeat sender, the dispatch loop and the cap writer go direct. So heartbeats are sent
    but none come back: within the deadline the service must stop booking managed shows
    (`can_enforce` False), and after the thaw reconnect, reseed (the lowered caps with it) and
    book again. A booking decided over a lowered cap later than the lowering commit plus the
    deadline plus 1 s is a breach, whatever the listener had applied.

    Its farm's caps leave room (the hosts bind): a frozen listener delivers no release either,
    so a Store at its caps could not book anything over a lowered cap, and the bound would hold
    trivially. Here the loop goes on booking the hosts its own completions free, the caps are
    lowered to half of what each key holds, and every booking until the pause is over them.
    """
    proxy = FreezableProxy().start()
    figures: dict[str, float] = {}
    lowered: list[tuple[str, str]] = []
    watchdogs: dict[int, CapWatchdog] = {}
    slack = 1.0

    def perturb(run: Run) -> None:
        service, listener = run.service, run.service.listener
        lookup = recent_caps_lookup(service)

        def applied_at(vertex: str, key: str, since: float) -> float | None:
            seen = lookup(vertex, key, since)
            if "lowered" not in figures:
                return seen
            bound = figures["lowered"] + listener.deadline + slack
            return bound if seen is None else min(seen, bound)

        run.watchdog.applied_at = applied_at
        watchdogs[0] = run.watchdog
        if not run.under_load(30):
            return
        if not run.wait_for("the listener to be fresh through the relay", service.can_enforce, 10):
            return
        wedges, reconnects = listener.stats.wedges, listener.stats.reconnects
        frozen = time.monotonic()
        figures["freeze"] = time.time()
        proxy.freeze()
        run.stop_loop.wait(min(0.5, listener.deadline / 4))  # a moment into the freeze
        seed = run.seed
        jobs = list(seed.job_ids[::4])
        keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
        keys += [("folder", f) for f in seed.folder_ids] + [("job", j) for j in jobs]
        params = {"shows": list(seed.show_ids), "folders": list(seed.folder_ids), "floor": 800}
        with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
            lowered.extend(("sub", k) for (k,) in conn.execute(HALVE_SUB_SQL, params))
            lowered.extend(("folder", k) for (k,) in conn.execute(HALVE_FOLDER_SQL, params))
            # The largest frame's cores: a cap below it would leave that job's frames unbookable.
            lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
            conn.commit()
        figures["lowered"] = time.time()
        if run.wait_for("the service to stop enforcing", lambda: not service.can_enforce(), listener.deadline + 5):
            figures["paused"] = time.time()
        run.stop_loop.wait(max(0.0, cfg.lw_freeze - (time.monotonic() - frozen)))
        proxy.thaw()
        figures["thaw"] = time.time()
        if run.wait_for("the listener to be fresh again after the thaw", service.can_enforce, 30):
            figures["resumed"] = time.time()
        figures["wedges"] = listener.stats.wedges - wedges
        figures["reconnects"] = listener.stats.reconnects - reconnects

    try:
        report = run_inprocess(
            cfg,
            "listener_wedge",
            cfg.integrity_spec(
                "listener_wedge",
                hosts=cfg.lw_hosts,
                frames_per_layer=cfg.lw_frames_per_layer,
                sub_burst=1_000_000,
                folder_max_cores=-1,
                job_max_cores=10_000,
            ),
            launcher=_int_launcher(cfg),
            perturb=perturb,
            loop_env={"CUESCHED_HEARTBEAT_DEADLINE": str(cfg.lw_deadline)},
            listener_connect=lambda: proxy.connect(application_name="cuesched-listener"),
        )
    finally:
        proxy.close()
    dog = watchdogs.get(0)
    last = dog.last_over_lowered if dog is not None else {}
    if not lowered:
        report.failed.append("no cap was lowered")
        return report
    if "paused" in figures:
        report.notes.append(
            f"listener path frozen -> service stopped enforcing: {figures['paused'] - figures['freeze']:.3f}s "
            f"(heartbeat deadline {cfg.lw_deadline:.1f}s)"
        )
    report.notes.append(
        f"caps lowered {figures['lowered'] - figures['freeze']:.3f}s into the freeze: {len(lowered)} "
        f"(subscriptions and folders to half their use, a quarter of the jobs to 4 cores); "
        f"frozen {figures.get('thaw', 0.0) - figures['freeze']:.2f}s"
    )
    over = [t for key, t in last.items() if key in set(lowered)]
    if over:
        report.notes.append(
            f"cap lowering commit -> last booking decided on a key over its lowered cap: "
            f"{max(over) - figures['lowered']:+.3f}s (breach past {cfg.lw_deadline + slack:.1f}s)"
        )
    else:
        report.notes.append("no booking was decided on a key over its lowered cap")
    if "resumed" in figures:
        report.notes.append(
            f"thaw -> enforcing again (reconnected, reseeded): {figures['resumed'] - figures['thaw']:.3f}s; "
            f"wedges detected {int(figures.get('wedges', 0))}, reconnects {int(figures.get('reconnects', 0))}"
        )
    if not figures.get("wedges"):
        report.failed.append("the listener never noticed its frozen path")
    return report


FLIP_SQL = "UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s"


def phase_flip_roundtrip(cfg: StressConfig) -> PhaseReport:
    """Issue 16: a managed show with live procs flipped out and back, faster than the managed-shows tick.

    The tick (CUESCHED_MANAGED_SHOWS_TTL) is longer than a round trip, so the published set
    looks the same before and after; only the flip generation (checked by the booking
    transaction, and by the recompute before it overwrites) can tell the Store its counters
    and caps of that show are stale. Each trip must end with the show seeded again at its new
    generation before it books as managed.
    """
    trips: list[tuple[int, float, float]] = []
    invisible = [0]  # trips the published set never showed: the show stayed published throughout

    def perturb(run: Run) -> None:
        show = run.seed.show_ids[0]
        rng = random.Random(f"{cfg.seed}/flip_roundtrip")
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            for trip_no in range(cfg.fr_trips):
                if not run.under_load(10) or not run.loop_alive():
                    break
                procs = run.procs()
                started = time.monotonic()
                conn.execute(FLIP_SQL, (False, show))
                # Out for a moment (the database's). Even trips stay out longer than a recompute
                # interval (a recompute reads the show unmanaged and would zero its counters),
                # odd ones shorter (often no recompute sees it: only the generation tells).
                if trip_no % 2 == 0:
                    out = rng.uniform(max(0.1, cfg.fr_recompute), max(0.3, 2 * cfg.fr_recompute))
                else:
                    out = rng.uniform(0.01, cfg.fr_recompute / 2)
                out_until = started + out
                published = True
                while time.monotonic() < out_until:
                    published = published and run.service.is_managed(show)
                    time.sleep(0.002)
                conn.execute(FLIP_SQL, (True, show))
                trip = time.monotonic() - started
                invisible[0] += published and run.service.is_managed(show)
                row = conn.execute(
                    "SELECT int_generation FROM cuesched_show_flip WHERE pk_show = %s", (show,)
                ).fetchone()
                generation = int(row[0]) if row else None
                if not run.wait_for(
                    "the show seeded again at its new generation",
                    lambda g=generation: run.service.managed_generation(show) == g,
                    cfg.fr_ttl + 10,
                ):
                    break
                trips.append((procs, trip, time.monotonic() - started))
                run.stop_loop.wait(rng.uniform(0.2, 0.6))  # books as managed again for a while

    report = run_inprocess(
        cfg,
        "flip_roundtrip",
        cfg.integrity_spec("flip_roundtrip"),
        launcher=_int_launcher(cfg),
        perturb=perturb,
        heal=reconcile,
        loop_env={"CUESCHED_MANAGED_SHOWS_TTL": str(cfg.fr_ttl), "CUESCHED_RECOMPUTE_INTERVAL": str(cfg.fr_recompute)},
    )
    if trips:
        report.notes.append(
            f"round trips: {len(trips)} (managed-shows tick {cfg.fr_ttl:.1f}s), procs running at each "
            f"{min(t[0] for t in trips)}-{max(t[0] for t in trips)}, out and back in "
            f"{max(t[1] for t in trips):.3f}s at most, seeded again at the new generation after "
            f"{statistics.median(t[2] for t in trips):.3f}s median, {max(t[2] for t in trips):.3f}s max; "
            f"{invisible[0]} of them never left the published set (only the flip generation told)"
        )
    if len(trips) < min(2, cfg.fr_trips):
        report.failed.append(f"only {len(trips)} round trips under load")
    if any(t[1] >= cfg.fr_ttl for t in trips):
        report.failed.append("a round trip took longer than the managed-shows tick")
    return report


FS_SIZES = (0.5, 0.3, 0.2)
FS_PRIORITIES = (1, 100, 200)
FS_BOOKED_SQL = "SELECT pk_show, SUM(int_cores_reserved) FROM proc WHERE pk_show = ANY(%s) GROUP BY 1"


def phase_fairshare(cfg: StressConfig) -> PhaseReport:
    """Shares converge to the subscription sizes, whatever the priorities, with 0 cap breaches.

    Three shows on one allocation, sized 50/30/20% of the farm, the smallest at the highest
    priority, each allowed to borrow up to fs_burst_share of the farm; the first two are
    managed (ordered by the Store's live counters), the third is not (by the trigger-kept
    ones). Frames run fs_runtime_min-max s, so every core changes hands many times. Sampled
    every 50 ms: from fs_converge_by on, each show's share of the booked cores, averaged over
    the last fs_window seconds, stays within fs_tolerance of its share of the sizes. Shares of
    what is booked, not of the farm: cores between a completion and the next booking are idle
    for every show alike.
    """
    capacity = cfg.fs_hosts * 8 * 100  # centicores
    spec = FarmSpec(
        prefix=f"{cfg.prefix}_{PHASE_LETTERS['fairshare']}",
        seed=cfg.seed,
        shows=len(FS_SIZES),
        managed_shows=2,
        allocs=1,
        hosts=cfg.fs_hosts,
        jobs=cfg.fs_jobs_per_show * len(FS_SIZES),
        layers=1,
        frames_per_layer=cfg.fs_frames_per_layer,
        manual_tags=0,
        host_cores_choices=(8,),
        host_mem_gb_choices=(64,),
        layer_cores_choices=(1,),
        layer_mem_gb_choices=(1,),
        sub_burst=int(capacity * cfg.fs_burst_share),
        job_max_cores=capacity,
    )
    samples: list[tuple[float, dict[str, int]]] = []

    def prepare(seed: FarmSeed) -> None:
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            for i, show in enumerate(seed.show_ids):
                conn.execute(
                    "UPDATE subscription SET int_size = %s WHERE pk_show = %s", (int(capacity * FS_SIZES[i]), show)
                )
                conn.execute(
                    "UPDATE job_resource SET int_priority = %s"
                    " WHERE pk_job IN (SELECT pk_job FROM job WHERE pk_show = %s)",
                    (FS_PRIORITIES[i], show),
                )

    def sample(run: Run) -> None:
        shows = list(run.seed.show_ids)
        started = time.monotonic()
        with db.connect(autocommit=True, application_name="cuesched-stress-fairshare") as conn:
            while run.loop_alive() and time.monotonic() - started < cfg.fs_seconds:
                booked = dict.fromkeys(shows, 0)
                booked.update({s: int(c) for s, c in conn.execute(FS_BOOKED_SQL, (shows,)).fetchall()})
                samples.append((time.monotonic() - started, booked))
                time.sleep(0.05)

    report = run_inprocess(
        cfg,
        "fairshare",
        spec,
        launcher=SimulatedLauncher(
            runtime_min=cfg.fs_runtime_min,
            runtime_max=cfg.fs_runtime_max,
            failure_rate=0.0,
            launch_failure_rate=0.0,
            seed=cfg.seed,
        ),
        perturb=sample,
        duration=0.001,
        prepare=prepare,
        loop_env={"CUESCHED_FAIR_SHARE": "1"},
    )
    report.frames = cfg.frames(spec)
    if not samples:
        report.failed.append("no share was sampled")
        return report
    shows = list(samples[0][1])
    sizes = {s: FS_SIZES[i] for i, s in enumerate(shows)}

    def share(booked: dict[str, int], show: str) -> float:
        total = sum(booked.values())
        return booked[show] / total if total else 0.0

    # Each sample's shares averaged over the fs_window seconds up to it: one frame is a big
    # part of a small farm, and the cores that free up between two cycles go to one show.
    smooth: list[tuple[float, dict[str, float]]] = []
    for t, _b in samples:
        recent = [b for u, b in samples if t - cfg.fs_window < u <= t]
        smooth.append((t, {s: statistics.fmean(share(b, s) for b in recent) for s in shows}))
    late = [(t, sh) for t, sh in smooth if t >= cfg.fs_converge_by]
    late_raw = [(t, b) for t, b in samples if t >= cfg.fs_converge_by]
    worst = {s: max((abs(sh[s] - sizes[s]) for _t, sh in late), default=1.0) for s in shows}
    worst_raw = {s: max((abs(share(b, s) - sizes[s]) for _t, b in late_raw), default=1.0) for s in shows}
    converged_at = None
    for i in range(len(smooth)):
        if all(abs(sh[s] - sizes[s]) <= cfg.fs_tolerance for _t, sh in smooth[i:] for s in shows):
            converged_at = smooth[i][0]
            break
    mean = {s: statistics.fmean(share(b, s) for _t, b in late_raw) if late_raw else 0.0 for s in shows}
    used = statistics.fmean(sum(b.values()) / capacity for _t, b in late_raw) if late_raw else 0.0
    report.notes.append(
        f"fair share: sizes {'/'.join(f'{x:.0%}' for x in FS_SIZES)} of {capacity // 100} cores, priorities "
        f"{'/'.join(map(str, FS_PRIORITIES))}; mean share of the booked cores after {cfg.fs_converge_by:.1f}s "
        + "/".join(f"{mean[s]:.1%}" for s in shows)
        + f"; worst deviation over {cfg.fs_window:.1f}s windows "
        + "/".join(f"{worst[s]:.1%}" for s in shows)
        + ", of one sample "
        + "/".join(f"{worst_raw[s]:.1%}" for s in shows)
        + f"; within {cfg.fs_tolerance:.0%} from {'never' if converged_at is None else f'{converged_at:.2f}s'}"
        + f" ({len(samples)} samples); farm {used:.0%} booked on average"
    )
    if not late:
        report.failed.append(f"the load ended before {cfg.fs_converge_by:.1f}s")
    elif converged_at is None or converged_at > cfg.fs_converge_by:
        report.failed.append(
            f"shares not within {cfg.fs_tolerance:.0%} of the sizes from {cfg.fs_converge_by:.1f}s on: worst "
            + ", ".join(f"show {i} {worst[s]:.1%}" for i, s in enumerate(shows))
        )
    return report


def phase_slow_listener(cfg: StressConfig) -> PhaseReport:
    """Issue 27 row 2: the listener's path slow, not frozen, while caps are lowered under load.

    The listener connects through a relay that holds every byte `sl_delay` seconds (within the
    heartbeat deadline: the listener stays fresh and the Store keeps enforcing, on caps it hears
    of that much late). Subscriptions and folders are lowered to half of what they hold and a
    quarter of the jobs to 4 cores while the loop books. The breach rule is strict here: a key
    over its lowered cap is a breach for any booking decided after the lowering committed,
    whenever the Store applied it; the booking transaction's generation check must refuse them
    all until the Store has the lowering.
    """
    proxy = FreezableProxy().start()
    figures: dict[str, float] = {}
    lowered: list[tuple[str, str]] = []
    watchdogs: dict[int, CapWatchdog] = {}

    def perturb(run: Run) -> None:
        service, listener = run.service, run.service.listener

        def applied_at(vertex: str, key: str, since: float) -> float | None:
            return figures.get("lowered")  # strict: nothing decided after the commit may be over

        run.watchdog.applied_at = applied_at
        watchdogs[0] = run.watchdog
        if not run.under_load(30):
            return
        proxy.delay = cfg.sl_delay
        figures["slowed"] = time.time()
        # The held heartbeats arrive: fresh again behind the slow path, still booking.
        run.stop_loop.wait(cfg.sl_delay + 0.5)
        if not run.wait_for("the listener fresh behind the slow relay", service.can_enforce, cfg.sl_deadline + 5):
            return
        wedges = listener.stats.wedges
        rejected = run.loop.totals.rejected["generation"]
        seed = run.seed
        jobs = list(seed.job_ids[::4])
        keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
        keys += [("folder", f) for f in seed.folder_ids] + [("job", j) for j in jobs]
        params = {"shows": list(seed.show_ids), "folders": list(seed.folder_ids), "floor": 800}
        with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
            lowered.extend(("sub", k) for (k,) in conn.execute(HALVE_SUB_SQL, params))
            lowered.extend(("folder", k) for (k,) in conn.execute(HALVE_FOLDER_SQL, params))
            lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
            conn.commit()
        figures["lowered"] = time.time()
        run.stop_loop.wait(cfg.sl_after)
        figures["enforcing"] = float(service.can_enforce())
        figures["wedges"] = listener.stats.wedges - wedges
        figures["generation_rejected"] = run.loop.totals.rejected["generation"] - rejected
        figures["skipped_behind"] = run.loop.totals.skipped_behind
        proxy.delay = 0.0

    try:
        report = run_inprocess(
            cfg,
            "slow_listener",
            cfg.integrity_spec(
                "slow_listener",
                hosts=cfg.lw_hosts,
                frames_per_layer=cfg.lw_frames_per_layer,
                sub_burst=1_000_000,
                folder_max_cores=-1,
                job_max_cores=10_000,
            ),
            launcher=_int_launcher(cfg),
            perturb=perturb,
            loop_env={"CUESCHED_HEARTBEAT_DEADLINE": str(cfg.sl_deadline)},
            listener_connect=lambda: proxy.connect(application_name="cuesched-listener"),
        )
    finally:
        proxy.close()
    if not lowered:
        report.failed.append("no cap was lowered")
        return report
    dog = watchdogs.get(0)
    last = dog.last_over_lowered if dog is not None else {}
    report.notes.append(
        f"listener delayed {cfg.sl_delay:.1f}s (deadline {cfg.sl_deadline:.1f}s); {len(lowered)} caps lowered "
        f"under load; {int(figures.get('generation_rejected', 0))} bookings refused on a moved generation, "
        f"{int(figures.get('skipped_behind', 0))} job visits skipped while the Store was behind"
    )
    over = [t for key, t in last.items() if key in set(lowered)]
    if over:
        report.notes.append(
            f"cap lowering commit -> last booking decided on a key over its lowered cap: "
            f"{max(over) - figures['lowered']:+.3f}s (breach if positive)"
        )
    else:
        report.notes.append("no booking was decided on a key over its lowered cap")
    if figures.get("wedges"):
        report.failed.append("the slow listener was declared wedged: the phase did not test a fresh one")
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
    "outside_writers": phase_outside_writers,
    "split_brain": phase_split_brain,
    "listener_wedge": phase_listener_wedge,
    "flip_roundtrip": phase_flip_roundtrip,
    "fairshare": phase_fairshare,
    "slow_listener": phase_slow_listener,
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
        "int_frames_per_layer": 10,
        "ow_ops": 240,
        "ow_writers": 3,
        "lw_hosts": 10,
        "lw_frames_per_layer": 8,
        "lw_deadline": 1.5,
        "lw_freeze": 3.0,
        "sl_delay": 1.0,
        "sl_deadline": 2.5,
        "sl_after": 2.5,
        "fr_trips": 4,
        "fr_ttl": 2.0,
        "fs_hosts": 8,
        "fs_jobs_per_show": 2,
        "fs_frames_per_layer": 400,
        "fs_runtime_min": 0.3,
        "fs_runtime_max": 1.0,
        "fs_seconds": 6.0,
        "fs_converge_by": 3.0,
    }
    sizes.update(overrides)
    return replace(base, **sizes)
