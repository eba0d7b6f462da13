"""Every change a person or a program makes to a job, its frames or a host: submit, pause,
resume, kill, retry, eat, priority, max cores; frame kill; host lock, unlock, drain. One function
each, one durable transaction each, writing only the columns that change, and (for the controls)
one `FarmAction` row in that same transaction, so the audit trail holds a control exactly when it
committed. The command line, the JSON API and the console call these and nothing else; they check
who may act, these functions do not.

Kill, and why it needs nothing from the scheduler process. A kill is not a release: the
running frames' procs stay booked until the runs have really ended (dispatch.engine.kills).
`kill_job`, in one transaction,
1. marks the job FINISHED (the feed never returns it again),
2. eats its WAITING and DEPEND frames: a booking in flight on one of them either committed
   before this statement reached the row (then its proc is marked in step 3) or fails its
   `str_state = 'WAITING'` guard afterwards, so no frame of the job can start after the kill,
3. marks every proc of the job for the kill (`proc.ts_kill`, `str_kill = 'JOB'`), repeating
   2 and 3 until no new proc appears (a completion that committed meanwhile may have put a
   frame back to WAITING and a booking taken it), and notifies `cuesched_kill`.
The scheduler's kill sender sends the kills to the hosts (KillRunningFrame to RQD, the run
lock and the agent's own poll for q2 and celery); each run's completion report releases its
proc and is recorded as killed (the frame eaten, exit 301). The caller needs no launcher.
`kill_frames` marks the named running frames (`str_kill = 'FRAME'`): they go back to WAITING,
no retry counted, once their runs have ended.

Retry of a FINISHED job (all its frames done or dead) opens it again (PENDING). The Store drops
the caps of finished jobs, so for a scheduler-managed show the job's caps are announced again
on `acct_limit_change` in the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import Q
from django.db.models.functions import Now

from accounting import actions as accounting_actions
from accounting import triggers as acct_triggers
from accounting.actions import audit_context
from accounting.notify import LIMIT_CHANNEL
from dispatch import cuebot_usage
from dispatch.engine import kills
from dispatch.engine.completion import FINISH_JOBS_SQL
from dispatch.jobs.frameset import frame_name
from dispatch.jobs.spec import JobPlan, SpecError, plan_job
from dispatch.models import FarmAction, Host, Job, JobResource, Layer, LayerLimit, Proc
from dispatch.models.base import new_id
from dispatch.models.depends import FRAME_BY_FRAME, LAYER_ON_LAYER
from dispatch.models.triggers import STATE_COLUMNS

logger = logging.getLogger(__name__)

MAX_PRIORITY = 1_000_000
_DEADLOCK_ATTEMPTS = 3

# --- SQL -----------------------------------------------------------------------------------

INSERT_FRAMES_SQL = """
INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, int_number, str_state, int_depend_count,
                   int_dispatch_order, int_layer_order, ts_updated)
SELECT f.pk, f.layer, %(job)s, f.name, f.number, CASE WHEN f.depends > 0 THEN 'DEPEND' ELSE 'WAITING' END,
       f.depends, f.dispatch_order, f.layer_order, now()
FROM unnest(%(pk)s::text[], %(layer)s::text[], %(name)s::text[], %(number)s::int[], %(depends)s::int[],
            %(dispatch_order)s::int[], %(layer_order)s::int[])
     AS f(pk, layer, name, number, depends, dispatch_order, layer_order)
"""

INSERT_DEPENDS_SQL = """
INSERT INTO depend (pk_depend, str_type, pk_job_depend_er, pk_job_depend_on, pk_layer_depend_er,
                    pk_layer_depend_on, pk_frame_depend_er, pk_frame_depend_on{signature_column})
SELECT gen_random_uuid()::text, d.type, %(job)s, %(job)s, d.layer_er, d.layer_on, d.frame_er, d.frame_on{signature}
FROM unnest(%(type)s::text[], %(layer_er)s::text[], %(layer_on)s::text[], %(frame_er)s::text[],
            %(frame_on)s::text[]) AS d(type, layer_er, layer_on, frame_er, frame_on)
