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
   job.int_max_retries) or when requeued (lost host), else DEAD; a failed run of an auto-eat
   job (job.b_autoeat) is EATEN instead, never retried, as Cuebot's, and what waits for it is
   released as for an operator's eat;
   a run whose proc carries a kill mark (`proc.str_kill`, see dispatch.engine.kills) and did
   not exit 0 is recorded as killed, whoever reports its end (its agent, RQD, the lost-host
   sweep, an orphan check): exit 301 (no retry counted, no failure), the frame EATEN for a
   job kill, WAITING for a frame kill. A memory kill's mark (`MEMORY`, dispatch.engine.memory:
   the host ran low and this run was furthest over its reservation) is a memory failure
   instead: exit 33, the layer's memory raised and the frame requeued with no retry charged
   (see the memory-failure classification below). The mark is read from the deleted row itself
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

from accounting.keylocks import LOCK_KEYS_OF_PROCS_SQL
from dispatch import cuebot_usage
from dispatch.engine.booking import HOST_GIVE_BACK_TEMPLATE, LOCK_LIMITS_OF_PROCS_SQL
from dispatch.engine.kill_marks import KILL_FRAME, KILL_JOB, KILL_LLU, KILL_MEMORY, KILL_NIMBY, KILL_TIMEOUT
from dispatch.engine.placement import ALL, Shard, in_shard, shard_params

logger = logging.getLogger(__name__)

EXIT_STATUS_DOWN_HOST = 399  # Cuebot's status for a frame whose host went away (no retry counted)
EXIT_STATUS_KILLED = 301

EXIT_STATUS_MEMORY_FAILURE = 33  # Cuebot's Dispatcher.EXIT_STATUS_MEMORY_FAILURE, recorded for every memory failure
EXIT_STATUS_DOCKER_MEMORY_FAILURE = 137  # Cuebot's DOCKER_EXIT_STATUS_MEMORY_FAILURE (an exit status, not a signal)
EXIT_STATUS_NIMBY = 286  # RQD's EXITSTATUS_FOR_NIMBY_KILL, Cuebot's SKIP_RETRY: requeued, no retry charged
SIGKILL = 9
SIGTERM = 15
DEFAULT_MEMORY_INCREASE_KB = 2 * 1024 * 1024  # Cuebot's CueUtil.GB2, when no service says otherwise

# How a run ended, when not as its exit status alone says (the frame's life, issue 29). Read from
# the raw report (exit status and signal as RQD or the agent sent them, never a folded 128 +
# signal) and from the deleted proc (its kill mark, its last reported RSS and reservation):
# - a kill the scheduler marked (dispatch.engine.kills: JOB, FRAME, TIMEOUT, LLU, NIMBY) is that
#   kill, never a memory failure, whatever the run's exit says; except MEMORY, the low-memory
#   kill, which is a memory failure by design;
# - exit status 286 (RQD's NIMBY kill): NIMBY;
# - Cuebot's memory failures (FrameCompleteHandler.isMemoryFailure: exit status 33, exit signal
#   33, exit status 137) and ours: killed by signal 9, which the scheduler did not send, with its
#   last reported RSS at or over its reservation (the kernel's OOM killer, a cgroup limit);
# - any other kill by signal 9 or 15 the scheduler did not send, on a host whose RQD runs its
#   NIMBY (`Completion.nimby`): NIMBY. RQD 1.37 kills its frames for a NIMBY lock and reports
#   their ends before it sets its lock flag, so those reports carry neither exit 286 nor the lock;
#   a stray kill on such a workstation (its owner's `kill`) gets a free retry, never a lost one;
# - a run that exited 0, or a requeue (lost host), is none of these.
CAUSE_JOB, CAUSE_FRAME, CAUSE_TIMEOUT, CAUSE_LLU = KILL_JOB, KILL_FRAME, KILL_TIMEOUT, KILL_LLU
CAUSE_NIMBY, CAUSE_MEMORY = KILL_NIMBY, KILL_MEMORY
CAUSE_SQL = f"""CASE
    WHEN g.exit_status = 0 AND g.exit_signal = 0 THEN NULL
    WHEN g.kill IS NOT NULL THEN g.kill
    WHEN g.requeue THEN NULL
    WHEN g.exit_status = {EXIT_STATUS_NIMBY} THEN '{CAUSE_NIMBY}'
    WHEN g.exit_status IN ({EXIT_STATUS_MEMORY_FAILURE}, {EXIT_STATUS_DOCKER_MEMORY_FAILURE})
      OR g.exit_signal = {EXIT_STATUS_MEMORY_FAILURE}
      OR (g.exit_signal = {SIGKILL} AND g.int_mem_used > 0 AND g.int_mem_used >= g.int_mem_reserved)
      THEN '{CAUSE_MEMORY}'
    WHEN g.nimby AND g.exit_signal IN ({SIGKILL}, {SIGTERM}) THEN '{CAUSE_NIMBY}'
  END"""
