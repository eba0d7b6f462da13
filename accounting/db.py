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


# The lease tag every connection of this process carries in its application_name once it holds
# the scheduler lease (set_lease_tag): a standby that finds the lease's deadline passed
# terminates exactly the sessions tagged with the old generation (accounting/singleton.py).
_lease_tag: str | None = None
# PostgreSQL keeps NAMEDATALEN - 1 bytes of an application_name.
APPLICATION_NAME_MAX = 63


def lease_tag(generation: int) -> str:
    """The application_name suffix of the sessions of the scheduler holding lease `generation`."""
    return f" [lease {generation}]"


def set_lease_tag(generation: int | None) -> None:
    """Tag every connection this process opens from now on with the lease it books under."""
    global _lease_tag
    _lease_tag = None if generation is None else lease_tag(generation)


def clear_lease_tag(generation: int | None) -> None:
    """At a scheduler's stop: untag later connections, unless another scheduler of this process
    (an in-process test harness) has tagged them with its own lease since."""
    global _lease_tag
    if generation is not None and _lease_tag == lease_tag(generation):
        _lease_tag = None


def tagged(application_name: str) -> str:
    """`application_name` with this process's lease tag, the name cut so the tag always fits."""
    if not _lease_tag:
        return application_name[:APPLICATION_NAME_MAX]
    return application_name[: APPLICATION_NAME_MAX - len(_lease_tag)] + _lease_tag


def connect(
    *, autocommit: bool = True, application_name: str = "cuesched", claim_writer: bool = True, **extra: Any
) -> psycopg.Connection:
    """A connection of the scheduler's database. `claim_writer=False` leaves out cuesched's writer
    claim (`cuesched.writer=on`): the connection then writes as any outside writer would, whatever
    its role (the stress suite's outside writers)."""
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
    options = psycopg.conninfo.conninfo_to_dict(info).get("options")
    options = with_writer_option(options) if claim_writer else without_writer_option(options)
    params["options"] = f"{options} {timeout_options()}".strip()
    return psycopg.connect(
        info, autocommit=autocommit, application_name=tagged(application_name), connect_timeout=10, **params
    )


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
    """libpq `options` with cuesched's writer claim, which the triggers honour for a member of the
    writer role only (see accounting.triggers.WRITER_ON)."""
    options = (options or "").strip()
    return options if WRITER_OPTION in options else f"{options} {WRITER_OPTION}".strip()


def without_writer_option(options: str | None) -> str:
    """libpq `options` without cuesched's writer claim."""
    return " ".join((options or "").replace(WRITER_OPTION, " ").split())


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
