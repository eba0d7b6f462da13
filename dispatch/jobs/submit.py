"""The submit: a job spec validated into a plan (`dispatch.jobs.spec.plan_job`), then written
(the job, its caps, layers, limits, environment, frames and depends) in one durable transaction
with its `submit` audit row (its detail the owner and the layer and depend counts).
`submit_jobs` writes several jobs all or none. The depends on other jobs are written by
`dispatch.jobs.depends`, the same rows and locks as a depend added to a running job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import IntegrityError, transaction

from accounting.actions import audit_context
from dispatch import cuebot_usage
from dispatch.jobs import audit
from dispatch.jobs.action_base import pg_cursor
from dispatch.jobs.depends import DependRow, insert_depends, lock_targets, rows_on
from dispatch.jobs.frameset import frame_name
from dispatch.jobs.plan import JobPlan, SpecError
from dispatch.jobs.spec import plan_job
from dispatch.models import Job, JobEnv, JobResource, Layer, LayerEnv, LayerLimit
from dispatch.models.base import new_id
from dispatch.models.depends import FRAME_BY_FRAME, LAYER_ON_LAYER
from dispatch.models.triggers import STATE_COLUMNS

INSERT_FRAMES_SQL = """
INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, int_number, str_state, int_depend_count,
                   int_dispatch_order, int_layer_order, ts_updated)
SELECT f.pk, f.layer, %(job)s, f.name, f.number, CASE WHEN f.depends > 0 THEN 'DEPEND' ELSE 'WAITING' END,
       f.depends, f.dispatch_order, f.layer_order, now()
FROM unnest(%(pk)s::text[], %(layer)s::text[], %(name)s::text[], %(number)s::int[], %(depends)s::int[],
            %(dispatch_order)s::int[], %(layer_order)s::int[])
     AS f(pk, layer, name, number, depends, dispatch_order, layer_order)
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


LAYER_HAS_GPUS_MAX_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('layer') AND attname = 'int_gpus_max'
               AND NOT attisdropped)
