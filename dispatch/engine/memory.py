"""Memory that follows use: a running frame's reservation grows to its RSS, and a host about to run
out of memory loses the frame furthest over its reservation first (issue 28).

A frame books its layer's minimum memory. What it really uses is measured on the host, for the
frame's whole process tree: RQD reports it (`ReportStatus`, through dispatch.hosts.rqd_gateway),
and cuesched's own agents measure it with psutil every `CUESCHED_AGENT_MEMORY_INTERVAL` seconds
(dispatch.hosts.agent). Each report comes here (`follow_use`), in one transaction on the
reporter's connection:

1. the use is recorded on the procs (`int_mem_used`, `int_mem_max_used`, ...), never on the
   RUNNING frame row (the completion finds that row by its version);
2. the host row is locked FOR NO KEY UPDATE, before the proc rows are written (the order a
   completion takes them: a report that wrote its procs first deadlocked with the completion of
   a frame it listed; not FOR UPDATE, which waits for the KEY SHARE every proc writer holds on its
   hosts), a proc another transaction holds is skipped, and the host's free memory estimated:
   the smaller of what the host reported (`host_stat.int_mem_free`) and its memory less the RSS
   of all its frames. The second stands in for the first where the host
   is a share of a bigger machine (an agent or RQD started with a memory override);
3. **a memory kill**: when that estimate is under `CUESCHED_MEMORY_KILL_FREE_FRACTION` of the
   host's memory, the frame furthest over its reservation (RSS - reserved, largest; only frames
   over it: one within what it reserved is not the cause) is marked for a kill,
   `proc.str_kill = 'MEMORY'`, through the existing kill path (dispatch.engine.kills: the
   scheduler's kill sender sends RQD its KillRunningFrame, an agent's kill poll ends the process
   group). Its completion is recorded as a memory failure: exit 33 (Cuebot's
   `Dispatcher.EXIT_STATUS_MEMORY_FAILURE`), a failure like any other (a retry counted; the frame
   goes WAITING while retries remain, else DEAD), whatever status the killed process exited
   with. No reservation grows in a report that kills;
4. otherwise **growth**: a frame whose RSS passed its reservation gets a reservation of exactly
   its RSS (no headroom; it never shrinks while the frame runs), as Cuebot's
   `ProcDaoJdbc.increaseReservedMemory`. The memory comes from the host's idle memory
   (`int_mem - SUM(reserved)`, recounted under the host's lock), or else from under-used frames
   of the same host (a frame that reserved more than its own peak RSS gives up the difference,
   largest first), as Cuebot's `balanceUnderUtilizedProcs`; when even that is not enough nothing
   changes, and the frame runs on over its reservation (the next report tries again, and the
   kill above catches it if the host runs low). Donors shrink in one statement, growers grow in
   the next, and the host's idle memory follows in the same transaction (the host memory
   ledger, accounting.host_memory, recounts it at commit; beside Cuebot its
   upgrade_proc_memory_usage trigger moves it too).

Where this differs from Cuebot (`HostReportHandler.handleMemoryReservations` / `killProcForMemory`):
Cuebot kills when the host's physical memory is over 90 % used AND its swap over 5 % used
(`dispatcher.oom_max_safe_used_physical_memory_threshold`, `..._swap_memory_threshold`), the
frames using the most swap first. A host without swap (most render nodes in containers, and
this project's CI) never meets the swap condition, so the kernel's OOM killer picks the victim.
cuesched looks at physical memory only, at the same 10 % free by default, and picks the frame
furthest over its reservation, which is the one that broke the ledger's promise. Cuebot's donor
floor is the layer's max RSS across its frames (`layer_mem`); cuesched keeps layer_mem too (each
report raises it right after its transaction, `RAISE_MAX_SQL`) but uses the donor's own peak.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg

from dispatch import conf
from dispatch.engine import kills
from dispatch.engine.completion import EXIT_STATUS_MEMORY_FAILURE

logger = logging.getLogger(__name__)

KILL_MEMORY = kills.KILL_MEMORY
# What RQD is sent with a frame, as Cuebot's DispatchFrame.setMinMemory: multiples of the memory
# the frame booked (Dispatcher.SOFT_MEMORY_MULTIPLIER, HARD_MEMORY_MULTIPLIER).
SOFT_MEMORY_MULTIPLIER = 1.6
HARD_MEMORY_MULTIPLIER = 2.0


def soft_memory_limit(reserved_kb: int) -> int:
    return int(reserved_kb * SOFT_MEMORY_MULTIPLIER)


def hard_memory_limit(reserved_kb: int) -> int:
    return int(reserved_kb * HARD_MEMORY_MULTIPLIER)


@dataclass(frozen=True, slots=True)
class Use:
    """One running frame's measured use, KB, as its host reports it."""

    pk_proc: str
    rss: int
    max_rss: int = 0
    vsize: int = 0
    max_vsize: int = 0
    gpu_mem: int = 0
    max_gpu_mem: int = 0


