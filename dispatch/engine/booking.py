"""The booking transaction: many bookings, one transaction, one statement per group.

Reference §3.7 books one frame per transaction. Here a batch of bookings (already applied
in the Store for managed shows) is written in ONE transaction, with the reference's guards
kept row by row but executed set-based:

0. the transaction is READ COMMITTED whatever the server's default, its first statement checks
   the scheduler lease (FOR KEY SHARE of its row): a scheduler that lost its lease cannot
   commit a single booking, and the takeover waits for this batch. The same statement records
   the transaction id, so an unknown COMMIT outcome is later settled from `pg_xact_status`,
   not from which procs happen to exist. After the batch's limit rows, one statement locks its
   key rows (accounting.keylocks: its shows, jobs and layers FOR KEY SHARE, its hosts FOR NO
   KEY UPDATE), so no flip or move of those keys commits under it, and a show whose row a
   flip or move holds is skipped this cycle while the others book;
1. each booking's managed decision is checked against `show.b_scheduler_managed` and, for a
   Store booking, the show's flip generation the Store was seeded at: a show flipped since
   (even there and back) loses its bookings, so a Store-booked proc is never counted by the
   database triggers too, nor one booked on a stale seed; its keys are checked too (the
   host's allocation and the job's folder the Store booked against: a move since is a
   rejection, not a proc counted under the wrong key);
2. frame start, guarded by `str_state = 'WAITING' AND int_version = <seen>` (and the layer's
   `ts_start_after`), version + 1, RUNNING, host, reservations, times, the retry bump;
3. proc INSERT ... ON CONFLICT (pk_frame) DO NOTHING, for the frames that started;
4. host idle decrement aggregated per host, guarded so no idle value goes negative and the
   host is still OPEN, UP and heard from within the lost-host timeout.

The Store-booked group runs under the transaction-local "Store-accounted" marker, so its
proc INSERT sends no usage delta (the Store counted it already). All three writes are one
statement (data-modifying CTEs) inside a SAVEPOINT per group; each
CTE reads the RETURNING of the one before, never a join of two CTEs (the planner estimates a
data-modifying CTE at one row and would nest-loop such a join). A
guard that fails only removes its bookings: the group is rolled back to the savepoint and
written again without them (rare: the host view tracks our own bookings exactly). A trigger
error (the database-enforced caps of unmanaged shows raise `check_violation`) splits the
group in halves until the offending booking is alone, so one over-cap booking never costs
the rest of the batch. Managed and unmanaged bookings are separate groups.

The caller settles the Store: every booking this module reports as rejected gets a Store
rollback, every written one a confirm after its launch, or, if the launch fails, the
compensating transaction below and then a rollback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from accounting import blockers as acct_blockers
from accounting import triggers as acct_triggers
from accounting.host_memory import HOST_LEDGER_RECOUNT_CONSTRAINT
from accounting.keylocks import LOCK_KEYS_OF_BOOKINGS_SQL, LOCK_KEYS_OF_PROCS_SQL
from accounting.licences import LIMIT_MAX_CONSTRAINT
from accounting.notify import STORE_ACCOUNTED_SQL
from accounting.service import BookingResult
from accounting.triggers import GENERATION_TABLE
from cuesched_project import conf
from dispatch.engine.feed import FrameWork, LayerWork
from dispatch.engine.placement import HostRec

logger = logging.getLogger(__name__)

# Exit statuses after which a new start does not count as a retry: Cuebot's list, and 33, which
# cuesched records for every memory failure (dispatch.engine.completion): that frame is retried
# with more memory and is never charged a retry for it.
NO_RETRY_EXIT_STATUSES = (-1, 33, 256, 286, 299, 301, 302, 399)
EXIT_STATUS_FRAME_CLEARED = 299

# Rejection tables reported by the batch writer (the Store's own are subscription, folder, job, ...).
REJECT_FRAME = "frame"  # state/version guard: the frame was started, changed or removed elsewhere
REJECT_PROC = "proc"  # the frame already has a proc
REJECT_HOST = "host"  # the host's idle resources (or lock state) no longer allow it
REJECT_MANAGED_FLIP = "managed_flip"  # the show's flag or flip generation differs from the booking's
REJECT_KEYS = "keys"  # the host's allocation or the job's folder moved since the Store booked it
# The show's accounting generation moved since the Store decided: a change it has not applied yet.
REJECT_GENERATION = "generation"
REJECT_DATABASE = "database"  # any other statement error of this booking alone
REJECT_LOCKED = "locked"  # another session held a lock of its show (or limit) past the lock wait

_CAP_TABLES = {
    acct_triggers.CAP_SUBSCRIPTION_MISSING: "subscription",
    acct_triggers.CAP_SUBSCRIPTION_BURST: "subscription",
    acct_triggers.CAP_FOLDER_MISSING: "folder",
    acct_triggers.CAP_JOB_MISSING: "job",
    acct_triggers.CAP_FOLDER_MAX_CORES: "folder",
    acct_triggers.CAP_JOB_MAX_CORES: "job",
    acct_triggers.CAP_FOLDER_MAX_GPUS: "folder_gpus",
    acct_triggers.CAP_JOB_MAX_GPUS: "job_gpus",
    LIMIT_MAX_CONSTRAINT: "limit",  # a licence limit (accounting.licences), every show
}
# The rejection tables that mean "a database-enforced cap refused it" (not a guard of this batch).
CAP_REFUSALS = frozenset(_CAP_TABLES.values())

# SQLSTATEs after which the same group is simply written again.
_RETRY_SQLSTATES = {"40P01", "40001"}  # deadlock, serialization failure
_MAX_GROUP_ATTEMPTS = 6

# The lease check (and the transaction id an unknown COMMIT is settled by), the first statement.
# FOR KEY SHARE: the takeover's FOR UPDATE of the row waits for this transaction and this one for
# a takeover in progress, so the generation read is the one in force until COMMIT; the holder's
# deadline renewals do not conflict with it.
LEASE_SQL = (
    "SELECT (SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1 FOR KEY SHARE),"
    " pg_current_xact_id()::text::bigint"
)

BOOK_SQL = f"""
WITH b AS (
  SELECT * FROM unnest(
    %(proc)b::text[], %(frame)b::text[], %(version)b::int[], %(host)b::text[], %(host_name)b::text[],
    %(show)b::text[], %(job)b::text[], %(layer)b::text[], %(cores)b::bigint[], %(mem)b::bigint[],
    %(gpus)b::int[], %(gpu_mem)b::bigint[], %(managed)b::bool[], %(decided)b::float8[], %(alloc)b::text[],
    %(folder)b::text[], %(generation)b::bigint[], %(acct_generation)b::bigint[])
  AS b(pk_proc, pk_frame, version, pk_host, host_name, pk_show, pk_job, pk_layer, cores, mem, gpus, gpu_mem,
       managed, decided, alloc, folder, generation, acct_generation)
),
shows AS (
  SELECT s.pk_show, s.b_scheduler_managed, COALESCE(fl.int_generation, 0) AS generation,
         COALESCE(ag.int_generation, 0) AS acct_generation FROM show s
  LEFT JOIN cuesched_show_flip fl ON fl.pk_show = s.pk_show
  LEFT JOIN {GENERATION_TABLE} ag ON ag.pk_show = s.pk_show
  WHERE s.pk_show IN (SELECT DISTINCT pk_show FROM b)
),
-- Owner and keys as the Store booked them: the flag (and, for a Store booking, the flip
-- generation of its seed), the host's allocation and the job's folder. The key rows this
-- transaction locked before this statement (accounting.keylocks) keep all of them still until COMMIT.
checked AS MATERIALIZED (
  SELECT b.*,
         (s.b_scheduler_managed = b.managed AND (NOT b.managed OR s.generation = b.generation)) AS owner_ok,
         (NOT b.managed OR s.acct_generation = b.acct_generation) AS gen_ok,
         (EXISTS (SELECT 1 FROM host h WHERE h.pk_host = b.pk_host AND h.pk_alloc = b.alloc)
          AND EXISTS (SELECT 1 FROM job j WHERE j.pk_job = b.pk_job AND j.pk_folder = b.folder)) AS keys_ok
  FROM b JOIN shows s ON s.pk_show = b.pk_show
),
-- The frames to start, found by primary key from the input (a LATERAL lookup per booking),
-- then updated by the exact row version seen: a frame changed since (by anyone) has a new
-- ctid and is skipped, which is the state/version guard without asking the planner to
-- estimate how many frames are WAITING (its statistics lag far behind our own churn, and a
-- wrong guess there turns the join quadratic).
target AS MATERIALIZED (
  SELECT b.*, x.fctid
  FROM checked b
  CROSS JOIN LATERAL (
    SELECT f.ctid AS fctid FROM frame f
    WHERE f.pk_frame = b.pk_frame AND f.str_state = 'WAITING' AND f.int_version = b.version
      AND NOT EXISTS (SELECT 1 FROM layer l WHERE l.pk_layer = f.pk_layer AND l.ts_start_after > now())
    LIMIT 1  -- a subquery per row (never flattened into a join): one index probe each
  ) x
  WHERE b.owner_ok AND b.gen_ok AND b.keys_ok
),
started AS (
  UPDATE frame f
  SET str_state = 'RUNNING', str_host = t.host_name, int_cores = t.cores, int_mem_reserved = t.mem,
      int_gpus = t.gpus, int_gpu_mem_reserved = t.gpu_mem, ts_started = now(), ts_updated = now(),
      ts_stopped = NULL, int_version = f.int_version + 1,
      int_retries = CASE WHEN f.int_exit_status IN {NO_RETRY_EXIT_STATUSES} THEN f.int_retries
                         ELSE f.int_retries + 1 END
  FROM target t
  WHERE f.ctid = t.fctid
  RETURNING f.pk_frame, f.int_version, t.pk_proc, t.pk_host, t.pk_show, t.pk_job, t.pk_layer, t.cores, t.mem,
            t.gpus, t.gpu_mem, t.decided
),
procs AS (
  INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,
                    int_mem_reserved, int_mem_pre_reserved, int_mem_used, int_gpus_reserved,
                    int_gpu_mem_reserved, int_gpu_mem_pre_reserved, ts_dispatched)
  SELECT st.pk_proc, st.pk_host, st.pk_show, st.pk_job, st.pk_layer, st.pk_frame, st.cores, st.mem, st.mem,
         LEAST(%(mem_used)s::bigint, st.mem), st.gpus, st.gpu_mem, st.gpu_mem,
         COALESCE(to_timestamp(st.decided), statement_timestamp())
  FROM started st
  ON CONFLICT (pk_frame) DO NOTHING
  RETURNING pk_frame
),
need AS (
  SELECT pk_host, SUM(cores) AS c, SUM(mem) AS m, SUM(gpus) AS g, SUM(gpu_mem) AS gm
  FROM started
  GROUP BY pk_host
),
took AS (
  UPDATE host h
  SET int_cores_idle = h.int_cores_idle - need.c, int_mem_idle = h.int_mem_idle - need.m,
      int_gpus_idle = h.int_gpus_idle - need.g, int_gpu_mem_idle = h.int_gpu_mem_idle - need.gm,
      ts_last_updated = now()
  FROM need
  WHERE h.pk_host = need.pk_host AND h.str_lock_state = 'OPEN'
    AND h.int_cores_idle >= need.c AND h.int_mem_idle >= need.m
    AND h.int_gpus_idle >= need.g AND h.int_gpu_mem_idle >= need.gm
    AND EXISTS (SELECT 1 FROM host_stat hs WHERE hs.pk_host = h.pk_host AND hs.str_state = 'UP'
                AND hs.ts_ping >= now() - make_interval(secs => %(stale_after)s))
  RETURNING h.pk_host, h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle
)
SELECT 'f', pk_frame, int_version::bigint, NULL::bigint, NULL::bigint, NULL::bigint FROM started
UNION ALL
SELECT 'p', pk_frame, NULL, NULL, NULL, NULL FROM procs
UNION ALL
SELECT 'h', pk_host, int_cores_idle, int_mem_idle, int_gpus_idle, int_gpu_mem_idle FROM took
UNION ALL
SELECT 'x', pk_frame, owner_ok::int::bigint, keys_ok::int::bigint, gen_ok::int::bigint, NULL FROM checked
WHERE NOT (owner_ok AND gen_ok AND keys_ok)
"""

# The end of the managed part, after every other write of the transaction: the accounting
# generation of each show it booked, locked FOR SHARE. A writer's bump in progress holds the row
# (FOR NO KEY UPDATE): SKIP LOCKED leaves it out, and those shows' bookings fail (the booking
# never waits for a writer, so it can never be part of a deadlock with one); a bump committed
# before this statement is read as it is now (READ COMMITTED); a bump that comes after waits for
# this transaction's COMMIT, so it is ordered after it. Either way no booking commits after a
# bump without having been compared with it.
GENERATION_LOCK_SQL = f"""
SELECT pk_show, int_generation FROM {GENERATION_TABLE} WHERE pk_show = ANY(%s::text[])
ORDER BY pk_show FOR SHARE SKIP LOCKED
"""
GENERATION_ROWS_SQL = f"SELECT pk_show FROM {GENERATION_TABLE} WHERE pk_show = ANY(%s::text[])"
_MAX_GENERATION_ATTEMPTS = 3

# Compensation after a failed launch, in the reference order proc -> host -> frame, each
# statement seeing the one before. Only what this transaction deleted is given back.
COMPENSATE_DELETE_PROCS_SQL = """
DELETE FROM proc WHERE pk_proc = ANY(%s::text[])
RETURNING pk_proc, pk_host, int_cores_reserved, int_mem_reserved, int_gpus_reserved, int_gpu_mem_reserved
"""

# Shared with the completion path: give booked resources back, never above the host's total.
# `{source}` yields (pk_host, c, m, g, gm) rows: centicores, KB, GPUs, KB.
HOST_GIVE_BACK_TEMPLATE = """
UPDATE host h
SET int_cores_idle = LEAST(h.int_cores_idle + need.c, h.int_cores),
    int_mem_idle = LEAST(h.int_mem_idle + need.m, h.int_mem),
    int_gpus_idle = LEAST(h.int_gpus_idle + need.g, h.int_gpus),
    int_gpu_mem_idle = LEAST(h.int_gpu_mem_idle + need.gm, h.int_gpu_mem),
    ts_last_updated = now()
