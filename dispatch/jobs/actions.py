"""Every change a person or a program makes to a job: submit, pause, resume, kill, retry, eat,
priority, max cores. One function each, one durable transaction each, writing only the columns
that change. The command line, the JSON API and the admin call these and nothing else; they
check who may act, these functions do not.

Kill, and why it needs nothing from the scheduler process. The scheduler (and its launcher)
usually runs in another process than the API, the admin or a command, so `kill_job` does not
ask it to do anything: in one transaction it
1. marks the job FINISHED (the feed never returns it again),
2. eats its WAITING and DEPEND frames: a booking in flight on one of them either committed
   before this statement reached the row (then its proc is released in step 3) or fails its
   `str_state = 'WAITING'` guard afterwards, so no frame of the job can start after the kill,
3. releases every proc of the job through the completion path's own statements
   (`completion.complete_in_transaction`: proc DELETE, whose triggers send `acct_release` to the Store
   for managed shows or decrement the database-enforced totals of the others; host resources
   given back; the frame ended with exit 301, no retry counted) and eats those frames too.
What the agent still runs is stopped best effort: `launcher.kill(pk_proc)` when the caller
holds the launcher (the simulated one drops the run), and otherwise the run's own completion
report, when it comes, finds its proc gone and changes nothing (completion is keyed by proc).
A remote agent learns the same way (its proc row is gone) and is expected to stop the process.

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
from django.db.models.functions import Now

from accounting import actions as accounting_actions
from accounting import triggers as acct_triggers
from accounting.actions import audit_context
from accounting.notify import LIMIT_CHANNEL
from dispatch.engine.completion import EXIT_STATUS_KILLED, FINISH_JOBS_SQL, Completion, complete_in_transaction
from dispatch.jobs.frameset import frame_name
from dispatch.jobs.spec import JobPlan, SpecError, plan_job
from dispatch.models import Job, JobResource, Layer, LayerLimit
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


# Kill step 2 and the end of step 3: frames of the job that could still start, eaten.
EAT_UNSTARTED_SQL = """
UPDATE frame SET str_state = 'EATEN', int_version = int_version + 1, ts_updated = now()
WHERE pk_job = %s AND str_state IN ('WAITING', 'DEPEND')
"""
JOB_PROCS_SQL = "SELECT pk_proc FROM proc WHERE pk_job = %s ORDER BY pk_proc"

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
    return JobActionResult(job_id, action, changed)


def set_priority(job: Job | str, priority: int, *, actor: Any = None) -> JobActionResult:
    """The job's dispatch priority (highest first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValidationError(f"priority must be a whole number from 0 to {MAX_PRIORITY}, not {priority!r}")
    job_id = _job_id(job)
    with transaction.atomic(durable=True), audit_context(actor, "priority"):
        changed = JobResource.objects.filter(job_id=job_id).exclude(int_priority=priority).update(int_priority=priority)
    return JobActionResult(job_id, "priority", changed, {"priority": priority})


def set_max_cores(job: Job | str, cores: int, *, actor: Any = None) -> JobActionResult:
    """The job's core cap in whole cores (-1 unlimited), via `accounting.actions.set_job_caps`.

    That action updates job_resource.int_max_cores (centicores), whose trigger notifies the
    Store for a managed show, records the audit event and warns when running frames exceed it.
    """
    job_id = _job_id(job)
    result = accounting_actions.set_job_caps(job_id, max_cores=cores, actor=actor)
    return JobActionResult(
        job_id, "max-cores", len(result.changes), {"max_cores": cores, "warnings": list(result.warnings)}
    )


def kill_job(job: Job | str, *, actor: Any = None, launcher: Any = None) -> JobActionResult:
    """Finish the job now: nothing of it starts again, every running frame is released.

    See the module docstring for the steps and why they are race-free against a booking. A
    deadlock with a concurrent booking batch (both lock frame rows) is retried.
    """
    job_id = _job_id(job)
    for attempt in range(1, _DEADLOCK_ATTEMPTS + 1):
        try:
            result = _kill(job_id, actor)
            break
        except (OperationalError, psycopg.errors.OperationalError) as exc:
            if attempt == _DEADLOCK_ATTEMPTS or not _is_deadlock(exc):
                raise
            logger.info("kill of job %s: deadlock with a concurrent writer, retrying", job_id)
    if launcher is not None:
        for pk_proc in result.detail["procs"]:
            try:
                launcher.kill(pk_proc)
            except Exception:
                logger.warning("kill of job %s: launcher could not stop proc %s", job_id, pk_proc, exc_info=True)
    return result


def _kill(job_id: str, actor: Any) -> JobActionResult:
    with transaction.atomic(durable=True), audit_context(actor, "kill"):
        finished = (
            Job.objects.filter(pk=job_id)
            .exclude(str_state="FINISHED")
            .update(str_state="FINISHED", ts_stopped=Now(), ts_updated=Now())
        )
        with _pg() as cur:
            cur.execute(EAT_UNSTARTED_SQL, (job_id,))
            eaten = cur.rowcount
            cur.execute(JOB_PROCS_SQL, (job_id,))
            procs = [row[0] for row in cur.fetchall()]
            released = 0
            if procs:
                kills = [Completion(pk, EXIT_STATUS_KILLED, requeue=True) for pk in procs]
                released = complete_in_transaction(cur, kills).released
                cur.execute(EAT_UNSTARTED_SQL, (job_id,))
    detail = {"finished": bool(finished), "eaten": eaten, "released": released, "procs": procs}
    return JobActionResult(job_id, "kill", finished + eaten + released, detail)


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
