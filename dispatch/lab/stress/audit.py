"""The audit every phase ends with: the database invariants, and the Store's counters against SUM(proc)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from accounting import db
from accounting.service import AccountingService
from accounting.units import centicores_to_cores
from dispatch.lab.seeding import FarmSeed

# SUM(proc) per Store key of the farm: (vertex, key, centicores, gpus).
BOOKED_BY_KEY_SQL = """
WITH p AS (
  SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.int_cores_reserved AS c, p.int_gpus_reserved AS g
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local AND p.pk_show = ANY(%(shows)s)
)
SELECT 'sub', pk_show || ':' || pk_alloc, SUM(c), SUM(g) FROM p GROUP BY pk_show, pk_alloc
UNION ALL SELECT 'folder', pk_folder, SUM(c), SUM(g) FROM p GROUP BY pk_folder
UNION ALL SELECT 'job', pk_job, SUM(c), SUM(g) FROM p GROUP BY pk_job
"""

# The database-side invariants of the audit, scoped to the farm: (what, key, seen, expected).
# Licence limits: the trigger-kept use of every limit equals its recount from proc.
AUDIT_SQL = """
SELECT 'limit_use', r.pk_limit_record, r.int_running, CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END
FROM limit_record r CROSS JOIN LATERAL (
  SELECT count(*) AS frames, count(DISTINCT p.pk_host) AS hosts
  FROM layer_limit ll JOIN proc p ON p.pk_layer = ll.pk_layer WHERE ll.pk_limit_record = r.pk_limit_record
) c
WHERE r.int_running <> CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END
UNION ALL
SELECT 'host_ledger', h.pk_host, h.int_cores - h.int_cores_idle, COALESCE(x.c, 0)
FROM host h LEFT JOIN (SELECT pk_host, SUM(int_cores_reserved) AS c FROM proc GROUP BY 1) x ON x.pk_host = h.pk_host
WHERE h.pk_host = ANY(%(hosts)s) AND h.int_cores - h.int_cores_idle <> COALESCE(x.c, 0)
UNION ALL
SELECT 'host_negative', h.pk_host, LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle), 0
FROM host h WHERE h.pk_host = ANY(%(hosts)s)
  AND LEAST(h.int_cores_idle, h.int_mem_idle, h.int_gpus_idle, h.int_gpu_mem_idle) < 0
UNION ALL
SELECT 'running_frames_vs_procs', '', (SELECT count(*) FROM frame WHERE str_state = 'RUNNING'
   AND pk_job = ANY(%(jobs)s)), (SELECT count(*) FROM proc WHERE pk_job = ANY(%(jobs)s))
WHERE (SELECT count(*) FROM frame WHERE str_state = 'RUNNING' AND pk_job = ANY(%(jobs)s))
   <> (SELECT count(*) FROM proc WHERE pk_job = ANY(%(jobs)s))
UNION ALL
SELECT 'procs_per_running_frame', f.pk_frame, count(p.pk_proc), 1
FROM frame f LEFT JOIN proc p ON p.pk_frame = f.pk_frame
WHERE f.pk_job = ANY(%(jobs)s) AND f.str_state = 'RUNNING' GROUP BY f.pk_frame HAVING count(p.pk_proc) <> 1
UNION ALL
SELECT 'proc_on_frame_not_running', p.pk_proc, 0, 0
FROM proc p JOIN frame f ON f.pk_frame = p.pk_frame WHERE p.pk_job = ANY(%(jobs)s) AND f.str_state <> 'RUNNING'
UNION ALL
SELECT 'job_stat_' || x.state, x.pk_job, x.kept, x.counted FROM (
  SELECT js.pk_job, s.state,
         CASE s.state WHEN 'WAITING' THEN js.int_waiting_count WHEN 'RUNNING' THEN js.int_running_count
              WHEN 'DEAD' THEN js.int_dead_count WHEN 'SUCCEEDED' THEN js.int_succeeded_count
              WHEN 'EATEN' THEN js.int_eaten_count WHEN 'DEPEND' THEN js.int_depend_count
              ELSE js.int_total_count END AS kept,
         (SELECT count(*) FROM frame f WHERE f.pk_job = js.pk_job AND (s.state = 'TOTAL' OR f.str_state = s.state))
           AS counted
  FROM job_stat js CROSS JOIN (VALUES ('WAITING'), ('RUNNING'), ('DEAD'), ('SUCCEEDED'), ('EATEN'), ('DEPEND'),
                                      ('TOTAL')) s(state)
  WHERE js.pk_job = ANY(%(jobs)s)) x
