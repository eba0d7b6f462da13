"""The cap watchdog: SUM(proc) against every cap of a phase's farm, sampled from its own connection.

With what it judges a key over its cap by: when a lowered cap reached the Store
(`recent_caps_lookup`) and when the Store surely had an outside write (`StoreReach`). The breach
rule is the package's (see its docstring).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from accounting import db
from accounting.licences import limit_max_sql
from accounting.service import AccountingService

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
