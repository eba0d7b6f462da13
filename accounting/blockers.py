"""Who holds the lock the scheduler could not get: the session, its application, state and age.

When a booking, the reconcile, a flip or an operator's cap write gives up on a lock (the lock
waits of accounting.conf), the operator needs the one thing PostgreSQL does not say in the
error: which session holds it. This module asks `pg_locks` (readable by every role) and
`pg_stat_activity`. Another role's session shows its pid and application_name to anybody, but
its state, transaction start and query only to a role with `pg_read_all_stats` (or a
superuser): without it those read as unknown, and the answer still names the pid to end
(`SELECT pg_terminate_backend(pid)`, which needs the same role or `pg_signal_backend`).

Two precise questions and one fallback:

* a show's database-accounting lock (the advisory key every database-enforced proc writer of
  the show takes, accounting.triggers.LOCK_DB_SHOWS): its holders are in `pg_locks` as granted
  advisory locks;
* a key row a flip or move waits for (accounting.keylocks: the show, host, job or layer row every
  proc writer of it locks FOR KEY SHARE): the row's xmax names the locking transaction when one
  session holds it, and `pg_locks` that transaction's session; when several do (a MultiXact),
  the holders named are the idle sessions inside a transaction that write procs;
* a row lock is not in `pg_locks` once the waiter gave up, so for a relation named by the
  error's context ("while locking tuple (0,3) in relation limit_record") the holders named are
  the other sessions inside a transaction that lock that table and are not running a
  statement (idle in transaction, or unknown without the privilege): the usual culprit;
* otherwise, the same for every table a booking touches.
"""

from __future__ import annotations

import re
import time
from typing import Any

import psycopg

from accounting.keylocks import KEY_TABLES
from accounting.triggers import DB_ACCOUNTING_LOCK_CLASS

Blocker = dict[str, Any]

# The tables a booking, a completion or the reconcile locks rows of.
BOOKING_TABLES = (
    "proc",
    "frame",
    "host",
    "show",
    "job",
    "layer",
    "limit_record",
    "subscription",
    "folder_resource",
    "job_resource",
    "layer_resource",
    "point",
)
MAX_NAMED = 5

_COLUMNS = """
       a.pid, a.application_name, a.usename, a.state,
       EXTRACT(epoch FROM now() - COALESCE(a.xact_start, a.state_change))::float8 AS seconds,
       a.query"""

# Granted advisory locks: {keys} yields (what, classid, objid) rows; objsubid 2 is the two-int4 form.
_ADVISORY_SQL = f"""
SELECT DISTINCT ON (k.what, l.pid) k.what, {_COLUMNS}
FROM ({{keys}}) AS k(what, classid, objid)
JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
     AND l.classid = k.classid::oid AND l.objid = k.objid::oid
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.pid <> pg_backend_pid()
ORDER BY k.what, l.pid
"""
SHOW_LOCK_HOLDERS_SQL = _ADVISORY_SQL.format(
    keys=f"SELECT s, {DB_ACCOUNTING_LOCK_CLASS}::bigint, hashtext(s)::bigint & 4294967295 "
    "FROM unnest(%(shows)s::text[]) AS s"
)
# The session of the one transaction a key row's xmax names (a single locker or updater).
_KEY_ROW_HOLDERS_SQL = f"""
SELECT DISTINCT ON (l.pid) r.k, {_COLUMNS}
FROM (SELECT t.{{key}}::text AS k, t.xmax FROM {{table}} t WHERE t.{{key}} = ANY(%(keys)s::text[])) r
JOIN pg_locks l ON l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
     AND l.transactionid = r.xmax
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.pid <> pg_backend_pid()
ORDER BY l.pid
LIMIT {MAX_NAMED}
"""

# Other sessions in a transaction that lock rows of these tables and run no statement now.
ROW_LOCK_HOLDERS_SQL = f"""
SELECT DISTINCT ON (l.pid) c.relname, {_COLUMNS}
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.granted AND l.mode IN ('RowShareLock', 'RowExclusiveLock')
  AND c.relname = ANY(%(tables)s::text[]) AND c.relkind IN ('r', 'p')
  AND l.pid <> pg_backend_pid()
  AND a.state IS DISTINCT FROM 'active'
ORDER BY l.pid, c.relname
LIMIT {MAX_NAMED}
"""

_RELATION = re.compile(r'in relation "?([A-Za-z_][A-Za-z0-9_]*)"?')


