"""The controls of a job, its layers and its frames: pause, resume, kill, retry, eat, priority,
max and min cores, max retries, auto-eat, a layer's min cores and memory; frame kill. One function each,
one durable transaction each, writing only the columns that change, and one `FarmAction` row in
that same transaction (`dispatch.jobs.audit`), so the audit trail holds a control exactly when
it committed. The command line, the JSON API, the OpenCue client API and the console call these
and nothing else; they check who may act, these functions do not.

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

from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from accounting import actions as accounting_actions
from accounting.actions import audit_context
from dispatch.engine import kills
from dispatch.engine.completion import FINISH_JOBS_SQL
from dispatch.jobs import audit
from dispatch.jobs.action_base import JobActionResult, JobNotFound, job_id_of, pg_cursor, retry_on_deadlock
from dispatch.models import Job, JobResource, Layer

MAX_PRIORITY = 1_000_000

# --- SQL -----------------------------------------------------------------------------------

# Kill step 2 and the end of step 3: frames of the job that could still start, eaten.
EAT_UNSTARTED_SQL = """
UPDATE frame SET str_state = 'EATEN', int_version = int_version + 1, ts_updated = now()
WHERE pk_job = %s AND str_state IN ('WAITING', 'DEPEND')
"""
_MARK_ROUNDS = 5  # kill steps 2 and 3 repeated until no new proc of the job appears

# The job's caps on acct_limit_change, as the job_resource insert trigger sends them, through the
# outbox (the `notify_outbox` migration of accounting: a function with its owner's rights, since
# the console's role may not write the outbox; it reads the row under FOR SHARE).
ANNOUNCE_JOB_CAPS_SQL = "SELECT cuesched_announce_job_caps(%s)"

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


# --- controls --------------------------------------------------------------------------------


def pause_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    """Stop dispatching new frames of the job; running frames go on."""
    return _set_paused(job_id_of(job), True, actor, "pause")


def resume_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    return _set_paused(job_id_of(job), False, actor, "resume")


def _set_paused(job_id: str, paused: bool, actor: Any, action: str) -> JobActionResult:
    return _set_column(job_id, Job.objects.filter(pk=job_id), "b_paused", paused, action, actor)


def _set_column(
    job_id: str,
    rows: QuerySet[Any],
    column: str,
    value: Any,
    action: str,
    actor: Any,
    detail: dict[str, Any] | None = None,
) -> JobActionResult:
    """One column of `rows` set to `value` where it differs, with the job's audit row, in one durable
    transaction: the shape of every control that changes one setting."""
    with transaction.atomic(durable=True), audit_context(actor, action):
        changed = rows.exclude(**{column: value}).update(**{column: value})
        audit.record("job", job_id, action, changed, actor, detail)
    return JobActionResult(job_id, action, changed, detail or {})


def set_priority(job: Job | str, priority: int, *, actor: Any = None) -> JobActionResult:
    """The job's dispatch priority (highest first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValidationError(f"priority must be a whole number from 0 to {MAX_PRIORITY}, not {priority!r}")
    job_id = job_id_of(job)
    rows = JobResource.objects.filter(job_id=job_id)
    return _set_column(job_id, rows, "int_priority", priority, "priority", actor, {"priority": priority})


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
    job_id = job_id_of(job)
    result = accounting_actions.set_job_caps(job_id, max_cores=cores, actor=actor)
    return JobActionResult(
        job_id, "max-cores", len(result.changes), {"max_cores": cores, "warnings": list(result.warnings)}
    )


MAX_RETRIES_LIMIT = 32767  # job.int_max_retries is a smallint
# Cuebot's floors (Dispatcher.CORE_POINTS_RESERVED_MIN, LayerDao.MEM_RESERVED_MIN): a layer asks for
# at least this much, so a layer edited to 0 still books something the host can account.
LAYER_MIN_CORES_FLOOR = 1  # centicores
LAYER_MIN_MEMORY_FLOOR = 262144  # KB (256 MB)


def _centicores(cores: Any, what: str) -> int:
    """Float cores (the wire's unit, Cuebot's Convert.coresToCoreUnits) to centicores, >= 0."""
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores != cores:
        raise ValidationError(f"{what} must be a number of cores, not {cores!r}")
    if cores < 0:
        raise ValidationError(f"{what} cannot be negative, not {cores!r}")
    if cores > accounting_actions.MAX_CAP_CORES:
        raise ValidationError(f"{what} of {cores:,} cores is above the limit of {accounting_actions.MAX_CAP_CORES:,}")
    return int(cores * 100 + 0.5)


