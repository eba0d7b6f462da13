"""Dependencies between jobs, layers and frames (Cuebot's `depend` table), satisfied by the database.

Five of Cuebot's types, each naming what waits (`*_depend_er`) and what it waits for (`*_depend_on`),
inside one job or across jobs:

* JOB_ON_JOB / JOB_ON_LAYER: every frame of the depending job waits until the other job is done
  (every frame SUCCEEDED or EATEN) / the other layer is done. One row.
* LAYER_ON_JOB / LAYER_ON_LAYER: every frame of the depending layer waits until the other job /
  layer is done. One row per layer pair.
* FRAME_BY_FRAME: a frame (chunk) of the depending layer waits for the frames (chunks) of the
  other layer that cover any of its frame numbers. One row per frame pair; a frame with no
  counterpart in the other layer does not wait.

An active row holds one unit of `int_depend_count` on every frame it names as depending (all the
frames of the job or layer, or the one frame); a WAITING frame with a count is moved to DEPEND by
the writer that adds the row. A frame is inserted in state DEPEND with its unmet rows counted.

A row stops holding (`b_active` false, `ts_satisfied`) when what it waits for is done, when the
job it waits on is FINISHED (done, or killed: a killed job's frames never finish, and its
dependers must not wait for ever, OpenCue #2219), or when it is dropped (`actions.drop_depend`).
Each of these decrements the held frames' counts in the same statement and moves those at zero
from DEPEND to WAITING (version + 1, ts_updated = now, which is where the time-to-book metric
starts): `RELEASE_SQL`, one text used by the three writers:

* the statement-level trigger on `frame` (`Frame.Meta.triggers`), for every writer (the completion
  path, `eat_frames`, the admin, a script): when a statement moves frames into SUCCEEDED or EATEN,
  it satisfies the depends on those frames, on layers now wholly SUCCEEDED/EATEN and on jobs now
  wholly so. Its UPDATE of frame fires the frame triggers again: the stat counters move
  DEPEND -> WAITING, and this trigger finds no new done frame and stops;
* the row trigger on `job` (`Job.Meta.triggers`), when a job becomes FINISHED: every active depend
  on it, whatever its type;
* `actions.drop_depend`.

Layer and job completeness are read from `layer_stat` / `job_stat` (kept by `frame_stat_update`),
which is O(1) and also what makes it race-free: the last two frames of a layer completing in two
concurrent transactions serialise on their layer_stat row, so exactly the second one sees the
layer complete. A writer adding a depend on another job's frames, layer or job takes those stat
rows and the job row FOR SHARE before it reads whether they are done, so a completion (which
updates them) either committed first, and the new row is written satisfied, or waits for it and
then sees the new row. The trigger's name sorts after `frame_stat_update`, because PostgreSQL
fires the triggers of one event in name order and this one must read the updated counters (a
test checks the order).
"""

from __future__ import annotations

import pgtrigger
from django.db import models

from dispatch.models.base import fk, now_default, pk_field

JOB_ON_JOB = "JOB_ON_JOB"
JOB_ON_LAYER = "JOB_ON_LAYER"
LAYER_ON_JOB = "LAYER_ON_JOB"
LAYER_ON_LAYER = "LAYER_ON_LAYER"
FRAME_BY_FRAME = "FRAME_BY_FRAME"
DEPEND_TYPES = (JOB_ON_JOB, JOB_ON_LAYER, LAYER_ON_JOB, LAYER_ON_LAYER, FRAME_BY_FRAME)
# What a row holds: the frames of its depending job, of its depending layer, or its one frame.
HOLDS_JOB = (JOB_ON_JOB, JOB_ON_LAYER)
HOLDS_LAYER = (LAYER_ON_JOB, LAYER_ON_LAYER)
# What a row waits for: a whole job, a whole layer, or one frame.
ON_JOB = (JOB_ON_JOB, LAYER_ON_JOB)
ON_LAYER = (JOB_ON_LAYER, LAYER_ON_LAYER)
DONE_STATES = ("SUCCEEDED", "EATEN")

# Fires after pgtrigger_frame_stat_update_* ('w' > 's'): it reads the counters that trigger writes.
SATISFY_TRIGGER_NAME = "frame_when_done_satisfy_depends"

_DONE = "('SUCCEEDED', 'EATEN')"


