"""Dependencies between jobs while both run, and the depend rows every dependency is written as.

`add_depend` / `drop_depend` make a job (or one of its layers) wait for another job (or one of
its layers, or frame by frame), and stop it waiting: Cuebot's JOB_ON_JOB, JOB_ON_LAYER,
LAYER_ON_JOB, LAYER_ON_LAYER and FRAME_BY_FRAME. One durable transaction each, with its
`FarmAction` row ("depend", "undepend"). The submit writes its depends on other jobs through the
same `lock_targets`, `rows_on` and `insert_depends`: what is waited for is locked first, then
read (dispatch.models.depends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from django.core.exceptions import ValidationError
from django.db import transaction

from accounting.actions import audit_context
from dispatch.jobs import audit
from dispatch.jobs.action_base import (
    JobActionResult,
    JobNotFound,
    pg_cursor,
    resolve_job,
    retry_on_deadlock,
)
from dispatch.jobs.frameset import chunk_frames, parse_frames
from dispatch.jobs.spec import MAX_FRAMES_PER_JOB
from dispatch.models import Job, Layer
from dispatch.models.base import new_id
from dispatch.models.depends import (
    FRAME_BY_FRAME,
    JOB_ON_JOB,
    JOB_ON_LAYER,
    LAYER_ON_JOB,
    LAYER_ON_LAYER,
    ON_JOB,
    ON_LAYER,
    RELEASE_SQL,
)

INSERT_DEPENDS_SQL = """
INSERT INTO depend (pk_depend, str_type, pk_job_depend_er, pk_job_depend_on, pk_layer_depend_er,
                    pk_layer_depend_on, pk_frame_depend_er, pk_frame_depend_on, b_active,
                    ts_satisfied{signature_column})
SELECT d.pk, d.type, d.job_er, d.job_on, d.layer_er, d.layer_on, d.frame_er, d.frame_on,
       d.active, CASE WHEN d.active THEN NULL ELSE now() END{signature}
FROM unnest(%(pk)s::text[], %(type)s::text[], %(job_er)s::text[], %(job_on)s::text[], %(layer_er)s::text[],
            %(layer_on)s::text[], %(frame_er)s::text[], %(frame_on)s::text[], %(active)s::bool[])
     AS d(pk, type, job_er, job_on, layer_er, layer_on, frame_er, frame_on, active)
"""

# Cuebot's depend table (a database adopted with adopt_cuebot_db) requires str_signature, unique:
# Cuebot refuses a second identical depend by it. cuesched's own schema has no such column. The
# signature of an active depend is a function of what it links (as Cuebot's is), 36 characters
# like its own; a satisfied one's is its id, as Cuebot writes when it satisfies one, so the same
# dependency can be added again later.
DEPEND_SIGNATURE = (
    "CASE WHEN d.active THEN md5(concat_ws(':', d.type, d.layer_er, d.layer_on, d.frame_er, d.frame_on, "
    "CASE WHEN d.job_er <> d.job_on THEN d.job_er END, CASE WHEN d.job_er <> d.job_on THEN d.job_on END"
    "))::uuid::text ELSE d.pk END"
)
# Cuebot's depend also says whether a depend links two jobs (str_target, DependTarget's name: its
# Java reads the column back with DependTarget.valueOf, so the column's default 'Internal' is no
# value it can read, and a row left at it fails every read of what depends on its target).
DEPEND_TARGET = "CASE WHEN d.job_er = d.job_on THEN 'INTERNAL' ELSE 'EXTERNAL' END"
HAS_DEPEND_SIGNATURE_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'depend'::regclass
               AND attname = 'str_signature' AND NOT attisdropped)
"""


@dataclass(frozen=True)
class DependRow:
    """One depend row to insert; `active` false when what it waits for is already done."""

    type: str
    job_er: str
    job_on: str
    layer_er: str | None = None
    layer_on: str | None = None
    frame_er: str | None = None
    frame_on: str | None = None
    active: bool = True


def insert_depends(cur: psycopg.Cursor[Any], rows: Sequence[DependRow]) -> None:
    signed = cur.execute(HAS_DEPEND_SIGNATURE_SQL).fetchone()[0]
    cur.execute(
        INSERT_DEPENDS_SQL.format(
            signature_column=", str_signature, str_target" if signed else "",
            signature=f", {DEPEND_SIGNATURE}, {DEPEND_TARGET}" if signed else "",
        ),
        {
            "pk": [new_id() for _ in rows],
            "type": [r.type for r in rows],
            "job_er": [r.job_er for r in rows],
            "job_on": [r.job_on for r in rows],
            "layer_er": [r.layer_er for r in rows],
            "layer_on": [r.layer_on for r in rows],
            "frame_er": [r.frame_er for r in rows],
            "frame_on": [r.frame_on for r in rows],
            "active": [r.active for r in rows],
        },
    )


