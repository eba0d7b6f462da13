"""Helpers for the dispatch tests: seeded farms, a cap sampler, running the loop to the end.

The loop under test works on its own connections, so the tests are transactional
(`django_db(transaction=True)`) and everything they check is read from committed rows.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from accounting import db
from accounting.service import AccountingService, BookingResult, NotManaged
from accounting.store import Applied, BookingDelta
from dispatch.engine.booking import Booking
from dispatch.engine.feed import JobWork, fetch_pending
from dispatch.engine.loop import CycleStats, DispatchLoop
from dispatch.engine.placement import HostView
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSeed, FarmSpec, seed_farm

# Small, deterministic, and every cap binds: 3 allocs x 12 cores of burst, a 24-core folder,
# 4-core jobs, on 10 hosts of 4 or 8 cores, for 12 jobs x 2 layers x 4 frames of 1 or 2 cores.
SMALL_FARM = {
    "hosts": 10,
    "jobs": 12,
    "layers": 2,
    "frames_per_layer": 4,
    "manual_tags": 3,
    "host_cores_choices": (4, 8),
    "host_mem_gb_choices": (16, 32),
    "layer_cores_choices": (1, 2),
    "layer_mem_gb_choices": (1, 2),
    "sub_burst": 1200,
    "folder_max_cores": 2400,
    "job_max_cores": 400,
}

# One-core frames on a few 16-core hosts: for tests that place frames by hand. 256 GB hosts, so
# the 1-2 GB frames stay one core under cores-from-memory (issue 28: on a 16 GB host a 2 GB
# frame is 2 cores' share).
ONE_CORE = {
    "layer_cores_choices": (1,),
    "host_cores_choices": (16,),
    "host_mem_gb_choices": (256,),
    "hosts": 4,
    "layers": 1,
}

# Every invariant the audit of issue 7 names that one consistent snapshot can show, as rows of
# (what, key, seen, limit). Centicores throughout; negative caps are unlimited, 0 books nothing.
INVARIANTS_SQL = """
WITH p AS (
  SELECT p.pk_proc, p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_host, p.pk_frame, p.int_cores_reserved AS c
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local
)
SELECT 'subscription', x.pk_show || '/' || x.pk_alloc, x.c, COALESCE(s.int_burst, 0)
FROM (SELECT pk_show, pk_alloc, SUM(c) AS c FROM p GROUP BY 1, 2) x
LEFT JOIN subscription s ON s.pk_show = x.pk_show AND s.pk_alloc = x.pk_alloc
WHERE x.c > COALESCE(s.int_burst, 0)
UNION ALL
SELECT 'folder', x.pk_folder, x.c, fr.int_max_cores
FROM (SELECT pk_folder, SUM(c) AS c FROM p GROUP BY 1) x JOIN folder_resource fr ON fr.pk_folder = x.pk_folder
WHERE fr.int_max_cores >= 0 AND x.c > fr.int_max_cores
UNION ALL
SELECT 'job', x.pk_job, x.c, jr.int_max_cores
FROM (SELECT pk_job, SUM(c) AS c FROM p GROUP BY 1) x JOIN job_resource jr ON jr.pk_job = x.pk_job
WHERE jr.int_max_cores >= 0 AND x.c > jr.int_max_cores
UNION ALL
SELECT 'host_negative', h.pk_host, LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle), 0
FROM host h WHERE LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle) < 0
UNION ALL
SELECT 'host_ledger', h.pk_host, h.int_cores - h.int_cores_idle, COALESCE(x.c, 0)
FROM host h LEFT JOIN (SELECT pk_host, SUM(int_cores_reserved) AS c FROM proc GROUP BY 1) x ON x.pk_host = h.pk_host
WHERE h.int_cores - h.int_cores_idle <> COALESCE(x.c, 0)
UNION ALL
SELECT 'running_vs_procs', '', (SELECT count(*) FROM frame WHERE str_state = 'RUNNING'), (SELECT count(*) FROM proc)
WHERE (SELECT count(*) FROM frame WHERE str_state = 'RUNNING') <> (SELECT count(*) FROM proc)
UNION ALL
SELECT 'proc_frame_not_running', p.pk_proc, 0, 0
FROM proc p JOIN frame f ON f.pk_frame = p.pk_frame WHERE f.str_state <> 'RUNNING'
"""


def seed(prefix: str, *, managed: bool = True, **sizes: Any) -> FarmSeed:
    spec = dict(SMALL_FARM)
    spec.update(sizes)
    return seed_farm(FarmSpec(prefix=prefix, managed=managed, **spec))


def _unlimited(_alloc: str) -> int:
    return 1 << 30


def plan(
    conn: psycopg.Connection,
    n_per_job: dict[int, int],
    *,
    managed: bool,
    book: Callable[[BookingDelta], BookingResult] | None = None,
) -> tuple[list[JobWork], list[Booking]]:
    """Bookings of the first frames of some jobs, placed as the loop would (view, then find).

    `book` decides each booking's Store result (default: Applied without a Store, or NotManaged).
    """
    jobs = fetch_pending(conn, managed_only=False, max_jobs=50, frames_per_layer=20)
    view = HostView(fit="loosest")  # spreads the bookings over the hosts
    view.load(conn)
    # The flip generation a Store seed would have read (the booking transaction checks it).
    generations = dict(conn.execute("SELECT pk_show, int_generation FROM cuesched_show_flip").fetchall())
    # And the accounting generation a Store's check would have been decided under.
    acct_generations = dict(conn.execute("SELECT pk_show, int_generation FROM cuesched_show_generation").fetchall())
    bookings = []
    for j, count in n_per_job.items():
        job = jobs[j]
        layer = job.layers[0]
        for frame in layer.frames[:count]:
            found = view.find(layer.demand, layer.tags, facility=job.facility, os=job.os, room=_unlimited)
            assert found is not None, "the test farm has no host for this frame"
            host, cores = found
            delta = BookingDelta(job.show, host.alloc, job.folder, job.pk, cores, 0)
            if book is not None:
                result = book(delta)
            else:
                result = Applied(delta) if managed else NotManaged(delta)
            view.take(host, cores * 100, layer.demand.mem, 0, 0)
            bookings.append(
                Booking(
                    pk_proc=str(uuid.uuid4()),
                    frame=frame,
                    layer=layer,
                    host=host,
                    cores=cores * 100,
                    mem=layer.demand.mem,
                    gpus=0,
                    gpu_mem=0,
                    result=result,
                    managed=managed,
                    generation=generations.get(job.show, 0) if managed else -1,
                    acct_generation=(
                        -1
                        if not managed
                        else result.generation
                        if book is not None and isinstance(result, Applied)
                        else acct_generations.get(job.show, 0)
                    ),
                )
            )
    return jobs, bookings


def db_cores(conn: psycopg.Connection, seed_: FarmSeed) -> dict[str, int]:
    """SUM(proc) in whole cores for the same keys as `store_cores`."""
    out: dict[str, int] = {}
    rows = conn.execute(
        "SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.int_cores_reserved FROM proc p"
        " JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job WHERE NOT p.b_local"
    ).fetchall()
    subs = conn.execute("SELECT pk_show, pk_alloc FROM subscription WHERE pk_show = ANY(%s)", (list(seed_.show_ids),))
    for show, alloc in subs.fetchall():
        out[f"sub:{show}/{alloc}"] = 0
    for folder in seed_.folder_ids:
        out[f"folder:{folder}"] = 0
    for job in seed_.job_ids:
        out[f"job:{job}"] = 0
    for show, alloc, folder, job, cc in rows:
        if show not in seed_.show_ids:
            continue
        for key in (f"sub:{show}/{alloc}", f"folder:{folder}", f"job:{job}"):
            out[key] = out.get(key, 0) + cc
    return {k: int(v / 100) for k, v in out.items()}


def violations(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """The invariants broken in one consistent snapshot (REPEATABLE READ)."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return [tuple(r) for r in conn.execute(INVARIANTS_SQL).fetchall()]


