"""One scheduler per database, enforced by a PostgreSQL advisory lock.

Two Stores over the same shows would each believe they hold the whole burst and jointly
over-book. The lock is session-level on a dedicated connection held for the process
lifetime: if the process dies, PostgreSQL drops the lock with the session, so a crashed
scheduler never blocks its replacement.
"""

from __future__ import annotations

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


class SchedulerAlreadyRunning(RuntimeError):
    pass


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


def still_held(conn: psycopg.Connection | None) -> psycopg.Connection:
    """Check the lock's session is alive; after a lost session (database restart, killed
    backend) take the lock again on a new one, or raise SchedulerAlreadyRunning when another
    scheduler took it meanwhile. Returns the connection that now holds the lock."""
    if conn is not None and not conn.closed and not conn.broken:
        try:
            conn.execute("SELECT 1")
            return conn
        except psycopg.Error:
            pass
    if conn is not None:
        conn.close()
    return acquire()
