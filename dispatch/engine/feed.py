"""Pending work: the WAITING frames worth trying this cycle, in dispatch order.

Two set-based queries per cycle, whatever the farm size: the layers of the first pending
jobs in dispatch order, then up to N WAITING frames per layer in frame dispatch order
(int_dispatch_order, int_layer_order), at most M in all, as the reference's layer/frame query
(§3.3, §3.4). Dispatch order (issue 19): the job's fair-share tier (booked cores / subscription
size, lowest first), then jobs below their int_min_cores, then job_resource.int_priority DESC,
then the oldest job, then layer dispatch order; with CUESCHED_FAIR_SHARE off, priority and age
alone. A job that cannot book this cycle (no subscription room where a free host fits one of
its layers) takes no place in the read, so it cannot starve the work below it.

Work a cap already blocks is left out before it costs anything:
- for shows the Store manages, the caller passes what the Store says is full (jobs at max
  cores, shows at burst on every subscription) and what is backing off (layers of sleeping
  clusters), since the database's `int_cores` columns of managed shows lag behind;
- for the others the database-enforced triggers keep `job_resource`, `folder_resource` and
  `subscription` `int_cores` exact in the booking transaction, so the query reads them.

Frame dependencies come in a later issue: `FRAME_READY` is the one place that says which
WAITING frame may start (today: no unmet dependency count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psycopg

from accounting.licences import limit_max_sql
from dispatch import conf
from dispatch.engine.placement import ALL, CENTI, Demand, HostRec, Shard, in_shard, parse_tags, shard_params

# The seam for frame dependencies: a WAITING frame is dispatchable when this holds.
FRAME_READY = "f.int_depend_count = 0"

# --- licence limits (issue 19): the layer-level part of the read, kept to these two fragments.
# A layer holding a limit that is full cannot book: not in the database's count (exact, every
# writer recounts it under the limit's lock), nor in the Store's (`skip_limits`, managed shows'
# bookings in flight on top). Such a layer takes no place in the read.
LAYER_LIMITS_COLUMN = (
    "ARRAY(SELECT ll.pk_limit_record FROM layer_limit ll WHERE ll.pk_layer = l.pk_layer"
    " ORDER BY ll.pk_limit_record) AS limits"
)
# The max is read as accounting.licences reads it (a NULL one, or a negative one on a Cuebot
# database, lets nothing run).
_MAX = limit_max_sql("r.int_max_value")
LAYER_LIMITS_FILTER = f"""NOT EXISTS (
    SELECT 1 FROM layer_limit ll JOIN limit_record r ON r.pk_limit_record = ll.pk_limit_record
    WHERE ll.pk_layer = l.pk_layer
      AND (r.pk_limit_record = ANY(%(skip_limits)s::text[])
           OR ({_MAX} >= 0 AND r.int_running >= {_MAX})))"""

# The top jobs first (job-level filters only, so the sort and the limit see one row per job),
# then their layers. Whether a layer has WAITING frames is left to the frame query, which
# probes the partial WAITING index per layer: layer_stat is rewritten on every frame state
# change and is not worth a scan here.
#
# Head-of-line (issue 19): a job takes a place in the limit only if it could book this cycle,
# as far as one set-based test can tell: some subscription of its show has a core of room
# (the Store's live values for managed shows, passed in; the trigger-kept int_cores for the
# others) on an allocation where a free host of the job's facility and OS carries one
# of a layer's tags and covers that layer's least cores, memory, GPUs and GPU memory, and the
# layer has a dispatchable WAITING frame. free_host is a summary of the caller's host view (per
# allocation, facility, OS and tag, the largest free value of each resource): it can only say
# yes too often (two resources on two different hosts), never no, so nothing bookable is left
# out. Without a host summary (check_hosts false) only the subscription room is tested.
#
# Fair share: the job's tier is the lowest booked/size among those subscriptions (OpenCue's
# float_tier; a size of 0 reads as infinitely above it). Shows below their size (tier < 1)
# come first, the furthest below first; then jobs below their int_min_cores; then priority.
_JOB_ORDER = (
    "(CASE WHEN %(fair_share)s THEN {tier} ELSE 0 END), (%(fair_share)s AND {below_min}) DESC, "
    "{priority} DESC, {started}, {job}"
)
_BELOW_MIN = "COALESCE(lj.cores, jr.int_cores) < jr.int_min_cores"
# A show the database says is managed but the caller's Store values do not cover (a flip in
# progress, a subscription newer than the loop's last read): its database counters lag, so
# its room is not judged here. The loop meets its jobs and handles the flip (skips them and
# asks for the seed); the Store decides the rest.
_ROOM_UNKNOWN = 1 << 40
# The least whole cores a frame of the layer books, in centicores (Demand.index_floor).
_LAYER_FLOOR = (
    "CASE WHEN l.b_threadable AND l.int_cores_min > 0 THEN GREATEST(100, l.int_cores_min / 100 * 100) ELSE 100 END"
)
_CTE_ORDER = _JOB_ORDER.format(
    tier="fit.tier", below_min=_BELOW_MIN, priority="jr.int_priority", started="j.ts_started", job="j.pk_job"
)
_OUTER_ORDER = _JOB_ORDER.format(
    tier="t.tier", below_min="t.below_min", priority="t.int_priority", started="t.ts_started", job="t.pk_job"
)
PENDING_LAYERS_SQL = f"""
WITH live_sub AS (
  SELECT sub.pk_show, sub.pk_alloc, sub.int_size, COALESCE(m.cores, sub.int_cores) AS cores,
         CASE WHEN m.pk_show IS NOT NULL THEN m.burst - m.cores
              WHEN sh.b_scheduler_managed THEN {_ROOM_UNKNOWN}
              ELSE sub.int_burst - sub.int_cores END AS room
  FROM subscription sub
  JOIN show sh ON sh.pk_show = sub.pk_show
  LEFT JOIN unnest(%(live_shows)s::text[], %(live_allocs)s::text[], %(live_cores)s::bigint[],
                   %(live_bursts)s::bigint[]) AS m(pk_show, pk_alloc, cores, burst)
    ON m.pk_show = sub.pk_show AND m.pk_alloc = sub.pk_alloc
), free_host AS (
  SELECT * FROM unnest(%(h_allocs)s::text[], %(h_facilities)s::text[], %(h_os)s::text[], %(h_tags)s::text[],
                       %(h_cores)s::bigint[], %(h_mem)s::bigint[], %(h_gpus)s::bigint[], %(h_gpu_mem)s::bigint[])
    AS h(pk_alloc, pk_facility, str_os, str_tag, cores, mem, gpus, gpu_mem)
), top_jobs AS (
  SELECT j.pk_job, j.str_name AS job_name, j.pk_show, s.str_name AS show_name, j.pk_folder,
         j.pk_facility, j.pk_dept, j.str_os, j.int_max_retries, s.b_scheduler_managed,
         jr.int_priority, jr.int_max_cores, jr.int_max_gpus, jr.int_cores, jr.int_gpus,
         fr.int_max_cores AS folder_max_cores, fr.int_max_gpus AS folder_max_gpus,
         fr.int_cores AS folder_cores, fr.int_gpus AS folder_gpus, j.ts_started,
         fit.tier, {_BELOW_MIN} AS below_min
  FROM job j
  JOIN job_stat js ON js.pk_job = j.pk_job
  JOIN job_resource jr ON jr.pk_job = j.pk_job
  JOIN show s ON s.pk_show = j.pk_show
  JOIN folder_resource fr ON fr.pk_folder = j.pk_folder
  LEFT JOIN unnest(%(live_jobs)s::text[], %(live_job_cores)s::bigint[]) AS lj(pk_job, cores)
    ON lj.pk_job = j.pk_job
  CROSS JOIN LATERAL (
    SELECT min(CASE WHEN su.int_size > 0 THEN su.cores::float8 / su.int_size ELSE 'Infinity'::float8 END) AS tier
    FROM live_sub su
    WHERE su.pk_show = j.pk_show AND su.room >= 100
      AND (NOT %(check_hosts)s OR EXISTS (
            SELECT 1 FROM layer l JOIN free_host h ON h.pk_alloc = su.pk_alloc
            WHERE l.pk_job = j.pk_job
              AND (l.ts_start_after IS NULL OR l.ts_start_after <= now())
              AND NOT (l.pk_layer = ANY(%(skip_layers)s::text[]))
              AND h.pk_facility = j.pk_facility AND (j.str_os IS NULL OR h.str_os = j.str_os)
              AND h.str_tag = ANY(string_to_array(replace(l.str_tags, ' ', ''), '|'))
              AND {_LAYER_FLOOR} <= LEAST(h.cores, su.room)
              AND l.int_mem_min <= h.mem AND l.int_gpus_min <= h.gpus AND l.int_gpu_mem_min <= h.gpu_mem
              AND EXISTS (SELECT 1 FROM frame f
                          WHERE f.pk_layer = l.pk_layer AND f.str_state = 'WAITING' AND {FRAME_READY})))
  ) fit
  WHERE j.str_state = 'PENDING' AND NOT j.b_paused AND s.b_active AND js.int_waiting_count > 0
    -- Cuebot's flags, honoured as their names say (Cuebot's own HAS_PENDING_JOBS requires
    -- b_auto_book; a paused show, or one with booking or dispatch disabled, books nothing new).
    AND j.b_auto_book AND NOT s.b_paused AND s.b_booking_enabled AND s.b_dispatch_enabled
    AND (s.b_scheduler_managed OR NOT %(managed_only)s)
    AND NOT (j.pk_job = ANY(%(skip_jobs)s::text[]))
    AND {in_shard("j.pk_job")}
    AND NOT (j.pk_show = ANY(%(skip_shows)s::text[]))
    AND NOT (j.pk_folder = ANY(%(skip_folders)s::text[]))
    -- Some subscription with room (and, with check_hosts, a free host that fits) on one allocation.
    AND fit.tier IS NOT NULL
    -- Unmanaged shows: a core of room left on the job and its folder (the trigger-kept totals
    -- are live for them).
    AND (s.b_scheduler_managed OR (
          (jr.int_max_cores < 0 OR jr.int_max_cores - jr.int_cores >= 100)
      AND (fr.int_max_cores < 0 OR fr.int_max_cores - fr.int_cores >= 100)))
    -- A job whose every layer backs off does not take a place in the limit.
    AND (cardinality(%(skip_layers)s::text[]) = 0 OR EXISTS (
          SELECT 1 FROM layer l WHERE l.pk_job = j.pk_job AND NOT (l.pk_layer = ANY(%(skip_layers)s::text[]))))
  ORDER BY {_CTE_ORDER}
  LIMIT %(max_jobs)s
)
SELECT t.pk_job, t.job_name, t.pk_show, t.show_name, t.pk_folder, t.pk_facility, t.pk_dept, t.str_os,
       t.int_max_retries, t.b_scheduler_managed, t.int_priority, t.int_max_cores, t.int_max_gpus,
       t.int_cores, t.int_gpus, t.folder_max_cores, t.folder_max_gpus, t.folder_cores, t.folder_gpus,
       l.pk_layer, l.str_name, l.str_cmd, l.str_range, l.int_chunk_size, l.int_cores_min, l.int_cores_max,
       l.int_mem_min, l.int_gpus_min, l.int_gpu_mem_min, l.b_threadable, l.str_tags, l.int_dispatch_order,
       {LAYER_LIMITS_COLUMN}