FROM (SELECT x.pk_host, SUM(x.c) AS c, SUM(x.m) AS m, SUM(x.g) AS g, SUM(x.gm) AS gm
      FROM {source} GROUP BY x.pk_host) AS need
WHERE h.pk_host = need.pk_host
RETURNING h.pk_host, h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle
"""
HOST_GIVE_BACK_SQL = HOST_GIVE_BACK_TEMPLATE.format(
    source="unnest(%s::text[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[]) AS x(pk_host, c, m, g, gm)"
)

COMPENSATE_CLEAR_FRAMES_SQL = f"""
WITH target AS MATERIALIZED (
  SELECT x.fctid
  FROM unnest(%s::text[], %s::int[]) AS b(pk_frame, version)
  CROSS JOIN LATERAL (
    SELECT f.ctid AS fctid FROM frame f
    WHERE f.pk_frame = b.pk_frame AND f.str_state = 'RUNNING' AND f.int_version = b.version
      AND NOT EXISTS (SELECT 1 FROM proc p WHERE p.pk_frame = f.pk_frame)
    LIMIT 1  -- a subquery per row (never flattened into a join): one index probe each
  ) x
)
UPDATE frame f
SET str_state = 'WAITING', int_exit_status = {EXIT_STATUS_FRAME_CLEARED}, ts_stopped = now(), ts_updated = now(),
    int_version = f.int_version + 1
