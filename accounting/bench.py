"""Measurements of the accounting runtime, shared by `bench_accounting` and `bench`.

Each function runs against the configured database on rows of its own prefix and prints
nothing: callers format the figures. Timings are medians of several runs, because this
kind of machine is shared and noisy; single runs are never quoted.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import psycopg

from accounting import db
from accounting.limits import reseed_limits
from accounting.listener import Listener
from accounting.recompute import Recomputer
from accounting.service import AccountingService
from accounting.store import Store

# Start every WAITING frame of a seeded farm as a 1-core proc, hosts taken round-robin:
# the recompute benchmark needs a database full of procs, not a dispatcher run. Staged
# through an analysed temp table, so each step is a plain hash join whatever the
# statistics of the freshly seeded tables say.
BOOK_ALL_STEPS = (
    """
CREATE TEMP TABLE bench_pairs ON COMMIT DROP AS
WITH hosts AS (
  SELECT array_agg(pk_host ORDER BY pk_host) AS ids FROM host WHERE str_name LIKE %(like)s
)
SELECT f.pk_frame, f.pk_layer, f.pk_job, j.pk_show,
       hosts.ids[1 + ((row_number() OVER (ORDER BY f.pk_frame) - 1) %% cardinality(hosts.ids))] AS pk_host
FROM frame f JOIN job j ON j.pk_job = f.pk_job CROSS JOIN hosts
WHERE j.str_name LIKE %(like)s AND f.str_state = 'WAITING'
LIMIT %(limit)s
""",
    "ANALYZE bench_pairs",
    """
UPDATE frame f SET str_state = 'RUNNING', int_version = f.int_version + 1, ts_started = now()
FROM bench_pairs p WHERE f.pk_frame = p.pk_frame
""",
    """
INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, int_mem_reserved)
SELECT gen_random_uuid()::text, pk_host, pk_show, pk_layer, pk_job, pk_frame, 100, 1024 FROM bench_pairs
""",
    """