# frame.str_reason: why the run ended as it did, when its exit status alone does not say it; NULL
# for an ordinary end. A memory failure's full reason is written after the layer's memory is
# raised (`_raise_memory`); this is its placeholder.
# An auto-eat job's eaten failure says so too: an EATEN frame is otherwise an operator's eat (or a kill's).
REASON_SQL = f"""CASE
    WHEN t.cause = '{CAUSE_TIMEOUT}' THEN format(
      'timeout: killed after running past its layer''s timeout of %%s min; %%s',
      (SELECT l.int_timeout FROM layer l WHERE l.pk_layer = t.pk_layer),
      CASE WHEN t.autoeat THEN 'EATEN (auto-eat)' ELSE 'DEAD, not retried' END)
    WHEN t.cause = '{CAUSE_LLU}' THEN format(
      'timeout: killed, its log silent past its layer''s timeout_llu of %%s min; %%s',
      (SELECT l.int_timeout_llu FROM layer l WHERE l.pk_layer = t.pk_layer),
      CASE WHEN t.autoeat THEN 'EATEN (auto-eat)' ELSE 'DEAD, not retried' END)
    WHEN t.cause = '{CAUSE_NIMBY}'
      THEN 'NIMBY: its host was taken by its owner (NIMBY lock); requeued, no retry charged'
    WHEN t.cause = '{CAUSE_MEMORY}' THEN 'memory failure'
    WHEN t.cause IS NULL AND NOT t.ok AND NOT t.requeue AND t.autoeat
      THEN format('auto-eat: the run failed (exit status %%s); EATEN, not retried', t.exit_status)
  END"""