FROM target t
WHERE f.ctid = t.fctid
RETURNING f.pk_frame, f.int_version
"""


@dataclass(slots=True, eq=False)
class Booking:
    """One frame on one host. Resources in centicores / KB; `result` is the Store's answer."""

    pk_proc: str
    frame: FrameWork
    layer: LayerWork
    host: HostRec
    cores: int
    mem: int
    gpus: int
    gpu_mem: int
    result: BookingResult
    managed: bool
    post_version: int | None = None
    # Unix time just before the Store's check decided this booking; written as
    # proc.ts_dispatched. proc.ts_booked (the INSERT) can come tens of milliseconds later in a
    # large batch, so only this says which cap the booking was checked against.
    decided_at: float | None = None
    # The show's flip generation the Store was seeded at (-1 for a database-enforced booking).
    generation: int = -1
    # The show's accounting generation the Store's check was decided under (Applied.generation;
    # -1 for a database-enforced booking): the booking transaction refuses it if the database's
    # moved since.
    acct_generation: int = -1
    # The booking transaction once written: the Store keeps the booking's licences counted
    # until the database's count for this transaction has arrived.
    xid: int | None = None


@dataclass
class BatchResult:
    """What one booking transaction did. `written` committed (or will, see `commit_sent`)."""

    written: list[Booking] = field(default_factory=list)
    rejected: list[tuple[Booking, str]] = field(default_factory=list)
    host_rows: list[tuple[Any, ...]] = field(default_factory=list)
    failed_hosts: set[str] = field(default_factory=set)
    xid: int | None = None  # the booking transaction, recorded before COMMIT
    # Shows skipped because another session held a lock (REJECT_LOCKED), with who holds it.
    blockers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class AmbiguousCommitError(psycopg.OperationalError):
    """The connection failed while COMMIT was in flight: the batch may or may not be durable.

    `result` says what the transaction wrote before COMMIT, `xid` which transaction it was.
    """

    def __init__(self, result: BatchResult, xid: int | None, cause: BaseException) -> None:
        super().__init__(f"commit outcome unknown: {cause}")
        self.result = result
        self.xid = xid


