"""Frame completion: the release path, and lost hosts.

A completion is keyed by its proc, never by its frame: a proc that is already gone (the
frame was killed, its host declared lost, the row deleted by hand) makes the completion a
logged no-op, so nothing is released twice and a late report of an old run cannot touch
the frame's next run.

One transaction per batch of completions, two statements:
1. delete the procs (the release trigger emits `acct_release` for managed shows, the
   database-enforced triggers decrement the tables of the others: nothing else notifies),
   give their hosts the resources back (never above the host's total), and record the end
   of the frames whose proc was deleted: exit status, ts_stopped, version + 1, and the new
   state: SUCCEEDED on exit 0, WAITING while retries remain (int_retries <
   job.int_max_retries) or when requeued (lost host), else DEAD;
   a run whose proc carries a kill mark (`proc.str_kill`, see dispatch.engine.kills) and did
   not exit 0 is recorded as killed, whoever reports its end (its agent, RQD, the lost-host
   sweep, an orphan check): exit 301 (no retry counted, no failure), the frame EATEN for a
   job kill, WAITING for a frame kill. The mark is read from the deleted row itself
   (RETURNING), so a kill that committed while this statement waited for the proc's row lock
   is seen: the kill and the completion serialise on that row;
2. jobs that have no frame left to run (none WAITING, RUNNING, DEPEND or SETUP) become
   FINISHED.
`complete` runs them in a transaction of its own; `complete_in_transaction` inside the
caller's (an action that releases procs as part of a larger change).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from accounting.triggers import LOCK_KEYS_SHARED_SQL
from dispatch import cuebot_usage
from dispatch.engine.booking import HOST_GIVE_BACK_TEMPLATE
from dispatch.engine.placement import ALL, Shard, in_shard, shard_params

logger = logging.getLogger(__name__)

EXIT_STATUS_DOWN_HOST = 399  # Cuebot's status for a frame whose host went away (no retry counted)
EXIT_STATUS_KILLED = 301

# Releases the procs (the DELETE fires the release / database-enforced triggers), gives the
# hosts their resources back and ends the frames of the procs it deleted. No plan here may
# depend on the planner's row estimates for proc or frame, which lag far behind our own churn
# (autovacuum may last have seen the proc table empty):
# - the procs are deleted by `pk_proc = ANY(...)`, an index condition, and each one's exit
#   status is looked up in a jsonb object keyed by proc. A join of proc with the input was
#   planned as a nested loop over the whole proc table once per completion: 8 ms for one
#   completion with 6,000 procs running, 0.3 s for a batch of 1,000;
# - each frame is found by primary key from the deleted proc (a LATERAL subquery, LIMIT 1: one
#   index probe per row, never flattened into a join) with its RUNNING guard, and updated by
#   the exact row version seen (ctid). A join planned on the RUNNING estimate matched 1,000
#   completions against the whole frame table, quadratically.
COMPLETE_SQL = f"""
WITH gone AS (
  DELETE FROM proc p
  WHERE p.pk_proc = ANY(%(proc)b::text[])
  RETURNING p.pk_proc, p.pk_frame, p.pk_host, p.pk_job, p.int_cores_reserved, p.int_mem_reserved,
            p.int_gpus_reserved, p.int_gpu_mem_reserved,
            (%(status)b::jsonb -> p.pk_proc ->> 0)::int AS exit_status,
            (%(status)b::jsonb -> p.pk_proc ->> 1)::bool AS requeue,
            p.str_kill AS kill
),
back AS ({
    HOST_GIVE_BACK_TEMPLATE.format(
        source="(SELECT pk_host, int_cores_reserved AS c, int_mem_reserved AS m, int_gpus_reserved::bigint AS g, "
        "int_gpu_mem_reserved AS gm FROM gone) AS x"
    )
}),
target AS MATERIALIZED (
  SELECT CASE WHEN g.kill IS NOT NULL AND g.exit_status <> 0 THEN {EXIT_STATUS_KILLED} ELSE g.exit_status END
           AS exit_status,
         g.requeue, CASE WHEN g.exit_status <> 0 THEN g.kill END AS kill, x.fctid, x.max_retries
  FROM gone g
  CROSS JOIN LATERAL (
    SELECT f.ctid AS fctid, j.int_max_retries AS max_retries
    FROM frame f JOIN job j ON j.pk_job = f.pk_job
    WHERE f.pk_frame = g.pk_frame AND f.str_state = 'RUNNING'
    LIMIT 1
  ) x
),
ended AS (
  UPDATE frame f
  SET str_state = CASE WHEN t.kill = 'JOB' THEN 'EATEN'
                       WHEN t.kill IS NOT NULL OR t.requeue THEN 'WAITING'
                       WHEN t.exit_status = 0 THEN 'SUCCEEDED'
                       WHEN f.int_retries < t.max_retries THEN 'WAITING'
                       ELSE 'DEAD' END,
      int_exit_status = t.exit_status, ts_stopped = now(), ts_updated = now(), ts_last_run = now(),
      int_version = f.int_version + 1
  FROM target t
  WHERE f.ctid = t.fctid
  RETURNING f.pk_frame, f.str_state, f.int_exit_status
)
SELECT 'p', pk_proc, pk_frame, pk_job, pk_host, int_mem_reserved, NULL::bigint, NULL::bigint, NULL::bigint
FROM gone
UNION ALL
SELECT 'f', pk_frame, str_state, NULL, NULL, int_exit_status, NULL, NULL, NULL FROM ended
UNION ALL
SELECT 'h', pk_host, NULL, NULL, NULL, int_cores_idle, int_mem_idle, int_gpus_idle, int_gpu_mem_idle FROM back
"""

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

SHOWS_OF_PROCS_SQL = "SELECT pk_proc, pk_show FROM proc WHERE pk_proc = ANY(%s::text[])"

FINISH_JOBS_SQL = """
UPDATE job j SET str_state = 'FINISHED', ts_stopped = now(), ts_updated = now()
WHERE j.pk_job = ANY(%s::text[]) AND j.str_state = 'PENDING'
  AND NOT EXISTS (
    SELECT 1 FROM frame f
    WHERE f.pk_job = j.pk_job AND f.str_state IN ('WAITING', 'RUNNING', 'DEPEND', 'SETUP'))
