"""Which shows the Store enforces, and the blocking seed before a show joins that set.

`show.b_scheduler_managed` is the ownership flag. A show that becomes managed usually has
live procs booked under database-enforced accounting; publishing it before its caps and
counters are in the Store would let the first booking see its whole burst free. So the
order is always: seed caps (a full limit reseed), seed its counters from SUM(proc), then
publish. If the seed fails the additions wait for the next tick; removals apply at once
(a show leaving the set is enforced by the database again, which is the safe direction).

A show is published with the flip generation its seed read (`cuesched_show_flip`, bumped by
every flip either way). A show whose generation moved since (it went unmanaged and back,
however fast) counts as added again: its published state is dropped and it is re-seeded
before it is published again. The booking transaction checks the generation, so even inside
the tick nothing books on the stale seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from accounting.limits import reseed_limits
from accounting.recompute import MANAGED_SQL, Recomputer

logger = logging.getLogger(__name__)

Managed = dict[str, int]  # show -> flip generation


@dataclass(frozen=True)
class RefreshResult:
    published: Managed
    added: frozenset[str]
    removed: frozenset[str]
    deferred: frozenset[str]


def read_managed(conn: psycopg.Connection) -> Managed:
    return {show: int(generation) for show, generation in conn.execute(MANAGED_SQL)}


def refresh_managed(current: Managed, recomputer: Recomputer, conn: psycopg.Connection) -> RefreshResult:
    """One tick of the managed-shows cache. Raises only if the set itself cannot be read."""
    new = read_managed(conn)
    added = frozenset(s for s, g in new.items() if current.get(s) != g)
    removed = frozenset(s for s in current if s not in new)
    if not added:
        return RefreshResult(new, frozenset(), removed, frozenset())
    try:
        reseed_limits(recomputer.store, conn)
        for show in sorted(added):
            # Under the recompute lock: a recompute pass must not interleave its older read
            # with this seed (both write absolute values).
            with recomputer.lock:
                snapshot, pg_snapshot, incarnation = recomputer.seed_show(conn, show)
                if not recomputer.store.seed_show_booked(snapshot, pg_snapshot=pg_snapshot, incarnation=incarnation):
                    raise psycopg.OperationalError("the server changed during the seed; retrying next tick")
                # Its caps were read by the reseed above, its counters here: both cover the
                # accounting generations they saw, and the show books under the smaller.
                recomputer.store.cover_generations("counters", recomputer.generations_seen, incarnation)
            logger.info(
                "managed-flip seed: show %s seeded (%d subscriptions, %d folders, %d jobs)",
                show,
                len(snapshot.sub),
                len(snapshot.folder),
                len(snapshot.job),
            )
    except (psycopg.Error, OSError) as exc:
        logger.warning("managed-flip seed failed, deferring %d show(s) to the next tick: %s", len(added), exc)
        return RefreshResult({s: g for s, g in new.items() if s not in added}, frozenset(), removed, added)
    return RefreshResult(new, added, removed, frozenset())