@dataclass
class Sampler:
    """Checks the invariants from its own connection, as often as it can, while a run goes on."""

    samples: int = 0
    breaches: list[tuple[Any, ...]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="cap-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with db.connect(autocommit=True, application_name="cuesched-test-sampler") as conn:
            while not self._stop.is_set():
                self.breaches.extend(violations(conn))
                self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def fast_launcher(**kw: Any) -> SimulatedLauncher:
    kw.setdefault("runtime_min", 0.0)
    kw.setdefault("runtime_max", 0.02)
    kw.setdefault("failure_rate", 0.0)
    kw.setdefault("launch_failure_rate", 0.0)
    kw.setdefault("seed", 7)
    return SimulatedLauncher(**kw)


def make_loop(service: AccountingService, launcher: SimulatedLauncher, **kw: Any) -> DispatchLoop:
    kw.setdefault("idle_sleep", 0.01)
    kw.setdefault("saturated_sleep", 0.05)
    kw.setdefault("host_refresh_interval", 0.5)
    return DispatchLoop(service, launcher, **kw)


def drain(loop: DispatchLoop, timeout: float = 60.0) -> CycleStats:
    """Run the loop until nothing is WAITING or RUNNING; fail (and stop it) after `timeout`."""
    stop = threading.Event()
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["totals"] = loop.run(stop, exit_when_idle=True)
        except BaseException as exc:  # pragma: no cover - reported below
            out["error"] = exc

    thread = threading.Thread(target=target, name="dispatch-loop", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        stop.set()
        thread.join(10)
        raise AssertionError(f"the farm did not drain within {timeout}s: {loop.totals}")
    if "error" in out:
        raise out["error"]
    return out["totals"]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def store_cores(service: AccountingService, seed_: FarmSeed) -> dict[str, int]:
    """Live Store cores of every key of a seeded farm (0 for keys the Store never saw)."""
    snap = service.store.audit_snapshot()
    out: dict[str, int] = {}
    for (show, alloc), _burst in service.store.caps().sub.items():
        if show in seed_.show_ids:
            out[f"sub:{show}/{alloc}"] = snap.sub.get((show, alloc), (0, 0))[0]
    for folder in seed_.folder_ids:
        out[f"folder:{folder}"] = snap.folder.get(folder, (0, 0))[0]
    for job in seed_.job_ids:
        out[f"job:{job}"] = snap.job.get(job, (0, 0))[0]
    return out


def scalar(conn: psycopg.Connection, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


@contextmanager
def autocommit() -> Iterator[psycopg.Connection]:
    conn = db.connect(autocommit=True, application_name="cuesched-test")
    try:
        yield conn
    finally:
        conn.close()
