"""Rows to Cuebot's messages, in Cuebot's units.

The wire units are Cuebot's, not the console's: a show's default cores and its reserved cores are
float cores, a subscription's size, burst and reserved cores are centicores (cueadmin divides
them by 100), an allocation's stats are float cores. Reserved cores come from the same numbers the
console shows (`ops.counters`): the scheduler's live view for a managed show, the database's
counters for the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection
from opencue_proto import facility_pb2, show_pb2, subscription_pb2

from accounting.units import CENTICORES_PER_CORE
from ops import counters, status

SHOWS_SQL = """
SELECT s.pk_show, s.str_name, s.int_default_min_cores, s.int_default_max_cores, s.str_comment_email,
       s.b_booking_enabled, s.b_dispatch_enabled, s.b_active, s.int_default_min_gpus, s.int_default_max_gpus,
       s.b_scheduler_managed, s.int_job_insert_count, s.int_frame_insert_count, s.int_frame_success_count,
       s.int_frame_fail_count,
       COALESCE(st.running, 0), COALESCE(st.dead, 0), COALESCE(st.waiting, 0), COALESCE(st.pending_jobs, 0)
FROM show s
LEFT JOIN LATERAL (
    SELECT SUM(js.int_running_count)::bigint AS running, SUM(js.int_dead_count)::bigint AS dead,
           SUM(js.int_waiting_count)::bigint AS waiting, COUNT(*) FILTER (WHERE j.str_state = 'PENDING') AS pending_jobs
    FROM job j JOIN job_stat js ON js.pk_job = j.pk_job
    WHERE j.pk_show = s.pk_show AND j.str_state = 'PENDING'
) st ON true
WHERE (%(active)s IS NOT TRUE OR s.b_active)
  AND (%(name)s::text IS NULL OR s.str_name = %(name)s OR s.pk_show = %(name)s)
ORDER BY s.str_name
"""

SUBS_SQL = """
SELECT sub.pk_subscription, sub.pk_show, s.str_name, a.pk_alloc, a.str_name, f.str_name, sub.int_size, sub.int_burst
FROM subscription sub JOIN show s ON s.pk_show = sub.pk_show JOIN alloc a ON a.pk_alloc = sub.pk_alloc
JOIN facility f ON f.pk_facility = a.pk_facility
WHERE (%(show)s::text IS NULL OR sub.pk_show = %(show)s) AND (%(alloc)s::text IS NULL OR sub.pk_alloc = %(alloc)s)
  AND (%(sub)s::text IS NULL OR sub.pk_subscription = %(sub)s)
ORDER BY a.str_name, s.str_name
"""

ALLOCS_SQL = """
SELECT a.pk_alloc, a.str_name, COALESCE(a.str_tag, ''), f.str_name, a.b_billable,
       COALESCE(SUM(h.int_cores), 0), COALESCE(SUM(h.int_cores_idle) FILTER (WHERE h.str_lock_state = 'OPEN'
           AND hs.str_state = 'UP'), 0),
       COALESCE(SUM(h.int_cores - h.int_cores_idle), 0),
       COALESCE(SUM(h.int_cores) FILTER (WHERE h.str_lock_state <> 'OPEN'), 0),
       COUNT(h.pk_host), COUNT(h.pk_host) FILTER (WHERE h.str_lock_state <> 'OPEN'),
       COUNT(h.pk_host) FILTER (WHERE hs.str_state IS DISTINCT FROM 'UP'),
       COALESCE(SUM(h.int_gpus), 0), COALESCE(SUM(h.int_gpus_idle), 0)
FROM alloc a JOIN facility f ON f.pk_facility = a.pk_facility
LEFT JOIN host h ON h.pk_alloc = a.pk_alloc LEFT JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE a.b_enabled AND (%(name)s::text IS NULL OR a.str_name = %(name)s OR a.pk_alloc = %(name)s)
  AND (%(facility)s::text IS NULL OR a.pk_facility = %(facility)s)