# Releases the procs (the DELETE fires the release / database-enforced triggers), gives the
# hosts their resources back and ends the frames of the procs it deleted. No plan here may
# depend on the planner's row estimates for proc or frame, which lag far behind our own churn
# (autovacuum may last have seen the proc table empty):
# - the procs are deleted by `pk_proc = ANY(...)`, an index condition, and each one's exit
#   status is looked up in a jsonb object keyed by proc. A join of proc with the input was
#   planned as a nested loop over the whole proc table once per completion: 8 ms for one
#   completion with 6,000 procs running, 0.3 s for a batch of 1,000;
# - each frame is found by primary key from the deleted proc (a LATERAL subquery, LIMIT 1: one
#   index probe per row, never flattened into a join; its job, for max retries and auto-eat, by
#   primary key in the same probe) with its RUNNING guard, and updated by
#   the exact row version seen (ctid). A join planned on the RUNNING estimate matched 1,000
#   completions against the whole frame table, quadratically.
COMPLETE_SQL = f"""
WITH gone AS (
  DELETE FROM proc p
  WHERE p.pk_proc = ANY(%(proc)b::text[])
  RETURNING p.pk_proc, p.pk_frame, p.pk_host, p.pk_job, p.pk_layer, p.pk_show, p.int_cores_reserved,
            p.int_mem_reserved, p.int_gpus_reserved, p.int_gpu_mem_reserved, p.int_mem_used,
            (%(status)b::jsonb -> p.pk_proc ->> 0)::int AS exit_status,
            (%(status)b::jsonb -> p.pk_proc ->> 1)::bool AS requeue,
            COALESCE((%(status)b::jsonb -> p.pk_proc ->> 2)::int, 0) AS exit_signal,
            COALESCE((%(status)b::jsonb -> p.pk_proc ->> 3)::bool, false) AS nimby,
            p.str_kill AS kill,
            -- Not int_mem_used: booking puts a placeholder there (CUESCHED_PROC_MEM_USED_START).
            GREATEST(p.int_mem_max_used, COALESCE((%(status)b::jsonb -> p.pk_proc ->> 4)::bigint, 0)) AS max_rss,
            p.int_gpu_mem_max_used AS max_gpu
),
-- The run's max RSS raises its layer's and job's (Cuebot's layer_mem / job_mem), never lowers
-- them: the frame's own is written with its end below. Only a raise writes (and locks) a row; the
-- input is in key order, so concurrent raises of several rows take them in one order.
layer_max AS (
  UPDATE layer_mem t SET int_max_rss = GREATEST(t.int_max_rss, r.m), int_gpu_mem_max = GREATEST(t.int_gpu_mem_max, r.g)
  FROM (SELECT pk_layer, MAX(max_rss) AS m, MAX(max_gpu) AS g FROM gone GROUP BY pk_layer ORDER BY pk_layer) r
  WHERE t.pk_layer = r.pk_layer AND (t.int_max_rss < r.m OR t.int_gpu_mem_max < r.g)
),
job_max AS (
  UPDATE job_mem t SET int_max_rss = GREATEST(t.int_max_rss, r.m), int_gpu_mem_max = GREATEST(t.int_gpu_mem_max, r.g)
  FROM (SELECT pk_job, MAX(max_rss) AS m, MAX(max_gpu) AS g FROM gone GROUP BY pk_job ORDER BY pk_job) r
  WHERE t.pk_job = r.pk_job AND (t.int_max_rss < r.m OR t.int_gpu_mem_max < r.g)
),
back AS ({
    HOST_GIVE_BACK_TEMPLATE.format(
        source="(SELECT pk_host, int_cores_reserved AS c, int_mem_reserved AS m, int_gpus_reserved::bigint AS g, "
        "int_gpu_mem_reserved AS gm FROM gone) AS x"
    )
}),
classed AS (
  SELECT g.*, {CAUSE_SQL} AS cause FROM gone g
),
target AS MATERIALIZED (
  SELECT CASE WHEN g.cause = '{CAUSE_MEMORY}' THEN {EXIT_STATUS_MEMORY_FAILURE}
              WHEN g.cause = '{CAUSE_NIMBY}' THEN {EXIT_STATUS_NIMBY}
              WHEN g.cause IS NOT NULL THEN {EXIT_STATUS_KILLED}
              WHEN g.exit_signal > 0 THEN 128 + g.exit_signal
              ELSE g.exit_status END AS exit_status,
         g.exit_status = 0 AND g.exit_signal = 0 AS ok,
         g.requeue, g.cause, g.pk_layer, g.max_rss, x.fctid, x.max_retries, x.autoeat
  FROM classed g
  CROSS JOIN LATERAL (
    SELECT f.ctid AS fctid, j.int_max_retries AS max_retries, j.b_autoeat AS autoeat
    FROM frame f JOIN job j ON j.pk_job = f.pk_job
    WHERE f.pk_frame = g.pk_frame AND f.str_state = 'RUNNING'
    LIMIT 1
  ) x
),
-- The new state. Auto-eat (job.b_autoeat, Cuebot's determineFrameState): a failure of the run
-- itself, and a timeout, is EATEN, before any retry is counted; a kill, a requeue, a NIMBY kill and
-- a memory failure are not the frame's failure and end as for any job (a memory failure's frame
-- that no host can ever fit is EATEN by `_raise_memory` instead of DEAD). EATEN releases what waits
-- for the frame through the frame's statement trigger (frame_when_done_satisfy_depends), as an
-- operator's eat does, and counts in layer_stat / job_stat as one.
ended AS (
  UPDATE frame f
  SET str_state = CASE WHEN t.cause = '{CAUSE_JOB}' THEN 'EATEN'
                       WHEN t.cause IN ('{CAUSE_TIMEOUT}', '{CAUSE_LLU}') THEN
                         CASE WHEN t.autoeat THEN 'EATEN' ELSE 'DEAD' END
                       WHEN t.cause IS NOT NULL OR t.requeue THEN 'WAITING'
                       WHEN t.ok THEN 'SUCCEEDED'
                       WHEN t.autoeat THEN 'EATEN'
                       WHEN f.int_retries < t.max_retries THEN 'WAITING'
                       ELSE 'DEAD' END,
      int_exit_status = t.exit_status, ts_stopped = now(), ts_updated = now(), ts_last_run = now(),
      int_version = f.int_version + 1,
      -- This run's max RSS (its reports' peak, or its launcher's figure at the end): what the
      -- frame shows beside its reservation, succeeded or not.
      int_mem_max_used = t.max_rss,
      str_reason = {REASON_SQL}
  FROM target t
  WHERE f.ctid = t.fctid
  RETURNING f.pk_frame, f.str_state, f.int_exit_status, t.cause
)
SELECT 'p', pk_proc, pk_frame, pk_job, pk_host, int_mem_reserved, int_mem_used, exit_status::bigint,
       exit_signal::bigint, pk_layer, pk_show, kill
FROM gone
UNION ALL
SELECT 'f', pk_frame, str_state, cause, NULL, int_exit_status, NULL, NULL, NULL, NULL, NULL, NULL FROM ended
UNION ALL
SELECT 'h', pk_host, NULL, NULL, NULL, int_cores_idle, int_mem_idle, int_gpus_idle, int_gpu_mem_idle, NULL, NULL,
       NULL
FROM back
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
  AND {in_shard("p.pk_host")}
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
  AND {in_shard("p.pk_host")}
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
    job.int_max_retries (or is EATEN at once in an auto-eat job).

    `exit_status` and `exit_signal` are the raw report, as RQD or the agent sent them (a signal
    death: status 1 and the signal, as RQD reports it); the frame records 128 + signal for a
    signal death. Callers that know only a folded status pass it as `exit_status`. `nimby`: the
    run's host runs RQD's NIMBY (a signal kill the scheduler did not send is then its NIMBY kill).
    """

    pk_proc: str
    exit_status: int
    requeue: bool = False
    exit_signal: int = 0
    nimby: bool = False
    # The run's max RSS, KB, as its launcher measured it at the end (RQD's FrameCompleteReport,
    # the agent's peak sample, the simulated launcher's figure); 0: unknown. The frame, its
    # layer_mem and its job_mem keep the larger of it and what the run's reports recorded.
    max_rss: int = 0


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
    causes: dict[str, str] = field(default_factory=dict)  # pk_frame -> cause (CAUSE_*), when not an ordinary end


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
        "status": Jsonb(
            {c.pk_proc: [c.exit_status, c.requeue, c.exit_signal, c.nimby, max(0, c.max_rss)] for c in completions}
        ),
    }


