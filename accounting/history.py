"""The farm's history: the scheduler samples it every few seconds into `ops_history_sample`.

Why here and not in the web process: the scheduler is the one process that always runs (one per
database), so a sample every `CUESCHED_HISTORY_INTERVAL` seconds exists whether or not anyone has
a console page open, and the web workers stay read-only. The table belongs to the console (its
model is `ops.models.HistorySample`, created by migration ops 0007); accounting must not import
ops, so this module writes it with SQL against the table name both sides share.

One sample is ONE statement, so every figure in it comes from the same snapshot: booked (SUM(proc),
the record of truth) against burst and size per subscription, pending frames, running procs, and
the frames started and stopped within the last minute (bookings and completions per minute, read
from the frame rows so that every writer counts, whichever process booked or completed them).
Drift is what the last recompute and database reconcile measured (the only consistent
measurement of it), not a difference of figures read at different moments: the service hands
it in (`ServiceState.measured_drift`), so this module needs nothing of the service.

Amounts are stored in the tables' units (centicores); the console converts for display.
Rows older than `CUESCHED_HISTORY_RETENTION_HOURS` are deleted by the same transaction.
A failed sample is logged by the loop and retried at the next tick; nothing else depends on it.
"""

from __future__ import annotations

import json
import time

import psycopg

from cuesched_project import conf

TABLE = "ops_history_sample"

SAMPLE_SQL = f"""
WITH usage AS (
  SELECT p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved)::bigint AS cc, COUNT(*)::bigint AS n
  FROM proc p JOIN host h ON h.pk_host = p.pk_host
  WHERE NOT p.b_local
  GROUP BY p.pk_show, h.pk_alloc
), show_usage AS (
  SELECT pk_show, SUM(cc)::bigint AS cc, SUM(n)::bigint AS n FROM usage GROUP BY pk_show
), pend AS (
  SELECT j.pk_show, SUM(js.int_waiting_count)::bigint AS w
  FROM job j JOIN job_stat js ON js.pk_job = j.pk_job
  WHERE j.str_state = 'PENDING'
  GROUP BY j.pk_show
)
INSERT INTO {TABLE} (ts, pending_frames, running_procs, booked_cc, bookings_per_min, completions_per_min,
                     drift_cores, subs, shows)
SELECT now(),
  (SELECT COALESCE(SUM(w), 0) FROM pend),
  (SELECT COALESCE(SUM(n), 0) FROM usage),
  (SELECT COALESCE(SUM(cc), 0) FROM usage),
  (SELECT COUNT(*) FROM frame WHERE ts_started >= now() - interval '60 seconds'),
  (SELECT COUNT(*) FROM frame WHERE ts_stopped >= now() - interval '60 seconds'
                                 AND str_state IN ('SUCCEEDED', 'DEAD', 'EATEN')),
  %(drift)s,
  (SELECT COALESCE(jsonb_object_agg(sub.pk_show || ':' || sub.pk_alloc,
                                    jsonb_build_array(COALESCE(u.cc, 0), sub.int_burst, sub.int_size)), '{{}}')
   FROM subscription sub LEFT JOIN usage u ON u.pk_show = sub.pk_show AND u.pk_alloc = sub.pk_alloc),
  (SELECT COALESCE(jsonb_object_agg(s.pk_show,
                                    jsonb_build_array(COALESCE(p.w, 0), COALESCE(su.n, 0), COALESCE(su.cc, 0),
                                                      COALESCE((%(show_drift)s::jsonb ->> s.pk_show)::int, 0))),
                   '{{}}')
   FROM show s LEFT JOIN pend p ON p.pk_show = s.pk_show LEFT JOIN show_usage su ON su.pk_show = s.pk_show)
"""

PRUNE_SQL = f"DELETE FROM {TABLE} WHERE ts < now() - make_interval(secs => %(seconds)s)"


class HistorySampler:
    """Writes one sample per tick and prunes what is past retention, in one transaction."""

    def __init__(self) -> None:
        self.samples = 0
        self.last_sample_at: float | None = None

    def sample(self, conn: psycopg.Connection, drift: tuple[int, dict[str, int]]) -> str:
        """One sample; `drift` is the service's measured drift (`ServiceState.measured_drift`)."""
        farm_drift, per_show = drift
        retention = conf.history_retention_hours() * 3600.0
        with conn.transaction():
            conn.execute(SAMPLE_SQL, {"drift": farm_drift, "show_drift": json.dumps(per_show)})
            pruned = conn.execute(PRUNE_SQL, {"seconds": retention}).rowcount
        self.samples += 1
        self.last_sample_at = time.time()
        return f"history: sample {self.samples} written, {pruned} past retention pruned"