WHERE x.kept <> x.counted
UNION ALL
SELECT 'layer_stat_' || x.state, x.pk_layer, x.kept, x.counted FROM (
  SELECT ls.pk_layer, s.state,
         CASE s.state WHEN 'WAITING' THEN ls.int_waiting_count WHEN 'RUNNING' THEN ls.int_running_count
              WHEN 'SUCCEEDED' THEN ls.int_succeeded_count ELSE ls.int_total_count END AS kept,
         (SELECT count(*) FROM frame f WHERE f.pk_layer = ls.pk_layer AND (s.state = 'TOTAL' OR f.str_state = s.state))
           AS counted
  FROM layer_stat ls CROSS JOIN (VALUES ('WAITING'), ('RUNNING'), ('SUCCEEDED'), ('TOTAL')) s(state)
  WHERE ls.pk_layer = ANY(%(layers)s)) x
WHERE x.kept <> x.counted
"""

# The five database counters of the farm's unmanaged shows against SUM(proc), and the proc
# sums no counter row holds: (what, key, counter "cc/g", SUM(proc) "cc/g"), mismatches only.
DB_COUNTERS_SQL = """
WITH u AS (SELECT pk_show FROM show WHERE pk_show = ANY(%(shows)s) AND NOT b_scheduler_managed),
live AS MATERIALIZED (
  SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
         p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
  FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local AND p.pk_show IN (SELECT pk_show FROM u)
)
SELECT 'db_subscription', s.pk_show || ':' || s.pk_alloc, s.int_cores || '/' || s.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM subscription s LEFT JOIN live l ON l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc
WHERE s.pk_show IN (SELECT pk_show FROM u) GROUP BY s.pk_subscription
HAVING s.int_cores <> COALESCE(SUM(l.cc), 0) OR s.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_folder_resource', fr.pk_folder, fr.int_cores || '/' || fr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM folder_resource fr JOIN folder f ON f.pk_folder = fr.pk_folder LEFT JOIN live l ON l.pk_folder = fr.pk_folder
WHERE f.pk_show IN (SELECT pk_show FROM u) GROUP BY fr.pk_folder_resource
HAVING fr.int_cores <> COALESCE(SUM(l.cc), 0) OR fr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_job_resource', jr.pk_job, jr.int_cores || '/' || jr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM job_resource jr JOIN job j ON j.pk_job = jr.pk_job LEFT JOIN live l ON l.pk_job = jr.pk_job
WHERE j.pk_show IN (SELECT pk_show FROM u) GROUP BY jr.pk_job_resource
HAVING jr.int_cores <> COALESCE(SUM(l.cc), 0) OR jr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_layer_resource', lr.pk_layer, lr.int_cores || '/' || lr.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM layer_resource lr JOIN job j ON j.pk_job = lr.pk_job LEFT JOIN live l ON l.pk_layer = lr.pk_layer
WHERE j.pk_show IN (SELECT pk_show FROM u) GROUP BY lr.pk_layer_resource
HAVING lr.int_cores <> COALESCE(SUM(l.cc), 0) OR lr.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_point', pt.pk_show || ':' || pt.pk_dept, pt.int_cores || '/' || pt.int_gpus,
       COALESCE(SUM(l.cc), 0) || '/' || COALESCE(SUM(l.g), 0)
FROM point pt LEFT JOIN live l ON l.pk_show = pt.pk_show AND l.pk_dept = pt.pk_dept
WHERE pt.pk_show IN (SELECT pk_show FROM u) GROUP BY pt.pk_point
HAVING pt.int_cores <> COALESCE(SUM(l.cc), 0) OR pt.int_gpus <> COALESCE(SUM(l.g), 0)
UNION ALL
SELECT 'db_subscription_missing', l.pk_show || ':' || l.pk_alloc, 'no row', SUM(l.cc) || '/' || SUM(l.g)
FROM live l
WHERE NOT EXISTS (SELECT 1 FROM subscription s WHERE s.pk_show = l.pk_show AND s.pk_alloc = l.pk_alloc)
GROUP BY l.pk_show, l.pk_alloc
UNION ALL
SELECT 'db_point_missing', l.pk_show || ':' || l.pk_dept, 'no row', SUM(l.cc) || '/' || SUM(l.g)
FROM live l
WHERE NOT EXISTS (SELECT 1 FROM point pt WHERE pt.pk_show = l.pk_show AND pt.pk_dept = l.pk_dept)
GROUP BY l.pk_show, l.pk_dept
"""

CAPS_SQL = """
SELECT 'sub', s.pk_show || ':' || s.pk_alloc, s.int_burst FROM subscription s WHERE s.pk_show = ANY(%(shows)s)
UNION ALL SELECT 'folder', fr.pk_folder, fr.int_max_cores FROM folder_resource fr WHERE fr.pk_folder = ANY(%(folders)s)
UNION ALL SELECT 'job', jr.pk_job, jr.int_max_cores FROM job_resource jr WHERE jr.pk_job = ANY(%(jobs)s)
"""


Counters = dict[tuple[str, str], tuple[int, int]]  # (vertex, key) -> (whole cores, gpus)


def store_counters(service: AccountingService, seed: FarmSeed) -> tuple[Counters, Counters]:
    """(live, in-flight) counters of the farm's keys, from the in-process Store."""
    shows, folders, jobs = set(seed.show_ids), set(seed.folder_ids), set(seed.job_ids)
    out: list[Counters] = []
    for snap in (service.store.audit_snapshot(), service.store.inflight_snapshot()):
        c: Counters = {}
        c.update({("sub", f"{s}:{a}"): v for (s, a), v in snap.sub.items() if s in shows})
        c.update({("folder", k): v for k, v in snap.folder.items() if k in folders})
        c.update({("job", k): v for k, v in snap.job.items() if k in jobs})
        out.append(c)
    return out[0], out[1]


