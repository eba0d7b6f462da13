"""GroupInterface, and a show's groups: Cuebot's groups are cuesched's folders.

CueGUI's job tree (Cuecommander's show/group view, and the group column of Cuetopia) reads a
show's root group, its groups and each group's jobs. A group's figures are the folder's:
caps from folder_resource (float cores, -1 unlimited), reserved cores as the console shows them
(the Store's for a managed show, the database's counter for the others), and frame counts summed
over its pending jobs, as Cuebot's group stats are. A group's max cores is set through the
console's own cap action, `accounting.actions.set_folder_caps`.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from opencue_proto import job_pb2, job_pb2_grpc

from accounting import actions as cap_actions
from accounting.units import CENTICORES_PER_CORE
from opencue_api import jobs
from opencue_api.rpc import API_ACTOR, BadRequest, unary
from ops import status
from ops.setup_actions import NotFound

GROUPS_SQL = """
WITH RECURSIVE tree AS (
    SELECT pk_folder, 0 AS level FROM folder WHERE pk_parent_folder IS NULL AND pk_show = ANY(%(shows)s)
    UNION ALL
    SELECT f.pk_folder, t.level + 1 FROM folder f JOIN tree t ON f.pk_parent_folder = t.pk_folder
)
SELECT f.pk_folder, f.str_name, COALESCE(d.str_name, ''), f.int_job_priority, f.int_job_min_cores,
       f.int_job_max_cores, fr.int_min_cores, fr.int_max_cores, t.level, COALESCE(f.pk_parent_folder, ''),
       fr.int_min_gpus, fr.int_max_gpus, f.int_job_min_gpus, f.int_job_max_gpus, fr.int_cores, fr.int_gpus,
       s.b_scheduler_managed,
       COALESCE(st.running, 0), COALESCE(st.dead, 0), COALESCE(st.depend, 0), COALESCE(st.waiting, 0),
       COALESCE(st.pending, 0)
FROM tree t JOIN folder f ON f.pk_folder = t.pk_folder JOIN show s ON s.pk_show = f.pk_show
JOIN folder_resource fr ON fr.pk_folder = f.pk_folder LEFT JOIN dept d ON d.pk_dept = f.pk_dept
LEFT JOIN LATERAL (
    SELECT SUM(js.int_running_count)::bigint AS running, SUM(js.int_dead_count)::bigint AS dead,
           SUM(js.int_depend_count)::bigint AS depend, SUM(js.int_waiting_count)::bigint AS waiting,
           COUNT(*) AS pending
    FROM job j JOIN job_stat js ON js.pk_job = j.pk_job
    WHERE j.pk_folder = f.pk_folder AND j.str_state = 'PENDING'
) st ON true
WHERE {where}
ORDER BY t.level, f.str_name
"""


def _fetch(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _cap(centicores: int) -> float:
    """A folder cap in float cores; any unlimited form is -1, as Cuebot shows it."""
    return -1.0 if centicores < 0 or centicores >= 2**31 - 1 else centicores / CENTICORES_PER_CORE


def groups(where: str, params: dict[str, Any], shows: list[str]) -> list[job_pb2.Group]:
    view = status.read_view()
    folders = (view or {}).get("folder") or {}
    out = []
    for r in _fetch(GROUPS_SQL.format(where=where), {**params, "shows": shows}):
        entry = folders.get(r[0]) if r[16] else None
        cores = float(entry["cores"]) if entry else r[14] / CENTICORES_PER_CORE
        gpus = float(entry["gpus"]) if entry else float(r[15])
        out.append(
            job_pb2.Group(
                id=r[0],
                name=r[1],
                department=r[2],
                default_job_priority=r[3],
                default_job_min_cores=_cap(r[4]),
                default_job_max_cores=_cap(r[5]),
                min_cores=r[6] / CENTICORES_PER_CORE,
                max_cores=_cap(r[7]),
                level=r[8],
                parent_id=r[9],
                min_gpus=r[10],
                max_gpus=-1 if r[11] < 0 else r[11],
                default_job_min_gpus=r[12],
                default_job_max_gpus=r[13],
                group_stats=job_pb2.GroupStats(
                    running_frames=r[17],
                    dead_frames=r[18],
                    depend_frames=r[19],
                    waiting_frames=r[20],
                    pending_jobs=r[21],
                    reserved_cores=cores,
                    reserved_gpus=gpus,
                ),
            )
        )
    return out


def _show_of(folder_id: str) -> str:
    rows = _fetch("SELECT pk_show FROM folder WHERE pk_folder = %(f)s", {"f": folder_id})
    if not rows:
        raise NotFound(f"no group with id {folder_id!r}")
    return rows[0][0]


def group(folder_id: str) -> job_pb2.Group:
    found = groups("f.pk_folder = %(f)s", {"f": folder_id}, [_show_of(folder_id)])
    if not found:
        raise NotFound(f"no group with id {folder_id!r}")
    return found[0]


def show_groups(show_id: str) -> list[job_pb2.Group]:
    return groups("true", {}, [show_id])


def root_group(show_id: str) -> job_pb2.Group:
    found = groups("f.pk_parent_folder IS NULL", {}, [show_id])
    if not found:
        raise NotFound("the show has no root group")
    return found[0]


class GroupServicer(job_pb2_grpc.GroupInterfaceServicer):
    @unary
    def GetGroup(self, request: Any, context: Any) -> job_pb2.GroupGetGroupResponse:
        return job_pb2.GroupGetGroupResponse(group=group(request.id))

    @unary
    def FindGroup(self, request: Any, context: Any) -> job_pb2.GroupFindGroupResponse:
        shows = [r[0] for r in _fetch("SELECT pk_show FROM show WHERE str_name = %(s)s", {"s": request.show})]
        found = groups("f.str_name = %(name)s", {"name": request.name}, shows) if shows else []
        if not found:
            raise NotFound(f"no group {request.name!r} in show {request.show!r}")
        return job_pb2.GroupFindGroupResponse(group=found[0])

    @unary
    def GetGroups(self, request: Any, context: Any) -> job_pb2.GroupGetGroupsResponse:
        parent = request.group.id
        found = groups("f.pk_parent_folder = %(parent)s", {"parent": parent}, [_show_of(parent)])
        return job_pb2.GroupGetGroupsResponse(groups=job_pb2.GroupSeq(groups=found))

    @unary
    def GetJobs(self, request: Any, context: Any) -> job_pb2.GroupGetJobsResponse:
        _show_of(request.group.id)
        # Cuebot's getJobs(group): the group's jobs that are not finished.
        found = jobs.jobs("j.pk_folder = %(f)s AND j.str_state <> 'FINISHED'", {"f": request.group.id})
        return job_pb2.GroupGetJobsResponse(jobs=job_pb2.JobSeq(jobs=found))

    @unary
    def SetMaxCores(self, request: Any, context: Any) -> job_pb2.GroupSetMaxCoresResponse:
        _show_of(request.group.id)
        value = request.max_cores
        if value != int(value):
            raise BadRequest(f"max_cores: cuesched keeps a group's max cores in whole cores, not {value}")
        cores = -1 if value < 0 else int(value)
        cap_actions.set_folder_caps(request.group.id, max_cores=cores, actor=API_ACTOR)
        return job_pb2.GroupSetMaxCoresResponse()
