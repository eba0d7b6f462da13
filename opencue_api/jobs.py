"""JobInterface, LayerInterface and FrameInterface: what cueadmin -lj, cueman and pycue read and do.

Reads are plain SQL over the job, layer and frame tables and their stat rows, in Cuebot's units
(float cores, KB of memory, epoch seconds). The controls are the console's own actions
(`dispatch.jobs.controls`): the same transaction, the same audit row, the same kill path, so a job
killed from cueman is killed exactly as one killed from the console. A frame search
(FrameSearchCriteria) picks the frames first; the action then gets their names. A job's
comments are opencue_api.comments'.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import grpc
from django.db import connection
from opencue_proto import depend_pb2, job_pb2, job_pb2_grpc

from accounting.units import CENTICORES_PER_CORE
from dispatch.jobs.comments import comments_on_job
from dispatch.jobs.controls import (
    eat_frames,
    kill_frames,
    kill_job,
    pause_job,
    resume_job,
    retry_frames,
    set_layer_min_cores,
    set_layer_min_memory,
    set_max_cores,
    set_max_retries,
    set_min_cores,
    set_priority,
)
from dispatch.jobs.frameset import FrameRangeError, parse_frames
from opencue_api.comments import add_comment, comment_seq
from opencue_api.rpc import API_ACTOR, BadRequest, actor, unary
from opencue_api.search import Where
from ops import status
from ops.setup_actions import NotFound

JOBS_SQL = """
SELECT j.pk_job, j.str_state, j.str_name, j.str_shot, s.str_name, j.str_user, f.str_name, fa.str_name,
       COALESCE(j.str_os, ''), COALESCE(j.int_uid, 0), jr.int_priority, jr.int_min_cores, jr.int_max_cores,
       j.str_log_dir, j.b_paused, j.b_comment, j.b_autoeat,
       COALESCE(extract(epoch FROM j.ts_started)::bigint, 0), COALESCE(extract(epoch FROM j.ts_stopped)::bigint, 0),
       jr.int_min_gpus, jr.int_max_gpus, COALESCE(j.str_loki_url, ''), s.b_scheduler_managed,
       j.int_layer_count, js.int_total_count, js.int_waiting_count, js.int_running_count, js.int_dead_count,
       js.int_eaten_count, js.int_depend_count, js.int_succeeded_count, jr.int_cores, jr.int_gpus
FROM job j JOIN show s ON s.pk_show = j.pk_show JOIN folder f ON f.pk_folder = j.pk_folder
JOIN facility fa ON fa.pk_facility = j.pk_facility
JOIN job_resource jr ON jr.pk_job = j.pk_job JOIN job_stat js ON js.pk_job = j.pk_job
WHERE {where}
ORDER BY j.str_name
"""

LAYERS_SQL = """
SELECT l.pk_layer, l.str_name, l.str_range, l.str_tags, l.int_cores_min, l.int_cores_max, l.b_threadable,
       l.int_mem_min, l.int_gpu_mem_min, l.int_chunk_size, l.int_dispatch_order, l.str_type, l.str_services,
       l.b_optimize, l.int_timeout, l.int_timeout_llu, l.int_gpus_min, l.str_cmd,
       ls.int_total_count, ls.int_waiting_count, ls.int_running_count, ls.int_dead_count, ls.int_eaten_count,
       ls.int_depend_count, ls.int_succeeded_count, lr.int_cores, lr.int_gpus, lr.int_max_rss,
       COALESCE((SELECT array_agg(lim.str_name ORDER BY lim.str_name) FROM layer_limit ll
                 JOIN limit_record lim ON lim.pk_limit_record = ll.pk_limit_record WHERE ll.pk_layer = l.pk_layer),
                '{{}}'::text[])