GROUP BY a.pk_alloc, a.str_name, a.str_tag, f.str_name, a.b_billable
ORDER BY a.str_name
"""


def _fetch(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _reserved(view: dict[str, Any] | None, show: str | None) -> dict[tuple[str, str], tuple[float, int]]:
    """(show, alloc) -> (reserved cores, GPUs) as the console shows them."""
    return {
        (row.extra["show"], row.extra["alloc"]): (
            float(row.shown_cores),
            int(row.db_gpus if row.enforced_gpus is None else row.enforced_gpus),
        )
        for row in counters.sub_rows(view, show)
    }


def shows(*, active: bool = False, name: str | None = None) -> list[show_pb2.Show]:
    per_show: dict[str, tuple[float, int]] = {}
    for (show, _alloc), (c, g) in _reserved(status.read_view(), None).items():
        had_c, had_g = per_show.get(show, (0.0, 0))
        per_show[show] = (had_c + c, had_g + g)
    out = []
    for r in _fetch(SHOWS_SQL, {"active": active, "name": name}):
        cores, gpus = per_show.get(r[0], (0.0, 0))
        out.append(
            show_pb2.Show(
                id=r[0],
                name=r[1],
                default_min_cores=r[2] / CENTICORES_PER_CORE,
                default_max_cores=r[3] / CENTICORES_PER_CORE,
                comment_email=r[4] or "",
                booking_enabled=r[5],
                dispatch_enabled=r[6],
                active=r[7],
                default_min_gpus=r[8],
                default_max_gpus=r[9],
                scheduler_managed=r[10],
                show_stats=show_pb2.ShowStats(
                    created_job_count=r[11],
                    created_frame_count=r[12],
                    rendered_frame_count=r[13],
                    failed_frame_count=r[14],
                    running_frames=r[15],
                    dead_frames=r[16],
                    pending_frames=r[17],
                    pending_jobs=r[18],
                    reserved_cores=cores,
                    reserved_gpus=gpus,
                ),
            )
        )
    return out


def subscriptions(
    *, show: str | None = None, alloc: str | None = None, sub: str | None = None
) -> list[subscription_pb2.Subscription]:
    reserved = _reserved(status.read_view(), show)
    out = []
    for pk, pk_show, show_name, pk_alloc, alloc_name, facility, size, burst in _fetch(
        SUBS_SQL, {"show": show, "alloc": alloc, "sub": sub}
    ):
        cores, gpus = reserved.get((pk_show, pk_alloc), (0.0, 0))
        out.append(
            subscription_pb2.Subscription(
                id=pk,
                name=f"{alloc_name}.{show_name}",
                show_name=show_name,
                facility=facility,
                allocation_name=alloc_name,
                size=int(size),
                burst=int(burst),
                reserved_cores=round(cores * CENTICORES_PER_CORE),
                reserved_gpus=gpus,
            )
        )
    return out


def allocations(*, name: str | None = None, facility: str | None = None) -> list[facility_pb2.Allocation]:
    return [_allocation(r) for r in _fetch(ALLOCS_SQL, {"name": name, "facility": facility})]


def _allocation(r: Sequence[Any]) -> facility_pb2.Allocation:
    cores, idle, running, locked = (v / CENTICORES_PER_CORE for v in r[5:9])
    return facility_pb2.Allocation(
        id=r[0],
        name=r[1],
        tag=r[2],
        facility=r[3],
        billable=r[4],
        stats=facility_pb2.AllocationStats(
            cores=cores,
            available_cores=idle,
            idle_cores=idle,
            running_cores=running,
            locked_cores=locked,
            hosts=r[9],
            locked_hosts=r[10],
            down_hosts=r[11],
            gpus=r[12],
            available_gpus=r[13],
            idle_gpus=r[13],
            running_gpus=r[12] - r[13],
        ),
    )


def facility(pk: str, name: str) -> facility_pb2.Facility:
    return facility_pb2.Facility(id=pk, name=name)


def seq(kind: Any, items: Iterable[Any], field: str) -> Any:
    """A Cuebot *Seq message (ShowSeq, AllocationSeq...) holding `items` in `field`."""
    return kind(**{field: list(items)})