FROM top_jobs t
JOIN layer l ON l.pk_job = t.pk_job
WHERE (l.ts_start_after IS NULL OR l.ts_start_after <= now())
  AND {LAYER_LIMITS_FILTER}
  AND NOT (l.pk_layer = ANY(%(skip_layers)s::text[]))
  AND (t.b_scheduler_managed OR (
        (t.int_max_cores < 0 OR t.int_cores + GREATEST(l.int_cores_min, 100) <= t.int_max_cores)
    AND (t.folder_max_cores < 0 OR t.folder_cores + GREATEST(l.int_cores_min, 100) <= t.folder_max_cores)))
ORDER BY {_OUTER_ORDER}, l.int_dispatch_order, l.pk_layer
"""

WAITING_FRAMES_SQL = f"""
SELECT x.pk_layer, f.pk_frame, f.int_version, f.str_name, f.int_number
FROM unnest(%(layers)s::text[]) WITH ORDINALITY AS x(pk_layer, ord)
CROSS JOIN LATERAL (
  SELECT f.pk_frame, f.int_version, f.str_name, f.int_number, f.int_dispatch_order, f.int_layer_order
  FROM frame f
  WHERE f.pk_layer = x.pk_layer AND f.str_state = 'WAITING' AND {FRAME_READY}
  ORDER BY f.int_dispatch_order, f.int_layer_order
  LIMIT %(per_layer)s
) f
ORDER BY x.ord, f.int_dispatch_order, f.int_layer_order
LIMIT %(max_frames)s
"""


@dataclass(slots=True)
class JobWork:
    """A pending job as the cycle sees it. Caps and usage in centicores / GPUs (usage is live for
    unmanaged shows, whose triggers keep it; it lags for managed ones, whose Store is the truth)."""

    pk: str
    name: str
    show: str
    show_name: str
    folder: str
    facility: str
    dept: str
    os: str | None
    max_retries: int
    managed_in_db: bool
    priority: int
    max_cores: int
    max_gpus: int
    cores: int
    gpus: int
    folder_max_cores: int
    folder_max_gpus: int
    folder_cores: int
    folder_gpus: int
    layers: list[LayerWork] = field(default_factory=list)


@dataclass(slots=True)
class FrameWork:
    pk: str
    version: int
    name: str
    number: int


@dataclass(slots=True)
class LayerWork:
    pk: str
    name: str
    job: JobWork
    cmd: str
    range: str
    chunk: int
    demand: Demand
    tags: frozenset[str]
    frames: list[FrameWork] = field(default_factory=list)
    limits: tuple[str, ...] = ()  # licence limits (limit_record ids) each frame holds while it runs

    @property
    def cluster(self) -> tuple[str, str, frozenset[str]]:
        """The back-off unit: layers of one show and facility with the same tags share hosts."""
        return (self.job.facility, self.job.show, self.tags)


@dataclass(frozen=True)
class Skips:
    """Work to leave out of this cycle's query."""

    jobs: Sequence[str] = ()
    shows: Sequence[str] = ()
    folders: Sequence[str] = ()
    layers: Sequence[str] = ()
    limits: Sequence[str] = ()  # licence limits the Store reads full


