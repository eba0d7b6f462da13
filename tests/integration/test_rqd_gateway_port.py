"""The RQD gateway owns its port: a second server on it is refused, never handed half the reports.

gRPC binds with SO_REUSEPORT unless told not to, and the kernel then spreads new connections over
every socket on the port: a second gateway (or the OpenCue client API, whose default is the same
8443) would silently receive some of the render nodes' reports.
"""

from __future__ import annotations

import pytest

from dispatch.hosts.rqd_gateway import start_gateway
from opencue_api import server


def test_a_second_server_on_the_gateways_port_is_refused() -> None:
    gw = start_gateway("127.0.0.1", 0, workers=1)
    try:
        with pytest.raises(OSError):
            start_gateway("127.0.0.1", gw.port, workers=1)
        with pytest.raises(OSError):
            server.start(f"127.0.0.1:{gw.port}")
    finally:
        gw.stop()
