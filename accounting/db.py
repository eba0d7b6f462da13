"""Dedicated psycopg connections for the scheduler's loops.

Each long-running loop owns one connection of its own, outside Django's per-thread
connection handling: the listener needs autocommit and must never share a session with
queries, and the recompute must start a fresh snapshot after `begin_recompute`, which a
connection borrowed mid-transaction could not guarantee.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.db import DatabaseError, connections

from accounting import blockers
from accounting.keylocks import KEY_TABLES
from accounting.notify import conninfo_from_settings
from accounting.triggers import WRITER_OPTION
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
    """A key row a flip or move must lock stayed held by proc writers for the whole timeout."""


def lock_for_move(cursor: Any, table: str, keys: list[str], *, timeout: float, what: str = "the flip") -> None:
    """Lock the key rows a flip or move changes FOR UPDATE, in the cursor's open transaction.

    It waits for the proc writers of exactly those keys (they hold the rows FOR KEY SHARE,
    accounting.keylocks) and holds off later ones; proc writes of every other show go on. Gives
    up after `timeout` seconds with KeysLockTimeout naming the sessions that hold the rows; the
    transaction stays usable (the attempt runs under a savepoint). `cursor` is a psycopg or
    Django cursor. The connection's lock_timeout is put back afterwards.
    """
    key = dict(KEY_TABLES)[table]
    ordered = sorted(set(keys))
    cursor.execute("SELECT current_setting('lock_timeout')")
    previous = cursor.fetchone()[0]
    cursor.execute("SAVEPOINT cuesched_move_lock")
    try:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", (f"{max(1, int(timeout * 1000))}ms",))
        cursor.execute(f"SELECT 1 FROM {table} WHERE {key} = ANY(%s::text[]) ORDER BY {key} FOR UPDATE", (ordered,))
    except Exception as exc:
        cursor.execute("ROLLBACK TO SAVEPOINT cuesched_move_lock")
        cursor.execute("RELEASE SAVEPOINT cuesched_move_lock")
        # A Django cursor wraps psycopg's error: the SQLSTATE is on its cause.
        if getattr(exc, "sqlstate", None) != "55P03" and getattr(exc.__cause__, "sqlstate", None) != "55P03":
            raise
        held = blockers.describe(blockers.key_row_holders(cursor, table, ordered))
        raise KeysLockTimeout(
            f"could not lock {table} {', '.join(ordered)} for {what} within {timeout:.0f} s: a transaction that "
            f"wrote procs of it is still open; end it and retry (other shows are not held up). "
            f"Sessions holding it: {held}"
        ) from exc
    cursor.execute("RELEASE SAVEPOINT cuesched_move_lock")
    cursor.execute("SELECT set_config('lock_timeout', %s, true)", (previous,))