class AmbiguousCompensationError(psycopg.OperationalError):
    """COMMIT of a compensation failed: `attempt` says what it deleted and which transaction it was."""

    def __init__(self, attempt: CompensationResult, cause: BaseException) -> None:
        super().__init__(f"compensation commit outcome unknown: {cause}")
        self.attempt = attempt


class LeaseLostError(RuntimeError):
    """The scheduler lease moved to another scheduler: this process may not book any more."""

    def __init__(self, mine: int, current: int | None) -> None:
        super().__init__(
            f"this scheduler booked under lease generation {mine}, the database says {current}: "
            "another scheduler owns the Store now"
        )
        self.mine = mine
        self.current = current


def write_batch(
    conn: psycopg.Connection,
    bookings: Sequence[Booking],
    *,
    mem_used: int,
    stale_after: float = 300.0,
    lease: int | None = None,
) -> BatchResult:
    """Write a batch of bookings in one transaction on an autocommit connection.

    Raises the connection's error if the transaction failed before COMMIT (nothing written),
    LeaseLostError if `lease` is no longer the database's (nothing written), or
    AmbiguousCommitError if COMMIT itself failed (settle it with `commit_status`).
    """
    result = BatchResult()
    managed = [b for b in bookings if b.managed]
    unmanaged = [b for b in bookings if not b.managed]
    xid: int | None = None
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        try:
            cur.execute(LEASE_SQL)
            current, xid = cur.fetchone() or (None, None)
            result.xid = xid
            if lease is not None and current != lease:
                raise LeaseLostError(lease, current)
            extra = {"mem_used": mem_used, "stale_after": stale_after}
            skipped = _bound_lock_waits(cur, bookings, result)
            if skipped:
                managed = [b for b in managed if b.pk_proc not in skipped]
                unmanaged = [b for b in unmanaged if b.pk_proc not in skipped]
            if managed:
                # Before both groups (the database-enforced one is spared the keys check under it).
                cur.execute(STORE_ACCOUNTED_SQL)
            if unmanaged:
                _write_locked_apart(cur, unmanaged, result, extra)
            if managed:
                # Last: its generation check comes after every other write of the transaction.
                _write_managed(cur, managed, result, extra)
            for b in result.written:
                b.xid = xid
            # COMMIT waits for the notification queue's lock behind other committers (and their
            # WAL flush): that wait is not a held show, so it gets the connection's own timeout.
            cur.execute(RESTORE_LOCK_TIMEOUT_SQL)
        except BaseException:
            _rollback_quietly(conn)
            raise
        # Before sending it: a log read after a stop then names every COMMIT sent after it.
        logger.debug("booking: COMMIT xid %s under lease %s, %d bookings", xid, lease, len(result.written))
        try:
            cur.execute("COMMIT")
        except psycopg.OperationalError as exc:
            raise AmbiguousCommitError(result, xid, exc) from exc
    return result