"""


def _layer_has_gpus_max(cur: psycopg.Cursor[Any]) -> bool:
    return bool(cur.execute(LAYER_HAS_GPUS_MAX_SQL).fetchone()[0])


SET_GPUS_MAX_SQL = """
UPDATE layer l SET int_gpus_max = x.gpus_max
FROM unnest(%s::text[], %s::int[]) AS x(pk_layer, gpus_max) WHERE l.pk_layer = x.pk_layer
"""


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    frames: int
    name: str = ""
    layers: int = 0
    depends: int = 0


def submit_job(spec: Any, *, user: str | None, actor: Any = None) -> SubmitResult:
    """Validate a spec and write the job, its caps, layers, frames and depends in one transaction.

    `user` owns the job when the spec names no user (the caller has checked that the submitter
    may submit as the spec's user). Raises SpecError with every problem; writes nothing then.
    The trigger-kept counters (job_stat, layer_stat) are right when this returns; for a
    scheduler-managed show the job's caps reach the Store through the job_resource insert and
    update notifications at commit.
    """
    return submit_jobs([spec], user=user, actor=actor)[0]


def submit_jobs(specs: Sequence[Any], *, user: str | None, actor: Any = None) -> list[SubmitResult]:
    """Several jobs in one transaction, all or none: a Cuebot XML spec may hold several jobs, and
    a refused one must not leave the others launched. The SpecError lists every job's problems,
    each prefixed by its job's name when there are several. Each job gets its `submit` audit row,
    as `submit_job`'s does.

    A job may depend on another job of the same call (Cuebot's spec makes its depends after all
    its jobs): the jobs are checked and written in an order where a job depended on comes first,
    so the later one's check finds it in this transaction as it finds any job already on the farm.
    Every job is still checked when an earlier one is refused (all the problems in one answer);
    what was written then goes with the rollback. The results are in the order of `specs`.
    """
    who = actor if actor is not None else user
    several = len(specs) > 1

    def prefix(spec: Any) -> str:
        return f"job {spec.get('name')!r}: " if several and isinstance(spec, dict) else ""

    names = [s.get("name") for s in specs if isinstance(s, dict)]
    twice = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if twice:
        raise SpecError([f"name: job {n!r} is given more than once" for n in twice])
    order, errors = _submit_order(specs)
    if errors:
        raise SpecError(errors)
    try:
        with transaction.atomic(durable=True), audit_context(who, "submit_job"):
            results: dict[int, SubmitResult] = {}
            refused: set[str] = set()
            for i in order:
                spec = specs[i]
                waits = sorted(_waits_for(spec) & refused)
                if waits:
                    errors.append(f"{prefix(spec)}waits for job {', '.join(map(repr, waits))} of this spec, refused")
                    refused.add(spec.get("name"))
                    continue
                try:
                    plan = plan_job(spec, user=user)
                except SpecError as exc:
                    errors.extend(prefix(spec) + e for e in exc.errors)
                    if isinstance(spec, dict):
                        refused.add(spec.get("name"))
                    continue
                result = _write_job(plan)
                # The submit's audit row, like every control's: who submitted what, in the same commit.
                detail = {"user": plan.user, "layers": result.layers, "depends": result.depends}
                audit.record("job", result.job_id, "submit", result.frames, who, detail)
                results[i] = result
            if errors:
                raise SpecError(errors)
            return [results[i] for i in range(len(specs))]
    except IntegrityError as exc:
        # Two submissions of one name racing: the loser gets the message validation gives.
        taken = list(Job.objects.filter(str_name__in=names).values_list("str_name", flat=True))
        if taken:
            raise SpecError([f"name: a job named {name!r} already exists" for name in sorted(taken)]) from exc
        raise


def _waits_for(spec: Any) -> set[str]:
    """The names of the other jobs a spec's layers depend on (as given; plan_job checks them)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("layers"), list):
        return set()
    return {
        d["job"]
        for layer in spec["layers"]
        if isinstance(layer, dict) and isinstance(layer.get("depends"), list)
        for d in layer["depends"]
        if isinstance(d, dict) and isinstance(d.get("job"), str)
    }


def _submit_order(specs: Sequence[Any]) -> tuple[list[int], list[str]]:
    """The specs' indexes with every job another of them depends on before it, else in the given
    order; and an error for each cycle of jobs waiting for each other (none of them could start)."""
    index = {s.get("name"): i for i, s in enumerate(specs) if isinstance(s, dict)}
    order: list[int] = []
    state: dict[int, int] = {}  # 1 being placed, 2 placed
    errors: list[str] = []

    def place(i: int, path: list[int]) -> None:
        if state.get(i) == 2:
            return
        if state.get(i) == 1:
            cycle = [specs[j].get("name") for j in path[path.index(i) :]] + [specs[i].get("name")]
            errors.append(f"depends: the jobs of this spec wait for each other: {' -> '.join(cycle)}")
            return
        state[i] = 1
        for name in sorted(_waits_for(specs[i])):
            if name in index and index[name] != i:
                place(index[name], [*path, i])
        state[i] = 2
        order.append(i)

    for i in range(len(specs)):
        place(i, [])
    return order, errors


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
        b_autoeat=plan.auto_eat,
        str_email=plan.email,
        int_uid=plan.uid,
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
            str_type=lp.type,
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
    # The environment (Cuebot's job_env / layer_env), read by every launcher at launch.
    if plan.env:
        JobEnv.objects.bulk_create(
            JobEnv(pk_job_env=new_id(), job=job, str_key=k, str_value=v) for k, v in plan.env.items()
        )
    layer_env = [
        LayerEnv(pk_layer_env=new_id(), layer_id=layer_ids[lp.name], job=job, str_key=k, str_value=v)
        for lp in plan.layers
        for k, v in lp.env.items()
    ]
    if layer_env:
        LayerEnv.objects.bulk_create(layer_env)

    # Frame ids first, so the depends can name them; then the unmet-dependency count per frame.
    frame_ids: dict[str, list[str]] = {lp.name: [new_id() for _ in lp.chunks] for lp in plan.layers}
    depend_rows, unmet = _plan_depends(plan, job.pk_job, layer_ids, frame_ids)
    with pg_cursor() as cur:
        other_rows = _other_job_rows(cur, plan, job.pk_job, layer_ids, frame_ids)
    frames_of_layer = {layer_ids[lp.name]: frame_ids[lp.name] for lp in plan.layers}
    for row in other_rows:
        if row.active:  # a layer's row holds its frames, a frame-by-frame row its one frame
            for pk in [row.frame_er] if row.frame_er is not None else frames_of_layer[row.layer_er or ""]:
                unmet[pk] = unmet.get(pk, 0) + 1
    depend_rows += other_rows

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
    with pg_cursor() as cur:
        cur.execute(INSERT_FRAMES_SQL, {"job": job.pk_job, **cols})
        cur.execute(_count_new_job_sql(), {"job": job.pk_job})
        gpus_max = [(layer_ids[lp.name], lp.gpus_max) for lp in plan.layers if lp.gpus_max]
        # Only Cuebot's layer has the column: beside Cuebot its dispatcher reads it. cuesched books
        # the GPUs a frame asks, so on its own database a service's max GPUs stays on the service.
        if gpus_max and _layer_has_gpus_max(cur):
            cur.execute(SET_GPUS_MAX_SQL, [[k for k, _ in gpus_max], [v for _, v in gpus_max]])
        if cuebot_usage.has_cuebot_usage(cur):
            cuebot_usage.record_submit(cur, job=job.pk_job, show=plan.show.pk_show, frames=len(cols["pk"]))
        if depend_rows:
            insert_depends(cur, depend_rows)
    return SubmitResult(
        job_id=job.pk_job, frames=len(cols["pk"]), name=plan.name, layers=len(layers), depends=len(depend_rows)
    )


def _plan_depends(
    plan: JobPlan, job_id: str, layer_ids: dict[str, str], frame_ids: dict[str, list[str]]
) -> tuple[list[DependRow], dict[str, int]]:
    """The depend rows inside the job, and per depending frame id the number of them it waits for."""
    rows: list[DependRow] = []
    unmet: dict[str, int] = {}
    by_name = {lp.name: lp for lp in plan.layers}
    for lp in plan.layers:
        er = layer_ids[lp.name]
        for dep in lp.depends:
            if dep.job is not None:
                continue  # another job's: _other_job_rows
            assert dep.on is not None
            on = layer_ids[dep.on]
            if dep.kind == LAYER_ON_LAYER:
                rows.append(DependRow(LAYER_ON_LAYER, job_id, job_id, er, on))
                for pk in frame_ids[lp.name]:
                    unmet[pk] = unmet.get(pk, 0) + 1
                continue
            # Frame by frame: each chunk waits for the other layer's chunks covering its frames.
            owner_of = {n: i for i, chunk in enumerate(by_name[dep.on].chunks) for n in chunk.frames}
            for chunk, pk in zip(lp.chunks, frame_ids[lp.name], strict=True):
                targets = sorted({owner_of[n] for n in chunk.frames if n in owner_of})
                rows.extend(
                    DependRow(FRAME_BY_FRAME, job_id, job_id, er, on, pk, frame_ids[dep.on][t]) for t in targets
                )
                if targets:
                    unmet[pk] = unmet.get(pk, 0) + len(targets)
    return rows, unmet


def _other_job_rows(
    cur: psycopg.Cursor[Any], plan: JobPlan, job_id: str, layer_ids: dict[str, str], frame_ids: dict[str, list[str]]
) -> list[DependRow]:
    """The submitted layers' depends on other jobs, with what they wait for locked (see `lock_targets`)."""
    wanted = [(lp, dep) for lp in plan.layers for dep in lp.depends if dep.job is not None]
    if not wanted:
        return []
    lock_targets(cur, [(dep.job_id, dep.layer_id) for _lp, dep in wanted])  # type: ignore[misc]
    rows: list[DependRow] = []
    for lp, dep in wanted:
        assert dep.job_id is not None
        er_frames = list(zip(frame_ids[lp.name], (c.frames for c in lp.chunks), strict=True))
        rows += rows_on(cur, dep.kind, job_id, layer_ids[lp.name], er_frames, dep.job_id, dep.layer_id)
    return rows