# --- dependencies on what runs: the targets' locks and state --------------------------------

# What a new depend waits for is locked before it is read (dispatch.models.depends): a completion
# updates the stat rows of its frame's layer and job, a job finishing updates the job row.
LOCK_LAYER_STATS_SQL = "SELECT 1 FROM layer_stat WHERE pk_layer = ANY(%s::text[]) ORDER BY pk_layer FOR SHARE"
LOCK_JOB_STATS_SQL = "SELECT 1 FROM job_stat WHERE pk_job = ANY(%s::text[]) ORDER BY pk_job FOR SHARE"
LOCK_JOBS_SQL = "SELECT 1 FROM job WHERE pk_job = ANY(%s::text[]) ORDER BY pk_job FOR SHARE"
JOB_DONE_SQL = """
SELECT j.str_state = 'FINISHED', js.int_succeeded_count + js.int_eaten_count = js.int_total_count
FROM job j JOIN job_stat js ON js.pk_job = j.pk_job WHERE j.pk_job = %s
"""
LAYER_DONE_SQL = """
SELECT ls.int_succeeded_count + ls.int_eaten_count = ls.int_total_count FROM layer_stat ls WHERE ls.pk_layer = %s
"""
LAYER_FRAMES_SQL = """
SELECT f.int_number, f.pk_frame, f.str_state IN ('SUCCEEDED', 'EATEN') FROM frame f WHERE f.pk_layer = %s
"""
LAYER_RANGE_SQL = "SELECT str_range, int_chunk_size FROM layer WHERE pk_layer = %s"


def lock_targets(cur: psycopg.Cursor[Any], targets: Sequence[tuple[str, str | None]]) -> None:
    """FOR SHARE, in one order: the layers' stat rows, the whole jobs' stat rows, the job rows."""
    layers = sorted({layer for _job, layer in targets if layer is not None})
    whole = sorted({job for job, layer in targets if layer is None})
    if layers:
        cur.execute(LOCK_LAYER_STATS_SQL, (layers,))
    if whole:
        cur.execute(LOCK_JOB_STATS_SQL, (whole,))
    cur.execute(LOCK_JOBS_SQL, (sorted({job for job, _layer in targets}),))


def rows_on(
    cur: psycopg.Cursor[Any],
    kind: str,
    er_job: str,
    er_layer: str | None,
    er_frames: Sequence[tuple[str, Sequence[int]]],
    on_job: str,
    on_layer: str | None,
) -> list[DependRow]:
    """The rows of one dependency on `on_job` (its `on_layer`), the target locked: `kind` is the
    depend type; `er_frames` the depending layer's (frame id, frame numbers) for frame by frame.
    A row whose target is done, or whose job is FINISHED, is written satisfied (not active)."""
    finished, job_done = cur.execute(JOB_DONE_SQL, (on_job,)).fetchone()
    if kind in ON_JOB:
        return [DependRow(kind, er_job, on_job, er_layer, None, active=not (finished or job_done))]
    assert on_layer is not None
    if kind in ON_LAYER:
        (layer_done,) = cur.execute(LAYER_DONE_SQL, (on_layer,)).fetchone()
        return [DependRow(kind, er_job, on_job, er_layer, on_layer, active=not (finished or layer_done))]
    # Frame by frame: the other layer's chunks (its range and chunk size) covering each frame's numbers.
    by_number = {n: (pk, done) for n, pk, done in cur.execute(LAYER_FRAMES_SQL, (on_layer,)).fetchall()}
    rng, chunk_size = cur.execute(LAYER_RANGE_SQL, (on_layer,)).fetchone()
    owner_of: dict[int, tuple[str, bool]] = {}
    for chunk in chunk_frames(parse_frames(rng, max_frames=MAX_FRAMES_PER_JOB * max(chunk_size, 1)), chunk_size):
        if chunk.number in by_number:
            owner_of.update(dict.fromkeys(chunk.frames, by_number[chunk.number]))
    rows = []
    for pk, numbers in er_frames:
        targets = sorted({owner_of[n] for n in numbers if n in owner_of})
        rows += [
            DependRow(FRAME_BY_FRAME, er_job, on_job, er_layer, on_layer, pk, on_pk, active=not (finished or done))
            for on_pk, done in targets
        ]
    return rows