def commit_status(conn: psycopg.Connection, xid: int | None) -> str | None:
    """'committed', 'aborted' or 'in progress' for a transaction id; None when it cannot be known.

    None covers an xid too old for the commit log, one this server never assigned (a failover:
    "transaction ID is in the future"), and no recorded xid at all. The caller keeps the
    booking then: a counter may read high until the recompute, never low.
    """
    if xid is None:
        return None
    try:
        with conn.transaction():
            row = conn.execute("SELECT pg_xact_status(%s::text::xid8)", (str(xid),)).fetchone()
    except psycopg.errors.InvalidParameterValue:
        return None
    return None if row is None else row[0]


def find_written(conn: psycopg.Connection, bookings: Sequence[Booking]) -> set[str]:
    """pk_proc of the bookings whose proc exists (and their frames' versions, for the launch)."""
    if not bookings:
        return set()
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pk_proc, pk_frame FROM proc WHERE pk_proc = ANY(%s::text[])", ([b.pk_proc for b in bookings],)
        )
        found = {row[0] for row in cur.fetchall()}
        if found:
            cur.execute(
                "SELECT pk_frame, int_version FROM frame WHERE pk_frame = ANY(%s::text[])",
                ([b.frame.pk for b in bookings if b.pk_proc in found],),
            )
            versions = dict(cur.fetchall())
            for b in bookings:
                if b.pk_proc in found:
                    b.post_version = versions.get(b.frame.pk)
    return found


def _rollback_quietly(conn: psycopg.Connection) -> None:
    if conn.closed or conn.broken:
        return
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error:
        logger.debug("rollback after a failed batch failed too", exc_info=True)


def _undo_savepoint(cur: psycopg.Cursor) -> None:
    cur.execute("ROLLBACK TO SAVEPOINT dispatch_group")
    cur.execute("RELEASE SAVEPOINT dispatch_group")


def _params(group: Sequence[Booking], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "proc": [b.pk_proc for b in group],
        "frame": [b.frame.pk for b in group],
        "version": [b.frame.version for b in group],
        "host": [b.host.pk for b in group],
        "host_name": [b.host.name for b in group],
        "show": [b.layer.job.show for b in group],
        "job": [b.layer.job.pk for b in group],
        "layer": [b.layer.pk for b in group],
        "cores": [b.cores for b in group],
        "mem": [b.mem for b in group],
        "gpus": [b.gpus for b in group],
        "gpu_mem": [b.gpu_mem for b in group],
        "managed": [b.managed for b in group],
        "decided": [b.decided_at for b in group],
        "alloc": [b.host.alloc for b in group],
        "folder": [b.layer.job.folder for b in group],
        "generation": [b.generation for b in group],
        "acct_generation": [b.acct_generation for b in group],
        **extra,
    }


def _write_managed(cur: psycopg.Cursor, group: list[Booking], result: BatchResult, extra: dict[str, Any]) -> None:
    """The Store-booked group, then its generation check; a show whose generation moved loses its bookings.

    On a mismatch the group is rolled back to its savepoint (which also lets go of the row
    locks the check took) and written again without those shows, then checked again.
    """
    pending = group
    for _attempt in range(_MAX_GENERATION_ATTEMPTS):
        part = BatchResult()
        cur.execute("SAVEPOINT dispatch_managed")
        _write_locked_apart(cur, pending, part, extra)
        stale = _stale_generations(cur, part.written)
        result.blockers.update(part.blockers)
        if not stale:
            cur.execute("RELEASE SAVEPOINT dispatch_managed")
            result.written.extend(part.written)
            result.rejected.extend(part.rejected)
            result.host_rows.extend(part.host_rows)
            result.failed_hosts |= part.failed_hosts
            return
        cur.execute("ROLLBACK TO SAVEPOINT dispatch_managed")
        cur.execute("RELEASE SAVEPOINT dispatch_managed")
        result.rejected.extend(part.rejected)
        result.failed_hosts |= part.failed_hosts
        for bk in part.written:
            bk.post_version = None
            if id(bk) in stale:
                result.rejected.append((bk, REJECT_GENERATION))
        pending = [bk for bk in part.written if id(bk) not in stale]
        logger.info("dispatch: %d bookings met an accounting generation bumped meanwhile", len(stale))
    for bk in pending:
        result.rejected.append((bk, REJECT_GENERATION))


def _stale_generations(cur: psycopg.Cursor, written: Sequence[Booking]) -> set[int]:
    """id() of the written bookings whose show's generation is not theirs now (or is being bumped)."""
    if not written:
        return set()
    shows = sorted({bk.layer.job.show for bk in written})
    cur.execute(GENERATION_LOCK_SQL, (shows,))
    now = dict(cur.fetchall())
    missing = [s for s in shows if s not in now]
    if missing:
        # Skipped (a bump in progress holds it), or no row yet: a show never bumped is at 0.
        cur.execute(GENERATION_ROWS_SQL, (missing,))
        held = {row[0] for row in cur.fetchall()}
        for show in missing:
            if show not in held:
                now[show] = 0
    return {id(bk) for bk in written if now.get(bk.layer.job.show) != bk.acct_generation}