"""

# Cuebot's depend table (a database adopted with adopt_cuebot_db) requires str_signature, unique:
# Cuebot refuses a second identical depend by it. cuesched's own schema has no such column. The
# signature is a function of what the depend links (as Cuebot's is), 36 characters like its own.
DEPEND_SIGNATURE = "md5(concat_ws(':', d.type, d.layer_er, d.layer_on, d.frame_er, d.frame_on))::uuid::text"
HAS_DEPEND_SIGNATURE_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'depend'::regclass
               AND attname = 'str_signature' AND NOT attisdropped)
"""

# The new job's counters, absolute, from its frames. cuesched's own frame-count triggers already
# counted the insert (this then writes the same values); on a Cuebot database they are not
# installed, and Cuebot's trigger counts only state changes after SETUP, never an insert, so
# without this a job's waiting count stays 0 and it is never dispatched. Nobody else can see
# the job before commit, so an absolute write is exact.
COUNT_NEW_JOB_SQL = """
WITH per_layer AS (
  SELECT pk_layer, count(*) AS total, {counts}
  FROM frame WHERE pk_job = %(job)s GROUP BY pk_layer
),
upd_layer AS (
  UPDATE layer_stat t SET int_total_count = c.total, {sets}
  FROM per_layer c WHERE t.pk_layer = c.pk_layer
)
UPDATE job_stat t SET int_total_count = c.total, {sets}
FROM (SELECT sum(total) AS total, {sums} FROM per_layer) c
WHERE t.pk_job = %(job)s
"""


def _count_new_job_sql() -> str:
    columns = STATE_COLUMNS.items()
    return COUNT_NEW_JOB_SQL.format(
        counts=", ".join(f"count(*) FILTER (WHERE str_state = '{state}') AS {col}" for state, col in columns),
        sets=", ".join(f"{col} = c.{col}" for _state, col in columns),
        sums=", ".join(f"sum({col}) AS {col}" for _state, col in columns),
    )


SET_GPUS_MAX_SQL = """
UPDATE layer l SET int_gpus_max = x.gpus_max
FROM unnest(%s::text[], %s::int[]) AS x(pk_layer, gpus_max) WHERE l.pk_layer = x.pk_layer
"""

# Kill step 2 and the end of step 3: frames of the job that could still start, eaten.
EAT_UNSTARTED_SQL = """
UPDATE frame SET str_state = 'EATEN', int_version = int_version + 1, ts_updated = now()
WHERE pk_job = %s AND str_state IN ('WAITING', 'DEPEND')
"""
_MARK_ROUNDS = 5  # kill steps 2 and 3 repeated until no new proc of the job appears

# The job's caps on acct_limit_change, as the job_resource insert trigger sends them.
ANNOUNCE_JOB_CAPS_SQL = f"""
WITH v AS (SELECT {acct_triggers.CURRENT_XID} AS v_xid, {acct_triggers.NEXT_SEQ} AS v_seq)
SELECT pg_notify('{LIMIT_CHANNEL}', {acct_triggers.cap_payload("job", "pk_job")})
FROM job_resource n
CROSS JOIN v
WHERE n.pk_job = %s
"""

_FRAME_FILTER = " AND (pk_frame = ANY(%(frames)s::text[]) OR str_name = ANY(%(frames)s::text[]))"
_LAYER_FILTER = " AND pk_layer = %(layer)s"

