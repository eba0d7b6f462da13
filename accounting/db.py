"""Dedicated psycopg connections for the scheduler's loops.

Each long-running loop owns one connection of its own, outside Django's per-thread
connection handling: the listener needs autocommit and must never share a session with
queries, and the recompute must start a fresh snapshot after `begin_recompute`, which a
connection borrowed mid-transaction could not guarantee.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from django.db import DatabaseError, connections

from accounting import blockers
from accounting.notify import conninfo_from_settings
from accounting.triggers import LOCK_KEYS_TRY_EXCLUSIVE_SQL, WRITER_OPTION
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
    info = conninfo()
    options = with_writer_option(psycopg.conninfo.conninfo_to_dict(info).get("options"))
    params["options"] = f"{options} {timeout_options()}".strip()
    return psycopg.connect(info, autocommit=autocommit, application_name=application_name, connect_timeout=10, **params)


def timeout_options() -> str:
    """libpq `options` with the scheduler's lock, statement and idle-in-transaction timeouts.

    Every scheduler connection carries them from its start: no wait for a lock another session
    holds (a psql session left open inside a transaction) lasts longer than the lock timeout,
    and the loops skip that show or retry instead of stalling the farm; a session of ours that
    is wedged inside a transaction is ended by PostgreSQL and its locks go with it. 0 disables one.
    """
    parts = []
    for name, seconds in (
        ("lock_timeout", conf.db_lock_timeout()),
        ("statement_timeout", conf.db_statement_timeout()),
        ("idle_in_transaction_session_timeout", conf.db_idle_in_transaction_timeout()),
    ):
        parts.append(f"-c {name}={max(0, int(seconds * 1000))}")
    return " ".join(parts)


def with_writer_option(options: str | None) -> str:
    """libpq `options` with cuesched's writer mark: in a Cuebot database the proc triggers count
    unmanaged shows' procs for cuesched's own writers only (see accounting.triggers.CUEBOT_WRITES)."""
    options = (options or "").strip()
    return options if WRITER_OPTION in options else f"{options} {WRITER_OPTION}".strip()


logger = logging.getLogger(__name__)


class KeysLockTimeout(DatabaseError):
    """The exclusive accounting-keys lock stayed busy for the whole timeout."""


def take_keys_lock(cursor: Any, *, timeout: float | None = None, what: str = "the accounting-keys lock") -> None:
    """Take the exclusive accounting-keys lock in the cursor's open transaction, polling.

    Never queued for: PostgreSQL would hold every later proc write of the farm behind a waiting
    exclusive request. For a caller that must hold it before it locks any row a proc references
    (the lease takeover, a console flip); the statement triggers of a move find it held then.
    `cursor` is a psycopg or Django cursor. `timeout=None` waits as long as it takes, logging
    every 5 s; otherwise KeysLockTimeout is raised.
    """
    started = logged = time.monotonic()
    while True:
        cursor.execute(LOCK_KEYS_TRY_EXCLUSIVE_SQL)
        if cursor.fetchone()[0]:
            return
        now = time.monotonic()
        if timeout is not None and now - started > timeout:
            held = blockers.describe(blockers.keys_lock_holders(cursor))
            raise KeysLockTimeout(
                f"could not take {what} within {timeout:.0f} s: proc writes kept it busy; retry. "
                f"Sessions inside a transaction that hold it: {held}"
            )
        if now - logged > 5:
            logged = now
            logger.warning("%s: still waiting for in-flight proc writes to commit (%.0fs)", what, now - started)
        time.sleep(0.005)
