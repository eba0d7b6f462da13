"""HostInterface: the render nodes, as cueadmin -lh lists them, their lock, allocation and tags.

A lock, unlock, allocation move or tag edit is the console's own host control
(`dispatch.jobs.host_controls`), so it is audited and ordered against bookings the same way; a
move's running procs change subscription through the accounting triggers, as any move's do.
A host's comments are opencue_api.comments'.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from opencue_proto import host_pb2, host_pb2_grpc

from accounting.units import CENTICORES_PER_CORE
from dispatch.jobs.comments import comments_on_host
from dispatch.jobs.host_controls import add_host_tags, lock_hosts, remove_host_tags, set_host_allocation, unlock_hosts
from opencue_api.comments import add_comment, comment_seq
from opencue_api.procs import search_procs
from opencue_api.rpc import BadRequest, actor, unary
from opencue_api.search import Where
from ops.setup_actions import NotFound

HOSTS_SQL = """
SELECT h.pk_host, h.str_name, a.str_name, h.b_nimby, h.b_comment, h.int_cores, h.int_cores_idle, h.int_mem,
       h.int_mem_idle, h.int_gpu_mem, h.int_gpu_mem_idle, COALESCE(hs.int_swap_total, 0),
       COALESCE(hs.int_mem_total, 0), COALESCE(hs.int_gpu_mem_total, 0), COALESCE(hs.int_mcp_total, 0),
       COALESCE(hs.int_swap_free, 0), COALESCE(hs.int_mem_free, 0), COALESCE(hs.int_mcp_free, 0),
       COALESCE(hs.int_gpu_mem_free, 0), COALESCE(hs.int_load, 0),
       COALESCE(extract(epoch FROM hs.ts_booted)::bigint, 0), COALESCE(extract(epoch FROM hs.ts_ping)::bigint, 0),
       COALESCE(hs.str_os, ''), COALESCE(hs.str_state, 'DOWN'), h.str_lock_state, h.int_thread_mode,
       h.int_gpus, h.int_gpus_idle,
       COALESCE((SELECT array_agg(t.str_tag ORDER BY t.str_tag) FROM host_tag t WHERE t.pk_host = h.pk_host),
                '{{}}'::text[])
