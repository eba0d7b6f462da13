"""Fixtures the OpenCue client tests share: the clients' own environment and a served API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.opencue_clients import Clients, client_venv


@pytest.fixture(scope="session")
def venv() -> Path:
    """The real 1.37 clients, installed once in their own environment."""
    return client_venv()


@pytest.fixture
def clients(venv: Path) -> Iterator[Clients]:
    """`run_opencue_api`'s server on a free loopback port, and the clients pointed at it."""
    from opencue_api import server

    api = server.start("127.0.0.1:0", workers=4)
    try:
        yield Clients(venv, f"127.0.0.1:{api.port}")
    finally:
        api.stop()