# --- one stuck session slows at most its own show (issue 27, rows 7 and 9) --------------------
# The limit rows of a batch, locked first and in key order: a completion (and the licence
# trigger of every statement) takes them in the same order, before any frame or host row, so
# no two proc writers, and no operator's limit write queued between them, can close a cycle.
BATCH_LIMITS_SQL = """
SELECT ll.pk_layer, ll.pk_limit_record FROM layer_limit ll WHERE ll.pk_layer = ANY(%s::text[])
ORDER BY ll.pk_limit_record
"""
LOCK_LIMIT_SQL = (
    "SELECT 1 FROM limit_record WHERE pk_limit_record = ANY(%s::text[]) ORDER BY pk_limit_record FOR UPDATE"
)
# The licence limits of the procs about to go, locked first and in key order: the booking
# transaction takes its limit rows first too, so neither ever holds a frame or host row while it
# waits for a limit row the other holds (with an operator's UPDATE of that limit queued between
# them, the cycle was found by the operator's wait: "deadlock detected ... in relation
# limit_record"). The DELETE's licence trigger then finds them held.
LOCK_LIMITS_OF_PROCS_SQL = """
SELECT 1 FROM limit_record r
WHERE r.pk_limit_record IN (
  SELECT ll.pk_limit_record FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer
  WHERE p.pk_proc = ANY(%(proc)s::text[]))
ORDER BY r.pk_limit_record FOR UPDATE OF r
"""

RESTORE_LOCK_TIMEOUT_SQL = "SET LOCAL lock_timeout TO DEFAULT"
# Every check of the batch at its statement, but the host memory ledger's recount once per
# booking statement: its statement records the same hosts twice (the proc INSERT's trigger and
# the host UPDATE's), and an IMMEDIATE recount ran once for each record. Deferred, the two records
# are one ledger row; RECOUNT_NOW_SQL, in the group's savepoint right after the statement, runs
# that one recount there (a refusal is still the group's, bisected as before).
CONSTRAINTS_SQL = f"SET CONSTRAINTS ALL IMMEDIATE; SET CONSTRAINTS {HOST_LEDGER_RECOUNT_CONSTRAINT} DEFERRED"
RECOUNT_NOW_SQL = (
    f"SET CONSTRAINTS {HOST_LEDGER_RECOUNT_CONSTRAINT} IMMEDIATE; "
    f"SET CONSTRAINTS {HOST_LEDGER_RECOUNT_CONSTRAINT} DEFERRED"
)
SHOWS_IN_LOCK_ORDER_SQL = "SELECT s FROM unnest(%s::text[]) AS s ORDER BY hashtext(s), s"


def _bound_lock_waits(cur: psycopg.Cursor, bookings: Sequence[Booking], result: BatchResult) -> set[str]:
    """Bound every later lock wait of the batch, and lock its limit rows first; returns pk_proc skipped.

    After the lease (which waits as long as the connection's lock_timeout allows), no statement
    of the batch waits longer than CUESCHED_BOOKING_LOCK_WAIT for a lock, and foreign keys are
    checked per statement (not at COMMIT, where a session holding one of their rows would fail
    the whole batch), the memory recount right after each booking statement (CONSTRAINTS_SQL).
    A limit whose row another session holds costs only its bookings. Then the batch's key rows
    (`_lock_keys`): limits first, as every proc writer of cuesched takes them.
    """
    wait_ms = max(1, int(conf.booking_lock_wait() * 1000))
    cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{wait_ms}ms",))
    cur.execute(CONSTRAINTS_SQL)
    layers = sorted({b.layer.pk for b in bookings})
    if not layers:
        return _lock_keys(cur, bookings, result)
    cur.execute(BATCH_LIMITS_SQL, (layers,))
    of_layer: dict[str, set[str]] = {}
    for layer, limit in cur.fetchall():
        of_layer.setdefault(layer, set()).add(limit)
    limits = sorted({lim for lims in of_layer.values() for lim in lims})
    if not limits or _try_locks(cur, LOCK_LIMIT_SQL, limits):
        return _lock_keys(cur, bookings, result)
    busy: set[str] = set()
    error: BaseException | None = None
    for limit in limits:  # one by one, still in key order: the busy ones are skipped
        try:
            _lock_or_raise(cur, LOCK_LIMIT_SQL, [limit])
        except pg_errors.LockNotAvailable as exc:
            busy.add(limit)
            error = exc
    skipped = [b for b in bookings if of_layer.get(b.layer.pk, set()) & busy]
    _skip_locked(cur, skipped, result, error, what=f"limit {', '.join(sorted(busy))}")
    gone = {b.pk_proc for b in skipped}
    return gone | _lock_keys(cur, [b for b in bookings if b.pk_proc not in gone], result)