RETRY_SQL = """
UPDATE frame SET str_state = 'WAITING', int_retries = 0, int_exit_status = -1,
       int_version = int_version + 1, ts_updated = now()
WHERE pk_job = %(job)s AND str_state = 'DEAD'
"""
EAT_SQL = """
UPDATE frame SET str_state = 'EATEN', int_version = int_version + 1, ts_updated = now()
WHERE pk_job = %(job)s AND str_state IN ('WAITING', 'DEAD', 'DEPEND')
"""
REOPEN_JOB_SQL = """
UPDATE job SET str_state = 'PENDING', ts_stopped = NULL, ts_updated = now()
WHERE pk_job = %s AND str_state = 'FINISHED'
"""
FIND_FRAMES_SQL = """
SELECT pk_frame, str_name FROM frame
WHERE pk_job = %(job)s AND (pk_frame = ANY(%(frames)s::text[]) OR str_name = ANY(%(frames)s::text[]))
"""


# --- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    frames: int
    name: str = ""
    layers: int = 0
    depends: int = 0


@dataclass
class JobActionResult:
    """What an action did to one job: `changed` counts the rows (frames, or 1 for the job) it moved."""

    job_id: str
    action: str
    changed: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


class JobNotFound(LookupError):
    pass


# --- helpers ---------------------------------------------------------------------------------


def _pg() -> psycopg.Cursor[Any]:
    """A server-side-binding cursor on Django's connection, inside its current transaction.

    Django's own cursors bind parameters client-side (arrays become SQL literals, and binary
    parameters such as COMPLETE_SQL's are refused); this one sends arrays as parameters.
    """
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


def resolve_job(ref: str) -> Job:
    """A job by its id, else by its (unique) name."""
    if not isinstance(ref, str) or not ref:
        raise JobNotFound(f"no job {ref!r}")
    job = Job.objects.filter(pk=ref).first() or Job.objects.filter(str_name=ref).first()
    if job is None:
        raise JobNotFound(f"no job with id or name {ref!r}")
    return job


def _job_id(job: Job | str) -> str:
    return job.pk_job if isinstance(job, Job) else resolve_job(job).pk_job


_RETRYABLE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def _is_deadlock(exc: BaseException) -> bool:
    """Our raw cursors raise psycopg's errors, Django's cursors wrap them (the cause)."""
    return isinstance(exc, _RETRYABLE) or isinstance(exc.__cause__, _RETRYABLE)


def _username(actor: Any) -> str:
    if actor is None:
        return ""
    return actor if isinstance(actor, str) else str(actor.get_username())


def _record(
    kind: str, target: str, action: str, changed: int, actor: Any, detail: dict[str, Any] | None = None
) -> None:
    """The control's audit row, written inside the control's own transaction (see the module doc)."""
    name = Job.objects.filter(pk=target).values_list("str_name", flat=True).first() or ""
    FarmAction.objects.create(
        str_action=action,
        str_target_kind=kind,
        str_target=target,
        str_target_name=name,
        int_changed=changed,
        detail=detail or {},
        str_username=_username(actor),
    )


# --- submit ----------------------------------------------------------------------------------


def submit_job(spec: Any, *, user: str | None, actor: Any = None) -> SubmitResult:
    """Validate a spec and write the job, its caps, layers, frames and depends in one transaction.

    `user` owns the job when the spec names no user (the caller has checked that the submitter
    may submit as the spec's user). Raises SpecError with every problem; writes nothing then.
    The trigger-kept counters (job_stat, layer_stat) are right when this returns; for a
    scheduler-managed show the job's caps reach the Store through the job_resource insert and
    update notifications at commit.
    """
    try:
        with transaction.atomic(durable=True), audit_context(actor if actor is not None else user, "submit_job"):
            plan = plan_job(spec, user=user)
            return _write_job(plan)
    except IntegrityError as exc:
        # Two submissions of one name racing: the loser gets the message validation gives.
        if Job.objects.filter(str_name=spec.get("name")).exists():
            raise SpecError([f"name: a job named {spec.get('name')!r} already exists"]) from exc
        raise


