"""Limit reseed: the five enforced caps of every managed show, from the database into the Store.

Runs at bootstrap, after every listener reconnect, on each managed-flip seed and every
~5 minutes. It is the only backstop for a missed cap *decrease* (the one drift that can
over-book), which is why the listener triggers it on reconnect instead of waiting.

The three reads share one REPEATABLE READ snapshot whose `pg_current_snapshot()` goes to
`Store.set_caps`, so a cap notified by a transaction this reseed could not see is kept,
and a notification the reseed already saw is not applied again on top of a newer value.
A reseed is complete: a cap the Store holds but the database no longer has for a managed
show (a deleted subscription, a finished job) is removed, so the key fails closed.

`fill_caps` reads the caps of a few folders and jobs the Store does not hold (a new job, one
reopened, one whose cap row came back) the same way, right before the dispatch loop books
them: the Store refuses a folder or job whose caps it does not know.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from accounting.licences import limit_max_problem, limit_max_sql
from accounting.store import PgSnapshot, Store
from accounting.triggers import CUEBOT_ACCOUNTS, GENERATION_SEQUENCE, GENERATION_TABLE
from accounting.units import centicores_to_cores, centicores_to_cores_cap, gpus_cap

logger = logging.getLogger(__name__)

SUB_LIMITS_SQL = """
SELECT sub.pk_show, sub.pk_alloc, sub.int_burst
FROM subscription sub
JOIN show s ON s.pk_show = sub.pk_show
WHERE s.b_scheduler_managed
"""

FOLDER_LIMITS_SQL = """
SELECT fr.pk_folder, fr.int_max_cores, fr.int_max_gpus
FROM folder_resource fr
JOIN folder f ON f.pk_folder = fr.pk_folder
JOIN show s ON s.pk_show = f.pk_show
WHERE s.b_scheduler_managed
"""

JOB_LIMITS_SQL = """
SELECT jr.pk_job, jr.int_max_cores, jr.int_max_gpus
FROM job_resource jr
JOIN job j ON j.pk_job = jr.pk_job
JOIN show s ON s.pk_show = j.pk_show
WHERE s.b_scheduler_managed AND j.str_state <> 'FINISHED'
"""

SNAPSHOT_SQL = "SELECT pg_current_snapshot()::text"

# Each managed show's accounting generation (0 before its first bump), read in the snapshot of
# the caps or counters it then vouches for (Store.cover_generations).
GENERATIONS_SQL = f"""
SELECT s.pk_show, COALESCE(g.int_generation, 0)::bigint FROM show s
LEFT JOIN {GENERATION_TABLE} g ON g.pk_show = s.pk_show
WHERE s.b_scheduler_managed
"""
# Every managed show gets its generation row before it is read (and so before it is published):
# a bump is then an UPDATE of an existing row, which the booking's FOR SHARE check sees held
# while it is in progress (a first bump's INSERT would be invisible to it until its commit).
# A row made again (after a TRUNCATE) starts from the sequence, above anything a Store may hold.
ENSURE_GENERATION_ROWS_SQL = f"""
INSERT INTO {GENERATION_TABLE} (pk_show, int_generation)
SELECT s.pk_show, nextval('{GENERATION_SEQUENCE}') FROM show s
WHERE s.b_scheduler_managed AND NOT EXISTS (SELECT 1 FROM {GENERATION_TABLE} g WHERE g.pk_show = s.pk_show)
ORDER BY 1
ON CONFLICT (pk_show) DO NOTHING
"""
# A writer's first bump of the same show still open holds the key: give up on it after this, so
# one idle transaction cannot hold up the reseed (the row is made by that bump, or the next read).
ENSURE_LOCK_TIMEOUT = "1s"
SHOW_GENERATION_SQL = f"""
SELECT s.pk_show, COALESCE(g.int_generation, 0)::bigint FROM show s
LEFT JOIN {GENERATION_TABLE} g ON g.pk_show = s.pk_show
WHERE s.pk_show = %(show)s
"""

# The caps of the folders and jobs the dispatch loop is about to book, whatever the show's flag
# (the loop only books shows the Store enforces). Finished jobs are left out, as by the reseed.
FILL_FOLDERS_SQL = """
SELECT fr.pk_folder, fr.int_max_cores, fr.int_max_gpus FROM folder_resource fr
WHERE fr.pk_folder = ANY(%(folders)s::text[])
"""
FILL_JOBS_SQL = """
SELECT jr.pk_job, jr.int_max_cores, jr.int_max_gpus FROM job_resource jr
JOIN job j ON j.pk_job = jr.pk_job
WHERE jr.pk_job = ANY(%(jobs)s::text[]) AND j.str_state <> 'FINISHED'
"""


@dataclass(frozen=True)
class LimitRows:
    subs: dict[tuple[str, str], int]
    folders: dict[str, tuple[int, int]]
    jobs: dict[str, tuple[int, int]]
    pg_snapshot: PgSnapshot
    # The managed shows' accounting generations in the same snapshot (a complete read only).
    generations: dict[str, int] | None = None


def begin_snapshot(conn: psycopg.Connection) -> PgSnapshot:
    """Start a read-only REPEATABLE READ transaction and return its snapshot.

    The first statement fixes the transaction snapshot, so every later read in the same
    transaction sees exactly what `pg_current_snapshot()` describes.
    """
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    row = conn.execute(SNAPSHOT_SQL).fetchone()
    assert row is not None
    return PgSnapshot.parse(row[0])


def read_limits(conn: psycopg.Connection) -> LimitRows:
    """Read the caps of every managed show, converted to the Store's units."""
    try:
        snap = begin_snapshot(conn)
        subs = {(show, alloc): centicores_to_cores(burst) for show, alloc, burst in conn.execute(SUB_LIMITS_SQL)}
        folders = {fid: (centicores_to_cores_cap(mc), gpus_cap(mg)) for fid, mc, mg in conn.execute(FOLDER_LIMITS_SQL)}
        jobs = {jid: (centicores_to_cores_cap(mc), gpus_cap(mg)) for jid, mc, mg in conn.execute(JOB_LIMITS_SQL)}
        generations = {show: int(g) for show, g in conn.execute(GENERATIONS_SQL)}
        conn.execute("COMMIT")
    except BaseException:
        abort_snapshot(conn)
        raise
    return LimitRows(subs=subs, folders=folders, jobs=jobs, pg_snapshot=snap, generations=generations)


