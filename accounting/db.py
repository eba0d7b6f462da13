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
from cuesched_project import conf
from cuesched_project.dburl import database_from_url


def conninfo(alias: str = "default") -> str:
    """libpq conninfo of the scheduler's database: CUESCHED_SCHEDULER_DATABASE_URL, else Django's alias."""
    override = conf.scheduler_database_url()
    if override:
        return conninfo_from_settings(database_from_url(override))
    return conninfo_from_settings(connections[alias].settings_dict)


def connect(*, autocommit: bool = True, application_name: str = "cuesched", **extra: Any) -> psycopg.Connection:
    # TCP keepalives and a user timeout, so a silently dead network path fails the connection in
    # seconds instead of the kernel's ~15 minutes of retries (both ignored on Unix sockets).
    # Neither notices a path that still acknowledges but delivers nothing (a frozen proxy): the
    # listener's heartbeat does.
    params: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": conf.tcp_user_timeout_ms(),
    }
    params.update(extra)
    return psycopg.connect(
        conninfo(), autocommit=autocommit, application_name=application_name, connect_timeout=10, **params
    )