def _write_job(plan: JobPlan) -> SubmitResult:
    job = Job.objects.create(
        pk_job=new_id(),
        folder=plan.folder,
        show=plan.show,
        facility=plan.facility,
        dept=plan.dept,
        str_name=plan.name,
        str_visible_name=plan.name,
        str_show=plan.show.str_name,
        str_shot=plan.shot,
        str_user=plan.user,
        str_os=plan.os,
        b_paused=plan.paused,
        int_max_retries=plan.max_retries,
        int_frame_count=plan.frame_count,
        int_layer_count=len(plan.layers),
    )
    # The fan-out trigger made job_resource with the column defaults; write only what differs.
    resource = JobResource.objects.only("int_priority", "int_max_cores", "int_max_gpus").get(job=job)
    wanted = {"int_priority": plan.priority, "int_max_cores": plan.max_cores, "int_max_gpus": plan.max_gpus}
    changed = {k: v for k, v in wanted.items() if getattr(resource, k) != v}
    if changed:
        JobResource.objects.filter(pk=resource.pk).update(**changed)

    layers = [
        Layer(
            pk_layer=new_id(),
            job=job,
            str_name=lp.name,
            str_cmd=lp.command,
            str_range=lp.range,
            int_chunk_size=lp.chunk_size,
            int_dispatch_order=lp.order,
            int_cores_min=lp.cores,
            int_mem_min=lp.memory,
            int_gpus_min=lp.gpus,
            int_gpu_mem_min=lp.gpu_memory,
            b_threadable=lp.threadable,
            str_tags=lp.str_tags,
            str_services=lp.str_services,
            int_cores_max=lp.cores_max,
            int_timeout=lp.timeout,
            int_timeout_llu=lp.timeout_llu,
        )
        for lp in plan.layers
    ]
    Layer.objects.bulk_create(layers)
    layer_ids = {lp.name: layer.pk_layer for lp, layer in zip(plan.layers, layers, strict=True)}
    # Licence limits: the layers are this transaction's own, so no frame of them runs anywhere
    # and the trigger takes no lock for them (accounting.licences).
    limit_rows = [
        LayerLimit(layer_id=layer_ids[lp.name], limit_id=limit_id) for lp in plan.layers for limit_id in lp.limit_ids
    ]
    if limit_rows:
        LayerLimit.objects.bulk_create(limit_rows)

    # Frame ids first, so the depends can name them; then the unmet-dependency count per frame.
    frame_ids: dict[str, list[str]] = {lp.name: [new_id() for _ in lp.chunks] for lp in plan.layers}
    depend_rows, unmet = _plan_depends(plan, layer_ids, frame_ids)

    cols: dict[str, list[Any]] = {
        k: [] for k in ("pk", "layer", "name", "number", "depends", "dispatch_order", "layer_order")
    }
    for lp in plan.layers:
        for chunk, pk in zip(lp.chunks, frame_ids[lp.name], strict=True):
            cols["pk"].append(pk)
            cols["layer"].append(layer_ids[lp.name])
            cols["name"].append(frame_name(chunk.number, lp.name))
            cols["number"].append(chunk.number)
            cols["depends"].append(unmet.get(pk, 0))
            cols["dispatch_order"].append(chunk.index)
            cols["layer_order"].append(lp.order)
    with _pg() as cur:
        cur.execute(INSERT_FRAMES_SQL, {"job": job.pk_job, **cols})
        cur.execute(_count_new_job_sql(), {"job": job.pk_job})
        gpus_max = [(layer_ids[lp.name], lp.gpus_max) for lp in plan.layers if lp.gpus_max]
        if gpus_max:  # only a Cuebot service sets it, and only Cuebot's layer has the column
            cur.execute(SET_GPUS_MAX_SQL, [[k for k, _ in gpus_max], [v for _, v in gpus_max]])
        if cuebot_usage.has_cuebot_usage(cur):
            cuebot_usage.record_submit(cur, job=job.pk_job, show=plan.show.pk_show, frames=len(cols["pk"]))
        if depend_rows:
            types, layer_er, layer_on, frame_er, frame_on = (list(c) for c in zip(*depend_rows, strict=True))
            signed = cur.execute(HAS_DEPEND_SIGNATURE_SQL).fetchone()[0]
            cur.execute(
                INSERT_DEPENDS_SQL.format(
                    signature_column=", str_signature" if signed else "",
                    signature=f", {DEPEND_SIGNATURE}" if signed else "",
                ),
                {
                    "job": job.pk_job,
                    "type": types,
                    "layer_er": layer_er,
                    "layer_on": layer_on,
                    "frame_er": frame_er,
                    "frame_on": frame_on,
                },
            )
    return SubmitResult(
        job_id=job.pk_job, frames=len(cols["pk"]), name=plan.name, layers=len(layers), depends=len(depend_rows)
    )