# A memory failure's retry (Cuebot's FrameCompleteHandler.retryFrameWithRaisedMemory): the layer's
# min memory becomes the failed run's reservation plus the service's min_memory_increase (the
# show's override, else the service, else 2 GB), only if that is larger, and the memory optimizer
# is turned off for it (b_optimize), as Cuebot does, so nothing sizes it back down. The frame
# waits again, no retry charged (exit 33 is on booking's no-retry list), unless no host of the
# show's allocations has that much memory at all: then it is DEAD, with that reason (Cuebot would
# leave it WAITING, where nobody sees why it never books).
# Cuebot's getMemoryIncrease: the layer's first service, the show's override of it, else it.
SERVICE_INCREASE_SQL = """
SELECT COALESCE(
  (SELECT ss.int_min_memory_increase FROM show_service ss
   WHERE ss.pk_show = %(show)s AND ss.str_name = %(service)s LIMIT 1),
  (SELECT s.int_min_memory_increase FROM service s WHERE s.str_name = %(service)s LIMIT 1))
"""
LAYERS_OF_RUNS_SQL = "SELECT pk_layer, str_name, split_part(str_services, ',', 1) FROM layer WHERE pk_layer = ANY(%s)"
RAISE_LAYER_SQL = """
UPDATE layer SET int_mem_min = GREATEST(int_mem_min, %(mem)s), b_optimize = false
WHERE pk_layer = %(layer)s
RETURNING int_mem_min
"""
# The largest host of the show's allocations, whatever it runs now or its state: what could ever fit.
LARGEST_HOST_SQL = """
SELECT COALESCE(MAX(h.int_mem), 0) FROM host h
WHERE h.pk_alloc IN (SELECT sub.pk_alloc FROM subscription sub WHERE sub.pk_show = %s)
"""
MEMORY_REASON_SQL = "UPDATE frame SET str_reason = %(reason)s WHERE pk_frame = %(frame)s"
# DEAD, or EATEN for an auto-eat job (as Cuebot, no frame of one is left DEAD to hold the job).
MEMORY_DEAD_SQL = """
UPDATE frame f
SET str_state = CASE WHEN j.b_autoeat THEN 'EATEN' ELSE 'DEAD' END,
    str_reason = %(reason)s || CASE WHEN j.b_autoeat THEN '; EATEN (auto-eat)' ELSE '; DEAD' END,
    ts_updated = now(), int_version = f.int_version + 1
FROM job j
WHERE f.pk_frame = %(frame)s AND f.str_state = 'WAITING' AND j.pk_job = f.pk_job
RETURNING f.pk_frame, f.str_state, f.str_reason
"""


