"""What the scheduler process needs to know about the database side of accounting.

The triggers in `accounting.triggers` emit two channels inside the writing transaction, so a
notification is delivered if and only if its write commits:

* `acct_release`: a signed usage delta, one message per (show, alloc, folder, job, layer, dept)
  per statement that changes what non-local procs of a scheduler-managed show book: a proc
  DELETE (negative), a proc INSERT or resize made outside the scheduler (positive), a proc, host
  or job whose accounting keys move (a negative message for the old key, a positive one for the
  new)::

    {"show":"<id>","alloc":"<id>","folder":"<id>","job":"<id>","layer":"<id>","dept":"<id>",
     "cores":-4,"gpus":-2,"xid":1234,"seq":1}

  `cores` is the group's centicore sum rounded toward +infinity once per message (a release of
  250 centicores is -2, a booking of 250 is +3): rounding may only ever leave the Store HIGH.

* `acct_limit_change` (one message per inserted, changed or deleted cap row, every show)::

    {"vertex":"sub","show":"<id>","alloc":"<id>","burst":15,"xid":1234,"seq":1}
    {"vertex":"folder","id":"<pk_folder>","max_cores":8,"max_gpus":3,"xid":1234,"seq":2}
    {"vertex":"job","id":"<pk_job>","removed":true,"xid":1234,"seq":3}

  Folder and job messages carry both fields; `removed` says the row was deleted.

* `acct_licence` (one message per changed `limit_record` row: a proc statement of one of its
  layers, a `layer_limit` change, its max or host flag; absolute values, every show)::

    {"id":"<pk_limit_record>","name":"arnold","max":100,"host":false,"running":37,"xid":1234,"seq":1}
    {"id":"<pk_limit_record>","removed":true,"xid":1234,"seq":2}

  Sent whatever the kill switch says: it carries absolute values, so an extra one is harmless.

* `acct_resync` (a TRUNCATE of proc or of a cap table: no per-row message is possible)::

    {"table":"proc","xid":1234}

* `cuesched_heartbeat`: the scheduler's own liveness probe of its LISTEN path (text payload).

The outbox: a notification is a doorbell, the row is the truth. PostgreSQL has no privilege on
NOTIFY or LISTEN: any session may send any payload on any channel, and any session may listen
to them. So the triggers never hand the scheduler a payload it must believe. Each message above
but the heartbeat is also written, in the same transaction, as a row of `OUTBOX_TABLE` by
`EMIT_FUNCTION` (`cuesched_acct_emit(channel, payload)`), a table no outside role may write
(the `notify_outbox` migration of accounting). The scheduler's listener takes any notification
on these channels as "look at the outbox", deletes what it finds there (`DRAIN_SQL`) and applies
only those rows, in their order. A forged notification finds nothing of its own to apply; a
replayed one finds its row already consumed. The payload stays on the channel as well, for the
tools that watch it (a psql `LISTEN` while debugging, the tests); nothing applies it from there.

`xid` is the writing transaction (`pg_current_xact_id()`), so the scheduler can tell whether a
snapshot it read (`pg_current_snapshot()`) already contains the write. `seq` numbers the trigger
invocations within that transaction: PostgreSQL drops a NOTIFY whose channel and payload repeat
one already queued by the same transaction, and two deletes of equal procs of one layer (or a
cap set to 2, then 1, then 2 again) would otherwise collapse into one message.

Kill switch: `accounting.models.AccountingSettings.notify_enabled` (one row, read by every
trigger statement) silences `acct_release` and `acct_limit_change`. `acct_resync` is always sent:
it is rare, and without it a truncated cap table would leave stale caps until the limit reseed.
The database-enforced accounting of shows that are not scheduler-managed is not affected by it.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db.backends.base.base import BaseDatabaseWrapper

RELEASE_CHANNEL = "acct_release"
LIMIT_CHANNEL = "acct_limit_change"
RESYNC_CHANNEL = "acct_resync"
HEARTBEAT_CHANNEL = "cuesched_heartbeat"
# A licence limit's row changed (its use or its max): absolute values, see accounting.licences.
LICENCE_CHANNEL = "acct_licence"
CHANNELS = (RELEASE_CHANNEL, LIMIT_CHANNEL, RESYNC_CHANNEL, HEARTBEAT_CHANNEL, LICENCE_CHANNEL)
# The channels whose messages the triggers also write to the outbox: on these a notification only rings.
OUTBOX_CHANNELS = frozenset({RELEASE_CHANNEL, LIMIT_CHANNEL, RESYNC_CHANNEL, LICENCE_CHANNEL})

# The outbox (see the module docstring). Written by EMIT_FUNCTION from the trigger functions, read
# and deleted by members of the writer role (the scheduler's listener), by nobody else.
OUTBOX_TABLE = "cuesched_acct_outbox"
EMIT_FUNCTION = "cuesched_acct_emit"
# What the listener applies on a doorbell: every committed row, consumed once (sorted by id after).
DRAIN_SQL = f"DELETE FROM {OUTBOX_TABLE} RETURNING id, str_channel, str_payload"
# On (re)connect, after LISTEN and before the reseed: what committed before it is in the reseed.
CLEAR_SQL = f"DELETE FROM {OUTBOX_TABLE}"
# The same two for a scheduler that books under a lease: they consume nothing unless the lease is
# still at its generation. A holder does not know it lost the lease until its next renewal, and
# its drain in between would take rows the new holder must apply (its Store then reads high for
# good, until a recompute). The lease read and the scan share the DELETE's one snapshot (the
# uncorrelated subquery runs once): if it still sees the old generation, the takeover committed
# after that snapshot, so every row it deletes committed before the new holder's reseed, which
# reads them. The lease row is not locked, so a stopped holder holds no takeover up.
LEASE_GENERATION_SQL = "SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1"
_FENCE = f"WHERE ({LEASE_GENERATION_SQL}) = %(generation)s"
DRAIN_FENCED_SQL = f"DELETE FROM {OUTBOX_TABLE} {_FENCE} RETURNING id, str_channel, str_payload"
CLEAR_FENCED_SQL = f"DELETE FROM {OUTBOX_TABLE} {_FENCE}"


def emit_sql(channel: str, payload: str) -> str:
    """The trigger-side call that sends `payload` (an SQL text expression) on `channel` through the outbox."""
    return f"{EMIT_FUNCTION}('{channel}', {payload})"


# Transaction-local marker read by the proc triggers (set_config(..., is_local => true)): the
# Store already accounts for this transaction's proc writes, so they send no usage delta.
STORE_ACCOUNTED_SETTING = "cuesched.store_accounted"
# Transaction-local counter that makes every payload of a transaction distinct.
NOTIFY_SEQ_SETTING = "cuesched.notify_seq"

# OPTIONS keys that are libpq connection parameters (Django also keeps its own keys there).
_LIBPQ_OPTIONS = frozenset(
    {
        "sslmode",
        "sslcert",
        "sslkey",
        "sslrootcert",
        "sslpassword",
        "application_name",
        "options",
        "connect_timeout",
        "target_session_attrs",
        "passfile",
        "service",
    }
)

STORE_ACCOUNTED_SQL = f"SELECT set_config('{STORE_ACCOUNTED_SETTING}', 'on', true)"


class NotInTransactionError(RuntimeError):
    """The marker was set outside a transaction, where it would vanish before the DELETE runs."""


def mark_store_accounted(cursor_or_connection: Any) -> None:
    """Make the rest of the current transaction's proc writes send no usage delta (`acct_release`).

    Only the scheduler may say this, and only for writes its Store accounts itself: the booking
    transaction (the Store booked those procs before the INSERT, so a delta would count them
    twice) and the compensating delete after a failed launch (the booking is rolled back in the
    Store, so a release would subtract it twice). The marker is transaction-local (it ends with
    COMMIT or ROLLBACK) and affects no other connection. Cap-change notifications and the
    database-enforced accounting of unmanaged shows are not affected. Accepts a Django
    connection or cursor, or a psycopg connection or cursor; raises `NotInTransactionError`
    when there is no open transaction to scope it to.
    """
    # django.db.connection is a proxy, not a BaseDatabaseWrapper: recognise it by what it has.
    if isinstance(cursor_or_connection, BaseDatabaseWrapper) or hasattr(cursor_or_connection, "in_atomic_block"):
        if not cursor_or_connection.in_atomic_block:
            raise NotInTransactionError("mark_store_accounted needs transaction.atomic()")
        with cursor_or_connection.cursor() as cursor:
            cursor.execute(STORE_ACCOUNTED_SQL)
        return
    django_db = getattr(cursor_or_connection, "db", None)
    if isinstance(django_db, BaseDatabaseWrapper):  # a Django CursorWrapper
        if not django_db.in_atomic_block:
            raise NotInTransactionError("mark_store_accounted needs transaction.atomic()")
        cursor_or_connection.execute(STORE_ACCOUNTED_SQL)
        return
    conn = cursor_or_connection.connection if isinstance(cursor_or_connection, psycopg.Cursor) else None
    conn = conn or cursor_or_connection
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(f"expected a Django or psycopg connection or cursor, got {type(conn).__name__}")
    conn.execute(STORE_ACCOUNTED_SQL)
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
        raise NotInTransactionError("mark_store_accounted ran outside a transaction")


def conninfo_from_settings(settings_dict: dict[str, Any]) -> str:
    """A libpq conninfo for a Django database: LISTEN needs its own autocommit connection."""
    params = {
        "dbname": settings_dict.get("NAME"),
        "user": settings_dict.get("USER"),
        "password": settings_dict.get("PASSWORD"),
        "host": settings_dict.get("HOST"),
        "port": settings_dict.get("PORT"),
    }
    options = settings_dict.get("OPTIONS") or {}
    params.update({k: v for k, v in options.items() if k in _LIBPQ_OPTIONS})
    return psycopg.conninfo.make_conninfo(**{k: v for k, v in params.items() if v not in (None, "")})