def _row(
    holds: str, pid: int, app: str | None, user: str | None, state: str | None, seconds: Any, query: Any
) -> Blocker:
    return {
        "pid": int(pid),
        "application_name": app or "",
        "user": user,
        # NULL for another role's session without pg_read_all_stats: say so instead of guessing.
        "state": state or "unknown (needs pg_read_all_stats)",
        "seconds": None if seconds is None else round(float(seconds), 1),
        "query": None if query in (None, "<insufficient privilege>") else str(query)[:200],
        "holds": holds,
    }


def show_lock_holders(conn: psycopg.Connection, shows: list[str]) -> dict[str, list[Blocker]]:
    """The sessions holding each show's database-accounting lock (only shows with a holder)."""
    out: dict[str, list[Blocker]] = {}
    if not shows:
        return out
    for show, *rest in conn.execute(SHOW_LOCK_HOLDERS_SQL, {"shows": list(shows)}).fetchall():
        out.setdefault(show, []).append(_row(f"show {show}'s accounting lock", *rest))
    return out


def key_row_holders(conn: Any, table: str, keys: list[str]) -> list[Blocker]:
    """The sessions holding the key rows a flip or move waits for (accounting.keylocks).

    Exact when one transaction holds a row (its xmax); otherwise the idle sessions inside a
    transaction that write procs, the usual culprit. Call it outside the failed statement's
    (sub)transaction: the caller's savepoint must be rolled back first.
    """
    key = dict(KEY_TABLES)[table]
    rows = _fetch(conn, _KEY_ROW_HOLDERS_SQL.format(table=table, key=key), {"keys": list(keys)})
    found = [_row(f"{table} {k}'s row (it wrote procs of it)", *rest) for k, *rest in rows]
    return found or row_lock_holders(conn, ("proc",))


def row_lock_holders(conn: Any, tables: tuple[str, ...] | list[str] = BOOKING_TABLES) -> list[Blocker]:
    rows = _fetch(conn, ROW_LOCK_HOLDERS_SQL, {"tables": list(tables)})
    return [_row(f"rows of {rel}", *rest) for rel, *rest in rows]


def relation_of(context: str | None) -> str | None:
    """The table an error's context names ("while locking tuple (0,3) in relation "limit_record"")."""
    found = _RELATION.search(context or "")
    return found.group(1) if found else None


def for_lock_error(conn: psycopg.Connection, exc: BaseException, shows: list[str]) -> dict[str, list[Blocker]]:
    """Blockers per show for a lock wait that gave up: the shows' own locks, else the row's table.

    Never raises: naming the blocker is a courtesy, the skip stands without it.
    """
    try:
        found = show_lock_holders(conn, shows)
        missing = [s for s in shows if s not in found]
        if missing:
            diag = getattr(exc, "diag", None)
            table = relation_of(getattr(diag, "context", None))
            if table == "show":  # the show's own key row (accounting.keylocks): its xmax names the holder
                for show in missing:
                    found[show] = key_row_holders(conn, "show", [show])
                return found
            rows = row_lock_holders(conn, (table,) if table else BOOKING_TABLES)
            for show in missing:
                found[show] = rows
        return found
    except psycopg.Error:
        return {}


def describe(blockers: list[Blocker]) -> str:
    """One line for a log or an error message."""
    if not blockers:
        return "no holder found (it may have ended)"
    parts = []
    for b in blockers[:MAX_NAMED]:
        age = "" if b.get("seconds") is None else f" for {b['seconds']:.1f}s"
        app = b.get("application_name") or "no application_name"
        parts.append(f"pid {b['pid']} ({app}, {b['state']}{age}) holds {b['holds']}")
    return "; ".join(parts)


def _fetch(conn: Any, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """psycopg connection or a Django cursor alike."""
    if isinstance(conn, psycopg.Connection):
        return conn.execute(sql, params).fetchall()
    conn.execute(sql, params)
    return conn.fetchall()


def view_lines(view: dict[str, Any]) -> list[str]:
    """From the published live view: the shows another session's lock keeps from booking or from
    the reconcile, with who holds it (store_status and the console's banner print these)."""
    lines = []
    dispatch = (view.get("extra") or {}).get("dispatch") or {}
    for show, entry in sorted((dispatch.get("locked_shows") or {}).items()):
        lines.append(
            f"show {show} skipped {entry['skips']} time(s) by the dispatch loop (last "
            f"{max(0.0, time.time() - entry['last']):.0f}s ago): {describe(entry.get('blockers') or [])}"
        )
    for show, who in sorted((view.get("reconcile_skipped") or {}).items()):
        lines.append(f"show {show} left out of the last reconcile: {who}")
    return lines