# --- dependencies on running jobs ----------------------------------------------------------

DEPEND_KIND_NAMES = ("job", "layer", "frame")
# (a depending layer named?, what is waited for) -> Cuebot's depend type.
_DEPEND_TYPE = {
    (False, "job"): JOB_ON_JOB,
    (False, "layer"): JOB_ON_LAYER,
    (True, "job"): LAYER_ON_JOB,
    (True, "layer"): LAYER_ON_LAYER,
    (True, "frame"): FRAME_BY_FRAME,
}

# Held frames of a new depend: +n each, and a WAITING one to DEPEND (a running frame runs on; if
# it comes back to WAITING the feed does not start it while its count is above 0).
HOLD_FRAMES_SQL = """
UPDATE frame f
SET int_depend_count = f.int_depend_count + x.n,
    str_state = CASE WHEN f.str_state = 'WAITING' THEN 'DEPEND' ELSE f.str_state END,
    int_version = CASE WHEN f.str_state = 'WAITING' THEN f.int_version + 1 ELSE f.int_version END,
    ts_updated = CASE WHEN f.str_state = 'WAITING' THEN now() ELSE f.ts_updated END
FROM (SELECT unnest(%(frames)s::text[]) AS pk_frame, unnest(%(n)s::int[]) AS n) x, frame o
WHERE f.pk_frame = x.pk_frame AND o.pk_frame = x.pk_frame
RETURNING o.str_state = 'WAITING'
"""
FRAMES_OF_SQL = "SELECT pk_frame, int_number FROM frame WHERE {column} = %s ORDER BY pk_frame"

# Would `er` (layers) waiting for `start` (layers) close a cycle: does `start` already wait,
# through active depends, for one of `er`? Layer by layer; a job-wide row links all its layers.
CYCLE_SQL = """
WITH RECURSIVE edge AS (
  SELECT DISTINCT COALESCE(d.pk_layer_depend_er, le.pk_layer) AS er, COALESCE(d.pk_layer_depend_on, lo.pk_layer) AS on_
  FROM depend d
  LEFT JOIN layer le ON d.pk_layer_depend_er IS NULL AND le.pk_job = d.pk_job_depend_er
  LEFT JOIN layer lo ON d.pk_layer_depend_on IS NULL AND lo.pk_job = d.pk_job_depend_on
  WHERE d.b_active
),
reach(l) AS (
  SELECT unnest(%(start)s::text[])
  UNION
  SELECT e.on_ FROM edge e JOIN reach r ON e.er = r.l
)
SELECT EXISTS (SELECT 1 FROM reach WHERE l = ANY(%(er)s::text[]))
"""

MATCH_DEPENDS = """
d.b_active AND d.str_type = %(type)s AND d.pk_job_depend_er = %(er_job)s AND d.pk_job_depend_on = %(on_job)s
AND d.pk_layer_depend_er IS NOT DISTINCT FROM %(er_layer)s AND d.pk_layer_depend_on IS NOT DISTINCT FROM %(on_layer)s
"""
ACTIVE_DEPEND_SQL = f"SELECT EXISTS (SELECT 1 FROM depend d WHERE {MATCH_DEPENDS})"
DROP_DEPENDS_SQL = f"""
WITH released AS (
  UPDATE depend d SET b_active = false, ts_satisfied = now(){{signature}}
  WHERE {MATCH_DEPENDS}
  RETURNING d.str_type, d.pk_job_depend_er, d.pk_layer_depend_er, d.pk_frame_depend_er
),
{RELEASE_SQL.replace("WHERE f.pk_frame = met.pk_frame", "WHERE f.pk_frame = met.pk_frame RETURNING f.str_state")}
"""
COUNT_DROPPED_SQL = "SELECT count(*) FROM depend d WHERE {match}"


@dataclass(frozen=True)
class _DependSpec:
    """A dependency as the CLI, the API and the console name it, resolved to rows."""

    type: str
    er_job: Job
    on_job: Job
    er_layer: Layer | None
    on_layer: Layer | None

    @property
    def params(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "er_job": self.er_job.pk_job,
            "on_job": self.on_job.pk_job,
            "er_layer": self.er_layer.pk_layer if self.er_layer else None,
            "on_layer": self.on_layer.pk_layer if self.on_layer else None,
        }

    def describe(self) -> str:
        er = (
            f"layer {self.er_layer.str_name!r} of job {self.er_job.str_name!r}"
            if self.er_layer
            else (f"job {self.er_job.str_name!r}")
        )
        on = (
            f"layer {self.on_layer.str_name!r} of job {self.on_job.str_name!r}"
            if self.on_layer
            else (f"job {self.on_job.str_name!r}")
        )
        how = " frame by frame" if self.type == FRAME_BY_FRAME else ""
        return f"{er} on {on}{how}"

    @property
    def detail(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "on_job": self.on_job.pk_job,
            "on_job_name": self.on_job.str_name,
            "layer": self.er_layer.str_name if self.er_layer else None,
            "on_layer": self.on_layer.str_name if self.on_layer else None,
        }


