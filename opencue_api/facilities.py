"""FacilityInterface and AllocationInterface: where hosts are, and the pools shows subscribe to."""

from __future__ import annotations

from typing import Any

from opencue_proto import facility_pb2, facility_pb2_grpc, subscription_pb2

from dispatch.models import Alloc, Facility
from opencue_api import messages
from opencue_api.rpc import API_ACTOR, unary
from ops import setup_actions
from ops.setup_actions import NotFound


def find_facility(name_or_id: str) -> Facility:
    fac = Facility.objects.filter(str_name=name_or_id).first() or Facility.objects.filter(pk=name_or_id).first()
    if fac is None:
        raise NotFound(f"no facility named {name_or_id!r}")
    return fac


def find_allocation(name_or_id: str) -> facility_pb2.Allocation:
    found = messages.allocations(name=name_or_id)
    if not found:
        raise NotFound(f"no allocation named {name_or_id!r}")
    return found[0]


def _alloc_id(alloc: facility_pb2.Allocation) -> str:
    pk = alloc.id or Alloc.objects.filter(str_name=alloc.name).values_list("pk", flat=True).first()
    if not pk or not Alloc.objects.filter(pk=pk).exists():
        raise NotFound(f"no allocation {alloc.name or alloc.id!r}")
    return pk


class FacilityServicer(facility_pb2_grpc.FacilityInterfaceServicer):
    @unary
    def Get(self, request: Any, context: Any) -> facility_pb2.FacilityGetResponse:
        fac = find_facility(request.name)
        return facility_pb2.FacilityGetResponse(facility=messages.facility(fac.pk, fac.str_name))

    @unary
    def Create(self, request: Any, context: Any) -> facility_pb2.FacilityCreateResponse:
        created = setup_actions.create_facility(request.name, actor=API_ACTOR)
        return facility_pb2.FacilityCreateResponse(facility=messages.facility(created.pk, created.name))

    @unary
    def GetAllocations(self, request: Any, context: Any) -> facility_pb2.FacilityGetAllocationsResponse:
        fac = find_facility(request.facility.id or request.facility.name)
        allocs = messages.allocations(facility=fac.pk)
        return facility_pb2.FacilityGetAllocationsResponse(allocations=facility_pb2.AllocationSeq(allocations=allocs))


class AllocationServicer(facility_pb2_grpc.AllocationInterfaceServicer):
    @unary
    def GetAll(self, request: Any, context: Any) -> facility_pb2.AllocGetAllResponse:
        return facility_pb2.AllocGetAllResponse(
            allocations=facility_pb2.AllocationSeq(allocations=messages.allocations())
        )

    @unary
    def Find(self, request: Any, context: Any) -> facility_pb2.AllocFindResponse:
        return facility_pb2.AllocFindResponse(allocation=find_allocation(request.name))

    @unary
    def Get(self, request: Any, context: Any) -> facility_pb2.AllocGetResponse:
        return facility_pb2.AllocGetResponse(allocation=find_allocation(request.id))

    @unary
    def Create(self, request: Any, context: Any) -> facility_pb2.AllocCreateResponse:
        fac = find_facility(request.facility.id or request.facility.name)
        created = setup_actions.create_allocation(fac.pk, request.name, request.tag, actor=API_ACTOR)
        return facility_pb2.AllocCreateResponse(allocation=find_allocation(created.pk))

    @unary
    def GetSubscriptions(self, request: Any, context: Any) -> facility_pb2.AllocGetSubscriptionsResponse:
        subs = messages.subscriptions(alloc=_alloc_id(request.allocation))
        return facility_pb2.AllocGetSubscriptionsResponse(
            subscriptions=subscription_pb2.SubscriptionSeq(subscriptions=subs)
        )
