"""One scheduler per database: an advisory lock to elect it, a lease generation to fence it.

Two Stores over the same shows would each believe they hold the whole burst and jointly
over-book. The lock is session-level on a dedicated connection held for the process
lifetime: if the process dies, PostgreSQL drops the lock with the session, so a crashed
scheduler never blocks its replacement.

A lock alone is not a fence: if the holder's lock session dies (a DBA killing idle sessions,
a proxy dropping it) while the process lives on, another scheduler takes the lock at once,
and the first would keep booking until it notices. So whoever takes the lock also takes the
lease (`take_lease`): under the exclusive accounting-keys lock, which waits for every
in-flight proc write including the old holder's last booking batch, it bumps
`cuesched_scheduler_lease.int_generation`. Every booking transaction checks the generation
its scheduler took (`dispatch.engine.booking.write_batch`), so after a takeover the old holder
cannot commit a single booking, and the new one bootstraps from a SUM(proc) that already
holds every booking the old one committed.
"""

from __future__ import annotations

import socket
import threading

import psycopg

from accounting import db

# An arbitrary, fixed 64-bit key ("cuesched" in ASCII).
SCHEDULER_LOCK_KEY = 0x6375657363686564

HOLDER_SQL = """
SELECT a.pid, a.application_name, COALESCE(host(a.client_addr), 'local socket'), a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted
  AND l.classid = (%(key)s >> 32)::oid AND l.objid = (%(key)s & 4294967295)::oid AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


TAKE_LEASE_SQL = """
INSERT INTO cuesched_scheduler_lease AS t (id, int_generation, str_holder, ts_acquired)
VALUES (1, 1, %(holder)s, now())
ON CONFLICT (id) DO UPDATE
SET int_generation = t.int_generation + 1, str_holder = EXCLUDED.str_holder, ts_acquired = now()
RETURNING int_generation
"""
LEASE_SQL = "SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1"


class SchedulerAlreadyRunning(RuntimeError):
    pass


class LeaseLost(RuntimeError):
    """Another scheduler took the lease while this one's lock session was gone."""


def holder_name() -> str:
    return f"{socket.gethostname()}:{__import__('os').getpid()}"


def take_lease(conn: psycopg.Connection, holder: str | None = None) -> int:
    """Bump the lease generation, after every in-flight proc write has committed; returns it.

    The exclusive accounting-keys lock is polled, never queued for: a queued exclusive request
    would hold every later proc write of the farm behind it.
    """
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        db.take_keys_lock(cur, what="lease")
        row = cur.execute(TAKE_LEASE_SQL, {"holder": (holder or holder_name())[:255]}).fetchone()
    assert row is not None
    return int(row[0])


def wait_for_lock(stop: threading.Event, poll: float) -> psycopg.Connection | None:
    """A standby: retry the lock until it is free (returns its connection) or `stop` is set."""
    while not stop.is_set():
        try:
            return acquire()
        except SchedulerAlreadyRunning:
            pass
        except psycopg.Error:
            pass  # the database is away: keep waiting
        stop.wait(poll)
    return None


def acquire() -> psycopg.Connection:
    """Take the scheduler lock or raise SchedulerAlreadyRunning naming the holder."""
    conn = db.connect(application_name="cuesched-scheduler-lock")
    got = conn.execute("SELECT pg_try_advisory_lock(%s)", (SCHEDULER_LOCK_KEY,)).fetchone()
    if got and got[0]:
        return conn
    holder = conn.execute(HOLDER_SQL, {"key": SCHEDULER_LOCK_KEY}).fetchone()
    conn.close()
    if holder:
        pid, app, addr, since = holder
        who = f"backend pid {pid} ({app or 'unnamed'}) from {addr}, connected since {since:%Y-%m-%d %H:%M:%S %Z}"
    else:
        who = "a session that has just released it (try again)"
    raise SchedulerAlreadyRunning(
        "another run_scheduler already owns this database's Store "
        f"(advisory lock {SCHEDULER_LOCK_KEY:#x} held by {who}); only one scheduler may run per "
        "database, since two Stores would jointly over-book"
    )


def still_held(conn: psycopg.Connection | None, generation: int | None = None) -> psycopg.Connection:
    """Check the lock's session is alive; after a lost session take the lock again on a new one.

    Raises SchedulerAlreadyRunning when another scheduler holds the lock now, and LeaseLost
    when this one got the lock back but the lease generation moved meanwhile (another
    scheduler held the Store in between: this Store missed its bookings). Returns the
    connection that now holds the lock.
    """
    if conn is not None and not conn.closed and not conn.broken:
        try:
            conn.execute("SELECT 1")
            return conn
        except psycopg.Error:
            pass
    if conn is not None:
        conn.close()
    new = acquire()
    if generation is not None:
        row = new.execute(LEASE_SQL).fetchone()
        if row is None or int(row[0]) != generation:
            new.close()
            raise LeaseLost(
                f"the scheduler lease is at generation {None if row is None else row[0]}, this scheduler "
                f"held {generation}: another scheduler owned the Store while this one's lock session was gone"
            )
    return new
