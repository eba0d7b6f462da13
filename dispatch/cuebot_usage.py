"""Cuebot's usage and show statistics, kept for the work cuesched does on an adopted Cuebot database.

Why: CueGUI and pycue read `show_stats` (V16), `job_usage` and `layer_usage`, which Cuebot's Java
writes, not its triggers. A show flipped to cuesched would look idle there unless cuesched's own
submit and completion write the same rows, with Cuebot's arithmetic, in the same transaction as
the change they describe (a rolled-back completion counts nothing). cuesched's own schema has none
of these tables (they are Cuebot's, never cuesched models): there nothing here runs.

What Cuebot writes, and where it comes from (OpenCue cuebot/src/main/java/com/imageworks/spcue/):
- submit: JobDaoJdbc.activateJob, `UPDATE show_stats SET int_frame_insert_count = ... + <frames>,
  int_job_insert_count = ... + 1`; the usage rows come from Cuebot's after_insert_job /
  after_insert_layer triggers (kept on an adopted database; inserted here only if missing).
- completion of a frame that was RUNNING: DispatchSupportService.updateUsageCounters, with the
  report's exit status:
  * FrameDaoJdbc.getResourceUsage: clock = COALESCE(interval_to_seconds(current_timestamp -
    ts_started), 1), cores = COALESCE(frame.int_cores, 100), gpus = frame.int_gpus; then
    ResourceUsage: clock at least 1, core time = (long)(clock * (cores / 100f)) at least 1 (float
    arithmetic, truncated), GPU time = clock * gpus;
  * ShowDaoJdbc.updateFrameCounters: exit status > 0 is a failure, anything else a success;
  * JobDaoJdbc.updateUsage / LayerDaoJdbc.updateUsage: exit status 0 adds core, GPU and clock
    time to the success columns, one success, raises int_clock_time_high (and, layers only,
    lowers int_clock_time_low, where 0 means unset); any other status adds core and clock time
    to the fail columns and one failure (no GPU time).
Cuebot runs these per frame; the completion path runs them per batch in one statement, the same
sums, maxima and minima grouped by show, job and layer (one UPDATE ... FROM row per target row:
two frames of one layer in a batch must not be one update).

Detection: the tables' existence, once per connection (a connection's database does not change
schema under it: adoption runs before the scheduler starts), so the hot path on cuesched's own
schema pays one catalog query per connection and nothing per completion.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import psycopg

HAS_CUEBOT_USAGE_SQL = """
SELECT to_regclass('show_stats') IS NOT NULL AND to_regclass('job_usage') IS NOT NULL
   AND to_regclass('layer_usage') IS NOT NULL