FROM layer l JOIN layer_stat ls ON ls.pk_layer = l.pk_layer JOIN layer_resource lr ON lr.pk_layer = l.pk_layer
WHERE {where}
ORDER BY l.int_dispatch_order, l.str_name
"""

FRAMES_SQL = """
SELECT f.pk_frame, f.str_name, l.str_name, f.int_number, f.str_state, f.int_retries, f.int_exit_status,
       f.int_dispatch_order, COALESCE(extract(epoch FROM f.ts_started)::bigint, 0),
       COALESCE(extract(epoch FROM f.ts_stopped)::bigint, 0), f.int_mem_max_used, f.int_mem_used,
       f.int_mem_reserved, f.int_gpu_mem_reserved, COALESCE(f.str_host, ''), f.int_checkpoint_count,
       f.int_gpu_mem_max_used
FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer
WHERE f.pk_job = %(job)s {where}
ORDER BY f.int_dispatch_order, f.int_layer_order, f.int_number
LIMIT %(limit)s OFFSET %(offset)s
"""
# Cuebot's FrameSearch: a page is 1000 frames unless the request says less (never more).
FRAME_PAGE = 1000

# Cuebot's getUpdatedFrames (WhiteboardDaoJdbc): the frames of the job (of the layers asked)
# changed since the client's last check, at most 100, and the job's state. Like Cuebot, a check
# more than a minute old is refused: the client then reads the whole list again (CueGUI does).
UPDATED_FRAMES_SQL = """
SELECT f.pk_frame, f.str_state, f.int_retries, f.int_exit_status,
       COALESCE(extract(epoch FROM f.ts_started)::bigint, 0), COALESCE(extract(epoch FROM f.ts_stopped)::bigint, 0),
       f.int_mem_max_used, f.int_mem_used, f.str_host, f.int_gpu_mem_max_used,
       COALESCE(p.int_cores_reserved, 0), COALESCE(p.int_gpus_reserved, 0)
FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer LEFT JOIN proc p ON p.pk_frame = f.pk_frame
WHERE f.pk_job = %(job)s AND f.ts_updated > to_timestamp(%(since)s) {where}
ORDER BY f.int_dispatch_order, f.int_layer_order, f.int_number
LIMIT 100
"""
UPDATED_FRAMES_MAX_AGE = 60  # seconds, Cuebot's bound on last_check

# What depends on a job (Cuebot's getWhatDependsOn): one Depend per depending layer pair. cuesched
# keeps a frame-by-frame depend as one row per frame pair (Cuebot: one composite row with
# children), so those rows are folded into one, active while any of them is.
DEPENDS_ON_JOB_SQL = """
SELECT MIN(d.pk_depend), d.str_type, bool_or(d.b_active), jer.str_name, ler.str_name, jon.str_name, lon.str_name
FROM depend d JOIN job jer ON jer.pk_job = d.pk_job_depend_er JOIN job jon ON jon.pk_job = d.pk_job_depend_on
LEFT JOIN layer ler ON ler.pk_layer = d.pk_layer_depend_er LEFT JOIN layer lon ON lon.pk_layer = d.pk_layer_depend_on
WHERE d.pk_job_depend_on = %(job)s
GROUP BY d.str_type, jer.str_name, ler.str_name, jon.str_name, lon.str_name
ORDER BY jer.str_name, ler.str_name, lon.str_name
"""


def _fetch(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _cores(centicores: int | None) -> float:
    return 0.0 if centicores is None else centicores / CENTICORES_PER_CORE


def _job_reserved(
    view: dict[str, Any] | None, pk: str, managed: bool, db_cores: int, db_gpus: int
) -> tuple[float, int]:
    """The job's booked cores and GPUs as the console shows them: the Store's for a managed show."""
    entry = ((view or {}).get("job") or {}).get(pk) if managed else None
    if entry:
        return float(entry["cores"]), int(entry["gpus"])
    return _cores(db_cores), db_gpus


def jobs(where: str, params: dict[str, Any]) -> list[job_pb2.Job]:
    view = status.read_view()
    out = []
    for r in _fetch(JOBS_SQL.format(where=where), params):
        cores, gpus = _job_reserved(view, r[0], r[22], r[31], r[32])
        out.append(
            job_pb2.Job(
                id=r[0],
                state=job_pb2.JobState.Value(r[1]),
                name=r[2],
                shot=r[3],
                show=r[4],
                user=r[5],
                group=r[6],
                facility=r[7],
                os=r[8],
                uid=r[9],
                priority=r[10],
                min_cores=_cores(r[11]),
                max_cores=_cores(r[12]),
                log_dir=r[13],
                is_paused=r[14],
                has_comment=r[15],
                auto_eat=r[16],
                start_time=r[17],
                stop_time=r[18],
                min_gpus=r[19],
                max_gpus=r[20],
                loki_url=r[21],
                job_stats=job_pb2.JobStats(
                    total_layers=r[23],
                    total_frames=r[24],
                    waiting_frames=r[25],
                    running_frames=r[26],
                    dead_frames=r[27],
                    eaten_frames=r[28],
                    depend_frames=r[29],
                    succeeded_frames=r[30],
                    pending_frames=r[25] + r[29],
                    reserved_cores=cores,
                    reserved_gpus=gpus,
                ),
            )
        )
    return out


def search_jobs(criteria: job_pb2.JobSearchCriteria) -> list[job_pb2.Job]:
    """Cuebot's JobSearch: every list given narrows the result; names are exact, regexes and
    substrings match the name; finished jobs only when asked."""
    where = Where()
    if not criteria.include_finished:
        where.add("j.str_state <> 'FINISHED'")
    where.any_of("j.pk_job", criteria.ids, "ids")
    where.any_of("j.str_name", criteria.jobs, "jobs")
    where.any_of("j.str_user", criteria.users, "users")
    where.any_of("j.str_shot", criteria.shots, "shots")
    where.any_of("s.str_name", criteria.shows, "shows")
    where.names("j.str_name", criteria.regex, criteria.substr)
    return jobs(where.sql(), where.params)


def find_job(name_or_id: str, *, include_finished: bool = True) -> job_pb2.Job:
    where = "(j.str_name = %(job)s OR j.pk_job = %(job)s)"
    if not include_finished:
        where += " AND j.str_state <> 'FINISHED'"
    found = jobs(where, {"job": name_or_id})
    if not found:
        raise NotFound(f"no job named {name_or_id!r}")
    return found[0]


def job_id(job: job_pb2.Job) -> str:
    return find_job(job.id or job.name).id


def layers(where: str, params: dict[str, Any]) -> list[job_pb2.Layer]:
    return [
        job_pb2.Layer(
            id=r[0],
            name=r[1],
            range=r[2],
            tags=[t for t in re.split(r"[\s|,]+", r[3] or "") if t],
            min_cores=_cores(r[4]),
            max_cores=_cores(r[5]),
            is_threadable=r[6],
            min_memory=r[7],
            min_gpu_memory=r[8],
            chunk_size=r[9],
            dispatch_order=r[10],
            type=job_pb2.LayerType.Value(r[11].upper()) if r[11].upper() in job_pb2.LayerType.keys() else 0,
            services=[s for s in (r[12] or "").split(",") if s],
            memory_optimizer_enabled=r[13],
            timeout=r[14],
            timeout_llu=r[15],
            min_gpus=r[16],
            command=r[17],
            limits=list(r[28]),
            layer_stats=job_pb2.LayerStats(
                total_frames=r[18],
                waiting_frames=r[19],
                running_frames=r[20],
                dead_frames=r[21],
                eaten_frames=r[22],
                depend_frames=r[23],
                succeeded_frames=r[24],
                pending_frames=r[19] + r[23],
                reserved_cores=_cores(r[25]),
                reserved_gpus=r[26],
                max_rss=r[27],
            ),
        )
        for r in _fetch(LAYERS_SQL.format(where=where), params)
    ]


def _range(text: str, field: str, scale: int) -> tuple[int | None, int | None]:
    """Cuebot's "lo-hi", "gt<n>", "lt<n>" ranges; memory in GB and duration in hours, scaled."""
    text = text.strip()
    try:
        if text.startswith("gt"):
            return int(float(text[2:]) * scale), None
        if text.startswith("lt"):
            return None, int(float(text[2:]) * scale)
        lo, sep, hi = text.partition("-")
        if not sep:  # Cuebot: a single value is a lower bound
            return int(float(lo) * scale), None
        return int(float(lo) * scale), int(float(hi) * scale)
    except ValueError:
        raise BadRequest(f"{field}: {text!r} is not a range (lo-hi, gtN or ltN)") from None