@dataclass(frozen=True)
class LiveUsage:
    """What the Store says managed shows book now, for the feed to order and filter by.

    The database's `subscription.int_cores` and `job_resource.int_cores` of managed shows lag
    (the Store, not a trigger, counts their bookings), so a tier computed from them would
    serve a show that is already over its size. Centicores, like the columns they stand for.
    """

    subs: Sequence[tuple[str, str, int, int]] = ()  # (show, alloc, booked, burst)
    jobs: Sequence[tuple[str, int]] = ()  # (job, booked)


@dataclass(frozen=True)
class FreeHosts:
    """The free capacity of a host view, summarised per (alloc, facility, OS, tag).

    Each entry holds the largest free value of each resource among those hosts, so a layer
    that fits no entry fits no host; one that fits an entry may still find none (the largest
    cores and the largest memory on two different hosts). The feed uses it to keep jobs that
    cannot book out of its limited read, never to decide a booking.
    """

    shapes: Sequence[tuple[str, str, str | None, str, int, int, int, int]] = ()

    @classmethod
    def of(cls, hosts: Iterable[HostRec]) -> FreeHosts:
        best: dict[tuple[str, str, str | None, str], list[int]] = {}
        for h in hosts:
            cores = h.idle_whole_cores
            if cores < 1:
                continue
            values = (cores * CENTI, h.mem_effective, h.gpus_idle, h.gpu_mem_effective)
            for tag in h.tags:
                cur = best.get((h.alloc, h.facility, h.os, tag))
                if cur is None:
                    best[(h.alloc, h.facility, h.os, tag)] = list(values)
                else:
                    for i, v in enumerate(values):
                        if v > cur[i]:
                            cur[i] = v
        return cls(tuple((*key, *vals) for key, vals in best.items()))  # type: ignore[misc]


