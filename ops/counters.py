"""Live counters for the console: the Store's view beside SUM(proc), per subscription, folder, job.

For a scheduler-managed show the Store is the enforced truth and the database columns lag
(the recompute rewrites them every ~15 s), so the page sets the Store's booked amount (from
the published view) beside SUM(proc) read now. For a database-enforced show the trigger-kept
`int_cores` columns are what is enforced, so they stand in the "enforced" column instead.

Drift comes from ONE consistent measurement, never from figures read at different moments
(the Store's view is up to a second older than a SUM(proc) read now, which made healthy shows
read +-12): for a database-enforced show it is the trigger-kept counter minus SUM(proc), both
read in one REPEATABLE READ snapshot (0 on a healthy show); for a scheduler-managed show it is
what the last recompute measured and corrected for that key (Store before minus SUM(proc) in
its snapshot). It is flagged only past `CUESCHED_OPS_DRIFT_THRESHOLD_CORES` (ops.drift).
All amounts here are WHOLE cores and GPU counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from accounting.units import centicores_to_cores, centicores_to_cores_cap
from ops import drift

# SUM(proc) by key, non-local procs (the Store's and the triggers' rule), optionally for one show.
SUB_SUMS_SQL = """
SELECT p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint, COUNT(*)
FROM proc p JOIN host h ON h.pk_host = p.pk_host
WHERE NOT p.b_local AND (%(show)s::text IS NULL OR p.pk_show = %(show)s)
GROUP BY p.pk_show, h.pk_alloc
"""
FOLDER_SUMS_SQL = """
SELECT j.pk_folder, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint, COUNT(*)
FROM proc p JOIN job j ON j.pk_job = p.pk_job
WHERE NOT p.b_local AND p.pk_show = %(show)s
GROUP BY j.pk_folder
"""
JOB_SUMS_SQL = """
SELECT p.pk_job, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint, COUNT(*)
FROM proc p
WHERE NOT p.b_local AND p.pk_show = %(show)s
GROUP BY p.pk_job
"""
SUBS_SQL = """
SELECT sub.pk_subscription, sub.pk_show, s.str_name, s.b_scheduler_managed, sub.pk_alloc, a.str_name,
       sub.int_burst, sub.int_size, sub.int_cores, sub.int_gpus
FROM subscription sub JOIN show s ON s.pk_show = sub.pk_show JOIN alloc a ON a.pk_alloc = sub.pk_alloc
WHERE (%(show)s::text IS NULL OR sub.pk_show = %(show)s)
ORDER BY s.str_name, a.str_name
"""
FOLDERS_SQL = """
SELECT f.pk_folder, f.str_name, fr.int_max_cores, fr.int_max_gpus, fr.int_cores, fr.int_gpus
FROM folder f JOIN folder_resource fr ON fr.pk_folder = f.pk_folder
WHERE f.pk_show = %(show)s
ORDER BY f.str_name
"""
# The jobs worth a row: not finished, or still holding procs; highest priority first.
JOBS_SQL = """
SELECT j.pk_job, j.str_name, j.str_state, j.b_paused, jr.int_priority, jr.int_max_cores, jr.int_max_gpus,
       jr.int_cores, jr.int_gpus, js.int_waiting_count, js.int_running_count, js.int_depend_count
FROM job j JOIN job_resource jr ON jr.pk_job = j.pk_job JOIN job_stat js ON js.pk_job = j.pk_job
WHERE j.pk_show = %(show)s AND (j.str_state <> 'FINISHED' OR EXISTS (SELECT 1 FROM proc p WHERE p.pk_job = j.pk_job))
ORDER BY jr.int_priority DESC, j.ts_started, j.pk_job
LIMIT %(limit)s
"""
SHOWS_SQL = """
SELECT s.pk_show, s.str_name, s.b_scheduler_managed, s.b_active,
       (SELECT COUNT(*) FROM job j WHERE j.pk_show = s.pk_show AND j.str_state = 'PENDING')
