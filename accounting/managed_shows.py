"""Which shows the Store enforces, and the blocking seed before a show joins that set.

`show.b_scheduler_managed` is the ownership flag. A show that becomes managed usually has
live procs booked under database-enforced accounting; publishing it before its caps and
counters are in the Store would let the first booking see its whole burst free. So the
order is always: seed caps (a full limit reseed), seed its counters from SUM(proc), then
publish. If the seed fails the additions wait for the next tick; removals apply at once
(a show leaving the set is enforced by the database again, which is the safe direction).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from accounting.limits import reseed_limits
from accounting.recompute import Recomputer

logger = logging.getLogger(__name__)

MANAGED_SHOWS_SQL = "SELECT pk_show FROM show WHERE b_scheduler_managed"


@dataclass(frozen=True)
class RefreshResult:
    published: frozenset[str]
    added: frozenset[str]
    removed: frozenset[str]
    deferred: frozenset[str]


def read_managed(conn: psycopg.Connection) -> frozenset[str]:
    return frozenset(row[0] for row in conn.execute(MANAGED_SHOWS_SQL))


def refresh_managed(current: frozenset[str], recomputer: Recomputer, conn: psycopg.Connection) -> RefreshResult:
    """One tick of the managed-shows cache. Raises only if the set itself cannot be read."""
    new = read_managed(conn)
    added = new - current
    removed = current - new
    if not added:
        return RefreshResult(new, frozenset(), removed, frozenset())
    try:
        reseed_limits(recomputer.store, conn)
        for show in sorted(added):
            # Under the recompute lock: a recompute pass must not interleave its older read
            # with this seed (both write absolute values).
            with recomputer.lock:
                snapshot, pg_snapshot = recomputer.seed_show(conn, show)
                recomputer.store.seed_show_booked(snapshot, pg_snapshot=pg_snapshot)
            logger.info(
                "managed-flip seed: show %s seeded (%d subscriptions, %d folders, %d jobs)",
                show,
                len(snapshot.sub),
                len(snapshot.folder),
                len(snapshot.job),
            )
    except (psycopg.Error, OSError) as exc:
        logger.warning("managed-flip seed failed, deferring %d show(s) to the next tick: %s", len(added), exc)
        return RefreshResult(new - added, frozenset(), removed, added)
    return RefreshResult(new, added, removed, frozenset())