"""

_has_usage: weakref.WeakKeyDictionary[psycopg.Connection[Any], bool] = weakref.WeakKeyDictionary()


def has_cuebot_usage(cur: psycopg.Cursor[Any]) -> bool:
    """Cuebot's usage tables are in the cursor's database (cached per connection)."""
    conn = cur.connection
    known = _has_usage.get(conn)
    if known is None:
        known = bool(cur.execute(HAS_CUEBOT_USAGE_SQL).fetchone()[0])
        _has_usage[conn] = known
    return known


# --- submit ------------------------------------------------------------------------------

# JobDaoJdbc.activateJob, verbatim but for the placeholders.
SHOW_STATS_INSERTED_SQL = (
    "UPDATE show_stats SET int_frame_insert_count=int_frame_insert_count+%s, "
    "int_job_insert_count=int_job_insert_count+1 WHERE pk_show=%s"
)
# The rows Cuebot's after_insert_job / after_insert_layer triggers insert (same keys), for a
# database where they are not there: the updates above and below would otherwise count nothing.
ENSURE_JOB_USAGE_SQL = """
INSERT INTO job_usage (pk_job_usage, pk_job) VALUES (%(job)s, %(job)s) ON CONFLICT DO NOTHING
"""
ENSURE_LAYER_USAGE_SQL = """
INSERT INTO layer_usage (pk_layer_usage, pk_layer, pk_job)
SELECT pk_layer, pk_layer, pk_job FROM layer WHERE pk_job = %(job)s
ON CONFLICT DO NOTHING
"""


def record_submit(cur: psycopg.Cursor[Any], *, job: str, show: str, frames: int) -> None:
    """A new job's show_stats counts and usage rows, in the submit's transaction."""
    cur.execute(ENSURE_JOB_USAGE_SQL, {"job": job})
    cur.execute(ENSURE_LAYER_USAGE_SQL, {"job": job})
    cur.execute(SHOW_STATS_INSERTED_SQL, (frames, show))


# --- completion --------------------------------------------------------------------------

# Cuebot's per-frame usage (see the module docstring), grouped per show, job and layer. The
# frames are the ones this transaction just ended (they were RUNNING): ts_started, int_cores and
# int_gpus are still the run's (the completion writes neither).
COMPLETE_USAGE_SQL = """
WITH run AS MATERIALIZED (
  SELECT f.pk_layer, f.pk_job, j.pk_show, d.exit_status,
         GREATEST(trunc(COALESCE(interval_to_seconds(current_timestamp - f.ts_started), 1)), 1)::bigint AS clock,
         COALESCE(f.int_cores, 100) AS cores, COALESCE(f.int_gpus, 0) AS gpus
  FROM unnest(%(frame)s::text[], %(status)s::int[]) AS d(pk_frame, exit_status)
  JOIN frame f ON f.pk_frame = d.pk_frame
  JOIN job j ON j.pk_job = f.pk_job
),
used AS MATERIALIZED (
  SELECT pk_layer, pk_job, pk_show, exit_status, clock,
         GREATEST(trunc((clock::real * (cores::real / 100::real))::float8), 1)::bigint AS core_time,
         clock * gpus AS gpu_time
  FROM run
),
per_show AS (
  SELECT pk_show, count(*) FILTER (WHERE exit_status <= 0) AS ok, count(*) FILTER (WHERE exit_status > 0) AS bad
  FROM used GROUP BY pk_show
),
per_layer AS (
  SELECT pk_layer, pk_job,
         COALESCE(sum(core_time) FILTER (WHERE exit_status = 0), 0) AS core_ok,
         COALESCE(sum(gpu_time) FILTER (WHERE exit_status = 0), 0) AS gpu_ok,
         COALESCE(sum(clock) FILTER (WHERE exit_status = 0), 0) AS clock_ok,
         count(*) FILTER (WHERE exit_status = 0) AS ok,
         max(clock) FILTER (WHERE exit_status = 0) AS high,
         min(clock) FILTER (WHERE exit_status = 0) AS low,
         COALESCE(sum(core_time) FILTER (WHERE exit_status <> 0), 0) AS core_bad,
         COALESCE(sum(clock) FILTER (WHERE exit_status <> 0), 0) AS clock_bad,
         count(*) FILTER (WHERE exit_status <> 0) AS bad
  FROM used GROUP BY pk_layer, pk_job
),
per_job AS (
  -- A layer is one job's: the job's figures are its layers' added up.
  SELECT pk_job, sum(core_ok) AS core_ok, sum(gpu_ok) AS gpu_ok, sum(clock_ok) AS clock_ok, sum(ok) AS ok,
         max(high) AS high, sum(core_bad) AS core_bad, sum(clock_bad) AS clock_bad, sum(bad) AS bad
  FROM per_layer GROUP BY pk_job
),
show_upd AS (
  UPDATE show_stats t
  SET int_frame_success_count = t.int_frame_success_count + s.ok,
      int_frame_fail_count = t.int_frame_fail_count + s.bad
  FROM per_show s WHERE t.pk_show = s.pk_show
),
job_upd AS (
  UPDATE job_usage t
  SET int_core_time_success = t.int_core_time_success + s.core_ok,
      int_gpu_time_success = t.int_gpu_time_success + s.gpu_ok,
      int_clock_time_success = t.int_clock_time_success + s.clock_ok,
      int_frame_success_count = t.int_frame_success_count + s.ok,
      int_clock_time_high = CASE WHEN t.int_clock_time_high < s.high THEN s.high ELSE t.int_clock_time_high END,
      int_core_time_fail = t.int_core_time_fail + s.core_bad,
      int_clock_time_fail = t.int_clock_time_fail + s.clock_bad,
      int_frame_fail_count = t.int_frame_fail_count + s.bad
  FROM per_job s WHERE t.pk_job = s.pk_job
)
UPDATE layer_usage t
SET int_core_time_success = t.int_core_time_success + s.core_ok,
    int_gpu_time_success = t.int_gpu_time_success + s.gpu_ok,
    int_clock_time_success = t.int_clock_time_success + s.clock_ok,
    int_frame_success_count = t.int_frame_success_count + s.ok,
    int_clock_time_high = CASE WHEN t.int_clock_time_high < s.high THEN s.high ELSE t.int_clock_time_high END,
    int_clock_time_low = CASE WHEN s.low IS NOT NULL AND (s.low < t.int_clock_time_low OR t.int_clock_time_low = 0)
                              THEN s.low ELSE t.int_clock_time_low END,
    int_core_time_fail = t.int_core_time_fail + s.core_bad,
    int_clock_time_fail = t.int_clock_time_fail + s.clock_bad,
    int_frame_fail_count = t.int_frame_fail_count + s.bad
FROM per_layer s WHERE t.pk_layer = s.pk_layer
"""


def record_completions(cur: psycopg.Cursor[Any], ended: Sequence[tuple[str, int]]) -> None:
    """Cuebot's usage counters for frames this transaction ended: (pk_frame, exit status) each."""
    if not ended:
        return
    cur.execute(COMPLETE_USAGE_SQL, {"frame": [f for f, _ in ended], "status": [s for _, s in ended]})
