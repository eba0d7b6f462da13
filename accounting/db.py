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


def conninfo(alias: str = "default") -> dict[str, Any]:
    """psycopg keyword arguments for a Django database alias (the test database under pytest)."""
    sd = connections[alias].settings_dict
    kwargs: dict[str, Any] = {"dbname": sd["NAME"]}
    if sd.get("USER"):
        kwargs["user"] = sd["USER"]
    if sd.get("PASSWORD"):
        kwargs["password"] = sd["PASSWORD"]
    if sd.get("HOST"):
        kwargs["host"] = sd["HOST"]
    if sd.get("PORT"):
        kwargs["port"] = sd["PORT"]
    options = dict(sd.get("OPTIONS") or {})
    options.pop("pool", None)
    options.pop("server_side_binding", None)
    options.pop("isolation_level", None)
    kwargs.update(options)
    return kwargs


def connect(*, autocommit: bool = True, application_name: str = "cuesched", **extra: Any) -> psycopg.Connection:
    kwargs = conninfo()
    kwargs.update(extra)
    # TCP keepalives so a silently dead network path is noticed (ignored on Unix sockets).
    kwargs.setdefault("keepalives", 1)
    kwargs.setdefault("keepalives_idle", 10)
    kwargs.setdefault("keepalives_interval", 5)
    kwargs.setdefault("keepalives_count", 3)
    return psycopg.connect(autocommit=autocommit, application_name=application_name, connect_timeout=10, **kwargs)
