"""Dedicated psycopg connections for the scheduler's loops.

Each long-running loop owns one connection of its own, outside Django's per-thread
connection handling: the listener needs autocommit and must never share a session with
queries, and the recompute must start a fresh snapshot after `begin_recompute`, which a
connection borrowed mid-transaction could not guarantee.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db import connections

from accounting.notify import conninfo_from_settings


def conninfo(alias: str = "default") -> str:
    """libpq conninfo of a Django database alias (the test database under pytest)."""
    return conninfo_from_settings(connections[alias].settings_dict)


def connect(*, autocommit: bool = True, application_name: str = "cuesched", **extra: Any) -> psycopg.Connection:
    # TCP keepalives so a silently dead network path is noticed (ignored on Unix sockets).
    params: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
    params.update(extra)
    return psycopg.connect(
        conninfo(), autocommit=autocommit, application_name=application_name, connect_timeout=10, **params
    )
