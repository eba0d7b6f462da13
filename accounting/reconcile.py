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

A show whose lock another session holds (a psql session that wrote a proc of it and was left
open) is skipped after `CUESCHED_RECONCILE_LOCK_WAIT` and the pass goes on with the next show;
the skipped ones are tried again after the others, three passes in all, and the ones still
held are reported with the session that holds them. One stuck show never holds up the rest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import errors as pg_errors

from accounting import blockers
from accounting.triggers import (
    COUNTER_REBUILD_SQL,
    LOCK_DB_SHOWS_SQL,
    REBUILD_TABLES,
    RECONCILE_SQL,
    UNMANAGED_SHOWS_SQL,
)
from accounting.units import usage_to_cores
from cuesched_project import conf

logger = logging.getLogger(__name__)

PASSES = 3  # the first over every show, then two more over the shows whose lock was held


@dataclass
class ReconcileResult:
    shows: int = 0
    # Cores corrected per table (sum over rows of |new - old|, rounded up).
    drift_cores: dict[str, int] = field(default_factory=dict)
    # Shows left out of this pass because another session held their lock: show -> who held it.
    skipped: dict[str, str] = field(default_factory=dict)
    # show -> table -> (centicores, GPUs) by which its counters read BELOW SUM(proc): never a
    # legitimate state here (every trigger-kept write moves them in its own statement, and this
    # pass holds the show's lock), so the service raises the integrity alarm on any of it.
    low: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)


def reconcile_unmanaged(conn: psycopg.Connection) -> ReconcileResult:
    """One pass over every unmanaged show, one READ COMMITTED transaction per show."""
    result = ReconcileResult()
    totals = dict.fromkeys(REBUILD_TABLES, 0)
    wait_ms = max(1, int(conf.reconcile_lock_wait() * 1000))
    todo = [s for (s,) in conn.execute(UNMANAGED_SHOWS_SQL)]
    for attempt in range(PASSES):
        held: dict[str, str] = {}
        for show in todo:
            try:
                row = _reconcile_show(conn, show, wait_ms)
            except pg_errors.LockNotAvailable as exc:
                held[show] = blockers.describe(blockers.for_lock_error(conn, exc, [show]).get(show, []))
                continue
            if row is None:
                continue
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
        todo = list(held)
        result.skipped = held
        if not todo:
            break
        if attempt < PASSES - 1:
            time.sleep(min(1.0, wait_ms / 1000))
    for show, who in result.skipped.items():
        logger.warning(
            "reconcile: gave up on show %s after %d tries (a lock stayed held past %.1fs each): %s; "
            "its counters are rebuilt at the next pass",
            show, PASSES, wait_ms / 1000, who,
        )  # fmt: skip
    result.drift_cores = {table: usage_to_cores(cc) for table, cc in totals.items()}
    return result


SHOW_STILL_UNMANAGED_SQL = "SELECT NOT b_scheduler_managed FROM show WHERE pk_show = %s FOR KEY SHARE"

def _reconcile_show(conn: psycopg.Connection, show: str, wait_ms: int) -> tuple[int, ...] | None:
    """Rebuild one show: per table the drift corrected, then (centicores, GPUs) found below
    SUM(proc); None if it is managed now. Raises LockNotAvailable past the lock wait."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        # Every wait of this show's rebuild (its row, its lock, its counter rows) is bounded.
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{wait_ms}ms",))
        # Still unmanaged? A flip of this show waits for the row lock this transaction now holds
        # (accounting.keylocks), and one in progress holds this read off, bounded.
        row = conn.execute(SHOW_STILL_UNMANAGED_SQL, (show,)).fetchone()
        if not row or not row[0]:
            return None
        conn.execute(LOCK_DB_SHOWS_SQL, {"shows": [show]})
        conn.execute(COUNTER_REBUILD_SQL)
        # A fresh statement: its snapshot starts after every writer the locks waited for.
        return tuple(conn.execute(RECONCILE_SQL, {"shows": [show]}).fetchone() or (0,) * (3 * len(REBUILD_TABLES)))