def view_counters(view: dict[str, Any], seed: FarmSeed) -> tuple[Counters, Counters]:
    """The same from a published live view (another process's Store)."""
    shows, folders, jobs = set(seed.show_ids), set(seed.folder_ids), set(seed.job_ids)
    live_c: Counters = {}
    infl: Counters = {}
    for vertex, keep in (
        ("sub", lambda k: k.split(":", 1)[0] in shows),
        ("folder", folders.__contains__),
        ("job", jobs.__contains__),
    ):
        for key, row in view.get(vertex, {}).items():
            if keep(key):
                live_c[(vertex, key)] = (row["cores"], row["gpus"])
                infl[(vertex, key)] = (row["inflight_cores"], row["inflight_gpus"])
    return live_c, infl


def _db_counters(conn: psycopg.Connection, seed: FarmSeed, managed: set[str]) -> Counters:
    out: Counters = {}
    for vertex, key, cc, gg in conn.execute(BOOKED_BY_KEY_SQL, {"shows": list(managed)}).fetchall():
        out[(vertex, key)] = (centicores_to_cores(int(cc)), int(gg))
    return out


def counter_mismatches(store: Counters, inflight: Counters, booked: Counters) -> list[str]:
    """Every Store counter equals SUM(proc); no leaked (nonzero, no procs) or in-flight counters."""
    failed = []
    for key in sorted(store.keys() | booked.keys()):
        have, want = store.get(key, (0, 0)), booked.get(key, (0, 0))
        if have != want:
            what = "leaked counter" if want == (0, 0) else "store != SUM(proc)"
            failed.append(f"{what} {key[0]} {key[1]}: store {have} vs SUM(proc) {want} (cores, gpus)")
    for key, value in sorted(inflight.items()):
        if value != (0, 0):
            failed.append(f"in-flight left {key[0]} {key[1]}: {value}")
    return failed


def audit_database(conn: psycopg.Connection, seed: FarmSeed) -> tuple[list[str], Counters]:
    """The database invariants and the managed shows' SUM(proc), from one REPEATABLE READ snapshot.

    The invariants include, for the unmanaged shows, the five counter tables the triggers
    keep (subscription, folder_resource, job_resource, layer_resource, point) equal to SUM(proc).
    """
    params = {
        "shows": list(seed.show_ids),
        "folders": list(seed.folder_ids),
        "jobs": list(seed.job_ids),
        "hosts": list(seed.host_ids),
        "layers": list(seed.layer_ids),
    }
    failed: list[str] = []
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        for what, key, seen, expected in conn.execute(AUDIT_SQL, params).fetchall():
            failed.append(f"{what} {key}: {seen} vs {expected}")
        for what, key, seen, expected in conn.execute(DB_COUNTERS_SQL, params).fetchall():
            failed.append(f"{what} {key}: counter {seen} vs SUM(proc) {expected} (centicores/gpus)")
        caps = {(v, k): int(c) for v, k, c in conn.execute(CAPS_SQL, params).fetchall()}
        all_booked = {
            (v, k): int(cc) for v, k, cc, _g in conn.execute(BOOKED_BY_KEY_SQL, {"shows": params["shows"]}).fetchall()
        }
        managed = {
            s
            for (s,) in conn.execute(
                "SELECT pk_show FROM show WHERE pk_show = ANY(%s) AND b_scheduler_managed", (params["shows"],)
            )
        }
        booked = _db_counters(conn, seed, managed)
    for key, cc in sorted(all_booked.items()):
        cap = caps.get(key)
        if cap is None:
            continue
        if (key[0] == "sub" and cc > cap) or (key[0] != "sub" and cap >= 0 and cc > cap):
            failed.append(f"over cap {key[0]} {key[1]}: booked {cc} > cap {cap} centicores")
    return failed, booked


def audit(
    seed: FarmSeed,
    read_store: Callable[[], tuple[Counters, Counters]],
    *,
    settle: float = 10.0,
) -> list[str]:
    """All invariants of the audit; empty when OK.

    Releases reach the Store asynchronously (NOTIFY), so the counter comparison is retried
    until it holds or `settle` seconds pass; the database invariants need no settling.
    """
    deadline = time.monotonic() + settle
    with db.connect(autocommit=True, application_name="cuesched-stress-audit") as conn:
        while True:
            failed, booked = audit_database(conn, seed)
            live_c, infl = read_store()
            mismatches = counter_mismatches(live_c, infl, booked)
            if not mismatches or time.monotonic() > deadline:
                return failed + mismatches
            time.sleep(0.05)