@dataclass
class FollowResult:
    recorded: int = 0  # procs of the host whose use was written
    grown: dict[str, int] = field(default_factory=dict)  # pk_proc -> its new reservation, KB
    taken: dict[str, int] = field(default_factory=dict)  # pk_proc of an under-used frame -> KB it gave up
    killed: str | None = None  # pk_proc marked for a memory kill
    reason: str | None = None


# The host first, FOR NO KEY UPDATE, as every scheduler transaction on a host's procs takes it
# (a completion, a booking, a kill's release: accounting.keylocks) before any proc: a report that
# wrote its procs first and then waited for the host deadlocked with a completion holding the
# host and deleting one of them. Not FOR UPDATE: every proc writer holds its hosts FOR KEY SHARE.
LOCK_HOST_SQL = "SELECT 1 FROM host WHERE pk_host = %s FOR NO KEY UPDATE"
# The use on the procs, returning what their layers' and jobs' max RSS (and GPU memory) needs. A
# proc another transaction holds is skipped, not waited for (the host is held by now): it is
# being deleted, or marked for a kill by a writer that may come for the host next; the next
# report records its use.
RECORD_SQL = """
UPDATE proc p SET int_mem_used = m.rss, int_mem_max_used = GREATEST(p.int_mem_max_used, m.max_rss, m.rss),
  int_virt_used = m.vsize, int_virt_max_used = GREATEST(p.int_virt_max_used, m.max_vsize),
  int_gpu_mem_used = m.gpu, int_gpu_mem_max_used = GREATEST(p.int_gpu_mem_max_used, m.max_gpu), ts_ping = now()
FROM unnest(%(proc)s::text[], %(rss)s::bigint[], %(max_rss)s::bigint[], %(vsize)s::bigint[],
            %(max_vsize)s::bigint[], %(gpu)s::bigint[], %(max_gpu)s::bigint[])
     AS m(pk_proc, rss, max_rss, vsize, max_vsize, gpu, max_gpu)
WHERE p.pk_proc = m.pk_proc AND p.pk_proc IN (
  SELECT q.pk_proc FROM proc q WHERE q.pk_proc = ANY(%(proc)s::text[]) AND q.pk_host = %(host)s
  ORDER BY q.pk_proc FOR UPDATE OF q SKIP LOCKED)
RETURNING p.pk_proc, p.pk_layer, p.pk_job, p.int_mem_max_used, p.int_gpu_mem_max_used
"""
# The max RSS of the reported procs' layers and jobs (Cuebot's layer_mem / job_mem, as its
# HostReportHandler raises them from each report), in a transaction of its own after the report's
# and never waiting for a row: a completion raises the same rows in the statement that gives its
# host its memory back, in an order PostgreSQL does not fix, so a report holding them while it
# waited for the host deadlocked with it. A row another writer holds is skipped: that writer is a
# completion or another report raising it too, and the proc keeps its own peak, which the next
# report or the frame's completion carries up. Only a raise writes a row.
RAISE_MAX_SQL = """
WITH m AS (
  SELECT * FROM unnest(%(layer)s::text[], %(job)s::text[], %(rss)s::bigint[], %(gpu)s::bigint[])
                AS m(pk_layer, pk_job, rss, gpu)
),
layer_max AS (
  UPDATE layer_mem t SET int_max_rss = GREATEST(t.int_max_rss, r.m), int_gpu_mem_max = GREATEST(t.int_gpu_mem_max, r.g)
  FROM (SELECT pk_layer, MAX(rss) AS m, MAX(gpu) AS g FROM m GROUP BY pk_layer) r
  WHERE t.pk_layer = r.pk_layer AND t.pk_layer_mem IN (
    SELECT l.pk_layer_mem FROM layer_mem l JOIN m ON m.pk_layer = l.pk_layer
    WHERE l.int_max_rss < m.rss OR l.int_gpu_mem_max < m.gpu FOR UPDATE OF l SKIP LOCKED)
)
UPDATE job_mem t SET int_max_rss = GREATEST(t.int_max_rss, r.m), int_gpu_mem_max = GREATEST(t.int_gpu_mem_max, r.g)
FROM (SELECT pk_job, MAX(rss) AS m, MAX(gpu) AS g FROM m GROUP BY pk_job) r
WHERE t.pk_job = r.pk_job AND t.pk_job_mem IN (
  SELECT j.pk_job_mem FROM job_mem j JOIN m ON m.pk_job = j.pk_job
  WHERE j.int_max_rss < m.rss OR j.int_gpu_mem_max < m.gpu FOR UPDATE OF j SKIP LOCKED)
"""
HOST_SQL = """
SELECT h.int_mem, hs.int_mem_free, h.str_name,
       COALESCE((SELECT SUM(p.int_mem_reserved) FROM proc p WHERE p.pk_host = h.pk_host), 0)::bigint,
       COALESCE((SELECT SUM(p.int_mem_used) FROM proc p WHERE p.pk_host = h.pk_host), 0)::bigint
FROM host h LEFT JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE h.pk_host = %s FOR NO KEY UPDATE OF h
"""
# The host's frames this report may change: a proc a completion or a kill holds is left alone
# (it is leaving, or it is being written), so this never waits for a proc while it holds the host.
PROCS_SQL = f"""
SELECT p.pk_proc, p.int_mem_reserved, p.int_mem_used, p.int_mem_max_used, p.ts_kill IS NOT NULL, p.b_local,
       p.str_kill IS NOT DISTINCT FROM '{KILL_MEMORY}'
FROM proc p WHERE p.pk_host = %s ORDER BY p.pk_proc FOR UPDATE OF p SKIP LOCKED
"""
MARK_MEMORY_SQL = f"""
UPDATE proc SET ts_kill = now(), str_kill = '{KILL_MEMORY}'
WHERE pk_proc = %s AND ts_kill IS NULL
RETURNING pk_frame
"""
SET_RESERVED_SQL = """
UPDATE proc p SET int_mem_reserved = m.r
FROM unnest(%(proc)s::text[], %(reserved)s::bigint[]) AS m(pk_proc, r)
WHERE p.pk_proc = m.pk_proc
"""
# The dispatch loop's changed-hosts read finds the host by it, and sees its new idle memory.
TOUCH_HOST_SQL = "UPDATE host SET ts_last_updated = now() WHERE pk_host = %s"