def _sql_list(values: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


# The tail of a statement whose CTE `released` holds the depend rows that just stopped holding
# (the RETURNING of an UPDATE depend ... SET b_active = false): each held frame's count goes down
# by the rows it lost, and a DEPEND frame at zero becomes WAITING.
RELEASE_SQL = f"""
    met AS (
      SELECT pk_frame, SUM(n)::int AS n FROM (
        SELECT r.pk_frame_depend_er AS pk_frame, 1 AS n FROM released r
        WHERE r.str_type = '{FRAME_BY_FRAME}'
        UNION ALL
        SELECT f.pk_frame, 1 FROM released r JOIN frame f ON f.pk_layer = r.pk_layer_depend_er
        WHERE r.str_type IN {_sql_list(HOLDS_LAYER)}
        UNION ALL
        SELECT f.pk_frame, 1 FROM released r JOIN frame f ON f.pk_job = r.pk_job_depend_er
        WHERE r.str_type IN {_sql_list(HOLDS_JOB)}
      ) x GROUP BY pk_frame
    )
    UPDATE frame f
    SET int_depend_count = GREATEST(f.int_depend_count - met.n, 0),
        str_state = CASE WHEN f.str_state = 'DEPEND' AND f.int_depend_count <= met.n
                         THEN 'WAITING' ELSE f.str_state END,
        int_version = CASE WHEN f.str_state = 'DEPEND' AND f.int_depend_count <= met.n
                           THEN f.int_version + 1 ELSE f.int_version END,
        ts_updated = CASE WHEN f.str_state = 'DEPEND' AND f.int_depend_count <= met.n
                          THEN now() ELSE f.ts_updated END
    FROM met
    WHERE f.pk_frame = met.pk_frame
"""
_RETURNING = "RETURNING d.str_type, d.pk_job_depend_er, d.pk_layer_depend_er, d.pk_frame_depend_er"

SATISFY_DEPENDS_SQL = f"""
    -- Cheap exit for the usual statement (frames starting, failing, waiting again).
    IF NOT EXISTS (SELECT 1 FROM new_frames WHERE str_state IN {_DONE}) THEN
        RETURN NULL;
    END IF;
    WITH done AS (
      SELECT n.pk_frame, n.pk_layer, n.pk_job
      FROM new_frames n JOIN old_frames o ON o.pk_frame = n.pk_frame
      WHERE n.str_state IN {_DONE} AND o.str_state NOT IN {_DONE}
    ),
    complete_layers AS (
      SELECT ls.pk_layer FROM layer_stat ls
      WHERE ls.pk_layer IN (SELECT pk_layer FROM done)
        AND ls.int_succeeded_count + ls.int_eaten_count = ls.int_total_count
    ),
    complete_jobs AS (
      SELECT js.pk_job FROM job_stat js
      WHERE js.pk_job IN (SELECT pk_job FROM done)
        AND js.int_succeeded_count + js.int_eaten_count = js.int_total_count
    ),
    -- One UPDATE per kind of target, each through its index (disjoint by type).
    by_frame AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM done
      WHERE d.pk_frame_depend_on = done.pk_frame AND d.b_active AND d.str_type = '{FRAME_BY_FRAME}'
      {_RETURNING}
    ),
    by_layer AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM complete_layers c
      WHERE d.pk_layer_depend_on = c.pk_layer AND d.b_active AND d.str_type = '{LAYER_ON_LAYER}'
      {_RETURNING}
    ),
    job_by_layer AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM complete_layers c
      WHERE d.pk_layer_depend_on = c.pk_layer AND d.b_active AND d.str_type = '{JOB_ON_LAYER}'
      {_RETURNING}
    ),
    by_job AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM complete_jobs c
      WHERE d.pk_job_depend_on = c.pk_job AND d.b_active AND d.str_type IN {_sql_list(ON_JOB)}
      {_RETURNING}
    ),
    released AS (
      SELECT * FROM by_frame UNION ALL SELECT * FROM by_layer
      UNION ALL SELECT * FROM job_by_layer UNION ALL SELECT * FROM by_job
    ),
    {RELEASE_SQL};
    RETURN NULL;
"""

# A job that becomes FINISHED (all done, or killed with frames that will never finish) satisfies
# every depend on it: nothing waits on a job that runs no more.
JOB_FINISHED_SQL = f"""
    WITH released AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      WHERE d.pk_job_depend_on = NEW.pk_job AND d.b_active
      {_RETURNING}
    ),
    {RELEASE_SQL};
    RETURN NULL;
"""
JOB_FINISHED_TRIGGER_NAME = "job_finished_satisfy_depends"


def frame_depend_triggers() -> list[pgtrigger.Trigger]:
    """The trigger on `frame` that satisfies dependencies (attached in Frame.Meta.triggers)."""
    return [
        pgtrigger.Trigger(
            name=SATISFY_TRIGGER_NAME,
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_frames", new="new_frames"),
            func=SATISFY_DEPENDS_SQL,
        )
    ]


def job_depend_triggers() -> list[pgtrigger.Trigger]:
    """The trigger on `job` that satisfies what depends on a job once it is FINISHED (Job.Meta.triggers)."""
    return [
        pgtrigger.Trigger(
            name=JOB_FINISHED_TRIGGER_NAME,
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition("OLD.str_state IS DISTINCT FROM 'FINISHED' AND NEW.str_state = 'FINISHED'"),
            func=JOB_FINISHED_SQL,
        )
    ]


class Depend(models.Model):
    """One dependency; `b_active` until satisfied (then `ts_satisfied`)."""

    pk_depend = pk_field("pk_depend")
    str_type = models.CharField(max_length=36, choices=[(t, t) for t in DEPEND_TYPES])
    # Indexed in Meta.indexes (plain btrees: a field index on a varchar would add a second,
    # pattern-ops one per column, which no query here uses).
    job_depend_er = fk("dispatch.Job", "pk_job_depend_er", related_name="depends", db_index=False)
    job_depend_on = fk("dispatch.Job", "pk_job_depend_on", db_index=False)
    layer_depend_er = fk("dispatch.Layer", "pk_layer_depend_er", null=True, db_index=False)
    layer_depend_on = fk("dispatch.Layer", "pk_layer_depend_on", null=True, db_index=False)
    frame_depend_er = fk("dispatch.Frame", "pk_frame_depend_er", null=True, db_index=False)
    frame_depend_on = fk("dispatch.Frame", "pk_frame_depend_on", null=True, db_index=False)
    b_active = models.BooleanField(db_default=True, default=True)
    ts_created = models.DateTimeField(db_default=now_default())
    ts_satisfied = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "depend"
        # Every reference is indexed: deleting a job, layer or frame checks its foreign keys
        # here, and without an index each deleted row scans the whole table (a purge of
        # 100,000 frames took minutes). The trigger finds frame-by-frame rows through
        # i_depend_frame_on, and layer-on-layer rows through the small partial index (the
        # plain layer_on index also holds every frame-by-frame row of the layer). No index
        # reads b_active or ts_satisfied, so satisfying a depend can be a HOT update.
        indexes = [
            models.Index(fields=["job_depend_er"], name="i_depend_job_er"),
            models.Index(fields=["job_depend_on"], name="i_depend_job_on"),
            models.Index(fields=["layer_depend_er"], name="i_depend_layer_er"),
            models.Index(fields=["layer_depend_on"], name="i_depend_layer_on"),
            models.Index(fields=["frame_depend_er"], name="i_depend_frame_er"),
            models.Index(fields=["frame_depend_on"], name="i_depend_frame_on"),
            models.Index(
                fields=["layer_depend_on"],
                name="i_depend_layer_on_layer",
                condition=models.Q(str_type=LAYER_ON_LAYER),
            ),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(str_type__in=DEPEND_TYPES), name="c_depend_type"),
            models.CheckConstraint(
                condition=~models.Q(str_type=FRAME_BY_FRAME)
                | models.Q(frame_depend_er__isnull=False, frame_depend_on__isnull=False),
                name="c_depend_frame_by_frame_has_frames",
            ),
            models.CheckConstraint(
                condition=~models.Q(str_type=LAYER_ON_LAYER)
                | models.Q(layer_depend_er__isnull=False, layer_depend_on__isnull=False),
                name="c_depend_layer_on_layer_has_layers",
            ),
            models.CheckConstraint(
                condition=~models.Q(str_type=LAYER_ON_JOB) | models.Q(layer_depend_er__isnull=False),
                name="c_depend_layer_on_job_has_layer",
            ),
            models.CheckConstraint(
                condition=~models.Q(str_type=JOB_ON_LAYER) | models.Q(layer_depend_on__isnull=False),
                name="c_depend_job_on_layer_has_layer",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.str_type} {self.pk_depend}"
