"""Names and SQL fragments every accounting trigger shares: its tables, the writer mark, the
show's generation, unit conversions, and the accounting-keys lock, so each is spelled once.
"""

from __future__ import annotations

from accounting.notify import NOTIFY_SEQ_SETTING, STORE_ACCOUNTED_SETTING
from accounting.units import CUEBOT_UNLIMITED_CAP

SETTINGS_TABLE = "cuesched_accounting_settings"
EPOCH_TABLE = "cuesched_accounting_epoch"
SHOW_FLIP_TABLE = "cuesched_show_flip"
GENERATION_TABLE = "cuesched_show_generation"
CORE_MULTIPLIER = 100  # centicores per core, as Cuebot's CENTICORES_PER_CORE

# --- SQL expressions shared by the trigger bodies ---------------------------------------------

# The kill switch. A missing row reads as on: a notification is only a hint, an extra one is safe.
NOTIFY_ENABLED = f"COALESCE((SELECT notify_enabled FROM {SETTINGS_TABLE} WHERE id = 1), true)"
# The writer mark: who writes as the scheduler. A connection claims it with the session setting
# `cuesched.writer=on` (WRITER_OPTION below, on every cuesched connection from its start), and
# the claim is honoured only when the connection's login role (session_user) is a member of the
# NOLOGIN role WRITER_ROLE, which the migrations create (accounting.writer_role). The setting
# alone, which any session can set, proves nothing; the membership is granted by whoever
# administers the database's roles, and PostgreSQL checks it. session_user, not current_user:
# inside a SECURITY DEFINER function current_user is the function's owner (the migrating role,
# often a member), and SET ROLE can only move current_user to roles session_user already belongs
# to; session_user is the authenticated login, changed only by a superuser's SET SESSION
# AUTHORIZATION. A superuser is a member of every role, so on the embedded default (one
# superuser) any session that sets the claim writes as the scheduler (docs/concepts.md). The
# claim is read first: a session that does not claim never pays for the membership check, which
# is one syscache lookup and PostgreSQL's cached role-membership list. A missing role (a database
# restored into another cluster: roles are not in a database's dump) reads as "not a member",
# fail closed, except for a superuser session (`is_superuser`, a setting PostgreSQL keeps for the
# session's role, which no SECURITY DEFINER call changes), which would be a member of it anyway; a
# plain read, where a catalog subquery cost the hot path 2 us per statement. The Store-accounted
# marker is honoured only together with the mark, so a psql session or Cuebot that sets the
# marker is accounted like any other writer.
WRITER_SETTING = "cuesched.writer"
WRITER_ROLE = "cuesched_writer"
WRITER_CLAIM = f"COALESCE(current_setting('{WRITER_SETTING}', true), '') = 'on'"
WRITER_MEMBER = (
    f"COALESCE(pg_has_role(session_user, to_regrole('{WRITER_ROLE}')::oid, 'MEMBER'), "
    "current_setting('is_superuser') = 'on')"
)
WRITER_ON = f"({WRITER_CLAIM} AND {WRITER_MEMBER})"
STORE_ACCOUNTED = f"(COALESCE(current_setting('{STORE_ACCOUNTED_SETTING}', true), '') = 'on' AND {WRITER_ON})"
READ_COMMITTED = "current_setting('transaction_isolation') = 'read committed'"
CURRENT_XID = "pg_current_xact_id()::text::bigint"
# Next value of the transaction-local payload counter (reset by COMMIT / ROLLBACK).
NEXT_SEQ = (
    f"set_config('{NOTIFY_SEQ_SETTING}', "
    f"(COALESCE(NULLIF(current_setting('{NOTIFY_SEQ_SETTING}', true), ''), '0')::bigint + 1)::text, "
    "true)::bigint"
)


