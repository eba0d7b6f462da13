"""ShowInterface: list, find and create shows, and a show's subscriptions."""

from __future__ import annotations

from typing import Any

from opencue_proto import job_pb2, show_pb2, show_pb2_grpc, subscription_pb2

from dispatch.models import Alloc, Show
from opencue_api import groups, messages
from opencue_api.rpc import API_ACTOR, BadRequest, unary
from ops import setup_actions
from ops.setup_actions import NotFound


def find_show(name_or_id: str) -> show_pb2.Show:
    found = messages.shows(name=name_or_id)
    if not found:
        raise NotFound(f"no show named {name_or_id!r}")
    return found[0]


def show_id(show: show_pb2.Show) -> str:
    """The id of the show a request names (pycue sends the whole message; the id is enough)."""
    pk = show.id or Show.objects.filter(str_name=show.name).values_list("pk", flat=True).first()
    if not pk or not Show.objects.filter(pk=pk).exists():
        raise NotFound(f"no show {show.name or show.id!r}")
    return pk


class ShowServicer(show_pb2_grpc.ShowInterfaceServicer):
    @unary
    def GetShows(self, request: Any, context: Any) -> show_pb2.ShowGetShowsResponse:
        return show_pb2.ShowGetShowsResponse(shows=show_pb2.ShowSeq(shows=messages.shows()))

    @unary
    def GetActiveShows(self, request: Any, context: Any) -> show_pb2.ShowGetActiveShowsResponse:
        return show_pb2.ShowGetActiveShowsResponse(shows=show_pb2.ShowSeq(shows=messages.shows(active=True)))

    @unary
    def FindShow(self, request: Any, context: Any) -> show_pb2.ShowFindShowResponse:
        return show_pb2.ShowFindShowResponse(show=find_show(request.name))

    @unary
    def CreateShow(self, request: Any, context: Any) -> show_pb2.ShowCreateShowResponse:
        created = setup_actions.create_show(request.name, actor=API_ACTOR)
        return show_pb2.ShowCreateShowResponse(show=find_show(created.pk))

    @unary
    def GetSubscriptions(self, request: Any, context: Any) -> show_pb2.ShowGetSubscriptionResponse:
        subs = messages.subscriptions(show=show_id(request.show))
        return show_pb2.ShowGetSubscriptionResponse(subscriptions=subscription_pb2.SubscriptionSeq(subscriptions=subs))

    @unary
    def GetGroups(self, request: Any, context: Any) -> show_pb2.ShowGetGroupsResponse:
        found = groups.show_groups(show_id(request.show))
        return show_pb2.ShowGetGroupsResponse(groups=job_pb2.GroupSeq(groups=found))

    @unary
    def GetRootGroup(self, request: Any, context: Any) -> show_pb2.ShowGetRootGroupResponse:
        return show_pb2.ShowGetRootGroupResponse(group=groups.root_group(show_id(request.show)))

    @unary
    def CreateSubscription(self, request: Any, context: Any) -> show_pb2.ShowCreateSubscriptionResponse:
        # Cuebot takes size and burst here in float cores (Convert.coresToCoreUnits); cuesched keeps
        # them in whole cores, so a fraction is refused rather than rounded.
        size, burst = _whole_cores(request.size, "size"), _whole_cores(request.burst, "burst")
        if not Alloc.objects.filter(pk=request.allocation_id).exists():
            raise NotFound(f"no allocation with id {request.allocation_id!r}")
        created = setup_actions.create_subscription(
            show_id(request.show), request.allocation_id, size_cores=size, burst_cores=burst, actor=API_ACTOR
        )
        (sub,) = messages.subscriptions(sub=created.pk)
        return show_pb2.ShowCreateSubscriptionResponse(subscription=sub)


def _whole_cores(value: float, field: str) -> int:
    if value != int(value):
        raise BadRequest(f"{field}: cuesched keeps subscriptions in whole cores, not {value}")
    return int(value)