def search_frames(job: str, criteria: job_pb2.FrameSearchCriteria) -> list[job_pb2.Frame]:
    where = Where()
    where.any_of("f.pk_frame", criteria.ids, "ids")
    where.any_of("f.str_name", criteria.frames, "frames")
    where.any_of("l.str_name", criteria.layers, "layers")
    where.any_of("f.str_state", [job_pb2.FrameState.Name(s) for s in criteria.states.frame_states], "states")
    if criteria.frame_range:
        try:
            where.any_of("f.int_number", parse_frames(criteria.frame_range), "numbers")
        except FrameRangeError as exc:
            raise BadRequest(f"frame_range: {exc}") from None
    if criteria.memory_range:
        lo, hi = _range(criteria.memory_range, "memory_range", 1024 * 1024)  # GB to KB
        where.add("(%(mem_lo)s::bigint IS NULL OR f.int_mem_max_used >= %(mem_lo)s)", mem_lo=lo)
        where.add("(%(mem_hi)s::bigint IS NULL OR f.int_mem_max_used <= %(mem_hi)s)", mem_hi=hi)
    if criteria.duration_range:
        lo, hi = _range(criteria.duration_range, "duration_range", 3600)  # hours to seconds
        # Cuebot's find_duration (0 for a frame never started); like Cuebot, a duration filter
        # leaves WAITING frames out (cueman -lf sends one by default, and says so in its help).
        run = "COALESCE(extract(epoch FROM COALESCE(f.ts_stopped, now()) - f.ts_started), 0)"
        where.add(f"f.str_state <> 'WAITING' AND (%(dur_lo)s::bigint IS NULL OR {run} >= %(dur_lo)s)", dur_lo=lo)
        where.add(f"(%(dur_hi)s::bigint IS NULL OR {run} <= %(dur_hi)s)", dur_hi=hi)
    # pycue sends its page size as max_results, Cuebot reads limit: take whichever is set.
    asked = criteria.limit or criteria.max_results
    limit = asked if 0 < asked <= FRAME_PAGE else FRAME_PAGE
    page = max(criteria.page, 1)
    params = {**where.params, "job": job, "limit": limit, "offset": criteria.offset or (page - 1) * limit}
    return [
        job_pb2.Frame(
            id=r[0],
            name=r[1],
            layer_name=r[2],
            number=r[3],
            state=job_pb2.FrameState.Value(r[4]),
            retry_count=r[5],
            exit_status=r[6],
            dispatch_order=r[7],
            start_time=r[8],
            stop_time=r[9],
            max_rss=r[10],
            used_memory=r[11],
            reserved_memory=r[12],
            reserved_gpu_memory=r[13],
            last_resource=r[14],
            checkpoint_count=r[15],
            max_gpu_memory=r[16],
        )
        for r in _fetch(FRAMES_SQL.format(where=f"AND {where.sql()}"), params)
    ]


