"""The integrity alarm: a counter found BELOW SUM(proc), which no fault of cuesched's own explains.

Why an alarm and not drift: a counter reading high is the safe direction the whole design leans
to (a lost release, a booking carried one pass), and the recompute heals it quietly. A counter
reading LOW means procs ran that no event counted, so bookings checked against it could have
passed a cap. Nothing in cuesched's own paths does that: the scheduler counts its bookings before
it writes them, and every other writer's proc write sends its delta from a trigger. What does is
a trigger that did not fire (`ALTER TABLE ... DISABLE TRIGGER`, a superuser's
`session_replication_role = replica`, a restore with triggers off). The pass corrects the
counter, so this alarm is what is left for the operator to act on (docs/runbook.md).

Where it comes from:

- `store_low`: a recompute pass (accounting/recompute.py, `result.low`) that waited until every
  notification committed before its read had arrived (so an event still on its way is no
  finding), for the shows published as managed through the whole pass;
- `db_low`: the reconcile of unmanaged shows (accounting/reconcile.py, `result.low`), whose
  counters a trigger moves in the writing statement and so never read low legitimately.

It latches: a row in `cuesched_integrity_alarm` per finding, open until acknowledged
(`store_status --acknowledge-alarms NOTE`, accounting.actions.acknowledge_integrity_alarms). A
one-pass finding would otherwise be gone 15 s later, and a breach it may have allowed would not.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg

from accounting import metrics

logger = logging.getLogger(__name__)

TABLE = "cuesched_integrity_alarm"
STORE_LOW = "store_low"
DB_LOW = "db_low"
KEYS_IN_SUMMARY = 5

OPEN_SQL = f"""
SELECT id, ts_raised, str_kind, str_summary FROM {TABLE} WHERE ts_acknowledged IS NULL ORDER BY id
"""
COUNT_OPEN_SQL = f"SELECT count(*) FROM {TABLE} WHERE ts_acknowledged IS NULL"

# The folder and job keys of a finding, with their show: only shows published as managed through
# the whole pass are judged (a show seeded meanwhile had no Store counters to compare yet).
FOLDER_SHOWS_SQL = "SELECT pk_folder, pk_show FROM folder WHERE pk_folder = ANY(%s::text[])"
JOB_SHOWS_SQL = "SELECT pk_job, pk_show FROM job WHERE pk_job = ANY(%s::text[])"


def managed_findings(
    conn: psycopg.Connection, low: dict[str, dict[str, tuple[int, int, int, int]]], stable: set[str]
) -> dict[str, dict[str, tuple[int, int, int, int]]]:
    """The recompute's low keys that belong to `stable` shows (published throughout the pass)."""
    if not any(low.values()):
        return {}
    shows: dict[str, dict[str, str]] = {"folder": {}, "job": {}}
    for vertex, sql in (("folder", FOLDER_SHOWS_SQL), ("job", JOB_SHOWS_SQL)):
        keys = list(low.get(vertex, {}))
        if keys:
            shows[vertex] = {k: s for k, s in conn.execute(sql, (keys,))}
    out: dict[str, dict[str, tuple[int, int, int, int]]] = {}
    for vertex, keys in low.items():
        for key, amounts in keys.items():
            show = key.split(":", 1)[0] if vertex == "sub" else shows[vertex].get(key)
            if show in stable:
                out.setdefault(vertex, {})[key] = amounts
    return out


def _store_summary(findings: dict[str, dict[str, tuple[int, int, int, int]]]) -> str:
    parts = []
    for vertex, keys in sorted(findings.items()):
        for key, (sc, pc, sg, pg) in sorted(keys.items())[:KEYS_IN_SUMMARY]:
            parts.append(f"{vertex} {key}: Store {sc} cores / {sg} GPUs < SUM(proc) {pc} cores / {pg} GPUs")
        if len(keys) > KEYS_IN_SUMMARY:
            parts.append(f"and {len(keys) - KEYS_IN_SUMMARY} more {vertex} keys")
    return "; ".join(parts)


def _db_summary(findings: dict[str, dict[str, tuple[int, int]]]) -> str:
    parts = []
    for show, tables in sorted(findings.items())[:KEYS_IN_SUMMARY]:
        for table, (cc, g) in sorted(tables.items()):
            parts.append(f"show {show} {table}: {cc} centicores / {g} GPUs below SUM(proc)")
    if len(findings) > KEYS_IN_SUMMARY:
        parts.append(f"and {len(findings) - KEYS_IN_SUMMARY} more shows")
    return "; ".join(parts)


def raise_alarm(conn: psycopg.Connection, kind: str, findings: dict[str, Any]) -> str:
    """Record one finding (committed at once, whatever the caller's transaction), log it, count it."""
    summary = _store_summary(findings) if kind == STORE_LOW else _db_summary(findings)
    what = "managed Store counter(s)" if kind == STORE_LOW else "unmanaged show counter(s)"
    message = (
        f"INTEGRITY ALARM ({kind}): {what} read BELOW SUM(proc), so procs ran that no trigger counted "
        f"(a disabled trigger, session_replication_role = replica, a restore?): {summary}; corrected now, "
        "the alarm stays open until acknowledged (store_status --acknowledge-alarms NOTE; see the runbook)"
    )
    logger.error(message)
    metrics.INTEGRITY_ALARMS.labels(kind).inc()
    details = {v: {k: list(a) for k, a in keys.items()} for v, keys in findings.items()}
    try:
        with conn.transaction():
            conn.execute(
                f"INSERT INTO {TABLE} (str_kind, str_summary, details, str_acknowledged_by, str_ack_note)"
                " VALUES (%s, %s, %s::jsonb, '', '')",
                (kind, summary, json.dumps(details)),
            )
    except psycopg.errors.UndefinedTable:
        # An adopted database not adopted again after an upgrade: the log line and the metric
        # above still carry it; adoption (`adopt_cuebot_db --apply`) creates the table.
        logger.error("integrity alarm not recorded: %s is missing (run adopt_cuebot_db --apply)", TABLE)
    return message


def open_alarms(cursor: Any) -> list[tuple[int, Any, str, str]]:
    """(id, raised at, kind, summary) of every alarm not yet acknowledged, oldest first.

    Empty where the table does not exist (an adopted database not adopted again after an
    upgrade); `to_regclass` keeps that a plain answer, not an error inside a caller's transaction.
    """
    cursor.execute(f"SELECT to_regclass('public.{TABLE}') IS NOT NULL")
    if not cursor.fetchone()[0]:
        return []
    cursor.execute(OPEN_SQL)
    return list(cursor.fetchall())


def count_open(conn: psycopg.Connection) -> int:
    """Open alarms (0 where the table is missing: an adopted database not adopted again yet)."""
    try:
        with conn.transaction():
            row = conn.execute(COUNT_OPEN_SQL).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row[0]) if row else 0
