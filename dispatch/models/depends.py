"""Dependencies between layers and frames (Cuebot's `depend` table), satisfied by the database.

Two kinds, both inside one job for now:

* LAYER_ON_LAYER: every frame of the depending layer (`*_depend_er`) waits until every frame
  of the layer it depends on (`*_depend_on`) is SUCCEEDED or EATEN. One row per layer pair.
* FRAME_BY_FRAME: a frame (chunk) of the depending layer waits for the frames (chunks) of the
  other layer that cover any of its frame numbers. One row per frame pair; a frame with no
  counterpart in the other layer does not wait.

A waiting frame is inserted in state DEPEND with `int_depend_count` = its unmet rows. The
statement-level trigger below, declared on `frame` (see `Frame.Meta.triggers`), satisfies
them for every writer (the completion path, `eat_frames`, the admin, a script): when a
statement moves frames into SUCCEEDED or EATEN, it deactivates the depends on those frames,
and on layers now wholly SUCCEEDED/EATEN, decrements the dependers' `int_depend_count`, and
moves those at zero from DEPEND to WAITING (version + 1, ts_updated = now, which is where the
time-to-book metric starts). That UPDATE fires the frame triggers again: the stat counters
move DEPEND -> WAITING, and this trigger finds no new done frame and stops.

Layer completeness is read from `layer_stat` (kept by `frame_stat_update`), which is O(1) and
also what makes it race-free: the last two frames of a layer completing in two concurrent
transactions serialise on their layer_stat row, so exactly the second one sees the layer
complete. The trigger's name sorts after `frame_stat_update`, because PostgreSQL fires the
triggers of one event in name order and this one must read the updated counters (a test
checks the order).
"""

from __future__ import annotations

import pgtrigger
from django.db import models

from dispatch.models.base import fk, now_default, pk_field

LAYER_ON_LAYER = "LAYER_ON_LAYER"
FRAME_BY_FRAME = "FRAME_BY_FRAME"
DEPEND_TYPES = (LAYER_ON_LAYER, FRAME_BY_FRAME)
DONE_STATES = ("SUCCEEDED", "EATEN")

# Fires after pgtrigger_frame_stat_update_* ('w' > 's'): it reads the counters that trigger writes.
SATISFY_TRIGGER_NAME = "frame_when_done_satisfy_depends"

_DONE = "('SUCCEEDED', 'EATEN')"

SATISFY_DEPENDS_SQL = f"""
    -- Cheap exit for the usual statement (frames starting, failing, waiting again).
    IF NOT EXISTS (SELECT 1 FROM new_frames WHERE str_state IN {_DONE}) THEN
        RETURN NULL;
    END IF;
    WITH done AS (
      SELECT n.pk_frame, n.pk_layer
      FROM new_frames n JOIN old_frames o ON o.pk_frame = n.pk_frame
      WHERE n.str_state IN {_DONE} AND o.str_state NOT IN {_DONE}
    ),
    by_frame AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM done
      WHERE d.pk_frame_depend_on = done.pk_frame AND d.b_active AND d.str_type = '{FRAME_BY_FRAME}'
      RETURNING d.pk_frame_depend_er
    ),
    complete_layers AS (
      SELECT ls.pk_layer FROM layer_stat ls
      WHERE ls.pk_layer IN (SELECT pk_layer FROM done)
        AND ls.int_succeeded_count + ls.int_eaten_count = ls.int_total_count
    ),
    by_layer AS (
      UPDATE depend d SET b_active = false, ts_satisfied = now()
      FROM complete_layers c
      WHERE d.pk_layer_depend_on = c.pk_layer AND d.b_active AND d.str_type = '{LAYER_ON_LAYER}'
      RETURNING d.pk_layer_depend_er
    ),
    met AS (
      SELECT pk_frame, SUM(n)::int AS n FROM (
        SELECT pk_frame_depend_er AS pk_frame, 1 AS n FROM by_frame
        UNION ALL
        SELECT f.pk_frame, 1 FROM by_layer b JOIN frame f ON f.pk_layer = b.pk_layer_depend_er
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
    WHERE f.pk_frame = met.pk_frame;
    RETURN NULL;
"""


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
        ]

    def __str__(self) -> str:
        return f"{self.str_type} {self.pk_depend}"
