"""ProcInterface: the booked runs, as `cueadmin -lp` and pycue's `getProcs` list them, and their kill.

A proc is one frame's booking on a host. Its kill is the console's frame kill
(`dispatch.jobs.controls.kill_frames`): the proc is marked (`ts_kill`, "killing") and stays
booked until the host reports the run ended, then the frame goes back to WAITING. cuesched never
gives a proc a second frame (it is released with its frame), so Cuebot's `Unbook` without kill,
"unbook after this frame", is already what every proc does: it is answered and writes nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from opencue_proto import host_pb2, host_pb2_grpc

from accounting.units import CENTICORES_PER_CORE
from dispatch.jobs.controls import kill_frames
from opencue_api.rpc import API_ACTOR, BadRequest, unary
from opencue_api.search import Where
from ops.setup_actions import NotFound

# Cuebot answers at most this many procs unless the criteria's max_results says fewer.
MAX_PROCS = 1000

PROCS_SQL = """
SELECT p.pk_proc, h.str_name, s.str_name, j.str_name, f.str_name, fo.str_name,
       extract(epoch FROM p.ts_ping)::bigint, extract(epoch FROM p.ts_booked)::bigint,
       extract(epoch FROM p.ts_dispatched)::bigint, p.int_mem_reserved, p.int_gpu_mem_reserved, p.int_mem_used,
       p.int_cores_reserved, p.b_unbooked, COALESCE(p.str_redirect, ''), COALESCE(l.str_services, ''),
       p.int_gpu_mem_used, p.int_gpus_reserved
FROM proc p
JOIN host h ON h.pk_host = p.pk_host
JOIN alloc a ON a.pk_alloc = h.pk_alloc
JOIN show s ON s.pk_show = p.pk_show
JOIN job j ON j.pk_job = p.pk_job
JOIN layer l ON l.pk_layer = p.pk_layer
JOIN frame f ON f.pk_frame = p.pk_frame
LEFT JOIN folder fo ON fo.pk_folder = j.pk_folder
WHERE {where}
ORDER BY h.str_name, p.ts_dispatched, p.pk_proc
LIMIT %(limit)s OFFSET %(offset)s
"""


def _whole(value: int, field: str) -> int:
    if value < 0:
        raise BadRequest(f"{field}: {value} cannot be negative")
    return value


def search_procs(criteria: host_pb2.ProcSearchCriteria) -> list[host_pb2.Proc]:
    """Cuebot's ProcSearch: every list given narrows; memory (KB used) and duration (seconds since
    dispatch) ranges as pycue sends them, a lower and an upper bound each."""
    where = Where()
    where.any_of("h.str_name", criteria.hosts, "hosts")
    where.any_of("j.str_name", criteria.jobs, "jobs")
    where.any_of("l.str_name", criteria.layers, "layers")
    where.any_of("s.str_name", criteria.shows, "shows")
    where.any_of("a.str_name", criteria.allocs, "allocs")
    bounds = [
        ("p.int_mem_used", "memory_range", [(r.min, r.max) for r in criteria.memory_range]),
        (
            "extract(epoch FROM now() - p.ts_dispatched)",
            "duration_range",
            [(r.min, r.max) for r in criteria.duration_range],
        ),
        ("p.int_mem_used", "memory_greater_than", [(r.value, None) for r in criteria.memory_greater_than]),
        ("p.int_mem_used", "memory_less_than", [(None, r.value) for r in criteria.memory_less_than]),
    ]
    for column, field, ranges in bounds:
        for i, (lo, hi) in enumerate(ranges):
            if lo is not None and hi is not None and lo > hi:
                raise BadRequest(f"{field}: {lo}-{hi} is not a range (min above max)")
            if lo is not None:
                where.add(f"{column} >= %({field}_lo{i})s", **{f"{field}_lo{i}": _whole(lo, field)})
            if hi is not None:
                where.add(f"{column} <= %({field}_hi{i})s", **{f"{field}_hi{i}": _whole(hi, field)})
    limit = min(_whole(criteria.max_results[0], "max_results"), MAX_PROCS) if criteria.max_results else MAX_PROCS
    params = {**where.params, "limit": limit or MAX_PROCS, "offset": _whole(criteria.first_result, "first_result")}
    with connection.cursor() as cur:
        cur.execute(PROCS_SQL.format(where=where.sql()), params)
        rows = cur.fetchall()
    return [
        host_pb2.Proc(
            id=r[0],
            name=r[1],
            show_name=r[2],
            job_name=r[3],
            frame_name=r[4],
            group_name=r[5] or "",
            ping_time=r[6],
            bookedTime=r[7],
            dispatch_time=r[8],
            reserved_memory=r[9],
            reserved_gpu_memory=r[10],
            used_memory=r[11],
            reserved_cores=r[12] / CENTICORES_PER_CORE,
            unbooked=r[13],
            redirect_target=r[14],
            services=[s for s in r[15].split(",") if s],
            used_gpu_memory=r[16],
            reserved_gpus=r[17],
        )
        for r in rows
    ]


def _kill(proc: host_pb2.Proc) -> None:
    """The console's frame kill of the proc's frame: marked, still booked until the run ends."""
    with connection.cursor() as cur:
        cur.execute("SELECT pk_job, pk_frame FROM proc WHERE pk_proc = %s", [proc.id])
        row = cur.fetchone()
    if row is None:
        raise NotFound(f"no proc with id {proc.id!r} (its frame may have ended)")
    kill_frames(row[0], [row[1]], actor=API_ACTOR)


class ProcServicer(host_pb2_grpc.ProcInterfaceServicer):
    @unary
    def GetProcs(self, request: Any, context: Any) -> host_pb2.ProcGetProcsResponse:
        return host_pb2.ProcGetProcsResponse(procs=host_pb2.ProcSeq(procs=search_procs(request.r)))

    @unary
    def Kill(self, request: Any, context: Any) -> host_pb2.ProcKillResponse:
        _kill(request.proc)
        return host_pb2.ProcKillResponse()

    @unary
    def Unbook(self, request: Any, context: Any) -> host_pb2.ProcUnbookResponse:
        if request.kill:
            _kill(request.proc)
        elif not _exists(request.proc.id):
            raise NotFound(f"no proc with id {request.proc.id!r} (its frame may have ended)")
        return host_pb2.ProcUnbookResponse()


def _exists(pk_proc: str) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT 1 FROM proc WHERE pk_proc = %s", [pk_proc])
        return cur.fetchone() is not None