FROM show s ORDER BY s.str_name
"""

JOB_ROWS_LIMIT = 200


@dataclass
class Row:
    """One key's line: enforced booked amount, SUM(proc), cap, in-flight, drift (whole cores)."""

    pk: str
    label: str
    enforced_cores: int | None
    enforced_gpus: int | None
    db_cores: int
    db_gpus: int
    procs: int
    cap_cores: int | None  # None: the Store has no cap yet; -1 (any negative max): unlimited
    cap_gpus: int | None = None
    inflight_cores: int = 0
    inflight_gpus: int = 0
    cap_is_burst: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Managed rows: the drift the last recompute measured for this key (None: no recompute yet).
    measured_drift: int | None = None
    managed: bool = False
    # A managed show the scheduler has not seeded yet (a flip just committed): no drift to show.
    seeding: bool = False

    @property
    def drift(self) -> int | None:
        if self.managed:
            return None if self.seeding else self.measured_drift
        if self.enforced_cores is None:
            return None
        return self.enforced_cores - self.db_cores

    @property
    def unlimited(self) -> bool:
        return self.cap_cores is None or (not self.cap_is_burst and self.cap_cores < 0)

    @property
    def shown_cores(self) -> int:
        return self.db_cores if self.enforced_cores is None else self.enforced_cores

    @property
    def percent(self) -> int | None:
        """Utilization of the cores cap, 0..100+ (a cap of 0 reads as full)."""
        if self.unlimited:
            return None
        assert self.cap_cores is not None
        if self.cap_cores <= 0:
            return 100
        return round(100 * self.shown_cores / self.cap_cores)

    @property
    def level(self) -> str:
        pct = self.percent
        if pct is None:
            return "none"
        if pct > 100:
            return "over"
        if pct >= 100:
            return "full"
        return "high" if pct >= 80 else "ok"

    @property
    def bar_width(self) -> int:
        return min(100, self.percent or 0)


@dataclass
class ShowCounters:
    pk: str
    name: str
    managed: bool
    subs: list[Row]
    folders: list[Row]
    jobs: list[Row]
    jobs_truncated: bool = False