def updated_frames(job: str, since: int, layers: Sequence[job_pb2.Layer]) -> job_pb2.JobGetUpdatedFramesResponse:
    now = int(time.time())
    if now - since > UPDATED_FRAMES_MAX_AGE:
        raise BadRequest(
            "last_check: the last update timestamp cannot be over a minute off the current time, "
            f"difference was: {now - since}"
        )
    state = _fetch("SELECT str_state FROM job WHERE pk_job = %(job)s", {"job": job})[0][0]
    where = Where()
    where.any_of("l.pk_layer", [x.id for x in layers if x.id], "layer_ids")
    where.any_of("l.str_name", [x.name for x in layers if not x.id and x.name], "layer_names")
    params = {**where.params, "job": job, "since": since}
    frames = [
        job_pb2.UpdatedFrame(
            id=r[0],
            state=job_pb2.FrameState.Value(r[1]),
            retry_count=r[2],
            exit_status=r[3],
            start_time=r[4],
            stop_time=r[5],
            max_rss=r[6],
            used_memory=r[7],
            # Cuebot's "host/cores/gpus" while the frame holds a proc, the host alone after.
            last_resource=(f"{r[8]}/{r[10] / CENTICORES_PER_CORE:.2f}/{r[11]}" if r[10] else r[8] or ""),
            max_gpu_memory=r[9],
        )
        for r in _fetch(UPDATED_FRAMES_SQL.format(where=f"AND {where.sql()}"), params)
    ]
    # Cuebot answers a second early, so a change in the same second is read again, never missed.
    return job_pb2.JobGetUpdatedFramesResponse(
        state=job_pb2.JobState.Value(state),
        server_time=now - 1,
        updated_frames=job_pb2.UpdatedFrameSeq(updated_frames=frames),
    )


def depends_on_job(job: str) -> list[depend_pb2.Depend]:
    out = []
    for pk, kind, active, er_job, er_layer, on_job, on_layer in _fetch(DEPENDS_ON_JOB_SQL, {"job": job}):
        out.append(
            depend_pb2.Depend(
                id=pk,
                type=depend_pb2.DependType.Value(kind),
                target=depend_pb2.INTERNAL if er_job == on_job else depend_pb2.EXTERNAL,
                active=active,
                depend_er_job=er_job,
                depend_er_layer=er_layer or "",
                depend_on_job=on_job,
                depend_on_layer=on_layer or "",
            )
        )
    return out


def layer_ref(layer: job_pb2.Layer) -> tuple[str, str]:
    """(job id, layer id) of the layer a request names (pycue sends the whole message)."""
    rows = _fetch("SELECT pk_job, pk_layer FROM layer WHERE pk_layer = %(layer)s", {"layer": layer.id})
    if not rows:
        raise NotFound(f"no layer with id {layer.id!r}")
    return rows[0][0], rows[0][1]


def _names(frames: Sequence[job_pb2.Frame]) -> list[str]:
    return [f.name for f in frames]