DependRow = tuple[str, str, str, str | None, str | None]  # type, layer er, layer on, frame er, frame on


def _plan_depends(
    plan: JobPlan, layer_ids: dict[str, str], frame_ids: dict[str, list[str]]
) -> tuple[list[DependRow], dict[str, int]]:
    """The depend rows, and per depending frame id the number of them it waits for."""
    rows: list[DependRow] = []
    unmet: dict[str, int] = {}
    by_name = {lp.name: lp for lp in plan.layers}
    for lp in plan.layers:
        er = layer_ids[lp.name]
        for dep in lp.depends:
            on = layer_ids[dep.on]
            if dep.kind == LAYER_ON_LAYER:
                rows.append((LAYER_ON_LAYER, er, on, None, None))
                for pk in frame_ids[lp.name]:
                    unmet[pk] = unmet.get(pk, 0) + 1
                continue
            # Frame by frame: each chunk waits for the other layer's chunks covering its frames.
            owner_of = {n: i for i, chunk in enumerate(by_name[dep.on].chunks) for n in chunk.frames}
            for chunk, pk in zip(lp.chunks, frame_ids[lp.name], strict=True):
                targets = sorted({owner_of[n] for n in chunk.frames if n in owner_of})
                rows.extend((FRAME_BY_FRAME, er, on, pk, frame_ids[dep.on][t]) for t in targets)
                if targets:
                    unmet[pk] = unmet.get(pk, 0) + len(targets)
    return rows, unmet


# --- controls --------------------------------------------------------------------------------


def pause_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    """Stop dispatching new frames of the job; running frames go on."""
    return _set_paused(_job_id(job), True, actor, "pause")


def resume_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    return _set_paused(_job_id(job), False, actor, "resume")


def _set_paused(job_id: str, paused: bool, actor: Any, action: str) -> JobActionResult:
    with transaction.atomic(durable=True), audit_context(actor, action):
        changed = Job.objects.filter(pk=job_id).exclude(b_paused=paused).update(b_paused=paused)
        _record("job", job_id, action, changed, actor)
    return JobActionResult(job_id, action, changed)