def _sums(sql: str, params: dict[str, Any], key_len: int) -> dict[Any, tuple[int, int, int]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        out = {}
        for row in cur.fetchall():
            key = row[0] if key_len == 1 else tuple(row[:key_len])
            cc, gpus, n = row[key_len:]
            out[key] = (centicores_to_cores(int(cc)), int(gpus), int(n))
    return out


def _fetch(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def sub_rows(view: dict[str, Any] | None, show: str | None = None) -> list[Row]:
    sums = _sums(SUB_SUMS_SQL, {"show": show}, 2)
    store = (view or {}).get("sub") or {}
    measured = drift.measured(view, "sub")
    rows = []
    for pk, pk_show, show_name, managed, pk_alloc, alloc_name, burst, size, t_cores, t_gpus in _fetch(
        SUBS_SQL, {"show": show}
    ):
        db_cores, db_gpus, procs = sums.get((pk_show, pk_alloc), (0, 0, 0))
        entry = store.get(f"{pk_show}:{pk_alloc}") if managed else None
        if managed:
            enforced = (entry["cores"], entry["gpus"]) if entry else (None, None)
        else:
            enforced = (centicores_to_cores(t_cores), t_gpus)
        rows.append(
            Row(
                pk=pk,
                label=f"{show_name} @ {alloc_name}",
                enforced_cores=enforced[0],
                enforced_gpus=enforced[1],
                db_cores=db_cores,
                db_gpus=db_gpus,
                procs=procs,
                cap_cores=centicores_to_cores(burst),
                inflight_cores=(entry or {}).get("inflight_cores", 0),
                inflight_gpus=(entry or {}).get("inflight_gpus", 0),
                cap_is_burst=True,
                managed=managed,
                seeding=managed and drift.seeded_at(view, pk_show) is None,
                measured_drift=drift.key_drift(measured, f"{pk_show}:{pk_alloc}", drift.seeded_at(view, pk_show)),
                extra={
                    "show": pk_show,
                    "show_name": show_name,
                    "alloc": pk_alloc,
                    "alloc_name": alloc_name,
                    "managed": managed,
                    "size": centicores_to_cores(size),
                    "store_burst": (entry or {}).get("burst"),
                },
            )
        )
    return rows


def _vertex_row(
    pk: str,
    label: str,
    managed: bool,
    entry: dict[str, Any] | None,
    sums: tuple[int, int, int],
    caps: tuple[int, ...],
    measured: dict[str, tuple[int, float | None]] | None = None,
    seeded: float | None = None,
) -> Row:
    max_cc, max_gpus, t_cores, t_gpus = caps
    db_cores, db_gpus, procs = sums
    if managed:
        enforced = (entry["cores"], entry["gpus"]) if entry else (None, None)
    else:
        enforced = (centicores_to_cores(t_cores), t_gpus)
    return Row(
        pk=pk,
        label=label,
        enforced_cores=enforced[0],
        enforced_gpus=enforced[1],
        db_cores=db_cores,
        db_gpus=db_gpus,
        procs=procs,
        cap_cores=centicores_to_cores_cap(max_cc),
        cap_gpus=max_gpus,
        inflight_cores=(entry or {}).get("inflight_cores", 0),
        inflight_gpus=(entry or {}).get("inflight_gpus", 0),
        managed=managed,
        seeding=managed and seeded is None,
        measured_drift=drift.key_drift(measured, pk, seeded),
    )


def show_counters(view: dict[str, Any] | None, show: str) -> ShowCounters:
    with drift.consistent_read():
        return _show_counters(view, show)


def _show_counters(view: dict[str, Any] | None, show: str) -> ShowCounters:
    meta = _fetch("SELECT str_name, b_scheduler_managed FROM show WHERE pk_show = %(show)s", {"show": show})
    name, managed = meta[0]
    params = {"show": show, "limit": JOB_ROWS_LIMIT + 1}
    folder_sums = _sums(FOLDER_SUMS_SQL, params, 1)
    job_sums = _sums(JOB_SUMS_SQL, params, 1)
    store_folders = (view or {}).get("folder") or {}
    store_jobs = (view or {}).get("job") or {}
    measured_folders, measured_jobs = drift.measured(view, "folder"), drift.measured(view, "job")
    seeded = drift.seeded_at(view, show)
    zero = (0, 0, 0)
    folders = [
        _vertex_row(
            pk,
            fname,
            managed,
            store_folders.get(pk),
            folder_sums.get(pk, zero),
            (mc, mg, c, g),
            measured_folders,
            seeded,
        )
        for pk, fname, mc, mg, c, g in _fetch(FOLDERS_SQL, params)
    ]
    jobs = []
    job_rows = _fetch(JOBS_SQL, params)
    for pk, jname, state, paused, prio, mc, mg, c, g, waiting, running, depend in job_rows[:JOB_ROWS_LIMIT]:
        row = _vertex_row(
            pk, jname, managed, store_jobs.get(pk), job_sums.get(pk, zero), (mc, mg, c, g), measured_jobs, seeded
        )
        row.extra = {
            "state": state,
            "paused": paused,
            "priority": prio,
            "waiting": waiting,
            "running": running,
            "depend": depend,
        }
        jobs.append(row)
    return ShowCounters(
        pk=show,
        name=name,
        managed=managed,
        subs=sub_rows(view, show),
        folders=folders,
        jobs=jobs,
        jobs_truncated=len(job_rows) > JOB_ROWS_LIMIT,
    )


@dataclass
class ShowSummary:
    pk: str
    name: str
    managed: bool
    active: bool
    pending_jobs: int
    subs: list[Row]

    @property
    def procs(self) -> int:
        return sum(r.procs for r in self.subs)

    @property
    def db_cores(self) -> int:
        return sum(r.db_cores for r in self.subs)

    @property
    def enforced_cores(self) -> int | None:
        values = [r.enforced_cores for r in self.subs]
        if any(v is None for v in values):
            return None
        return sum(v for v in values if v is not None)

    @property
    def drift(self) -> int | None:
        drifts = [r.drift for r in self.subs]
        if any(d is None for d in drifts):
            return None
        return sum(d for d in drifts if d is not None)

    @property
    def seeding(self) -> bool:
        return any(r.seeding for r in self.subs)

    @property
    def burst(self) -> int:
        return sum(max(0, r.cap_cores or 0) for r in self.subs)


def farm_overview(view: dict[str, Any] | None) -> list[ShowSummary]:
    with drift.consistent_read():
        return _farm_overview(view)


def _farm_overview(view: dict[str, Any] | None) -> list[ShowSummary]:
    by_show: dict[str, list[Row]] = {}
    for row in sub_rows(view):
        by_show.setdefault(row.extra["show"], []).append(row)
    return [
        ShowSummary(pk, name, managed, active, pending, by_show.get(pk, []))
        for pk, name, managed, active, pending in _fetch(SHOWS_SQL, {})
    ]