def _columns(rows: Sequence[tuple], n: int) -> list[list]:
    return [[r[i] for r in rows] for i in range(n)]


def fetch_pending(
    conn: psycopg.Connection,
    *,
    managed_only: bool,
    max_jobs: int,
    frames_per_layer: int,
    max_frames: int | None = None,
    skips: Skips = Skips(),
    shard: Shard = ALL,
    live: LiveUsage = LiveUsage(),
    free: FreeHosts | None = None,
    fair_share: bool | None = None,
) -> list[JobWork]:
    """Pending jobs in dispatch order, each with its dispatchable layers and their first frames.

    At most `max_frames` frames in all (the highest-priority ones), so a cycle that can only
    book a few (caps nearly full) does not read thousands. `free` (the caller's free hosts)
    keeps work that fits none of them out of the read, so it cannot crowd out work that
    can book (head-of-line blocking); None skips that test. `fair_share` defaults to
    CUESCHED_FAIR_SHARE.
    """
    if fair_share is None:
        fair_share = conf.fair_share()
    sub_cols = _columns(live.subs, 4)
    job_cols = _columns(live.jobs, 2)
    host_cols = _columns(free.shapes if free is not None else (), 8)
    if max_frames is None:
        max_frames = max_jobs * frames_per_layer * 16
    max_jobs = min(max_jobs, max_frames)
    jobs: dict[str, JobWork] = {}
    layers: dict[str, LayerWork] = {}
    tag_cache: dict[str, frozenset[str]] = {}
    with conn.cursor() as cur:
        cur.execute(
            PENDING_LAYERS_SQL,
            {
                "managed_only": managed_only,
                "skip_jobs": list(skips.jobs),
                "skip_shows": list(skips.shows),
                "skip_folders": list(skips.folders),
                "skip_layers": list(skips.layers),
                "skip_limits": list(skips.limits),
                "max_jobs": max_jobs,
                "fair_share": fair_share,
                "live_shows": sub_cols[0],
                "live_allocs": sub_cols[1],
                "live_cores": sub_cols[2],
                "live_bursts": sub_cols[3],
                "live_jobs": job_cols[0],
                "live_job_cores": job_cols[1],
                "check_hosts": free is not None,
                "h_allocs": host_cols[0],
                "h_facilities": host_cols[1],
                "h_os": host_cols[2],
                "h_tags": host_cols[3],
                "h_cores": host_cols[4],
                "h_mem": host_cols[5],
                "h_gpus": host_cols[6],
                "h_gpu_mem": host_cols[7],
                **shard_params(shard),
            },
        )
        for r in cur.fetchall():
            (pk_job, job_name, pk_show, show_name, pk_folder, pk_facility, pk_dept, str_os, max_retries,
             managed, priority, max_cores, max_gpus, cores, gpus, f_max_cores, f_max_gpus, f_cores, f_gpus,
             pk_layer, layer_name, cmd, rng, chunk,
             cores_min, cores_max, mem_min, gpus_min, gpu_mem_min, threadable, str_tags,
             _order, layer_limits) = r  # fmt: skip
            job = jobs.get(pk_job)
            if job is None:
                job = jobs[pk_job] = JobWork(
                    pk=pk_job,
                    name=job_name,
                    show=pk_show,
                    show_name=show_name,
                    folder=pk_folder,
                    facility=pk_facility,
                    dept=pk_dept,
                    os=str_os,
                    max_retries=max_retries,
                    managed_in_db=managed,
                    priority=priority,
                    max_cores=max_cores,
                    max_gpus=max_gpus,
                    cores=cores,
                    gpus=gpus,
                    folder_max_cores=f_max_cores,
                    folder_max_gpus=f_max_gpus,
                    folder_cores=f_cores,
                    folder_gpus=f_gpus,
                )
            tags = tag_cache.get(str_tags)
            if tags is None:
                tags = tag_cache[str_tags] = parse_tags(str_tags)
            layer = LayerWork(
                pk=pk_layer,
                name=layer_name,
                job=job,
                cmd=cmd,
                range=rng,
                chunk=chunk,
                demand=Demand(
                    cores_min=cores_min,
                    cores_max=cores_max,
                    mem=mem_min,
                    gpus=gpus_min,
                    gpu_mem=gpu_mem_min,
                    threadable=threadable,
                ),
                tags=tags,
                limits=tuple(layer_limits) if layer_limits else (),
            )
            job.layers.append(layer)
            layers[pk_layer] = layer
        if not layers:
            return []
        cur.execute(
            WAITING_FRAMES_SQL, {"layers": list(layers), "per_layer": frames_per_layer, "max_frames": max_frames}
        )
        for pk_layer, pk_frame, version, name, number in cur.fetchall():
            layers[pk_layer].frames.append(FrameWork(pk_frame, version, name, number))
    return [job for job in jobs.values() if any(layer.frames for layer in job.layers)]


IDLE_SQL = """
SELECT EXISTS (
  SELECT 1 FROM job_stat js JOIN job j ON j.pk_job = js.pk_job JOIN show s ON s.pk_show = j.pk_show
  WHERE (js.int_waiting_count > 0 OR js.int_running_count > 0)
    AND (s.b_scheduler_managed OR NOT %(managed_only)s)
)
"""


def has_waiting_or_running(conn: psycopg.Connection, *, managed_only: bool) -> bool:
    """Whether any frame of a dispatched show is WAITING or RUNNING (the exit-when-idle test)."""
    with conn.cursor() as cur:
        cur.execute(IDLE_SQL, {"managed_only": managed_only})
        row = cur.fetchone()
    return bool(row and row[0])