# --- the accounting generation of a show ------------------------------------------------------
# Every committed change the Store must apply before it may book a show again (a cap lowered or
# removed, a key moved into a cap, a positive outside delta, a flip) bumps the show's row of
# GENERATION_TABLE in the writing transaction, and the notification that carries the change
# carries the generation: the last message of that show sent by the bumping trigger gets
# `"gen_from":F,"gen":G` (and `"show"` where the payload has none), so the Store records G only
# once every message of the bump before it is applied. The booking transaction compares the
# database's generation with the one its bookings were decided under (dispatch.engine.booking).
# Releases, shrinks and cap raises do not bump: they can only make room.
#
# Values come from the flip sequence (never repeated, even for a row deleted and re-created),
# and `int_prev_generation` keeps the value before the bump, so the Store can tell an unbroken
# chain from a gap (a message it never got, a flip, which sends none). Rows are locked in show
# order; at REPEATABLE READ / SERIALIZABLE a bump of a row changed after the writer's snapshot
# fails with a serialization failure (40001), as any such UPDATE does.
GENERATION_SEQUENCE = f"{SHOW_FLIP_TABLE}_generation"
GENERATION_DECLARE = [("v_gen_show", "text[]"), ("v_gen_from", "bigint[]"), ("v_gen_to", "bigint[]")]


def bump_generation(shows: str, reason: str) -> str:
    """Bump the generation of every show `shows` yields (a SELECT of pk_show values, NULLs skipped)."""
    return f"""
    WITH bumped AS (
        INSERT INTO {GENERATION_TABLE} AS t (pk_show, int_generation, int_prev_generation, str_reason, ts_bumped)
        SELECT x.pk_show, nextval('{GENERATION_SEQUENCE}'), 0, '{reason}', now()
        FROM (SELECT DISTINCT y.pk_show FROM ({shows}) AS y(pk_show) WHERE y.pk_show IS NOT NULL) x
        ORDER BY x.pk_show
        ON CONFLICT (pk_show) DO UPDATE
        SET int_prev_generation = t.int_generation, int_generation = nextval('{GENERATION_SEQUENCE}'),
            str_reason = EXCLUDED.str_reason, ts_bumped = EXCLUDED.ts_bumped
        RETURNING t.pk_show, t.int_prev_generation, t.int_generation
    )
    SELECT array_agg(b.pk_show), array_agg(b.int_prev_generation), array_agg(b.int_generation)
    INTO v_gen_show, v_gen_from, v_gen_to FROM bumped b;"""


def with_generation(rows: str, order: list[str], *, add_show: bool) -> str:
    """The payloads of `rows` in `order`, the last one of each bumped show carrying its generation.

    `rows` yields `payload` (a JSON object as text), `gen_show` (the show it belongs to, or NULL)
    and the `order` columns.
    """
    last = ", ".join(f"x.{c} DESC" for c in order)
    show = "',\"show\":' || to_json(r.gen_show)::text || " if add_show else ""
    return f"""
        SELECT CASE WHEN b.gt IS NOT NULL AND r.rn = 1
                    THEN left(r.payload, -1) || {show}',\"gen_from\":' || b.gf || ',\"gen\":' || b.gt || '}}'
                    ELSE r.payload END AS payload
        FROM (SELECT x.*, row_number() OVER (PARTITION BY x.gen_show ORDER BY {last}) AS rn FROM ({rows}) x) r
        LEFT JOIN unnest(v_gen_show, v_gen_from, v_gen_to) AS b(pk_show, gf, gt) ON b.pk_show = r.gen_show
        ORDER BY {", ".join("r." + c for c in order)}"""


def json_id(expr: str) -> str:
    """A text id as a JSON string; to_json escapes, so an odd id cannot break the payload."""
    return f"to_json({expr})::text"


def cores_from_centicores(expr: str) -> str:
    """Integer division truncating toward zero, as Java and Rust (-250 -> -2). For caps."""
    return f"(({expr})::bigint / {CORE_MULTIPLIER})"


def usage_cores(expr: str) -> str:
    """A usage delta in whole cores, rounded toward +infinity (+250 -> +3, -250 -> -2).

    A counter may read high, never low: rounding a positive delta down (or a negative one
    away from zero) would leave the Store below SUM(proc).
    """
    return (
        f"(CASE WHEN ({expr}) > 0 THEN (({expr})::bigint + {CORE_MULTIPLIER - 1}) / {CORE_MULTIPLIER}"
        f" ELSE ({expr})::bigint / {CORE_MULTIPLIER} END)"
    )