@dataclass(frozen=True, slots=True)
class RunEnd:
    """A released run as the completion statement returned it (memory KB, raw exit)."""

    pk_proc: str
    pk_frame: str
    pk_job: str
    pk_layer: str
    pk_show: str
    mem_reserved: int
    mem_used: int
    exit_status: int
    exit_signal: int
    kill: str | None = None


def _gb(kb: int) -> str:
    return f"{kb / (1024 * 1024):.1f} GB"


def memory_failure_how(run: RunEnd) -> str:
    """What made the run a memory failure, in the report's own terms."""
    if run.kill == CAUSE_MEMORY:
        return "killed by the scheduler for memory (its host ran low)"
    if run.exit_status in (EXIT_STATUS_MEMORY_FAILURE, EXIT_STATUS_DOCKER_MEMORY_FAILURE) and not run.exit_signal:
        return f"exit status {run.exit_status}"
    if run.exit_signal == EXIT_STATUS_MEMORY_FAILURE:
        return "exit signal 33"
    return f"killed by signal 9 at RSS {_gb(run.mem_used)}, at or over its reservation"


def memory_increase(cur: psycopg.Cursor[Any], service: str, pk_show: str) -> int:
    """KB to add to a memory-failed run's reservation: the show's service override, the service, else 2 GB.

    Both tables are on every database (Cuebot's, and cuesched's own since 0040_services_tables)."""
    if service:
        row = cur.execute(SERVICE_INCREASE_SQL, {"show": pk_show, "service": service}).fetchone()
        if row is not None and row[0] is not None and int(row[0]) > 0:
            return int(row[0])
    return DEFAULT_MEMORY_INCREASE_KB