def set_min_cores(job: Job | str, cores: float, *, actor: Any = None) -> JobActionResult:
    """The job's minimum cores (job_resource.int_min_cores): the share it is booked before others
    above their minimum. Not a cap: nothing is refused by it, so it sends the Store nothing."""
    value = _centicores(cores, "min cores")
    job_id = job_id_of(job)
    rows = JobResource.objects.filter(job_id=job_id)
    return _set_column(job_id, rows, "int_min_cores", value, "min_cores", actor, {"min_cores": value / 100})


def set_max_retries(job: Job | str, retries: int, *, actor: Any = None) -> JobActionResult:
    """How many times a failed frame of the job is retried before it is DEAD (0: never)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES_LIMIT:
        raise ValidationError(f"max retries must be a whole number from 0 to {MAX_RETRIES_LIMIT}, not {retries!r}")
    job_id = job_id_of(job)
    rows = Job.objects.filter(pk=job_id)
    return _set_column(job_id, rows, "int_max_retries", retries, "max_retries", actor, {"max_retries": retries})


# What Cuebot's JobDao.updateAutoEat writes beside b_autoeat: max retries 0 when auto-eat goes on
# (an eaten frame is never retried, so the figure on the job says so), 1 when it goes off.
AUTO_EAT_MAX_RETRIES = {True: 0, False: 1}


def set_auto_eat(job: Job | str, on: bool, *, actor: Any = None) -> JobActionResult:
    """Auto-eat on or off (job.b_autoeat): a failed frame of an auto-eat job is EATEN instead of
    retried or DEAD (dispatch.engine.completion), which releases what waits for it as an eat does.

    As Cuebot's JobDao.updateAutoEat, on also sets the job's max retries to 0 and off sets them
    to 1; the audit detail says so and keeps the figure it replaced (`was`). Unlike Cuebot, off on
    a job that is not auto-eating writes nothing: it would otherwise cut a job's retries to 1 for a
    setting it never had. Frames already DEAD stay DEAD (Cuebot's call eats none either; CueGUI
    eats them with a second call): eat them with `eat_frames`.
    """
    if not isinstance(on, bool):
        raise ValidationError(f"auto-eat is true or false, not {on!r}")
    job_id = job_id_of(job)
    retries = AUTO_EAT_MAX_RETRIES[on]
    with transaction.atomic(durable=True), audit_context(actor, "auto_eat"):
        before = (
            Job.objects.select_for_update(no_key=True)
            .filter(pk=job_id)
            .values_list("b_autoeat", "int_max_retries")
            .first()
        )
        if before is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        was_on, was_retries = before
        changed = 0
        if (on and (not was_on or was_retries != retries)) or (not on and was_on):
            changed = Job.objects.filter(pk=job_id).update(b_autoeat=on, int_max_retries=retries)
        detail: dict[str, Any] = {"auto_eat": on}
        if changed:
            detail.update(max_retries=retries, was=was_retries)
        audit.record("job", job_id, "auto_eat", changed, actor, detail)
    return JobActionResult(job_id, "auto_eat", changed, detail)


def _layer(job_id: str, layer: str) -> Layer:
    found = (
        Layer.objects.filter(job_id=job_id, pk=layer).first()
        or Layer.objects.filter(job_id=job_id, str_name=layer).first()
    )
    if found is None:
        raise ValidationError(f"the job has no layer {layer!r}")
    return found


def set_layer_min_cores(job: Job | str, layer: str, cores: float, *, actor: Any = None) -> JobActionResult:
    """The cores each frame of the layer books (layer.int_cores_min); frames already running keep
    what they booked. Below Cuebot's floor it is the floor, as in Cuebot."""
    value = max(_centicores(cores, "min cores"), LAYER_MIN_CORES_FLOOR)
    job_id = job_id_of(job)
    found = _layer(job_id, layer)
    detail = {"layer": found.str_name, "min_cores": value / 100}
    rows = Layer.objects.filter(pk=found.pk)
    return _set_column(job_id, rows, "int_cores_min", value, "layer_min_cores", actor, detail)


def set_layer_min_memory(job: Job | str, layer: str, kb: int, *, actor: Any = None) -> JobActionResult:
    """The memory (KB) each frame of the layer books; at least Cuebot's floor (256 MB)."""
    if isinstance(kb, bool) or not isinstance(kb, int) or kb < 0:
        raise ValidationError(f"min memory must be a whole number of KB, not {kb!r}")
    value = max(kb, LAYER_MIN_MEMORY_FLOOR)
    job_id = job_id_of(job)
    found = _layer(job_id, layer)
    detail = {"layer": found.str_name, "min_memory_kb": value}
    rows = Layer.objects.filter(pk=found.pk)
    return _set_column(job_id, rows, "int_mem_min", value, "layer_min_memory", actor, detail)


