"""Helpers for the RQD tests: the gateway in this process, real daemons (`dispatch.lab.rqdfarm`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from dispatch.hosts.rqd_gateway import Gateway, start_gateway
from dispatch.lab.rqdfarm import Rqd, pids_of, start_daemons, wait_registered

__all__ = ["Rqd", "gateway", "pids_of", "rqd_daemons", "wait_registered"]


@contextmanager
def gateway() -> Iterator[Gateway]:
    gw = start_gateway("127.0.0.1", 0, workers=8)
    try:
        yield gw
    finally:
        gw.stop()


@contextmanager
def rqd_daemons(
    conn: psycopg.Connection,
    gw: Gateway,
    tmp: Path,
    names: list[str],
    *,
    tags: list[str],
    cores: int = 4,
    memory_kb: int = 8 * 1024 * 1024,
    nimby_display: str | None = None,
    nimby_idle: int = 5,
) -> Iterator[dict[str, Rqd]]:
    """Start one RQD per name; yields once every host registered through the gateway.
    `nimby_display`: RQD's own NIMBY on, watching that X display (dispatch.lab.rqdfarm)."""
    daemons: dict[str, Rqd] = {}
    try:
        daemons = start_daemons(
            names,
            gw.port,
            tmp,
            tags=tags,
            cores=cores,
            memory_kb=memory_kb,
            nimby_display=nimby_display,
            nimby_idle=nimby_idle,
        )
        for rqd in daemons.values():
            wait_registered(conn, rqd, 30)
        yield daemons
    finally:
        for rqd in daemons.values():
            rqd.stop()
