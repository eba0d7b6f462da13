"""ServiceInterface: the farm's default services, read-only.

A service's row is sent as Cuebot's whiteboard sends it, column for column and in the table's own
units (cores in centicores, memory in KB, timeouts in minutes): pycue's `Service.minCores()` of
the seeded `shell` service is 100, as from Cuebot. Creating, changing and deleting services stays
with the console and `/api/services` (their audited actions); here those calls answer
UNIMPLEMENTED.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from opencue_proto import service_pb2, service_pb2_grpc

from dispatch.models import Service
from opencue_api.rpc import unary
from ops.setup_actions import NotFound


def service_message(row: Service) -> service_pb2.Service:
    return service_pb2.Service(
        id=row.pk,
        name=row.str_name,
        threadable=row.b_threadable,
        min_cores=row.int_cores_min,
        max_cores=row.int_cores_max,
        min_memory=row.int_mem_min,
        min_gpu_memory=row.int_gpu_mem_min,
        tags=row.tags,
        timeout=row.int_timeout,
        timeout_llu=row.int_timeout_llu,
        min_gpus=row.int_gpus_min,
        max_gpus=row.int_gpus_max,
        min_memory_increase=row.int_min_memory_increase,
    )


class ServiceServicer(service_pb2_grpc.ServiceInterfaceServicer):
    @unary
    def GetDefaultServices(self, request: Any, context: Any) -> service_pb2.ServiceGetDefaultServicesResponse:
        rows = [service_message(s) for s in Service.objects.order_by("str_name")]
        return service_pb2.ServiceGetDefaultServicesResponse(services=service_pb2.ServiceSeq(services=rows))

    @unary
    def GetService(self, request: Any, context: Any) -> service_pb2.ServiceGetServiceResponse:
        # Cuebot's whiteboard finds a service by its name or its id; pycue's getService sends the name.
        row = Service.objects.filter(Q(str_name=request.name) | Q(pk=request.name)).first()
        if row is None:
            raise NotFound(f"no service named {request.name!r}")
        return service_pb2.ServiceGetServiceResponse(service=service_message(row))