def _raise_memory(cur: psycopg.Cursor[Any], runs: Sequence[RunEnd]) -> list[tuple[str, str]]:
    """Raise the memory of the memory-failed runs' layers and record why; returns the frames that
    no host can fit, with their new state (DEAD, EATEN for an auto-eat job)."""
    layers = {r[0]: (r[1], r[2]) for r in cur.execute(LAYERS_OF_RUNS_SQL, (sorted({r.pk_layer for r in runs}),))}
    largest: dict[str, int] = {}
    dead: list[tuple[str, str]] = []
    for run in sorted(runs, key=lambda r: (r.pk_layer, r.pk_frame)):  # one lock order on layer rows
        name, service = layers.get(run.pk_layer, ("?", ""))
        increase = memory_increase(cur, service, run.pk_show)
        wanted = run.mem_reserved + increase
        row = cur.execute(RAISE_LAYER_SQL, {"mem": wanted, "layer": run.pk_layer}).fetchone()
        now_min = int(row[0]) if row else wanted
        if run.pk_show not in largest:
            largest[run.pk_show] = int(cur.execute(LARGEST_HOST_SQL, (run.pk_show,)).fetchone()[0])
        how = memory_failure_how(run)
        if largest[run.pk_show] < now_min:
            reason = (
                f"memory failure ({how}, {_gb(run.mem_reserved)} reserved): layer {name} now needs "
                f"{_gb(now_min)}, more than any host of the show's allocations has (largest "
                f"{_gb(largest[run.pk_show])})"
            )
            row = cur.execute(MEMORY_DEAD_SQL, {"frame": run.pk_frame, "reason": reason}).fetchone()
            if row:
                dead.append((row[0], row[1]))
                reason = row[2]
            logger.warning("frame %s: %s", run.pk_frame, reason)
            continue
        reason = (
            f"memory failure ({how}, {_gb(run.mem_reserved)} reserved): layer {name} now reserves "
            f"{_gb(now_min)} (+{_gb(increase)}); retried with it, no retry charged"
        )
        cur.execute(MEMORY_REASON_SQL, {"frame": run.pk_frame, "reason": reason})
        logger.info("frame %s: %s", run.pk_frame, reason)
    return dead


def complete_in_transaction(cur: psycopg.Cursor[Any], completions: Sequence[Completion]) -> CompletionResult:
    """The completion statements on a cursor inside a transaction the caller owns and commits.

    For an action that releases procs as part of a larger change (a job kill). The cursor must
    bind parameters server-side (a psycopg cursor, not Django's), since the arrays go binary.
    """
    out = CompletionResult()
    if not completions:
        return out
    params = complete_params(completions)
    cur.execute(LOCK_LIMITS_OF_PROCS_SQL, params)
    # Then the procs' key rows (accounting.keylocks), hosts FOR NO KEY UPDATE, before the
    # statement that gives their cores back: a move of one of them waits for this transaction,
    # and this one never waits for a move midway while holding the host's KEY SHARE.
    cur.execute(LOCK_KEYS_OF_PROCS_SQL, params)
    cur.execute(COMPLETE_SQL, params)
    released: list[tuple[str, str, str]] = []  # (pk_proc, pk_frame, pk_job)
    runs: dict[str, RunEnd] = {}  # pk_frame -> the released run, for a memory failure's raise
    ended: dict[str, tuple[str, int]] = {}  # pk_frame -> (new state, recorded exit status)
    for kind, key, a, b, c, d, e, f, g, h, i, kill in cur.fetchall():
        if kind == "p":
            released.append((key, a, b))
            out.freed_mem[c] = out.freed_mem.get(c, 0) + d
            runs[a] = RunEnd(key, a, b, h, i, int(d), int(e or 0), int(f or 0), int(g or 0), kill)
        elif kind == "f":
            ended[key] = (a, int(d))
            if b is not None:
                out.causes[key] = b
        else:
            out.host_rows.append((key, d, e, f, g))
    memory = [runs[pk] for pk, cause in out.causes.items() if cause == CAUSE_MEMORY and pk in runs]
    if memory:
        for pk_frame, state in _raise_memory(cur, memory):
            ended[pk_frame] = (state, ended[pk_frame][1])
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


def find_lost_procs(conn: psycopg.Connection, timeout: float, shard: Shard = ALL) -> list[tuple[str, str, str]]:
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
