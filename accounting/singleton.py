"""One scheduler per database: an advisory lock to elect it, a lease generation to fence it.

Two Stores over the same shows would each believe they hold the whole burst and jointly
over-book. The lock is session-level on a dedicated connection held for the process
lifetime: if the process dies, PostgreSQL drops the lock with the session, so a crashed
scheduler never blocks its replacement.

A lock alone is not a fence: if the holder's lock session dies (a DBA killing idle sessions,
a proxy dropping it) while the process lives on, another scheduler takes the lock at once,
and the first would keep booking until it notices. So whoever takes the lock also takes the
lease (`take_lease`): under `FOR UPDATE` of the lease row, which waits for every booking
transaction in flight including the old holder's last batch (each reads the row FOR KEY SHARE), it bumps
`cuesched_scheduler_lease.int_generation`. Every booking transaction checks the generation
its scheduler took (`dispatch.engine.booking.write_batch`), so after a takeover the old holder
cannot commit a single booking, and the new one bootstraps from a SUM(proc) that already
holds every booking the old one committed.

A lock session alone is not a liveness proof either: a holder that is stopped (SIGSTOP, a
frozen VM) keeps its sessions, its lock and any transaction it had open, and a standby would
wait for it forever. So the holder renews a deadline on the lease row (`ts_deadline`, now +
CUESCHED_LEASE_TTL, every CUESCHED_LEASE_RENEW_INTERVAL) from its lock session, and tags every
session it opens with its lease generation in `application_name` (`accounting.db.lease_tag`).
A standby that finds the deadline passed by the database's clock terminates every session of
this database carrying the old generation's tag (`fence_expired_holder`): the lock session (the
advisory lock goes with it), the dispatch connections with whatever transaction they had open
(rolled back), the listener. Then it takes the lock and the lease. Terminating needs the
privilege to signal those backends: the same role, a member of it, or `pg_signal_backend`
(never a superuser's backend unless the standby is superuser too); without it the standby logs
why and keeps waiting.

Whatever the timing, safety rests on the generation alone: the takeover bumps it under the
`FOR UPDATE` of the lease row, and every booking transaction reads it `FOR KEY SHARE` before it
writes anything, so a booking commits only under the
generation current at its COMMIT. The deadline only decides when a standby may stop waiting.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import psycopg

from accounting import db
from cuesched_project import conf

logger = logging.getLogger(__name__)

# An arbitrary, fixed 64-bit key ("cuesched" in ASCII).
SCHEDULER_LOCK_KEY = 0x6375657363686564

HOLDER_SQL = """
SELECT a.pid, a.application_name, COALESCE(host(a.client_addr), 'local socket'), a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted
  AND l.classid = (%(key)s >> 32)::oid AND l.objid = (%(key)s & 4294967295)::oid AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


# FOR UPDATE, not the UPDATE's own FOR NO KEY UPDATE: it must wait for (and block) the
# booking transactions' FOR KEY SHARE of the row, which the deadline renewals do not.
LOCK_LEASE_ROW_SQL = "SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1 FOR UPDATE"
TAKE_LEASE_SQL = """
INSERT INTO cuesched_scheduler_lease AS t (id, int_generation, str_holder, ts_acquired, ts_deadline)
VALUES (1, 1, %(holder)s, now(), clock_timestamp() + make_interval(secs => %(ttl)s))
ON CONFLICT (id) DO UPDATE
SET int_generation = t.int_generation + 1, str_holder = EXCLUDED.str_holder, ts_acquired = now(),
    ts_deadline = EXCLUDED.ts_deadline
RETURNING int_generation
"""
LEASE_SQL = "SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1"
# The heartbeat: only the generation's holder moves the deadline (0 rows: the lease is gone).
RENEW_SQL = """
UPDATE cuesched_scheduler_lease SET ts_deadline = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE id = 1 AND int_generation = %(generation)s
RETURNING int_generation
"""
# The lease as a standby judges it: by the database's clock, never the standby's.
EXPIRED_SQL = """
SELECT int_generation, ts_deadline IS NOT NULL AND ts_deadline < clock_timestamp(),
       EXTRACT(EPOCH FROM clock_timestamp() - ts_deadline)::float8
FROM cuesched_scheduler_lease WHERE id = 1
"""
# The sessions of the expired holder: this database, tagged with its generation, not this one.
HOLDER_SESSIONS_SQL = """
SELECT pid, application_name, usename FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND right(application_name, %(n)s) = %(tag)s
"""
TERMINATE_SQL = "SELECT pg_terminate_backend(%(pid)s, %(wait_ms)s)"