def _layer_of(job: Job, ref: str | None, what: str) -> Layer | None:
    if ref is None:
        return None
    if not isinstance(ref, str) or not ref:
        raise ValidationError(f"{what} must be a layer name")
    found = Layer.objects.filter(job=job, str_name=ref).first() or Layer.objects.filter(job=job, pk=ref).first()
    if found is None:
        known = ", ".join(Layer.objects.filter(job=job).order_by("str_name").values_list("str_name", flat=True)[:50])
        raise ValidationError(f"job {job.str_name!r} has no layer {ref!r} (layers: {known})")
    return found


def _depend_spec(
    job: Job | str, on_job: Job | str, layer: str | None, on_layer: str | None, kind: str | None
) -> _DependSpec:
    """Validate the arguments of `add_depend` / `drop_depend`; a ValidationError says what is wrong."""
    er_job = job if isinstance(job, Job) else resolve_job(job)
    if isinstance(on_job, Job):
        other = on_job
    else:
        try:
            other = resolve_job(on_job)
        except JobNotFound:
            raise ValidationError(f"no job with id or name {on_job!r} to depend on") from None
    if kind is None:
        kind = "layer" if on_layer is not None else "job"
    if kind not in DEPEND_KIND_NAMES:
        raise ValidationError(f"the type must be job, layer or frame, not {kind!r}")
    if kind == "job" and on_layer is not None:
        raise ValidationError("a job dependency waits for the whole other job: give no on-layer, or type layer")
    if kind in ("layer", "frame") and on_layer is None:
        raise ValidationError(f"a {kind} dependency needs the other job's layer (on-layer)")
    if kind == "frame" and layer is None:
        raise ValidationError("a frame-by-frame dependency needs the depending layer (layer) too")
    er_layer = _layer_of(er_job, layer, "layer")
    on = _layer_of(other, on_layer, "on-layer")
    if other.pk_job == er_job.pk_job and (er_layer is None or on is None or er_layer.pk_layer == on.pk_layer):
        raise ValidationError(f"job {er_job.str_name!r} cannot depend on itself (name two different layers of it)")
    return _DependSpec(_DEPEND_TYPE[(er_layer is not None, kind)], er_job, other, er_layer, on)


def add_depend(
    job: Job | str,
    on_job: Job | str,
    *,
    layer: str | None = None,
    on_layer: str | None = None,
    kind: str | None = None,
    actor: Any = None,
) -> JobActionResult:
    """Make `job` (or its `layer`) wait for `on_job` (or its `on_layer`; `kind` job, layer or
    frame by frame), while both run: Cuebot's JOB_ON_JOB, JOB_ON_LAYER, LAYER_ON_JOB,
    LAYER_ON_LAYER and FRAME_BY_FRAME.

    One durable transaction with its `FarmAction` row ("depend"). What is waited for is locked
    first and then read (dispatch.models.depends): when it is already done, or its job FINISHED,
    the depend is written satisfied and nothing waits. Otherwise each held frame's count goes up
    and its WAITING frames move to DEPEND; the frame and job triggers release them when the
    target is done, or its job finishes or is killed. Refused with a ValidationError, writing
    nothing: an unknown job or layer, a dependency on itself, a FINISHED depending job, one
    already there, or one that would close a cycle.
    """
    spec = _depend_spec(job, on_job, layer, on_layer, kind)
    return retry_on_deadlock(lambda: _add_depend(spec, actor), f"depend of job {spec.er_job.pk_job}")


