"""Pending work: the WAITING frames worth trying this cycle, in dispatch order.

Two set-based queries per cycle, whatever the farm size: the layers of the highest-priority
pending jobs (job_resource.int_priority DESC, then oldest job first, then layer dispatch
order), then up to N WAITING frames per layer in frame dispatch order (int_dispatch_order,
int_layer_order), at most M in all, as the reference's layer/frame query (§3.3, §3.4).

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

from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg

from dispatch.engine.placement import ALL, Demand, Shard, in_shard, parse_tags, shard_params

# The seam for frame dependencies: a WAITING frame is dispatchable when this holds.
FRAME_READY = "f.int_depend_count = 0"

# The top jobs first (job-level filters only, so the sort and the limit see one row per job),
# then their layers. Whether a layer has WAITING frames is left to the frame query, which
# probes the partial WAITING index per layer: layer_stat is rewritten on every frame state
# change and is not worth a scan here.
PENDING_LAYERS_SQL = f"""
WITH top_jobs AS (
  SELECT j.pk_job, j.str_name AS job_name, j.pk_show, s.str_name AS show_name, j.pk_folder,
         j.pk_facility, j.pk_dept, j.str_os, j.int_max_retries, s.b_scheduler_managed,
         jr.int_priority, jr.int_max_cores, jr.int_max_gpus, jr.int_cores, jr.int_gpus,
         fr.int_max_cores AS folder_max_cores, fr.int_max_gpus AS folder_max_gpus,
         fr.int_cores AS folder_cores, fr.int_gpus AS folder_gpus, j.ts_started
  FROM job j
  JOIN job_stat js ON js.pk_job = j.pk_job
  JOIN job_resource jr ON jr.pk_job = j.pk_job
  JOIN show s ON s.pk_show = j.pk_show
  JOIN folder_resource fr ON fr.pk_folder = j.pk_folder
  WHERE j.str_state = 'PENDING' AND NOT j.b_paused AND s.b_active AND js.int_waiting_count > 0
    -- Cuebot's flags, honoured as their names say (Cuebot's own HAS_PENDING_JOBS requires
    -- b_auto_book; a paused show, or one with booking or dispatch disabled, books nothing new).
    AND j.b_auto_book AND NOT s.b_paused AND s.b_booking_enabled AND s.b_dispatch_enabled
    AND (s.b_scheduler_managed OR NOT %(managed_only)s)
    AND NOT (j.pk_job = ANY(%(skip_jobs)s::text[]))
    AND {in_shard('j.pk_job')}
    AND NOT (j.pk_show = ANY(%(skip_shows)s::text[]))
    AND NOT (j.pk_folder = ANY(%(skip_folders)s::text[]))
    -- Unmanaged shows: a core of room left on the job, its folder and some subscription
    -- (the trigger-kept totals are live for them).
    AND (s.b_scheduler_managed OR (
          (jr.int_max_cores <= 0 OR jr.int_max_cores - jr.int_cores >= 100)
      AND (fr.int_max_cores <= 0 OR fr.int_max_cores - fr.int_cores >= 100)
      AND EXISTS (SELECT 1 FROM subscription sub
                  WHERE sub.pk_show = j.pk_show AND sub.int_burst - sub.int_cores >= 100)))
    -- A job whose every layer backs off does not take a place in the limit.
    AND (cardinality(%(skip_layers)s::text[]) = 0 OR EXISTS (
          SELECT 1 FROM layer l WHERE l.pk_job = j.pk_job AND NOT (l.pk_layer = ANY(%(skip_layers)s::text[]))))
  ORDER BY jr.int_priority DESC, j.ts_started, j.pk_job
  LIMIT %(max_jobs)s
)
SELECT t.pk_job, t.job_name, t.pk_show, t.show_name, t.pk_folder, t.pk_facility, t.pk_dept, t.str_os,
       t.int_max_retries, t.b_scheduler_managed, t.int_priority, t.int_max_cores, t.int_max_gpus,
       t.int_cores, t.int_gpus, t.folder_max_cores, t.folder_max_gpus, t.folder_cores, t.folder_gpus,
       l.pk_layer, l.str_name, l.str_cmd, l.str_range, l.int_chunk_size, l.int_cores_min, l.int_cores_max,
       l.int_mem_min, l.int_gpus_min, l.int_gpu_mem_min, l.b_threadable, l.str_tags, l.int_dispatch_order
FROM top_jobs t
JOIN layer l ON l.pk_job = t.pk_job
WHERE (l.ts_start_after IS NULL OR l.ts_start_after <= now())
  AND NOT (l.pk_layer = ANY(%(skip_layers)s::text[]))
  AND (t.b_scheduler_managed OR (
        (t.int_max_cores <= 0 OR t.int_cores + GREATEST(l.int_cores_min, 100) <= t.int_max_cores)
    AND (t.folder_max_cores <= 0 OR t.folder_cores + GREATEST(l.int_cores_min, 100) <= t.folder_max_cores)))
ORDER BY t.int_priority DESC, t.ts_started, t.pk_job, l.int_dispatch_order, l.pk_layer
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


def fetch_pending(
    conn: psycopg.Connection,
    *,
    managed_only: bool,
    max_jobs: int,
    frames_per_layer: int,
    max_frames: int | None = None,
    skips: Skips = Skips(),
    shard: Shard = ALL,
) -> list[JobWork]:
    """Pending jobs in dispatch order, each with its dispatchable layers and their first frames.

    At most `max_frames` frames in all (the highest-priority ones), so a cycle that can only
    book a few (caps nearly full) does not read thousands.
    """
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
                "max_jobs": max_jobs,
                **shard_params(shard),
            },
        )
        for r in cur.fetchall():
            (pk_job, job_name, pk_show, show_name, pk_folder, pk_facility, pk_dept, str_os, max_retries,
             managed, priority, max_cores, max_gpus, cores, gpus, f_max_cores, f_max_gpus, f_cores, f_gpus,
             pk_layer, layer_name, cmd, rng, chunk,
             cores_min, cores_max, mem_min, gpus_min, gpu_mem_min, threadable, str_tags,
             _order) = r  # fmt: skip
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
