"""SubscriptionInterface: a show's share of an allocation, found by `<allocation>.<show>`.

Size and burst travel in centicores here, as in Cuebot's SetSize/SetBurst (which store the number
as sent): `cueadmin -burst show alloc 2000` is 20 cores. cuesched keeps subscriptions in whole
cores, so a value that is not a multiple of 100 is refused, never rounded. The change goes through
the console's own action, `accounting.actions.set_subscription`: the same bounded wait behind
bookings, the same cap history, the same notification to the scheduler.
"""

from __future__ import annotations

from typing import Any

from opencue_proto import subscription_pb2, subscription_pb2_grpc

from accounting import actions
from accounting.units import CENTICORES_PER_CORE
from dispatch.models import Subscription
from opencue_api import messages
from opencue_api.rpc import API_ACTOR, BadRequest, unary
from ops import setup_actions
from ops.setup_actions import NotFound


def find_subscription(name: str) -> subscription_pb2.Subscription:
    alloc, _, show = name.rpartition(".")
    if not alloc or not show:
        raise BadRequest(f"name: subscription names are <allocation>.<show>, not {name!r}")
    # One indexed lookup by the two names (not a scan of every subscription's message).
    pk = Subscription.objects.filter(alloc__str_name=alloc, show__str_name=show).values_list("pk", flat=True).first()
    found = messages.subscriptions(sub=pk) if pk else []
    if not found:
        raise NotFound(f"a subscription to {name} was not found")
    return found[0]


def _sub_id(sub: subscription_pb2.Subscription) -> str:
    pk = sub.id
    if not pk and sub.name:
        pk = find_subscription(sub.name).id
    if not pk or not Subscription.objects.filter(pk=pk).exists():
        raise NotFound(f"no subscription {sub.name or sub.id!r}")
    return pk


def _cores(centicores: int, field: str) -> int:
    if centicores % CENTICORES_PER_CORE:
        raise BadRequest(
            f"{field}: {centicores} centicores is {centicores / CENTICORES_PER_CORE:g} cores; "
            "cuesched keeps subscriptions in whole cores (multiples of 100)"
        )
    return centicores // CENTICORES_PER_CORE


class SubscriptionServicer(subscription_pb2_grpc.SubscriptionInterfaceServicer):
    @unary
    def Find(self, request: Any, context: Any) -> subscription_pb2.SubscriptionFindResponse:
        return subscription_pb2.SubscriptionFindResponse(subscription=find_subscription(request.name))

    @unary
    def Get(self, request: Any, context: Any) -> subscription_pb2.SubscriptionGetResponse:
        found = messages.subscriptions(sub=request.id)
        if not found:
            raise NotFound(f"no subscription with id {request.id!r}")
        return subscription_pb2.SubscriptionGetResponse(subscription=found[0])

    @unary
    def SetSize(self, request: Any, context: Any) -> subscription_pb2.SubscriptionSetSizeResponse:
        size = _cores(request.new_size, "new_size")
        actions.set_subscription(_sub_id(request.subscription), size_cores=size, actor=API_ACTOR)
        return subscription_pb2.SubscriptionSetSizeResponse()

    @unary
    def SetBurst(self, request: Any, context: Any) -> subscription_pb2.SubscriptionSetBurstResponse:
        burst = _cores(request.burst, "burst")
        actions.set_subscription(_sub_id(request.subscription), burst_cores=burst, actor=API_ACTOR)
        return subscription_pb2.SubscriptionSetBurstResponse()

    @unary
    def Delete(self, request: Any, context: Any) -> subscription_pb2.SubscriptionDeleteResponse:
        setup_actions.delete_subscription(_sub_id(request.subscription), actor=API_ACTOR)
        return subscription_pb2.SubscriptionDeleteResponse()