RETURNING j.pk_job
"""

PROCS_OF_FRAMES_SQL = "SELECT pk_proc FROM proc WHERE pk_frame = ANY(%s::text[])"

LOST_PROCS_SQL = f"""
SELECT p.pk_proc, p.pk_frame, h.str_name
FROM proc p JOIN host_stat hs ON hs.pk_host = p.pk_host JOIN host h ON h.pk_host = p.pk_host
WHERE hs.ts_ping < now() - make_interval(secs => %(timeout)s) AND NOT p.b_local
  AND {in_shard('p.pk_host')}
"""


# Beside Cuebot (accounting.cuebot): Cuebot's orphan cleanup (ProcDaoJdbc.GET_ORPHANED_PROC_LIST)
# unbooks every proc whose ts_ping is over 300 s old. RQD's reports to Cuebot refresh it for frames
# RQD runs; for any other launcher nobody would, so the scheduler refreshes the procs of managed
# shows on hosts that are still alive by cuesched's own lost-host rule (a silent host's procs are
# released by the sweep instead, and then Cuebot may clean up what is left). Unmanaged shows'
# procs are Cuebot's and are left alone. ts_ping is no accounted column: the proc triggers leave
# at their first test.
PING_PROCS_SQL = f"""
UPDATE proc p SET ts_ping = now()
FROM host_stat hs, show s
WHERE hs.pk_host = p.pk_host AND s.pk_show = p.pk_show AND s.b_scheduler_managed AND NOT p.b_local
  AND hs.ts_ping >= now() - make_interval(secs => %(timeout)s)
  AND p.ts_ping < now() - make_interval(secs => %(older_than)s)
  AND {in_shard('p.pk_host')}
