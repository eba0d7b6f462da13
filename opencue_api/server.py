"""The gRPC server OpenCue's clients connect to, on Cuebot's port.

Cuebot has no authentication: whoever reaches its port controls every job. cuesched keeps that
protocol (the clients cannot be changed), so it binds to loopback by default and refuses any other
address unless the operator passes a flag whose name says what it means.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opencue_proto import (
    comment_pb2_grpc,
    cue_pb2_grpc,
    facility_pb2_grpc,
    host_pb2_grpc,
    job_pb2_grpc,
    limit_pb2_grpc,
    service_pb2_grpc,
    show_pb2_grpc,
    subscription_pb2_grpc,
)

from opencue_api.comments import CommentServicer
from opencue_api.facilities import AllocationServicer, FacilityServicer
from opencue_api.groups import GroupServicer
from opencue_api.hosts import HostServicer
from opencue_api.jobs import FrameServicer, LayerServicer
from opencue_api.launch import LaunchingJobServicer
from opencue_api.limits import LimitServicer
from opencue_api.procs import ProcServicer
from opencue_api.services import ServiceServicer
from opencue_api.shows import ShowServicer
from opencue_api.subscriptions import SubscriptionServicer
from opencue_api.system import CueServicer

logger = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1:8443"
OPEN_FLAG = "--anyone-who-reaches-the-port-controls-every-job"
# pycue's default max message size (cuebot.max_message_bytes): GetFrames of a big job is large.
MAX_MESSAGE_BYTES = 104_857_600


@dataclass
class ApiServer:
    server: grpc.Server
    port: int

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace).wait()


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--addr must be HOST:PORT, not {addr!r}")
    return host, int(port)


# Every service this API answers, and the function that adds it to a server. A call of a service
# not here, or a method a servicer does not override, answers UNIMPLEMENTED (docs/opencue-clients.md
# lists both; tests/unit/test_opencue_api_docs.py checks the page against this).
SERVICERS: tuple[tuple[Callable[[Any, grpc.Server], None], type], ...] = (
    (cue_pb2_grpc.add_CueInterfaceServicer_to_server, CueServicer),
    (show_pb2_grpc.add_ShowInterfaceServicer_to_server, ShowServicer),
    (facility_pb2_grpc.add_FacilityInterfaceServicer_to_server, FacilityServicer),
    (facility_pb2_grpc.add_AllocationInterfaceServicer_to_server, AllocationServicer),
    (subscription_pb2_grpc.add_SubscriptionInterfaceServicer_to_server, SubscriptionServicer),
    (job_pb2_grpc.add_JobInterfaceServicer_to_server, LaunchingJobServicer),
    (job_pb2_grpc.add_LayerInterfaceServicer_to_server, LayerServicer),
    (job_pb2_grpc.add_FrameInterfaceServicer_to_server, FrameServicer),
    (job_pb2_grpc.add_GroupInterfaceServicer_to_server, GroupServicer),
    (host_pb2_grpc.add_HostInterfaceServicer_to_server, HostServicer),
    (service_pb2_grpc.add_ServiceInterfaceServicer_to_server, ServiceServicer),
    (limit_pb2_grpc.add_LimitInterfaceServicer_to_server, LimitServicer),
    (host_pb2_grpc.add_ProcInterfaceServicer_to_server, ProcServicer),
    (comment_pb2_grpc.add_CommentInterfaceServicer_to_server, CommentServicer),
)


def start(addr: str = DEFAULT_ADDR, *, workers: int = 16, open_to_network: bool = False) -> ApiServer:
    """Start serving (returns at once); port 0 picks a free one (tests)."""
    host, port = split_addr(addr)
    if not is_loopback(host) and not open_to_network:
        raise ValueError(
            f"{host} is not a loopback address: OpenCue's protocol has no authentication, so anyone who "
            f"reaches the port could kill or change every job. Pass {OPEN_FLAG} to do it anyway."
        )
    # grpc binds with SO_REUSEPORT by default: a second server on the port (the RQD gateway's
    # default is 8443 too) would silently share the connections. Refuse to start instead.
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="opencue-api"), options=options
    )
    for add, servicer in SERVICERS:
        add(servicer(), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc 1.85 raises where older releases returned 0
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {addr}")
    server.start()
    logger.info("OpenCue client API listening on %s:%d", host, bound)
    return ApiServer(server, bound)