def _lock_keys(cur: psycopg.Cursor, bookings: Sequence[Booking], result: BatchResult) -> set[str]:
    """Lock the batch's keys (accounting.keylocks); returns pk_proc of the shows skipped.

    Its own statement, before any write: the batch's later statements see every flip or move it
    waited for, and none can commit under them until COMMIT (the booking's owner, generation
    and keys checks rely on it). Show, job and layer rows FOR KEY SHARE, hosts FOR NO KEY
    UPDATE (the batch takes their cores next). A row a flip or move holds costs only the shows
    whose bookings need it, for this cycle.
    """
    if not bookings or _try_params(cur, LOCK_KEYS_OF_BOOKINGS_SQL, _key_params(bookings)):
        return set()
    skipped: list[Booking] = []
    error: BaseException | None = None
    for show in sorted({b.layer.job.show for b in bookings}):
        group = [b for b in bookings if b.layer.job.show == show]
        try:
            _lock_params_or_raise(cur, LOCK_KEYS_OF_BOOKINGS_SQL, _key_params(group))
        except pg_errors.LockNotAvailable as exc:
            skipped.extend(group)
            error = exc
    _skip_locked(cur, skipped, result, error, what="a key row a flip or move holds")
    return {b.pk_proc for b in skipped}


def _key_params(group: Sequence[Booking]) -> dict[str, list[str]]:
    return {
        "show": [b.layer.job.show for b in group],
        "job": [b.layer.job.pk for b in group],
        "layer": [b.layer.pk for b in group],
        "host": [b.host.pk for b in group],
    }


def _try_params(cur: psycopg.Cursor, sql: str, params: dict[str, Any]) -> bool:
    try:
        _lock_params_or_raise(cur, sql, params)
    except pg_errors.LockNotAvailable:
        return False
    return True


def _lock_params_or_raise(cur: psycopg.Cursor, sql: str, params: Any) -> None:
    cur.execute("SAVEPOINT dispatch_lock")
    try:
        cur.execute(sql, params)
    except BaseException:
        cur.execute("ROLLBACK TO SAVEPOINT dispatch_lock")
        cur.execute("RELEASE SAVEPOINT dispatch_lock")
        raise
    cur.execute("RELEASE SAVEPOINT dispatch_lock")


def _try_locks(cur: psycopg.Cursor, sql: str, keys: list[str]) -> bool:
    try:
        _lock_or_raise(cur, sql, keys)
    except pg_errors.LockNotAvailable:
        return False
    return True


def _lock_or_raise(cur: psycopg.Cursor, sql: str, keys: list[str]) -> None:
    _lock_params_or_raise(cur, sql, (keys,))


def _skip_locked(
    cur: psycopg.Cursor, skipped: Sequence[Booking], result: BatchResult, exc: BaseException | None, what: str
) -> None:
    """Reject `skipped` as REJECT_LOCKED and name, per show, the session holding the lock."""
    if not skipped:
        return
    shows = sorted({b.layer.job.show for b in skipped})
    named = acct_blockers.for_lock_error(cur.connection, exc, shows) if exc is not None else {}
    for show in shows:
        result.blockers[show] = named.get(show, [])
        logger.warning(
            "dispatch: show %s skipped this cycle: a lock (%s) stayed held past %.2fs: %s",
            show, what, conf.booking_lock_wait(), acct_blockers.describe(result.blockers[show]),
        )  # fmt: skip
    result.rejected.extend((b, REJECT_LOCKED) for b in skipped)


def _write_locked_apart(cur: psycopg.Cursor, group: list[Booking], result: BatchResult, extra: dict[str, Any]) -> None:
    """The group in one statement; if a lock wait gave up, again one show at a time.

    Show by show in the order of their database-accounting locks (the triggers take them in
    that order), each under its own savepoint: the show whose lock another session holds is
    skipped (REJECT_LOCKED) and the others are written. Nothing of a skipped show reaches the
    database, so the caller rolls its Store bookings back exactly.
    """
    try:
        _write_group(cur, group, result, extra, lock_errors=True)
        return
    except pg_errors.LockNotAvailable:
        pass
    cur.execute(SHOWS_IN_LOCK_ORDER_SQL, (sorted({b.layer.job.show for b in group}),))
    for (show,) in cur.fetchall():
        _write_group(cur, [b for b in group if b.layer.job.show == show], result, extra)