class SchedulerAlreadyRunning(RuntimeError):
    pass


class LeaseLost(RuntimeError):
    """Another scheduler took the lease while this one's lock session was gone."""


def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Fenced:
    """What `fence_expired_holder` did: the expired generation, the sessions it ended, and those
    it was not allowed to end (pid, application_name, role)."""

    generation: int
    overdue: float
    terminated: list[tuple[int, str]]
    refused: list[tuple[int, str, str]]


def fence_expired_holder(conn: psycopg.Connection) -> Fenced | None:
    """If the lease's deadline has passed, terminate every session of its holder; else None.

    The sessions are found by the generation's tag in application_name, so a holder that took
    the lease again on a new session, or opened a new dispatch connection, is found too; a
    session that merely calls itself so only gets itself terminated. pg_terminate_backend waits
    (bounded) for each backend to exit, so the holder's open transactions have rolled back and
    its advisory lock is free when this returns.
    """
    row = conn.execute(EXPIRED_SQL).fetchone()
    if row is None or not row[1]:
        return None
    generation, overdue = int(row[0]), float(row[2])
    tag = db.lease_tag(generation)
    fenced = Fenced(generation, overdue, [], [])
    for pid, app, role in conn.execute(HOLDER_SESSIONS_SQL, {"n": len(tag), "tag": tag}).fetchall():
        try:
            conn.execute(TERMINATE_SQL, {"pid": pid, "wait_ms": 3000})
            fenced.terminated.append((pid, app))
        except psycopg.errors.InsufficientPrivilege:
            fenced.refused.append((pid, app, role))
        except psycopg.errors.QueryCanceled:
            # A statement_timeout shorter than the wait: the signal went before the wait began.
            fenced.terminated.append((pid, app))
    if fenced.terminated:
        logger.warning(
            "lease generation %d expired %.1fs ago: terminated its holder's sessions %s",
            generation,
            overdue,
            ", ".join(f"{pid} ({app})" for pid, app in fenced.terminated),
        )
    if fenced.refused:
        logger.error(
            "lease generation %d expired %.1fs ago, but this role may not terminate its holder's sessions %s; "
            "hint: run every scheduler as the same role, or GRANT pg_signal_backend TO the scheduler role "
            "(a superuser's sessions can be ended only by a superuser); waiting",
            generation,
            overdue,
            ", ".join(f"{pid} ({app}, role {role})" for pid, app, role in fenced.refused),
        )
    return fenced


def deadline_in(conn: psycopg.Connection) -> float | None:
    """Seconds until the lease's deadline by the database's clock (None: no deadline kept)."""
    row = conn.execute(EXPIRED_SQL).fetchone()
    return None if row is None or row[2] is None else -float(row[2])


def take_lease(conn: psycopg.Connection, holder: str | None = None, *, ttl: float | None = None) -> int:
    """Bump the lease generation, after every in-flight booking transaction has committed; returns it.

    The lease row FOR UPDATE waits for every booking transaction in flight (each reads it FOR
    KEY SHARE) and holds off later ones, which then read the new generation and write nothing.
    Nothing else of the farm waits for it: a stuck proc writer of some show does not hold the
    takeover up, nor does the takeover hold up that show's other writers. A previous holder that
    is stopped with a booking open (its lock session may be gone already) would hold the row
    forever, so the wait is tried in 0.5 s steps, and between them, once the previous lease's
    deadline has passed, its sessions are terminated (on a second connection: this transaction
    must not end). Before that, the previous holder's other open transactions (a completion,
    a compensation: they hold their procs' key rows) are waited for the same way, so a stopped
    holder's are ended once its deadline has passed and none is left holding rows the new
    holder books on. Then this connection is tagged with the new generation, like every
    connection the process opens from now on.
    """
    ttl = conf.lease_ttl() if ttl is None else ttl
    _wait_for_the_previous_holders_transactions(conn)
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        waited = 0
        while True:
            try:
                with conn.transaction():
                    cur.execute("SELECT set_config('lock_timeout', '500ms', true)")
                    cur.execute(LOCK_LEASE_ROW_SQL)
                break
            except psycopg.errors.LockNotAvailable:
                waited += 1
                if waited % 10 == 0:
                    logger.warning(
                        "lease takeover: a booking transaction has held the lease row for %ds; the previous "
                        "holder's sessions are terminated once its lease deadline has passed, any other "
                        "session's only when it ends",
                        waited // 2,
                    )
                _fence_on_the_side()
        cur.execute("SET LOCAL lock_timeout TO DEFAULT")
        row = cur.execute(TAKE_LEASE_SQL, {"holder": (holder or holder_name())[:255], "ttl": ttl}).fetchone()
    assert row is not None
    generation = int(row[0])
    db.set_lease_tag(generation)
    conn.execute("SELECT set_config('application_name', %s, false)", (db.tagged("cuesched-scheduler-lock"),))
    return generation