LICENCES_SQL = f"""
SELECT pk_limit_record, str_name, int_max_value, {limit_max_sql("int_max_value")}, b_host_limit, int_running,
       {CUEBOT_ACCOUNTS}
FROM limit_record
"""


def _licence_row(row: tuple[Any, ...]) -> tuple[int, bool, int]:
    """One limit as the Store holds it; a row it cannot read runs nothing (max 0), logged by name.

    The max arrives as `limit_max_sql` reads it, so a NULL or (on a Cuebot database) negative
    one is 0 already; the raw value is only for the log line, which says why nothing runs there.
    """
    pk, name, raw, max_read, host, running, cuebot = row
    problem = limit_max_problem(name, raw, cuebot=bool(cuebot))
    if problem is not None:
        logger.warning("licence reseed: %s (limit_record %s): give it a max", problem, pk)
    try:
        return int(max_read), bool(host), int(running)
    except (TypeError, ValueError):
        # A count the triggers never write (NULL): the limit is refused until the row is fixed.
        logger.error("licence reseed: limit_record %s (%s) is unreadable %r: nothing runs under it", pk, name, row)
        return 0, bool(host), 0


def reseed_licences(store: Store, conn: psycopg.Connection) -> dict[str, tuple[int, bool, int]]:
    """Every licence limit's max and database count into the Store, fenced by the read's snapshot.

    Limits span shows, so all of them are read, whoever uses them. The count is the triggers'
    (recounted from proc under the limit's lock by every writer), read as committed. One bad row
    never stops the read: it is held as running nothing, and the caps' reseed that follows runs.
    """
    incarnation = store.incarnation
    token = store.begin_licence_read()
    try:
        snap = begin_snapshot(conn)
        rows = {row[0]: _licence_row(row) for row in conn.execute(LICENCES_SQL)}
        conn.execute("COMMIT")
    except BaseException:
        abort_snapshot(conn)
        raise
    store.set_licences(rows, snap, token, complete=True, incarnation=incarnation)
    return rows


def ensure_generation_rows(conn: psycopg.Connection) -> int:
    """Create the missing generation rows of managed shows; returns how many (0 if it had to give up)."""
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{ENSURE_LOCK_TIMEOUT}'")
            return conn.execute(ENSURE_GENERATION_ROWS_SQL).rowcount
    except psycopg.errors.LockNotAvailable:
        logger.warning("limit reseed: a writer holds a new show's generation row; it is created by its bump")
        return 0


def reseed_limits(store: Store, conn: psycopg.Connection) -> LimitRows:
    started = time.monotonic()
    incarnation = store.incarnation
    ensure_generation_rows(conn)
    reseed_licences(store, conn)
    rows = read_limits(conn)
    removed = store.set_caps(
        rows.subs, rows.folders, rows.jobs, pg_snapshot=rows.pg_snapshot, complete=True, incarnation=incarnation
    )
    if rows.generations is not None:
        store.cover_generations("caps", rows.generations, incarnation)
    logger.info(
        "limit reseed: %d subscriptions, %d folders, %d jobs in %.3fs (%d caps removed)",
        len(rows.subs),
        len(rows.folders),
        len(rows.jobs),
        time.monotonic() - started,
        removed,
    )
    return rows


def fill_caps(store: Store, conn: psycopg.Connection, folders: list[str], jobs: list[str]) -> LimitRows:
    """Load the caps of these folders and jobs into the Store, fenced by the read's snapshot."""
    incarnation = store.incarnation
    try:
        snap = begin_snapshot(conn)
        params = {"folders": folders, "jobs": jobs}
        folder_rows = {
            fid: (centicores_to_cores_cap(mc), gpus_cap(mg)) for fid, mc, mg in conn.execute(FILL_FOLDERS_SQL, params)
        }
        job_rows = {
            jid: (centicores_to_cores_cap(mc), gpus_cap(mg)) for jid, mc, mg in conn.execute(FILL_JOBS_SQL, params)
        }
        conn.execute("COMMIT")
    except BaseException:
        abort_snapshot(conn)
        raise
    store.set_caps({}, folder_rows, job_rows, pg_snapshot=snap, incarnation=incarnation)
    return LimitRows(subs={}, folders=folder_rows, jobs=job_rows, pg_snapshot=snap)


def abort_snapshot(conn: psycopg.Connection) -> None:
    """Leave the connection usable after a failed read (or let the caller reconnect)."""
    if conn.closed:
        return
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error:
        pass