FROM host h JOIN alloc a ON a.pk_alloc = h.pk_alloc LEFT JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE {where}
ORDER BY h.str_name
"""


def _enum(kind: Any, name: str, default: int = 0) -> int:
    return kind.Value(name) if name in kind.keys() else default


def hosts(where: str, params: dict[str, Any]) -> list[host_pb2.Host]:
    with connection.cursor() as cur:
        cur.execute(HOSTS_SQL.format(where=where), params)
        rows = cur.fetchall()
    return [
        host_pb2.Host(
            id=r[0],
            name=r[1],
            alloc_name=r[2],
            nimby_enabled=r[3],
            has_comment=r[4],
            cores=r[5] / CENTICORES_PER_CORE,
            idle_cores=r[6] / CENTICORES_PER_CORE,
            memory=r[7],
            idle_memory=r[8],
            gpu_memory=r[9],
            idle_gpu_memory=r[10],
            total_swap=r[11],
            total_memory=r[12],
            total_gpu_memory=r[13],
            total_mcp=r[14],
            free_swap=r[15],
            free_memory=r[16],
            free_mcp=r[17],
            free_gpu_memory=r[18],
            load=r[19],
            boot_time=r[20],
            ping_time=r[21],
            os=r[22],
            state=_enum(host_pb2.HardwareState, r[23], host_pb2.DOWN),
            lock_state=_enum(host_pb2.LockState, r[24]),
            thread_mode=r[25] if r[25] in (0, 1, 2) else 0,
            gpus=r[26],
            idle_gpus=r[27],
            tags=list(r[28]),
        )
        for r in rows
    ]


def search_hosts(criteria: host_pb2.HostSearchCriteria) -> list[host_pb2.Host]:
    where = Where()
    where.any_of("h.str_name", criteria.hosts, "hosts")
    where.any_of("h.pk_host", criteria.ids, "ids")
    where.any_of("a.str_name", criteria.allocs, "allocs")
    where.names("h.str_name", criteria.regex, criteria.substr)
    where.any_of(
        "COALESCE(hs.str_state, 'DOWN')", [host_pb2.HardwareState.Name(s) for s in criteria.states.state], "states"
    )
    where.any_of("h.str_lock_state", [host_pb2.LockState.Name(s) for s in criteria.lock_states.state], "locks")
    return hosts(where.sql(), where.params)


def _host(host: host_pb2.Host) -> host_pb2.Host:
    found = hosts("(h.pk_host = %(h)s OR h.str_name = %(h)s)", {"h": host.id or host.name})
    if not found:
        raise NotFound(f"no host {host.name or host.id!r}")
    return found[0]


def _host_id(host: host_pb2.Host) -> str:
    return _host(host).id


def _host_name(host: host_pb2.Host) -> str:
    return _host(host).name


class HostServicer(host_pb2_grpc.HostInterfaceServicer):
    @unary
    def GetHosts(self, request: Any, context: Any) -> host_pb2.HostGetHostsResponse:
        return host_pb2.HostGetHostsResponse(hosts=host_pb2.HostSeq(hosts=search_hosts(request.r)))

    @unary
    def FindHost(self, request: Any, context: Any) -> host_pb2.HostFindHostResponse:
        found = hosts("h.str_name = %(h)s", {"h": request.name})
        if not found:
            raise NotFound(f"no host named {request.name!r}")
        return host_pb2.HostFindHostResponse(host=found[0])

    @unary
    def GetHost(self, request: Any, context: Any) -> host_pb2.HostGetHostResponse:
        found = hosts("h.pk_host = %(h)s", {"h": request.id})
        if not found:
            raise NotFound(f"no host with id {request.id!r}")
        return host_pb2.HostGetHostResponse(host=found[0])

    @unary
    def Lock(self, request: Any, context: Any) -> host_pb2.HostLockResponse:
        lock_hosts([_host_id(request.host)], actor=actor())
        return host_pb2.HostLockResponse()

    @unary
    def Unlock(self, request: Any, context: Any) -> host_pb2.HostUnlockResponse:
        unlock_hosts([_host_id(request.host)], actor=actor())
        return host_pb2.HostUnlockResponse()

    @unary
    def GetProcs(self, request: Any, context: Any) -> host_pb2.HostGetProcsResponse:
        criteria = host_pb2.ProcSearchCriteria(hosts=[_host_name(request.host)])
        return host_pb2.HostGetProcsResponse(procs=host_pb2.ProcSeq(procs=search_procs(criteria)))

    @unary
    def SetAllocation(self, request: Any, context: Any) -> host_pb2.HostSetAllocationResponse:
        if not request.allocation_id:
            raise BadRequest("allocation_id: name the allocation to move the host to")
        set_host_allocation(_host_id(request.host), request.allocation_id, actor=actor())
        return host_pb2.HostSetAllocationResponse()

    @unary
    def AddTags(self, request: Any, context: Any) -> host_pb2.HostAddTagsResponse:
        add_host_tags(_host_id(request.host), list(request.tags), actor=actor())
        return host_pb2.HostAddTagsResponse()

    @unary
    def RemoveTags(self, request: Any, context: Any) -> host_pb2.HostRemoveTagsResponse:
        remove_host_tags(_host_id(request.host), list(request.tags), actor=actor())
        return host_pb2.HostRemoveTagsResponse()

    @unary
    def AddComment(self, request: Any, context: Any) -> host_pb2.HostAddCommentResponse:
        add_comment("host", _host_id(request.host), request.new_comment)
        return host_pb2.HostAddCommentResponse()

    @unary
    def GetComments(self, request: Any, context: Any) -> host_pb2.HostGetCommentsResponse:
        return host_pb2.HostGetCommentsResponse(comments=comment_seq(comments_on_host(_host_id(request.host))))
