"""CueInterface: every client's first call (pycue's connection probe)."""

from __future__ import annotations

from typing import Any

from opencue_proto import cue_pb2, cue_pb2_grpc

from opencue_api.rpc import unary


class CueServicer(cue_pb2_grpc.CueInterfaceServicer):
    @unary
    def GetSystemStats(self, request: Any, context: Any) -> cue_pb2.CueGetSystemStatsResponse:
        # Cuebot's figures are its Java thread pools'; cuesched has none of them. An empty message
        # answers the probe honestly (every count 0) rather than with invented numbers.
        return cue_pb2.CueGetSystemStatsResponse(stats=cue_pb2.SystemStats())
