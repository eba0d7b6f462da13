"""LimitInterface: licence limits (`limit_record`), listed, found, created and given a new max.

A limit is sent as Cuebot sends a limit no licence server has reported: its whole use is
"pending" (the running frames of its layers, or their distinct hosts for a HOST limit), nothing is
"settled", and `current_running` is that use, the number every booking is checked against
(`int_running`, recounted from `proc` by the triggers of accounting.licences).

Creating one and changing its max are the console's own actions (`accounting.actions.create_limit`,
`set_limit`): the same validation, the same audit rows, the same notification to the scheduler.
What cuesched cannot keep is refused naming the field, never dropped: a limit is always enforced
(no ADVISORY or DISABLED), has no soft threshold and no exit-status failure rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection
from opencue_proto import limit_pb2, limit_pb2_grpc

from accounting import actions
from accounting.licences import COUNT_LATERAL
from opencue_api.rpc import API_ACTOR, BadRequest, unary
from ops.setup_actions import NotFound

# One row per limit: its columns, its hosts counted from proc, and the layers it is on.
LIMITS_SQL = f"""
SELECT r.pk_limit_record, r.str_name, COALESCE(r.int_max_value, 0), r.b_host_limit, r.int_running, c.hosts,
       (SELECT count(*) FROM layer_limit ll WHERE ll.pk_limit_record = r.pk_limit_record)
FROM limit_record r {COUNT_LATERAL}
WHERE (%(id)s::text IS NULL OR r.pk_limit_record = %(id)s) AND (%(name)s::text IS NULL OR r.str_name = %(name)s)
ORDER BY r.str_name
"""


def limits(*, pk: str | None = None, name: str | None = None) -> list[limit_pb2.Limit]:
    with connection.cursor() as cur:
        cur.execute(LIMITS_SQL, {"id": pk, "name": name})
        rows = cur.fetchall()
    return [
        limit_pb2.Limit(
            id=lid,
            name=lname,
            max_value=max_value,
            current_running=running,
            type=limit_pb2.HOST if host_limit else limit_pb2.FRAME,
            enforcement=limit_pb2.ENFORCED,
            soft_value=-1,
            current_usage=running,
            settled_usage=0,
            pending_usage=running,
            host_count=hosts,
            spec_layer_count=layers,
        )
        for lid, lname, max_value, host_limit, running, hosts, layers in rows
    ]


def find_limit(name: str) -> limit_pb2.Limit:
    found = limits(name=name)
    if not found:
        raise NotFound(f"no limit named {name!r}")
    return found[0]


def _checked(field: str, check: Callable[[Any], Any], value: Any) -> Any:
    """The action's own validation, its refusal prefixed with the request's field name."""
    try:
        return check(value)
    except ValidationError as exc:
        raise BadRequest(f"{field}: {'; '.join(exc.messages)}") from None


def _host_limit(request: Any) -> bool:
    if request.type not in (limit_pb2.FRAME, limit_pb2.HOST):
        raise BadRequest(f"type: {request.type} is not a LimitType (FRAME or HOST)")
    if request.enforcement != limit_pb2.ENFORCED:
        raise BadRequest("enforcement: cuesched enforces every limit (ENFORCED); ADVISORY and DISABLED are not kept")
    if request.soft_value > 0:
        raise BadRequest("soft_value: cuesched has no soft threshold (send -1: the same as the max)")
    if request.exit_status:
        raise BadRequest("exit_status: cuesched has no exit-status failure rule (send 0: none)")
    if request.delay_minutes:
        raise BadRequest("delay_minutes: cuesched has no exit-status failure rule to delay by (send 0)")
    # auto_tag only says what a failure rule does; with none (exit_status 0) there is nothing to keep.
    return request.type == limit_pb2.HOST


class LimitServicer(limit_pb2_grpc.LimitInterfaceServicer):
    @unary
    def GetAll(self, request: Any, context: Any) -> limit_pb2.LimitGetAllResponse:
        return limit_pb2.LimitGetAllResponse(limits=limits())

    @unary
    def Find(self, request: Any, context: Any) -> limit_pb2.LimitFindResponse:
        return limit_pb2.LimitFindResponse(limit=find_limit(request.name))

    @unary
    def Get(self, request: Any, context: Any) -> limit_pb2.LimitGetResponse:
        # pycue reads a limit back by its id after every change (Limit._update).
        found = limits(pk=request.id)
        if not found:
            raise NotFound(f"no limit with id {request.id!r}")
        return limit_pb2.LimitGetResponse(limit=found[0])

    @unary
    def Create(self, request: Any, context: Any) -> limit_pb2.LimitCreateResponse:
        name = _checked("name", actions.validate_limit_name, request.name)
        max_value = _checked("max_value", actions.validate_limit_max, request.max_value)
        host_limit = _host_limit(request)
        # A duplicate name is the action's ValidationError(code="exists"): ALREADY_EXISTS, as from Cuebot.
        created = actions.create_limit(name, max_value, host_limit=host_limit, actor=API_ACTOR)
        (limit,) = limits(pk=created.target)
        return limit_pb2.LimitCreateResponse(limit=limit)

    @unary
    def SetMaxValue(self, request: Any, context: Any) -> limit_pb2.LimitSetMaxValueResponse:
        max_value = _checked("max_value", actions.validate_limit_max, request.max_value)
        actions.set_limit(find_limit(request.name).id, max_value=max_value, actor=API_ACTOR)
        return limit_pb2.LimitSetMaxValueResponse()