def set_priority(job: Job | str, priority: int, *, actor: Any = None) -> JobActionResult:
    """The job's dispatch priority (highest first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValidationError(f"priority must be a whole number from 0 to {MAX_PRIORITY}, not {priority!r}")
    job_id = _job_id(job)
    with transaction.atomic(durable=True), audit_context(actor, "priority"):
        changed = JobResource.objects.filter(job_id=job_id).exclude(int_priority=priority).update(int_priority=priority)
        _record("job", job_id, "priority", changed, actor, {"priority": priority})
    return JobActionResult(job_id, "priority", changed, {"priority": priority})


def set_max_cores(job: Job | str, cores: int, *, actor: Any = None, confirm_stop: bool = False) -> JobActionResult:
    """The job's core cap in whole cores (-1 unlimited, 0 books nothing), via `accounting.actions.set_job_caps`.

    That action updates job_resource.int_max_cores (centicores), whose trigger notifies the
    Store for a managed show, records the audit event and warns when running frames exceed it.
    0 stops the job booking, which an operator who meant "no limit" must not get by accident:
    it is refused unless `confirm_stop` says the caller asked for it (the CLI's --yes, the API's
    "confirm": true).
    """
    if not confirm_stop and not isinstance(cores, bool) and cores == 0:
        raise ValidationError(
            "max cores 0 books nothing for this job (-1 is unlimited): confirm it to stop the job booking",
            code="confirm_stop",
        )
    job_id = _job_id(job)
    result = accounting_actions.set_job_caps(job_id, max_cores=cores, actor=actor)
    return JobActionResult(
        job_id, "max-cores", len(result.changes), {"max_cores": cores, "warnings": list(result.warnings)}
    )


def kill_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    """Finish the job now: nothing of it starts again, every running frame is sent a kill.

    Its procs stay booked (`killing`) until their runs have ended; see the module docstring for
    the steps and why they are race-free against a booking. A deadlock with a concurrent
    booking batch (both lock frame rows) is retried.
    """
    job_id = _job_id(job)
    for attempt in range(1, _DEADLOCK_ATTEMPTS + 1):
        try:
            return _kill(job_id, actor)
        except (OperationalError, psycopg.errors.OperationalError) as exc:
            if attempt == _DEADLOCK_ATTEMPTS or not _is_deadlock(exc):
                raise
            logger.info("kill of job %s: deadlock with a concurrent writer, retrying", job_id)
    raise AssertionError("unreachable")


def _kill(job_id: str, actor: Any) -> JobActionResult:
    with transaction.atomic(durable=True), audit_context(actor, "kill"):
        finished = (
            Job.objects.filter(pk=job_id)
            .exclude(str_state="FINISHED")
            .update(str_state="FINISHED", ts_stopped=Now(), ts_updated=Now())
        )
        eaten = marked = 0
        with _pg() as cur:
            for _round in range(_MARK_ROUNDS):
                cur.execute(EAT_UNSTARTED_SQL, (job_id,))
                eaten += cur.rowcount
                cur.execute(kills.MARK_JOB_SQL, {"job": job_id})
                new = cur.rowcount
                marked += new
                if not new:
                    break
            cur.execute(kills.KILLING_OF_JOB_SQL, (job_id,))
            procs = [row[0] for row in cur.fetchall()]
            if procs:
                cur.execute(kills.NOTIFY_SQL, (job_id,))
        detail = {"finished": bool(finished), "eaten": eaten, "killing": len(procs), "procs": procs}
        _record("job", job_id, "kill", finished + eaten + marked, actor, {**detail, "procs": len(procs)})
    return JobActionResult(job_id, "kill", finished + eaten + marked, detail)


def retry_frames(
    job: Job | str, frames: Sequence[str] | None = None, *, layer: str | None = None, actor: Any = None
) -> JobActionResult:
    """DEAD frames back to WAITING with a fresh retry budget; all of the job's, or the named ones.

    `frames` are frame ids or names ('0001-render'); `layer` a layer name or id. A FINISHED job
    with frames to retry is opened again.
    """
    job_id = _job_id(job)
    with transaction.atomic(durable=True), audit_context(actor, "retry"):
        params, sql = _frame_scope(RETRY_SQL, job_id, frames, layer)
        with _pg() as cur:
            cur.execute(sql, params)
            changed = cur.rowcount
            reopened = False
            if changed:
                cur.execute(REOPEN_JOB_SQL, (job_id,))
                reopened = cur.rowcount > 0
                if reopened:
                    cur.execute(ANNOUNCE_JOB_CAPS_SQL, (job_id,))
        detail = _scope_detail(frames, layer, reopened=reopened)
        _record(*_scope_target(job_id, frames), "retry", changed, actor, detail)
    return JobActionResult(job_id, "retry", changed, {"reopened": reopened})


def eat_frames(
    job: Job | str, frames: Sequence[str] | None = None, *, layer: str | None = None, actor: Any = None
) -> JobActionResult:
    """WAITING, DEAD and DEPEND frames to EATEN (done without running), which satisfies the
    dependencies on them; a job left with nothing to run is FINISHED."""
    job_id = _job_id(job)
    with transaction.atomic(durable=True), audit_context(actor, "eat"):
        params, sql = _frame_scope(EAT_SQL, job_id, frames, layer)
        with _pg() as cur:
            cur.execute(sql, params)
            changed = cur.rowcount
            finished = False
            if changed:
                cur.execute(FINISH_JOBS_SQL, ([job_id],))
                finished = bool(cur.fetchall())
        _record(*_scope_target(job_id, frames), "eat", changed, actor, _scope_detail(frames, layer, finished=finished))
    return JobActionResult(job_id, "eat", changed, {"finished": finished})


def _frame_scope(base: str, job_id: str, frames: Sequence[str] | None, layer: str | None) -> tuple[dict[str, Any], str]:
    """The UPDATE limited to a layer and/or named frames; unknown names are an error, not a no-op."""
    params: dict[str, Any] = {"job": job_id}
    sql = base
    if layer is not None:
        found = (
            Layer.objects.filter(job_id=job_id, pk=layer).first()
            or Layer.objects.filter(job_id=job_id, str_name=layer).first()
        )
        if found is None:
            raise ValidationError(f"the job has no layer {layer!r}")
        params["layer"] = found.pk_layer
        sql += _LAYER_FILTER
    if frames is not None:
        wanted = [f for f in frames if isinstance(f, str)]
        if len(wanted) != len(frames) or not wanted:
            raise ValidationError("frames must be a non-empty list of frame names or ids")
        with _pg() as cur:
            cur.execute(FIND_FRAMES_SQL, {"job": job_id, "frames": wanted})
            known = {name for row in cur.fetchall() for name in row}
        missing = [f for f in wanted if f not in known]
        if missing:
            raise ValidationError(f"the job has no frame {', '.join(repr(m) for m in missing[:10])}")
        params["frames"] = wanted
        sql += _FRAME_FILTER
    return params, sql


def _scope_target(job_id: str, frames: Sequence[str] | None) -> tuple[str, str]:
    return ("job" if frames is None else "frame"), job_id


def _scope_detail(frames: Sequence[str] | None, layer: str | None, **extra: Any) -> dict[str, Any]:
    detail: dict[str, Any] = dict(extra)
    if frames is not None:
        detail["frames"] = list(frames)[:50]
    if layer is not None:
        detail["layer"] = layer
    return detail


# --- frame kill --------------------------------------------------------------------------


def kill_frames(job: Job | str, frames: Sequence[str], *, actor: Any = None) -> JobActionResult:
    """Stop the named RUNNING frames of a job; once their runs have ended they go back to
    WAITING (no retry counted), as OpenCue's frame kill does; eat them to stop them for good.

    Like `kill_job`, this marks their procs (`str_kill = 'FRAME'`, a job kill's mark wins) and
    notifies the scheduler, which sends the kills; the procs stay booked until the hosts report
    the runs ended. A frame that is not running is not an error: there is nothing to kill (it
    counts 0).
    """
    job_id = _job_id(job)
    wanted = [f for f in frames if isinstance(f, str)] if isinstance(frames, (list, tuple)) else []
    if not wanted or len(wanted) != len(frames):
        raise ValidationError("frames must be a non-empty list of frame names or ids")
    with transaction.atomic(durable=True), audit_context(actor, "kill_frames"):
        with _pg() as cur:
            cur.execute(FIND_FRAMES_SQL, {"job": job_id, "frames": wanted})
            known = {name for row in cur.fetchall() for name in row}
            missing = [f for f in wanted if f not in known]
            if missing:
                raise ValidationError(f"the job has no frame {', '.join(repr(m) for m in missing[:10])}")
            cur.execute(kills.MARK_FRAMES_SQL, {"job": job_id, "frames": wanted})
            procs = sorted(row[0] for row in cur.fetchall())
            if procs:
                cur.execute(kills.NOTIFY_SQL, (job_id,))
        _record("frame", job_id, "kill", len(procs), actor, {"frames": wanted[:50], "killing": len(procs)})
    return JobActionResult(job_id, "kill_frames", len(procs), {"killing": len(procs), "procs": procs})


# --- hosts ---------------------------------------------------------------------------------

HOST_LOCK_STATE = {"lock": "LOCKED", "drain": "LOCKED", "unlock": "OPEN"}


@dataclass
class HostActionResult:
    """What a host control did: the hosts whose lock state changed, and those already there."""

    action: str
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    running: int = 0  # frames still running on the hosts (drain: they finish, nothing new starts)


def lock_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """LOCKED: placement books nothing new on the hosts (booking re-checks OPEN in its own
    statement, so a booking in flight either committed first or fails); running frames go on."""
    return _set_lock(hosts, "lock", actor)


def unlock_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """OPEN again. A NIMBY_LOCKED host (its owner's lock) is unlocked too: the operator asked."""
    return _set_lock(hosts, "unlock", actor)


def drain_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """Slurm's drain: lock the hosts and let their running frames finish; the host list reads
    "draining (N running)" until the last one ends, then "drained". Nothing is killed: to empty
    a host now, kill its frames (they go back to WAITING and run elsewhere)."""
    return _set_lock(hosts, "drain", actor)


def _set_lock(hosts: Sequence[str], action: str, actor: Any) -> HostActionResult:
    ids = [h for h in hosts if isinstance(h, str)] if isinstance(hosts, (list, tuple)) else []
    if not ids or len(ids) != len(hosts):
        raise ValidationError("hosts must be a non-empty list of host ids or names")
    for attempt in range(1, _DEADLOCK_ATTEMPTS + 1):
        try:
            return _set_lock_once(ids, action, actor)
        except (OperationalError, psycopg.errors.OperationalError) as exc:
            if attempt == _DEADLOCK_ATTEMPTS or not _is_deadlock(exc):
                raise
            logger.info("host %s: deadlock with a concurrent booking, retrying", action)
    raise AssertionError("unreachable")


def _set_lock_once(ids: list[str], action: str, actor: Any) -> HostActionResult:
    state = HOST_LOCK_STATE[action]
    result = HostActionResult(action)
    with transaction.atomic(durable=True), audit_context(actor, f"host_{action}"):
        # Row locks in a fixed order: two bulk locks over overlapping hosts cannot deadlock.
        rows = list(
            Host.objects.select_for_update()
            .filter(_id_or_name(ids))
            .order_by("pk_host")
            .values_list("pk_host", "str_name", "str_lock_state")
        )
        found = {v for pk, name, _ in rows for v in (pk, name)}
        missing = [h for h in ids if h not in found]
        if missing:
            raise ValidationError(f"no host {', '.join(repr(m) for m in missing[:10])}")
        moving = [pk for pk, _name, lock in rows if lock != state]
        result.changed = [name for _pk, name, lock in rows if lock != state]
        result.unchanged = [name for _pk, name, lock in rows if lock == state]
        if moving:
            Host.objects.filter(pk__in=moving).update(str_lock_state=state, ts_last_updated=Now())
        if action == "drain":
            result.running = Proc.objects.filter(host_id__in=[r[0] for r in rows]).count()
        user = _username(actor)
        FarmAction.objects.bulk_create(
            FarmAction(
                str_action=action,
                str_target_kind="host",
                str_target=pk,
                str_target_name=name,
                int_changed=int(lock != state),
                detail={"from": lock, "to": state},
                str_username=user,
            )
            for pk, name, lock in rows
        )
    return result


def _id_or_name(ids: list[str]) -> Q:
    return Q(pk__in=ids) | Q(str_name__in=ids)