# Cuebot has no unlimited job cap (its verify_job_resources refuses any booking over a negative
# max, and its dispatcher reads `int_cores < int_max_cores`), so on a Cuebot database an
# unlimited job cap is stored as CUEBOT_UNLIMITED_CAP, the column's largest value, which both
# read as unlimited (see cuebot_job_caps_trigger).


def cores_cap(expr: str) -> str:
    """Folder/job max cores: any negative value (or Cuebot's unlimited) is the sentinel -1."""
    return (
        f"(CASE WHEN ({expr}) < 0 OR ({expr}) >= {CUEBOT_UNLIMITED_CAP} THEN -1 "
        f"ELSE ({expr})::bigint / {CORE_MULTIPLIER} END)"
    )


def gpus_cap(expr: str) -> str:
    """Folder/job max GPUs: any negative value (or Cuebot's unlimited) is the sentinel -1."""
    return f"(CASE WHEN ({expr}) < 0 OR ({expr}) >= {CUEBOT_UNLIMITED_CAP} THEN -1 ELSE ({expr})::bigint END)"


def _tail() -> str:
    return "',\"xid\":' || v_xid || ',\"seq\":' || v_seq || '}'"


# --- the accounting-keys locks: row locks on the keys (accounting.keylocks) ----------------------
# Every proc writer locks the show, job, layer and host rows of its procs FOR KEY SHARE before it
# reads their keys; a mover locks the row it moves FOR UPDATE (a BEFORE ROW trigger, bounded):
# it waits for the writers of those keys only. See accounting/keylocks.py.

# A proc writer at REPEATABLE READ / SERIALIZABLE reads keys from its transaction snapshot, which
# may predate a move it waited for. A flip or a host or job move updates the very row the writer
# locks, so PostgreSQL fails that writer (40001) on the row itself; a limit put on an existing
# layer only locks the layer, so it bumps this epoch row, and locking it fails such a writer.
# The row is (re)created on demand, so a TRUNCATE of it (Django's test flush does one) cannot
# silently void the guard: an insert that conflicts with a row this snapshot cannot see fails
# with the same serialization failure.
EPOCH_GUARD = f"""
    IF NOT {READ_COMMITTED} THEN
        INSERT INTO {EPOCH_TABLE} (id, int_moves, ts_moved) VALUES (1, 0, now()) ON CONFLICT (id) DO NOTHING;
        PERFORM 1 FROM {EPOCH_TABLE} WHERE id = 1 FOR SHARE;
    END IF;"""
EPOCH_BUMP = (
    f"INSERT INTO {EPOCH_TABLE} AS t (id, int_moves, ts_moved) VALUES (1, 1, now()) "
    "ON CONFLICT (id) DO UPDATE SET int_moves = t.int_moves + 1, ts_moved = now();"
)


def _refuse_unless_read_committed(what: str) -> str:
    return f"""
    IF NOT {READ_COMMITTED} THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: %s must run at READ COMMITTED, not %s', '{what}',
                             current_setting('transaction_isolation')),
            HINT = 'It moves the accounting of running procs and must see every proc committed before it; '
                   'run it in a READ COMMITTED transaction.',
            ERRCODE = 'feature_not_supported';
    END IF;"""


# Database-enforced accounting of a show is one writer at a time: an exclusive lock per
# unmanaged show (its own key space, 'acdb'), taken in show order before any counter row.
# Without it, concurrent bookers and releasers of one show deadlocked on the subscription,
# folder and point rows (4 deadlocks in one 6,000-frame drain with two dispatch workers).
DB_ACCOUNTING_LOCK_CLASS = 0x61636462
LOCK_DB_SHOWS = (
    f"PERFORM pg_advisory_xact_lock({DB_ACCOUNTING_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(d.pk_show) AS k FROM {rows} d ORDER BY 1) x;"
)
LOCK_DB_SHOWS_SQL = (
    f"SELECT pg_advisory_xact_lock({DB_ACCOUNTING_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(s) AS k FROM unnest(%(shows)s::text[]) AS s ORDER BY 1) AS x"
)