class JobServicer(job_pb2_grpc.JobInterfaceServicer):
    @unary
    def AddComment(self, request: Any, context: Any) -> job_pb2.JobAddCommentResponse:
        add_comment("job", job_id(request.job), request.new_comment)
        return job_pb2.JobAddCommentResponse()

    @unary
    def GetComments(self, request: Any, context: Any) -> job_pb2.JobGetCommentsResponse:
        return job_pb2.JobGetCommentsResponse(comments=comment_seq(comments_on_job(job_id(request.job))))

    @unary
    def GetJobs(self, request: Any, context: Any) -> job_pb2.JobGetJobsResponse:
        return job_pb2.JobGetJobsResponse(jobs=job_pb2.JobSeq(jobs=search_jobs(request.r)))

    @unary
    def FindJob(self, request: Any, context: Any) -> job_pb2.JobFindJobResponse:
        # Cuebot's findJob looks among jobs that are not finished.
        return job_pb2.JobFindJobResponse(job=find_job(request.name, include_finished=False))

    @unary
    def GetJob(self, request: Any, context: Any) -> job_pb2.JobGetJobResponse:
        return job_pb2.JobGetJobResponse(job=find_job(request.id))

    @unary
    def IsJobPending(self, request: Any, context: Any) -> job_pb2.JobIsJobPendingResponse:
        found = jobs("j.str_name = %(job)s AND j.str_state = 'PENDING'", {"job": request.name})
        return job_pb2.JobIsJobPendingResponse(value=bool(found))

    @unary
    def GetLayers(self, request: Any, context: Any) -> job_pb2.JobGetLayersResponse:
        found = layers("l.pk_job = %(job)s", {"job": job_id(request.job)})
        return job_pb2.JobGetLayersResponse(layers=job_pb2.LayerSeq(layers=found))

    @unary
    def GetFrames(self, request: Any, context: Any) -> job_pb2.JobGetFramesResponse:
        found = search_frames(job_id(request.job), request.req)
        return job_pb2.JobGetFramesResponse(frames=job_pb2.FrameSeq(frames=found))

    @unary
    def Pause(self, request: Any, context: Any) -> job_pb2.JobPauseResponse:
        pause_job(job_id(request.job), actor=API_ACTOR)
        return job_pb2.JobPauseResponse()

    @unary
    def Resume(self, request: Any, context: Any) -> job_pb2.JobResumeResponse:
        resume_job(job_id(request.job), actor=API_ACTOR)
        return job_pb2.JobResumeResponse()

    @unary
    def Kill(self, request: Any, context: Any) -> job_pb2.JobKillResponse:
        kill_job(job_id(request.job), actor=actor(request.username))
        return job_pb2.JobKillResponse()

    @unary
    def SetPriority(self, request: Any, context: Any) -> job_pb2.JobSetPriorityResponse:
        set_priority(job_id(request.job), request.val, actor=API_ACTOR)
        return job_pb2.JobSetPriorityResponse()

    @unary
    def SetMaxCores(self, request: Any, context: Any) -> job_pb2.JobSetMaxCoresResponse:
        if request.val != int(request.val):
            raise BadRequest(f"val: cuesched keeps a job's max cores in whole cores, not {request.val}")
        set_max_cores(job_id(request.job), int(request.val), actor=API_ACTOR, confirm_stop=True)
        return job_pb2.JobSetMaxCoresResponse()

    @unary
    def SetMinCores(self, request: Any, context: Any) -> job_pb2.JobSetMinCoresResponse:
        set_min_cores(job_id(request.job), request.val, actor=API_ACTOR)
        return job_pb2.JobSetMinCoresResponse()

    @unary
    def SetMaxRetries(self, request: Any, context: Any) -> job_pb2.JobSetMaxRetriesResponse:
        set_max_retries(job_id(request.job), request.max_retries, actor=API_ACTOR)
        return job_pb2.JobSetMaxRetriesResponse()

    @unary
    def SetAutoEat(self, request: Any, context: Any) -> job_pb2.JobSetAutoEatResponse:
        # cuesched's completion never eats a frame that would be DEAD: accepting true would
        # record a behaviour nothing performs. Off is what every cuesched job already is.
        pk = job_id(request.job)
        if request.value or _fetch("SELECT b_autoeat FROM job WHERE pk_job = %(job)s", {"job": pk})[0][0]:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "auto-eat is not supported by cuesched: a frame out of retries is DEAD (eat it, or set max retries)",
            )
        return job_pb2.JobSetAutoEatResponse()

    @unary
    def GetUpdatedFrames(self, request: Any, context: Any) -> job_pb2.JobGetUpdatedFramesResponse:
        return updated_frames(job_id(request.job), request.last_check, request.layer_filter.layers)

    @unary
    def GetWhatDependsOnThis(self, request: Any, context: Any) -> job_pb2.JobGetWhatDependsOnThisResponse:
        found = depends_on_job(job_id(request.job))
        return job_pb2.JobGetWhatDependsOnThisResponse(depends=depend_pb2.DependSeq(depends=found))

    @unary
    def RetryFrames(self, request: Any, context: Any) -> job_pb2.JobRetryFramesResponse:
        job = job_id(request.job)
        names = _names(search_frames(job, request.req))
        if names:
            retry_frames(job, names, actor=API_ACTOR)
        return job_pb2.JobRetryFramesResponse()

    @unary
    def EatFrames(self, request: Any, context: Any) -> job_pb2.JobEatFramesResponse:
        job = job_id(request.job)
        names = _names(search_frames(job, request.req))
        if names:
            eat_frames(job, names, actor=API_ACTOR)
        return job_pb2.JobEatFramesResponse()

    @unary
    def KillFrames(self, request: Any, context: Any) -> job_pb2.JobKillFramesResponse:
        job = job_id(request.job)
        names = _names(search_frames(job, request.req))
        if names:
            kill_frames(job, names, actor=actor(request.username))
        return job_pb2.JobKillFramesResponse()