# The previous generation's sessions inside a transaction (their state needs the same role or
# pg_read_all_stats; another role's read as none, and the takeover does not wait for them).
OPEN_HOLDER_TRANSACTIONS_SQL = """
SELECT count(*) FROM pg_stat_activity a, (SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1) l
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND a.xact_start IS NOT NULL
  AND right(a.application_name, length(' [lease ' || l.int_generation || ']')) = ' [lease ' || l.int_generation || ']'
"""


def _wait_for_the_previous_holders_transactions(conn: psycopg.Connection) -> None:
    """Until no session of the current lease generation is inside a transaction, fencing it
    (terminating its sessions) once its deadline has passed. A live holder's transactions are
    short, so this returns at once; a stopped one's end with the fence."""
    waited = 0
    while True:
        row = conn.execute(OPEN_HOLDER_TRANSACTIONS_SQL).fetchone()
        if not row or not row[0]:
            return
        waited += 1
        if waited % 100 == 0:
            logger.warning(
                "lease takeover: the previous holder has %d session(s) inside a transaction; they are "
                "terminated once its lease deadline has passed",
                row[0],
            )
        if waited % 10 == 0:
            _fence_on_the_side()
        time.sleep(0.05)


def _fence_on_the_side() -> None:
    try:
        with db.connect(application_name="cuesched-standby-fence") as side:
            fence_expired_holder(side)
    except psycopg.Error as exc:
        logger.warning("lease takeover: could not check the previous holder's deadline: %s", exc)


def renew(conn: psycopg.Connection, generation: int, ttl: float | None = None) -> bool:
    """Move the lease's deadline to now + ttl; False when the lease is no longer `generation`."""
    ttl = conf.lease_ttl() if ttl is None else ttl
    return conn.execute(RENEW_SQL, {"generation": generation, "ttl": ttl}).fetchone() is not None


def wait_for_lock(stop: threading.Event, poll: float) -> psycopg.Connection | None:
    """A standby: retry the lock until it is free (returns its connection) or `stop` is set.

    Between attempts it checks the lease's deadline, and once that has passed terminates the
    holder's sessions (`fence_expired_holder`) and tries again at once: a stopped holder's lock
    session would otherwise keep the lock for as long as it stays stopped.
    """
    side: psycopg.Connection | None = None
    try:
        while not stop.is_set():
            try:
                return acquire()
            except SchedulerAlreadyRunning:
                try:
                    if side is None or side.closed or side.broken:
                        side = db.connect(application_name="cuesched-standby-fence")
                    fenced = fence_expired_holder(side)
                    if fenced is not None and fenced.terminated:
                        continue  # the lock went with the holder's lock session: take it now
                    if fenced is None:
                        # Look again right after the deadline rather than up to a poll later.
                        left = deadline_in(side)
                        if left is not None and left < poll:
                            stop.wait(max(left, 0.0) + 0.05)
                            continue
                except psycopg.Error as exc:
                    logger.debug("standby: deadline check failed: %s", exc)
            except psycopg.Error:
                pass  # the database is away: keep waiting
            stop.wait(poll)
        return None
    finally:
        if side is not None:
            side.close()


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
