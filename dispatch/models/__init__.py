"""The Cuebot-mapped farm tables, one module per family."""

from dispatch.models.api_tokens import ApiToken
from dispatch.models.comments import Comment
from dispatch.models.depends import Depend
from dispatch.models.farm_actions import FarmAction
from dispatch.models.hosts import Host, HostStat, HostTag, WaitingHost
from dispatch.models.jobs import (
    Frame,
    Job,
    JobEnv,
    JobMem,
    JobResource,
    JobStat,
    Layer,
    LayerEnv,
    LayerMem,
    LayerResource,
    LayerStat,
)
from dispatch.models.limits import LayerLimit, LimitRecord
from dispatch.models.org import Alloc, Dept, Facility, Folder, FolderResource, Point, Show, Subscription
from dispatch.models.procs import Proc
from dispatch.models.services import Service, ShowService

__all__ = [
    "Alloc",
    "ApiToken",
    "Comment",
    "Depend",
    "Dept",
    "Facility",
    "FarmAction",
    "Folder",
    "FolderResource",
    "Frame",
    "Host",
    "HostStat",
    "HostTag",
    "Job",
    "JobEnv",
    "JobMem",
    "JobResource",
    "JobStat",
    "Layer",
    "LayerEnv",
    "LayerLimit",
    "LayerMem",
    "LayerResource",
    "LayerStat",
    "LimitRecord",
    "Point",
    "Proc",
    "Service",
    "Show",
    "ShowService",
    "Subscription",
    "WaitingHost",
]