def kill_job(job: Job | str, *, actor: Any = None) -> JobActionResult:
    """Finish the job now: nothing of it starts again, every running frame is sent a kill.

    Its procs stay booked (`killing`) until their runs have ended; see the module docstring for
    the steps and why they are race-free against a booking. A deadlock with a concurrent
    booking batch (both lock frame rows) is retried.
    """
    job_id = job_id_of(job)
    return retry_on_deadlock(lambda: _kill(job_id, actor), f"kill of job {job_id}")


def _kill(job_id: str, actor: Any) -> JobActionResult:
    with transaction.atomic(durable=True), audit_context(actor, "kill"):
        finished = (
            Job.objects.filter(pk=job_id)
            .exclude(str_state="FINISHED")
            .update(str_state="FINISHED", ts_stopped=Now(), ts_updated=Now())
        )
        eaten = marked = 0
        with pg_cursor() as cur:
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
        audit.record("job", job_id, "kill", finished + eaten + marked, actor, {**detail, "procs": len(procs)})
    return JobActionResult(job_id, "kill", finished + eaten + marked, detail)


def retry_frames(
    job: Job | str, frames: Sequence[str] | None = None, *, layer: str | None = None, actor: Any = None
) -> JobActionResult:
    """DEAD frames back to WAITING with a fresh retry budget; all of the job's, or the named ones.

    `frames` are frame ids or names ('0001-render'); `layer` a layer name or id. A FINISHED job
    with frames to retry is opened again.
    """
    job_id = job_id_of(job)
    with transaction.atomic(durable=True), audit_context(actor, "retry"):
        params, sql = _frame_scope(RETRY_SQL, job_id, frames, layer)
        with pg_cursor() as cur:
            cur.execute(sql, params)
            changed = cur.rowcount
            reopened = False
            if changed:
                cur.execute(REOPEN_JOB_SQL, (job_id,))
                reopened = cur.rowcount > 0
                if reopened:
                    cur.execute(ANNOUNCE_JOB_CAPS_SQL, (job_id,))
        detail = _scope_detail(frames, layer, reopened=reopened)
        audit.record(*_scope_target(job_id, frames), "retry", changed, actor, detail)
    return JobActionResult(job_id, "retry", changed, {"reopened": reopened})


def eat_frames(
    job: Job | str, frames: Sequence[str] | None = None, *, layer: str | None = None, actor: Any = None
) -> JobActionResult:
    """WAITING, DEAD and DEPEND frames to EATEN (done without running), which satisfies the
    dependencies on them; a job left with nothing to run is FINISHED."""
    job_id = job_id_of(job)
    with transaction.atomic(durable=True), audit_context(actor, "eat"):
        params, sql = _frame_scope(EAT_SQL, job_id, frames, layer)
        with pg_cursor() as cur:
            cur.execute(sql, params)
            changed = cur.rowcount
            finished = False
            if changed:
                cur.execute(FINISH_JOBS_SQL, ([job_id],))
                finished = bool(cur.fetchall())
        audit.record(
            *_scope_target(job_id, frames), "eat", changed, actor, _scope_detail(frames, layer, finished=finished)
        )
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
        with pg_cursor() as cur:
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
    job_id = job_id_of(job)
    wanted = [f for f in frames if isinstance(f, str)] if isinstance(frames, (list, tuple)) else []
    if not wanted or len(wanted) != len(frames):
        raise ValidationError("frames must be a non-empty list of frame names or ids")
    with transaction.atomic(durable=True), audit_context(actor, "kill_frames"):
        with pg_cursor() as cur:
            cur.execute(FIND_FRAMES_SQL, {"job": job_id, "frames": wanted})
            known = {name for row in cur.fetchall() for name in row}
            missing = [f for f in wanted if f not in known]
            if missing:
                raise ValidationError(f"the job has no frame {', '.join(repr(m) for m in missing[:10])}")
            cur.execute(kills.MARK_FRAMES_SQL, {"job": job_id, "frames": wanted})
            procs = sorted(row[0] for row in cur.fetchall())
            if procs:
                cur.execute(kills.NOTIFY_SQL, (job_id,))
        audit.record("frame", job_id, "kill", len(procs), actor, {"frames": wanted[:50], "killing": len(procs)})
    return JobActionResult(job_id, "kill_frames", len(procs), {"killing": len(procs), "procs": procs})