class LayerServicer(job_pb2_grpc.LayerInterfaceServicer):
    @unary
    def FindLayer(self, request: Any, context: Any) -> job_pb2.LayerFindLayerResponse:
        job = find_job(request.job).id
        found = layers("l.pk_job = %(job)s AND l.str_name = %(layer)s", {"job": job, "layer": request.layer})
        if not found:
            raise NotFound(f"no layer {request.layer!r} in job {request.job!r}")
        return job_pb2.LayerFindLayerResponse(layer=found[0])

    @unary
    def GetLayer(self, request: Any, context: Any) -> job_pb2.LayerGetLayerResponse:
        found = layers("l.pk_layer = %(layer)s", {"layer": request.id})
        if not found:
            raise NotFound(f"no layer with id {request.id!r}")
        return job_pb2.LayerGetLayerResponse(layer=found[0])

    @unary
    def GetFrames(self, request: Any, context: Any) -> job_pb2.LayerGetFramesResponse:
        job, layer = layer_ref(request.layer)
        criteria = job_pb2.FrameSearchCriteria()
        criteria.CopyFrom(request.s)
        del criteria.layers[:]
        name = _fetch("SELECT str_name FROM layer WHERE pk_layer = %(layer)s", {"layer": layer})[0][0]
        criteria.layers.append(name)
        return job_pb2.LayerGetFramesResponse(frames=job_pb2.FrameSeq(frames=search_frames(job, criteria)))

    @unary
    def SetMinCores(self, request: Any, context: Any) -> job_pb2.LayerSetMinCoresResponse:
        job, layer = layer_ref(request.layer)
        set_layer_min_cores(job, layer, request.cores, actor=API_ACTOR)
        return job_pb2.LayerSetMinCoresResponse()

    @unary
    def SetMinMemory(self, request: Any, context: Any) -> job_pb2.LayerSetMinMemoryResponse:
        job, layer = layer_ref(request.layer)
        set_layer_min_memory(job, layer, request.memory, actor=API_ACTOR)
        return job_pb2.LayerSetMinMemoryResponse()


class FrameServicer(job_pb2_grpc.FrameInterfaceServicer):
    @unary
    def FindFrame(self, request: Any, context: Any) -> job_pb2.FrameFindFrameResponse:
        job = find_job(request.job).id
        criteria = job_pb2.FrameSearchCriteria(layers=[request.layer], frame_range=str(request.frame))
        found = search_frames(job, criteria)
        if not found:
            raise NotFound(f"no frame {request.frame} of layer {request.layer!r} in job {request.job!r}")
        return job_pb2.FrameFindFrameResponse(frame=found[0])

    @unary
    def GetFrames(self, request: Any, context: Any) -> job_pb2.FrameGetFramesResponse:
        found = search_frames(find_job(request.job).id, request.r)
        return job_pb2.FrameGetFramesResponse(frames=job_pb2.FrameSeq(frames=found))

    def _frame_job(self, frame: job_pb2.Frame) -> tuple[str, str]:
        rows = _fetch("SELECT pk_job, str_name FROM frame WHERE pk_frame = %(f)s", {"f": frame.id})
        if not rows:
            raise NotFound(f"no frame with id {frame.id!r}")
        return rows[0][0], rows[0][1]

    @unary
    def Retry(self, request: Any, context: Any) -> job_pb2.FrameRetryResponse:
        job, name = self._frame_job(request.frame)
        retry_frames(job, [name], actor=API_ACTOR)
        return job_pb2.FrameRetryResponse()

    @unary
    def Eat(self, request: Any, context: Any) -> job_pb2.FrameEatResponse:
        job, name = self._frame_job(request.frame)
        eat_frames(job, [name], actor=API_ACTOR)
        return job_pb2.FrameEatResponse()

    @unary
    def Kill(self, request: Any, context: Any) -> job_pb2.FrameKillResponse:
        job, name = self._frame_job(request.frame)
        kill_frames(job, [name], actor=actor(request.username))
        return job_pb2.FrameKillResponse()