"""


def ping_procs(conn: psycopg.Connection, timeout: float, older_than: float, *, shard: Shard = ALL) -> int:
    """Refresh proc.ts_ping of managed shows' procs on live hosts; returns how many."""
    with conn.transaction():
        cur = conn.execute(PING_PROCS_SQL, {"timeout": timeout, "older_than": older_than, **shard_params(shard)})
        return cur.rowcount


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished run of a frame, as its launcher reports it.

    `requeue` puts the frame back to WAITING whatever the exit status and retry count (lost
    host, kill for a retry); otherwise exit 0 is SUCCEEDED and a failure retries until
    job.int_max_retries.
    """

    pk_proc: str
    exit_status: int
    requeue: bool = False


@dataclass
class CompletionResult:
    released: int = 0
    missing_procs: list[str] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)  # new frame state -> count
    finished_jobs: list[str] = field(default_factory=list)
    released_jobs: set[str] = field(default_factory=set)  # jobs that had a proc released
    host_rows: list[tuple[Any, ...]] = field(default_factory=list)
    freed_mem: dict[str, int] = field(default_factory=dict)  # KB per host
    killed: int = 0  # frames ended as killed (their proc carried a kill mark)


def complete(
    conn: psycopg.Connection, completions: Sequence[Completion], *, lock_wait: float | None = None
) -> CompletionResult:
    """Apply completions in one transaction on an autocommit connection (idempotent by proc).

    `lock_wait` (seconds) bounds every lock wait of the transaction: past it the whole batch
    fails with LockNotAvailable, nothing written (the dispatch loop then completes it show by
    show and keeps a held show's completions for later: booked meanwhile, high, never low).
    """
    if not completions:
        return CompletionResult()
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            if lock_wait is not None:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{max(1, int(lock_wait * 1000))}ms",))
            out = complete_in_transaction(cur, completions)
            if lock_wait is not None:
                # COMMIT's wait for the notification queue is no held show: the connection's timeout.
                cur.execute("SET LOCAL lock_timeout TO DEFAULT")
            cur.execute("COMMIT")
        except BaseException:
            if not conn.broken:
                try:
                    conn.execute("ROLLBACK")
                except psycopg.Error:
                    logger.debug("rollback after a failed completion batch failed too", exc_info=True)
            raise
    for pk in out.missing_procs:
        logger.info("completion: proc %s is already gone; nothing to release", pk)
    return out


def complete_params(completions: Sequence[Completion]) -> dict[str, Any]:
    """COMPLETE_SQL's parameters: the procs, and each one's (exit status, requeue) keyed by proc."""
    return {
        "proc": [c.pk_proc for c in completions],
        "status": Jsonb({c.pk_proc: [c.exit_status, c.requeue] for c in completions}),
    }


def complete_in_transaction(cur: psycopg.Cursor[Any], completions: Sequence[Completion]) -> CompletionResult:
    """The completion statements on a cursor inside a transaction the caller owns and commits.

    For an action that releases procs as part of a larger change (a job kill). The cursor must
    bind parameters server-side (a psycopg cursor, not Django's), since the arrays go binary.
    """
    out = CompletionResult()
    if not completions:
        return out
    # Before the statement locks any host row: a key move that took the accounting-keys lock
    # and then waited for one of those rows would otherwise deadlock with the proc trigger.
    cur.execute(LOCK_KEYS_SHARED_SQL)
    params = complete_params(completions)
    cur.execute(LOCK_LIMITS_OF_PROCS_SQL, params)
    cur.execute(COMPLETE_SQL, params)
    released: list[tuple[str, str, str]] = []  # (pk_proc, pk_frame, pk_job)
    ended: dict[str, tuple[str, int]] = {}  # pk_frame -> (new state, recorded exit status)
    for kind, key, a, b, c, d, e, f, g in cur.fetchall():
        if kind == "p":
            released.append((key, a, b))
            out.freed_mem[c] = out.freed_mem.get(c, 0) + d
        elif kind == "f":
            ended[key] = (a, int(d))
        else:
            out.host_rows.append((key, d, e, f, g))
    jobs_to_check: set[str] = set()
    usage: dict[str, int] = {}  # pk_frame -> exit status, of the frames ended here (once each)
    for pk_proc, pk_frame, job in released:
        out.released += 1
        out.released_jobs.add(job)
        end = ended.get(pk_frame)
        if end is None:
            logger.warning("completion: proc %s released, but its frame was not RUNNING", pk_proc)
            continue
        state, exit_status = end
        out.states[state] = out.states.get(state, 0) + 1
        usage.setdefault(pk_frame, exit_status)  # a killed run's usage is a kill's, not a failure's
        if exit_status == EXIT_STATUS_KILLED:
            out.killed += 1
        if state in ("SUCCEEDED", "DEAD", "EATEN"):
            jobs_to_check.add(job)
    if usage and cuebot_usage.has_cuebot_usage(cur):
        cuebot_usage.record_completions(cur, list(usage.items()))
    if jobs_to_check:
        cur.execute(FINISH_JOBS_SQL, (sorted(jobs_to_check),))
        out.finished_jobs = [r[0] for r in cur.fetchall()]
    gone = {r[0] for r in released}
    out.missing_procs = [c.pk_proc for c in completions if c.pk_proc not in gone]
    return out


def find_lost_procs(
    conn: psycopg.Connection, timeout: float, shard: Shard = ALL
) -> list[tuple[str, str, str]]:
    """(pk_proc, pk_frame, host name) of procs on hosts silent for longer than `timeout` seconds."""
    with conn.cursor() as cur:
        cur.execute(LOST_PROCS_SQL, {"timeout": timeout, **shard_params(shard)})
        return [tuple(r) for r in cur.fetchall()]


def release_lost_hosts(
    conn: psycopg.Connection,
    timeout: float,
    *,
    exclude: set[str] | None = None,
    shard: Shard = ALL,
    lock_wait: float | None = None,
) -> tuple[list[str], CompletionResult]:
    """Release the procs of lost hosts the same way as a completion, frames back to WAITING.

    `exclude`: procs another path is settling (a pending compensation) are left alone.
    Returns the released procs and the completion result.
    """
    lost = [row for row in find_lost_procs(conn, timeout, shard) if not exclude or row[0] not in exclude]
    if not lost:
        return [], CompletionResult()
    for pk_proc, pk_frame, host in lost:
        logger.warning("lost host %s: releasing proc %s of frame %s, frame back to WAITING", host, pk_proc, pk_frame)
    result = complete(
        conn, [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk, _f, _h in lost], lock_wait=lock_wait
    )
    return [row[0] for row in lost], result


def kill_frames(conn: psycopg.Connection, frames: Sequence[str]) -> CompletionResult:
    """Release the running frames' procs now, the completion way, frames back to WAITING (exit 301).

    Not a kill (a kill marks the procs and waits for the runs' ends: dispatch.engine.kills): a
    forced release for runs known to run nowhere, as the stress harness uses it for the frames a
    SIGKILLed scheduler's simulated launcher took with it. An agent whose proc is released this
    way stops the process group; a later report of the run is a no-op. No retry is counted (301
    is on the no-retry list).
    """
    with conn.cursor() as cur:
        cur.execute(PROCS_OF_FRAMES_SQL, (list(frames),))
        procs = [row[0] for row in cur.fetchall()]
    return complete(conn, [Completion(pk, EXIT_STATUS_KILLED, requeue=True) for pk in procs])