def _add_depend(spec: _DependSpec, actor: Any) -> JobActionResult:
    er_job = spec.er_job.pk_job
    with transaction.atomic(durable=True), audit_context(actor, "depend"), pg_cursor() as cur:
        if cur.execute("SELECT str_state FROM job WHERE pk_job = %s", (er_job,)).fetchone()[0] == "FINISHED":
            raise ValidationError(f"job {spec.er_job.str_name!r} is finished: it has nothing left to wait")
        if cur.execute(ACTIVE_DEPEND_SQL, spec.params).fetchone()[0]:
            raise ValidationError(f"{spec.describe()}: that dependency is already there")
        er_layers = [spec.er_layer.pk_layer] if spec.er_layer else _layers_of(cur, er_job)
        start = [spec.on_layer.pk_layer] if spec.on_layer else _layers_of(cur, spec.on_job.pk_job)
        if cur.execute(CYCLE_SQL, {"start": start, "er": er_layers}).fetchone()[0]:
            raise ValidationError(f"{spec.describe()}: the other side already waits for this one (a cycle)")
        on_layer = spec.on_layer.pk_layer if spec.on_layer else None
        lock_targets(cur, [(spec.on_job.pk_job, on_layer)])
        column, scope = ("pk_layer", spec.er_layer.pk_layer) if spec.er_layer else ("pk_job", er_job)
        er_frames = cur.execute(FRAMES_OF_SQL.format(column=column), (scope,)).fetchall()
        if spec.type == FRAME_BY_FRAME:
            assert spec.er_layer is not None
            numbers = _chunk_numbers(spec.er_layer)
            pairs = [(pk, numbers.get(n, (n,))) for pk, n in er_frames]
        else:
            pairs = []
        er_layer = spec.er_layer.pk_layer if spec.er_layer else None
        rows = rows_on(cur, spec.type, er_job, er_layer, pairs, spec.on_job.pk_job, on_layer)
        held: dict[str, int] = {}
        for row in rows:
            if row.active:
                for pk in [row.frame_er] if row.frame_er is not None else [pk for pk, _n in er_frames]:
                    held[pk] = held.get(pk, 0) + 1
        insert_depends(cur, rows)
        moved = 0
        if held:
            frames = sorted(held)
            cur.execute(HOLD_FRAMES_SQL, {"frames": frames, "n": [held[pk] for pk in frames]})
            moved = sum(1 for (was_waiting,) in cur.fetchall() if was_waiting)
        active = sum(r.active for r in rows)
        detail = {**spec.detail, "depends": len(rows), "active": active, "held": len(held), "to_depend": moved}
        if not active:
            detail["satisfied"] = True  # the target was already done: nothing waits
        audit.record("job", er_job, "depend", moved, actor, detail)
    return JobActionResult(er_job, "depend", moved, detail)


def drop_depend(
    job: Job | str,
    on_job: Job | str,
    *,
    layer: str | None = None,
    on_layer: str | None = None,
    kind: str | None = None,
    actor: Any = None,
) -> JobActionResult:
    """Drop the active dependency `add_depend` (or the spec) made with the same arguments, in one
    durable transaction with its `FarmAction` row ("undepend"): its rows are satisfied and each
    held frame's count goes down; a DEPEND frame with no other unmet dependency is WAITING again.
    None to drop is a ValidationError (nothing written)."""
    spec = _depend_spec(job, on_job, layer, on_layer, kind)
    return retry_on_deadlock(lambda: _drop_depend(spec, actor), f"undepend of job {spec.er_job.pk_job}")


def _drop_depend(spec: _DependSpec, actor: Any) -> JobActionResult:
    er_job = spec.er_job.pk_job
    with transaction.atomic(durable=True), audit_context(actor, "undepend"), pg_cursor() as cur:
        signed = cur.execute(HAS_DEPEND_SIGNATURE_SQL).fetchone()[0]
        dropped = cur.execute(COUNT_DROPPED_SQL.format(match=MATCH_DEPENDS), spec.params).fetchone()[0]
        if not dropped:
            raise ValidationError(f"{spec.describe()}: there is no such dependency waiting to drop")
        cur.execute(DROP_DEPENDS_SQL.format(signature=", str_signature = d.pk_depend" if signed else ""), spec.params)
        released = sum(1 for (state,) in cur.fetchall() if state == "WAITING")
        detail = {**spec.detail, "depends": dropped, "released": released}
        audit.record("job", er_job, "undepend", released, actor, detail)
    return JobActionResult(er_job, "undepend", released, detail)


def _layers_of(cur: psycopg.Cursor[Any], job_id: str) -> list[str]:
    return [r[0] for r in cur.execute("SELECT pk_layer FROM layer WHERE pk_job = %s", (job_id,)).fetchall()]


def _chunk_numbers(layer: Layer) -> dict[int, tuple[int, ...]]:
    """A layer's chunks by their first frame number (the frame row's int_number) -> their frames."""
    frames = parse_frames(layer.str_range, max_frames=MAX_FRAMES_PER_JOB * max(layer.int_chunk_size, 1))
    return {c.number: c.frames for c in chunk_frames(frames, layer.int_chunk_size)}
