"""Reconcile: the five counter tables of unmanaged shows, rebuilt from SUM(proc).

The database-enforced path keeps those tables by deltas in the writing transaction, so a
change that slipped past every trigger (one written with triggers disabled, a restore of one
table, a bug) would otherwise stay wrong for good: a counter reading low there lets the
trigger admit bookings over a cap. This loop is the backstop the Store's recompute is for
managed shows: every `CUESCHED_DB_RECONCILE_INTERVAL` it rewrites every unmanaged show's
counters to the truth and reports what it corrected as drift.

Each show is rebuilt in a transaction of its own that takes the accounting-keys lock shared
(no flip or key move under it) and that show's database-accounting lock exclusively (no
database-enforced writer between its read of proc and its write), so the rebuild and a
concurrent booking can never interleave. One show's lock per transaction: a writer holding
several shows' locks can then never deadlock with the reconcile. Writers of the show wait for
one statement (an index scan of its procs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg

from accounting.triggers import (
    COUNTER_REBUILD_SQL,
    LOCK_DB_SHOWS_SQL,
    LOCK_KEYS_SHARED_SQL,
    REBUILD_TABLES,
    RECONCILE_SQL,
    UNMANAGED_SHOWS_SQL,
)
from accounting.units import usage_to_cores


@dataclass
class ReconcileResult:
    shows: int = 0
    # Cores corrected per table (sum over rows of |new - old|, rounded up).
    drift_cores: dict[str, int] = field(default_factory=dict)
    # show -> table -> (centicores, GPUs) by which its counters read BELOW SUM(proc): never a
    # legitimate state here (every trigger-kept write moves them in its own statement, and this
    # pass holds the show's lock), so the service raises the integrity alarm on any of it.
    low: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)


def reconcile_unmanaged(conn: psycopg.Connection) -> ReconcileResult:
    """One pass over every unmanaged show, one READ COMMITTED transaction per show."""
    result = ReconcileResult()
    totals = dict.fromkeys(REBUILD_TABLES, 0)
    shows = [s for (s,) in conn.execute(UNMANAGED_SHOWS_SQL)]
    for show in shows:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            conn.execute(LOCK_KEYS_SHARED_SQL)
            # Still unmanaged? A flip waits for the shared lock this transaction now holds.
            row = conn.execute("SELECT NOT b_scheduler_managed FROM show WHERE pk_show = %s", (show,)).fetchone()
            if not row or not row[0]:
                continue
            conn.execute(LOCK_DB_SHOWS_SQL, {"shows": [show]})
            conn.execute(COUNTER_REBUILD_SQL)
            # A fresh statement: its snapshot starts after every writer the locks waited for.
            row = conn.execute(RECONCILE_SQL, {"shows": [show]}).fetchone() or (0,) * (3 * len(REBUILD_TABLES))
        result.shows += 1
        n = len(REBUILD_TABLES)
        for table, cc in zip(REBUILD_TABLES, row[:n], strict=True):
            totals[table] += int(cc)
        lows = row[n:]
        low = {
            table: (int(lows[2 * i]), int(lows[2 * i + 1]))
            for i, table in enumerate(REBUILD_TABLES)
            if lows[2 * i] or lows[2 * i + 1]
        }
        if low:
            result.low[show] = low
    result.drift_cores = {table: usage_to_cores(cc) for table, cc in totals.items()}
    return result
