"""Schema triggers of the farm tables: child-row fan-out and frame counters.

Fan-out (as Cuebot's after_insert_* triggers): a folder gets its folder_resource row, a job
its job_stat, job_resource and job_mem rows, a layer its layer_stat, layer_resource and
layer_mem rows, so every writer gets exactly one of each (the *_mem rows keyed by the job's or
layer's own id, as Cuebot's triggers key them). Accounting triggers (notifications, database-enforced caps)
live in `accounting.triggers`.

Frame counters: statement-level with transition tables: one UPDATE per touched layer and job per
statement, however many frames the statement wrote. A dispatcher that starts 500 frames
in one UPDATE therefore costs two small aggregated updates, not a thousand row updates
that would serialise on the same stat rows.
"""

from __future__ import annotations

import pgtrigger

# frame.str_state -> counter column in job_stat / layer_stat. SETUP has no counter.
STATE_COLUMNS = {
    "WAITING": "int_waiting_count",
    "RUNNING": "int_running_count",
    "DEAD": "int_dead_count",
    "DEPEND": "int_depend_count",
    "EATEN": "int_eaten_count",
    "SUCCEEDED": "int_succeeded_count",
    "CHECKPOINT": "int_checkpoint_count",
}


def _apply_sql(delta_rows: str) -> str:
    """SQL applying signed per-state deltas; `delta_rows` yields (pk_layer, pk_job, str_state, n, total)."""
    sums = ",\n  ".join(
        f"COALESCE(SUM(n) FILTER (WHERE str_state = '{state}'), 0) AS {col}"
        for state, col in STATE_COLUMNS.items()
    )
    sets = ", ".join(f"{col} = t.{col} + d.{col}" for col in [*STATE_COLUMNS.values(), "int_total_count"])
    return f"""
    WITH delta AS ({delta_rows}),
    per_layer AS (
      SELECT pk_layer, {sums},
      COALESCE(SUM(total), 0) AS int_total_count
      FROM delta GROUP BY pk_layer
    ),
    per_job AS (
      SELECT pk_job, {sums},
      COALESCE(SUM(total), 0) AS int_total_count
      FROM delta GROUP BY pk_job
    ),
    upd_layer AS (
      -- A data-modifying CTE always runs to completion, referenced or not.
      UPDATE layer_stat t SET {sets} FROM per_layer d WHERE t.pk_layer = d.pk_layer
    )
    UPDATE job_stat t SET {sets} FROM per_job d WHERE t.pk_job = d.pk_job;
    RETURN NULL;
    """


_INSERT_DELTA = "SELECT pk_layer, pk_job, str_state, 1 AS n, 1 AS total FROM new_frames"
_DELETE_DELTA = "SELECT pk_layer, pk_job, str_state, -1 AS n, -1 AS total FROM old_frames"
_UPDATE_DELTA = """
  SELECT o.pk_layer, o.pk_job, o.str_state, -1 AS n, 0 AS total
  FROM old_frames o JOIN new_frames f ON f.pk_frame = o.pk_frame
  WHERE o.str_state IS DISTINCT FROM f.str_state
  UNION ALL
  SELECT f.pk_layer, f.pk_job, f.str_state, 1 AS n, 0 AS total
  FROM old_frames o JOIN new_frames f ON f.pk_frame = o.pk_frame
  WHERE o.str_state IS DISTINCT FROM f.str_state
"""


def frame_stat_triggers() -> list[pgtrigger.Trigger]:
    return [
        pgtrigger.Trigger(
            name="frame_stat_insert",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_frames"),
            func=_apply_sql(_INSERT_DELTA),
        ),
        pgtrigger.Trigger(
            name="frame_stat_update",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_frames", new="new_frames"),
            func=_apply_sql(_UPDATE_DELTA),
        ),
        pgtrigger.Trigger(
            name="frame_stat_delete",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_frames"),
            func=_apply_sql(_DELETE_DELTA),
        ),
    ]


def _fanout(name: str, inserts: str) -> pgtrigger.Trigger:
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.After,
        operation=pgtrigger.Insert,
        level=pgtrigger.Statement,
        referencing=pgtrigger.Referencing(new="new_rows"),
        func=f"{inserts}\n    RETURN NULL;",
    )


def folder_fanout_triggers() -> list[pgtrigger.Trigger]:
    return [
        _fanout(
            "folder_fanout",
            """
    INSERT INTO folder_resource (pk_folder_resource, pk_folder)
    SELECT gen_random_uuid()::text, pk_folder FROM new_rows
    ON CONFLICT (pk_folder) DO NOTHING;""",
        )
    ]


def job_fanout_triggers() -> list[pgtrigger.Trigger]:
    return [
        _fanout(
            "job_fanout",
            """
    INSERT INTO job_stat (pk_job_stat, pk_job)
    SELECT gen_random_uuid()::text, pk_job FROM new_rows ON CONFLICT (pk_job) DO NOTHING;
    INSERT INTO job_resource (pk_job_resource, pk_job)
    SELECT gen_random_uuid()::text, pk_job FROM new_rows ON CONFLICT (pk_job) DO NOTHING;
    INSERT INTO job_mem (pk_job_mem, pk_job)
    SELECT pk_job, pk_job FROM new_rows ON CONFLICT (pk_job) DO NOTHING;""",
        )
    ]


def layer_fanout_triggers() -> list[pgtrigger.Trigger]:
    return [
        _fanout(
            "layer_fanout",
            """
    INSERT INTO layer_stat (pk_layer_stat, pk_layer, pk_job)
    SELECT gen_random_uuid()::text, pk_layer, pk_job FROM new_rows ON CONFLICT (pk_layer) DO NOTHING;
    INSERT INTO layer_resource (pk_layer_resource, pk_layer, pk_job)
    SELECT gen_random_uuid()::text, pk_layer, pk_job FROM new_rows ON CONFLICT (pk_layer) DO NOTHING;
    INSERT INTO layer_mem (pk_layer_mem, pk_layer, pk_job)
    SELECT pk_layer, pk_layer, pk_job FROM new_rows ON CONFLICT (pk_layer) DO NOTHING;""",
        )
    ]