UPDATE host h SET int_cores_idle = h.int_cores_idle - agg.cores, int_mem_idle = h.int_mem_idle - agg.mem
FROM (SELECT pk_host, count(*) * 100 AS cores, count(*) * 1024 AS mem FROM bench_pairs GROUP BY pk_host) agg
WHERE h.pk_host = agg.pk_host
""",
)


def like(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%") + "\\_%"


def book_all(conn: psycopg.Connection, prefix: str, limit: int) -> int:
    with conn.transaction():
        for step in BOOK_ALL_STEPS:
            conn.execute(step, {"like": like(prefix), "limit": limit} if "%(" in step else None)
        row = conn.execute(
            "SELECT count(*) FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE j.str_name LIKE %s",
            (like(prefix),),
        ).fetchone()
    return int(row[0]) if row else 0


@dataclass
class Spread:
    """Median with min and max, in the unit of the samples."""

    median: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def fmt(self, unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
        return (
            f"{self.median * scale:.{digits}f} {unit} (min {self.low * scale:.{digits}f}, "
            f"max {self.high * scale:.{digits}f}, {self.runs} runs)"
        )


@dataclass
class RecomputeFigures:
    procs: int
    jobs: int
    store_side: Spread
    pg_side: Spread
    cycle: Spread


def measure_recompute(repeats: int = 5) -> RecomputeFigures:
    """Recompute passes over whatever the database holds, on a Store bootstrapped from it."""
    store = Store()
    recomputer = Recomputer(store)
    store_s, pg_s, cycle = [], [], []
    with db.connect(application_name="cuesched-bench") as conn:
        reseed_limits(store, conn)
        recomputer.run_once(conn)  # warm-up: first PG-side pass writes every row once
        for _ in range(repeats):
            result = recomputer.run_once(conn)
            store_s.append(result.store_seconds)
            pg_s.append(result.pg_seconds)
            cycle.append(result.store_seconds + result.pg_seconds)
        procs = conn.execute("SELECT count(*) FROM proc").fetchone()[0]  # type: ignore[index]
    return RecomputeFigures(
        procs, len(store.audit_snapshot().job), Spread.of(store_s), Spread.of(pg_s), Spread.of(cycle)
    )


@dataclass
class NotifyFigures:
    releases: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def measure_notify_delay(prefix: str, releases: int = 1000) -> NotifyFigures:
    """Commit-to-Store delay of `releases` single-proc deletes, one transaction each.

    The clock starts before the autocommitted DELETE is sent (so it includes the delete
    itself and its commit, a conservative figure) and stops when the listener has applied
    the release to the Store; the next delete waits for it, so the figure is latency, not
    throughput.
    """
    service = AccountingService()
    applied = threading.Event()

    def on_event(channel: str, outcome: str) -> None:
        if channel == "acct_release":
            applied.set()

    listener = Listener(service.store, on_connect=lambda _identity: _reseed(service), on_event=on_event)
    stop = threading.Event()
    thread = threading.Thread(target=listener.run, args=(stop,), daemon=True)
    thread.start()
    delays: list[float] = []
    try:
        if not listener.connected.wait(60):
            raise RuntimeError(f"listener did not connect: {listener.stats.last_error}")
        with db.connect(application_name="cuesched-bench") as conn:
            procs = [
                r[0]
                for r in conn.execute(
                    "SELECT p.pk_proc FROM proc p JOIN job j ON j.pk_job = p.pk_job"
                    " JOIN show s ON s.pk_show = p.pk_show WHERE j.str_name LIKE %s AND s.b_scheduler_managed"
                    " ORDER BY p.pk_proc LIMIT %s",
                    (like(prefix), releases),
                )
            ]
            for pk in procs:
                applied.clear()
                t0 = time.perf_counter()
                conn.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))  # autocommit: commits here
                if not applied.wait(10):
                    raise RuntimeError("a release did not reach the Store within 10 s")
                delays.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join(5)
    delays.sort()
    return NotifyFigures(
        releases=len(delays),
        p50_ms=statistics.median(delays) * 1000,
        p99_ms=delays[max(0, int(len(delays) * 0.99) - 1)] * 1000,
        max_ms=delays[-1] * 1000,
    )


def _reseed(service: AccountingService) -> None:
    with db.connect(application_name="cuesched-bench") as conn:
        service.reseed_all(conn)


def _store_matches_db(service: AccountingService, conn: psycopg.Connection, jobs: list[str]) -> bool:
    rows = conn.execute(
        "SELECT jr.pk_job, jr.int_max_cores, COALESCE((SELECT SUM(int_cores_reserved) FROM proc p"
        " WHERE p.pk_job = jr.pk_job), 0) FROM job_resource jr WHERE jr.pk_job = ANY(%s)",
        (jobs,),
    ).fetchall()
    store = service.store
    for job, max_cores, booked in rows:
        cap = store.job_cap(job)
        if cap is None or cap[0] != (max_cores // 100 if max_cores >= 0 else -1):
            return False
        if store.job_cores_in_use(job) != booked // 100:
            return False
    return True


def measure_reconnect_heal(prefix: str, repeats: int = 5, procs_per_round: int = 20) -> Spread:
    """Kill the listener's backend, then delete procs and lower caps while it is away.

    The clock starts at the kill and stops when every touched job's counter and cap in
    the Store equal the database again: the listener's LISTEN-then-reseed on reconnect is
    what heals it, since the backstop loops are far too slow to count here.
    """
    service = AccountingService()
    stop = threading.Event()
    thread = threading.Thread(target=service.listener.run, args=(stop,), daemon=True)
    service.listener.on_connect = lambda: _reseed(service)
    thread.start()
    samples: list[float] = []
    try:
        if not service.listener.connected.wait(60):
            raise RuntimeError(f"listener did not connect: {service.listener.stats.last_error}")
        with db.connect(application_name="cuesched-bench") as conn:
            for _ in range(repeats):
                victims = conn.execute(
                    "SELECT p.pk_proc, p.pk_job FROM proc p JOIN job j ON j.pk_job = p.pk_job"
                    " WHERE j.str_name LIKE %s ORDER BY p.pk_proc LIMIT %s",
                    (like(prefix), procs_per_round),
                ).fetchall()
                jobs = sorted({j for _, j in victims})
                reconnects = service.listener.stats.reconnects
                t0 = time.perf_counter()
                conn.execute("SELECT pg_terminate_backend(%s)", (service.listener.backend_pid,))
                with conn.transaction():
                    conn.execute("DELETE FROM proc WHERE pk_proc = ANY(%s)", ([p for p, _ in victims],))
                    conn.execute(
                        "UPDATE job_resource SET int_max_cores = GREATEST(int_max_cores - 100, 100)"
                        " WHERE pk_job = ANY(%s)",
                        (jobs,),
                    )
                while not (
                    service.listener.stats.reconnects > reconnects
                    and service.listener.connected.is_set()
                    and _store_matches_db(service, conn, jobs)
                ):
                    if time.perf_counter() - t0 > 60:
                        raise RuntimeError("the Store did not heal within 60 s of the kill")
                    time.sleep(0.002)
                samples.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join(5)
    return Spread.of(samples)