@dataclass
class _Proc:
    pk: str
    reserved: int
    used: int
    peak: int
    killing: bool
    local: bool
    memory_kill: bool


def follow_use(
    conn: psycopg.Connection, pk_host: str, uses: Sequence[Use], *, kill_fraction: float | None = None
) -> FollowResult:
    """Record `uses`, then kill for memory or grow reservations, in one transaction (see the module)."""
    fraction = conf.memory_kill_free_fraction() if kill_fraction is None else kill_fraction
    out = FollowResult()
    with conn.transaction(), conn.cursor() as cur:
        if uses:
            cur.execute(LOCK_HOST_SQL, (pk_host,))
            cur.execute(
                RECORD_SQL,
                {
                    "host": pk_host,
                    "proc": [u.pk_proc for u in uses],
                    "rss": [max(0, u.rss) for u in uses],
                    "max_rss": [max(0, u.max_rss) for u in uses],
                    "vsize": [max(0, u.vsize) for u in uses],
                    "max_vsize": [max(0, u.max_vsize) for u in uses],
                    "gpu": [max(0, u.gpu_mem) for u in uses],
                    "max_gpu": [max(0, u.max_gpu_mem) for u in uses],
                },
            )
            recorded = cur.fetchall()
            out.recorded = len(recorded)
        name = _kill_or_grow(cur, out, pk_host, fraction)
    if out.recorded:
        _, layers, jobs, rss, gpu = zip(*recorded, strict=True)
        conn.execute(RAISE_MAX_SQL, {"layer": list(layers), "job": list(jobs), "rss": list(rss), "gpu": list(gpu)})
    for pk, reserved in out.grown.items():
        logger.info("host %s: proc %s reservation grew to %d MB (its RSS)", name, pk, reserved // 1024)
    return out


def _kill_or_grow(cur: psycopg.Cursor, out: FollowResult, pk_host: str, fraction: float) -> str | None:
    """Under the host's lock: a memory kill, else reservations grown. Returns the host's name."""
    if not out.recorded:
        return None
    row = cur.execute(HOST_SQL, (pk_host,)).fetchone()
    if row is None:
        return None
    mem, reported_free, name, reserved_sum, used_sum = row
    procs = [_Proc(*r) for r in cur.execute(PROCS_SQL, (pk_host,)).fetchall()]
    free = mem - used_sum if reported_free is None else min(reported_free, mem - used_sum)
    if free < fraction * mem:
        _kill(cur, out, procs, name, free, mem)
        return name
    _grow(cur, out, procs, mem - reserved_sum)
    if out.grown:
        cur.execute(TOUCH_HOST_SQL, (pk_host,))
    return name


def _kill(cur: psycopg.Cursor, out: FollowResult, procs: list[_Proc], host: str, free: int, mem: int) -> None:
    if any(p.memory_kill for p in procs):
        return  # one memory kill at a time: the frame already marked has not ended yet
    over = [p for p in procs if p.used > p.reserved and not p.killing and not p.local]
    if not over:
        logger.warning(
            "host %s: %d KB free of %d KB, but no frame is over its reservation: no memory kill", host, free, mem
        )
        return
    victim = max(over, key=lambda p: (p.used - p.reserved, p.pk))
    if cur.execute(MARK_MEMORY_SQL, (victim.pk,)).fetchone() is None:
        return
    cur.execute(kills.NOTIFY_SQL, (victim.pk,))
    out.killed = victim.pk
    out.reason = (
        f"memory: host {host} had {free // 1024} MB free of {mem // 1024} MB; this frame used "
        f"{victim.used // 1024} MB, {(victim.used - victim.reserved) // 1024} MB over its "
        f"{victim.reserved // 1024} MB reservation (exit {EXIT_STATUS_MEMORY_FAILURE})"
    )
    logger.warning("host %s: memory kill of proc %s: %s", host, victim.pk, out.reason)


def _grow(cur: psycopg.Cursor, out: FollowResult, procs: list[_Proc], idle: int) -> None:
    """Reservations up to RSS, from idle memory, else from under-used frames of the host."""
    growers = sorted(
        (p for p in procs if p.used > p.reserved and not p.killing and not p.local),
        key=lambda p: (p.reserved - p.used, p.pk),
    )
    shrunk: dict[str, int] = {}
    for target in growers:
        need = target.used - target.reserved
        if need > idle:
            donors = sorted(
                (
                    d
                    for d in procs
                    if d is not target and not d.killing and not d.local and d.peak > 0 and d.reserved > d.peak
                    and d.used <= d.reserved
                ),
                key=lambda d: (d.peak - d.reserved, d.pk),
            )  # fmt: skip
            if idle + sum(d.reserved - d.peak for d in donors) < need:
                continue  # not enough anywhere: it runs over its reservation, and the kill watches it
            for donor in donors:
                if need <= idle:
                    break
                give = min(donor.reserved - donor.peak, need - idle)
                donor.reserved -= give
                idle += give
                shrunk[donor.pk] = donor.reserved
                out.taken[donor.pk] = out.taken.get(donor.pk, 0) + give
        idle -= need
        target.reserved = target.used
        out.grown[target.pk] = target.reserved
    if shrunk:  # first: beside Cuebot its per-row trigger moves the host's idle memory as it goes
        cur.execute(SET_RESERVED_SQL, {"proc": list(shrunk), "reserved": list(shrunk.values())})
    if out.grown:
        cur.execute(SET_RESERVED_SQL, {"proc": list(out.grown), "reserved": list(out.grown.values())})