def _write_group(
    cur: psycopg.Cursor,
    group: list[Booking],
    result: BatchResult,
    extra: dict[str, Any],
    *,
    lock_errors: bool = False,
) -> None:
    """Write one group under a savepoint, dropping bookings whose guard fails, bisecting on errors."""
    pending = group
    for _attempt in range(_MAX_GROUP_ATTEMPTS):
        if not pending:
            return
        cur.execute("SAVEPOINT dispatch_group")
        try:
            cur.execute(BOOK_SQL, _params(pending, extra))
            rows = cur.fetchall()
            cur.execute(RECOUNT_NOW_SQL)
        except psycopg.Error as exc:
            _undo_savepoint(cur)
            if isinstance(exc, pg_errors.LockNotAvailable):
                if lock_errors:
                    raise  # nothing of this group was kept: the caller writes it show by show
                _skip_locked(cur, pending, result, exc, what="its accounting lock or a row it books")
                return
            if exc.sqlstate in _RETRY_SQLSTATES:
                logger.info("dispatch: %s on a group of %d bookings; writing it again", exc.sqlstate, len(pending))
                continue
            if isinstance(exc, psycopg.OperationalError) and not isinstance(exc, pg_errors.QueryCanceled):
                raise
            if len(pending) == 1:
                table = _CAP_TABLES.get(getattr(exc.diag, "constraint_name", None) or "", REJECT_DATABASE)
                message = exc.diag.message_primary or str(exc)
                if table == REJECT_DATABASE:
                    logger.warning("dispatch: frame %s rejected by the database: %s", pending[0].frame.pk, message)
                else:
                    logger.debug("dispatch: frame %s rejected by the %s cap: %s", pending[0].frame.pk, table, message)
                result.rejected.append((pending[0], table))
                return
            half = len(pending) // 2
            _write_group(cur, pending[:half], result, extra)
            _write_group(cur, pending[half:], result, extra)
            return
        started: dict[str, int] = {}
        with_proc: set[str] = set()
        host_rows = []
        refused: dict[str, str] = {}
        keys_moved: set[str] = set()
        for kind, key, a, b, c, d in rows:
            if kind == "f":
                started[key] = a
            elif kind == "p":
                with_proc.add(key)
            elif kind == "h":
                host_rows.append((key, a, b, c, d))
            else:
                refused[key] = REJECT_MANAGED_FLIP if not a else REJECT_GENERATION if not c else REJECT_KEYS
                if a and not b:
                    keys_moved.add(key)
        ok_hosts = {r[0] for r in host_rows}
        keep: list[Booking] = []
        redo = False
        for bk in pending:
            pk_frame = bk.frame.pk
            if pk_frame not in started:
                # Not started, so nothing of it was written: the statement stays as it is.
                table = refused.get(pk_frame, REJECT_FRAME)
                result.rejected.append((bk, table))
                if pk_frame in keys_moved:
                    result.failed_hosts.add(bk.host.pk)  # the view's allocation is stale: reload it
            elif pk_frame not in with_proc:
                result.rejected.append((bk, REJECT_PROC))
                redo = True
            elif bk.host.pk not in ok_hosts:
                result.rejected.append((bk, REJECT_HOST))
                result.failed_hosts.add(bk.host.pk)
                redo = True
            else:
                keep.append(bk)
        if not redo:
            cur.execute("RELEASE SAVEPOINT dispatch_group")
            for bk in keep:
                bk.post_version = started[bk.frame.pk]
            result.written.extend(keep)
            result.host_rows.extend(host_rows)
            return
        # A started frame without its proc, or a host whose guard failed: undo the statement
        # and write the others again.
        _undo_savepoint(cur)
        pending = keep
    for bk in pending:
        result.rejected.append((bk, REJECT_DATABASE))
    logger.warning("dispatch: gave up on %d bookings after %d attempts", len(pending), _MAX_GROUP_ATTEMPTS)


@dataclass
class CompensationResult:
    xid: int | None = None
    procs_deleted: set[str] = field(default_factory=set)
    frames_cleared: dict[str, int] = field(default_factory=dict)
    host_rows: list[tuple[Any, ...]] = field(default_factory=list)


def compensate(conn: psycopg.Connection, bookings: Sequence[Booking]) -> CompensationResult:
    """Undo committed bookings whose launch failed: proc, then host, then frame, in one transaction.

    The proc delete sends an ordinary release, with the keys and amounts the proc has NOW
    (an outside writer may have moved or resized it since it was booked), and the caller
    confirms the booking instead of rolling it back: the release takes it out of the Store,
    whoever deleted the proc. Idempotent: run again after an unknown outcome, it deletes
    nothing twice and gives no host anything twice.
    """
    out = CompensationResult()
    if not bookings:
        return out
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        try:
            # Limits, then the key rows, as every proc writer of cuesched takes them.
            keys = {"proc": [b.pk_proc for b in bookings]}
            cur.execute(LOCK_LIMITS_OF_PROCS_SQL, keys)
            cur.execute(LOCK_KEYS_OF_PROCS_SQL, keys)
            cur.execute("SELECT pg_current_xact_id()::text::bigint")
            row = cur.fetchone()
            out.xid = None if row is None else row[0]
            cur.execute(COMPENSATE_DELETE_PROCS_SQL, ([b.pk_proc for b in bookings],))
            deleted = cur.fetchall()
            out.procs_deleted = {r[0] for r in deleted}
            if deleted:
                cur.execute(HOST_GIVE_BACK_SQL, _give_back_params(deleted))
                out.host_rows = cur.fetchall()
            cur.execute(
                COMPENSATE_CLEAR_FRAMES_SQL,
                ([b.frame.pk for b in bookings], [b.post_version or 0 for b in bookings]),
            )
            out.frames_cleared = dict(cur.fetchall())
        except BaseException:
            _rollback_quietly(conn)
            raise
        try:
            cur.execute("COMMIT")
        except psycopg.OperationalError as exc:
            raise AmbiguousCompensationError(out, exc) from exc
    for b in bookings:
        if b.pk_proc not in out.procs_deleted:
            logger.warning("compensation: proc %s of frame %s was already gone", b.pk_proc, b.frame.pk)
        elif b.frame.pk not in out.frames_cleared:
            logger.warning("compensation: frame %s was no longer RUNNING at version %s", b.frame.pk, b.post_version)
    return out


def _give_back_params(rows: Sequence[Sequence[Any]]) -> tuple[list[Any], ...]:
    """(pk_host, cores, mem, gpus, gpu_mem) rows -> the five arrays of HOST_GIVE_BACK_SQL."""
    return (
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
        [r[4] for r in rows],
        [r[5] for r in rows],
    )
