"""Every accounting trigger, and the SQL it runs.

In OpenCue, Cuebot's DAOs send these signals; here PostgreSQL does, so every writer (our own
completion path, the admin, a script, a DBA in psql, a Cuebot sharing the database) produces
them. The triggers are attached in the farm models' `Meta.triggers` and installed by `migrate`.

The rule they enforce: **every change to a booked amount, or to the key it is booked against,
is an event sent in the writing transaction and applied once.** A proc books
(show, alloc, folder, job, layer, dept) where alloc is its host's and folder and dept its job's,
so the events are:

| table | event | does |
|---|---|---|
| proc | INSERT, UPDATE of an accounted column, DELETE | signed deltas of the old and new keys |
| host | UPDATE OF pk_alloc | its running procs move subscription |
| job | UPDATE OF pk_folder, pk_dept | its running procs move folder and point |
| proc | TRUNCATE | unmanaged counters rebuilt, `acct_resync` |
| subscription, folder_resource, job_resource | INSERT, UPDATE, DELETE | `acct_limit_change`, every show |
| subscription, folder_resource, job_resource | TRUNCATE | `acct_resync` |
| show | UPDATE OF b_scheduler_managed | flip generation; to unmanaged: rebuild from SUM(proc) |
| the five counter tables | INSERT, UPDATE, DELETE, TRUNCATE | beside Cuebot, an unmarked change, into the ledger |
| job_resource | BEFORE INSERT, UPDATE (a negative cap) | beside Cuebot, stored as 2147483647 |
| cuesched_outside_ledger | INSERT, UPDATE, DELETE by a client | refused |
| cuesched_outside_ledger | INSERT (deferred to commit) | beside Cuebot, the top-up of what the transaction still owes |
| cuesched_accounting_settings, _epoch | DELETE | refused: the single rows must stay |

Each delta goes to the side that owns its show at that moment: a scheduler-managed show's
deltas become `acct_release` messages for the Store (unless the transaction carries the
scheduler's own "Store-accounted" marker: its bookings and compensations are already in the
Store); an unmanaged show's deltas update the five counter tables in the same statement, with
the caps checked for every positive delta (the statement fails with `check_violation` and the
cap's constraint name, as Cuebot's `verify_*` triggers do).

Ordering, the part that makes "applied once" hold under concurrency. A delta is only right if
the keys it reads (the show's flag, the host's allocation, the job's folder) cannot change
between the read and the commit. So:

* every proc statement takes ONE shared transaction-level advisory lock (`ACCT_LOCK`) before it
  reads any key, in a statement of its own (under READ COMMITTED the next statement's snapshot
  then starts after whatever it waited for);
* every statement that can move keys under running procs (a flip, `UPDATE host SET pk_alloc`,
  `UPDATE job SET pk_folder / pk_dept`) takes the same lock exclusively in a BEFORE STATEMENT
  trigger, before it locks any row, so it waits for in-flight proc writes and later ones wait
  for it; its AFTER ROW trigger then sees every committed proc it moves;
* a mover must run at READ COMMITTED (at REPEATABLE READ its snapshot predates the procs it
  waited for) and is refused otherwise; it bumps `cuesched_accounting_epoch`, which a proc
  writer at REPEATABLE READ or SERIALIZABLE locks FOR SHARE, so a move or flip committed after
  that writer's snapshot fails it with a serialization failure (40001) instead of letting it
  account against a key it cannot see has moved.

Advisory locks live in the lock table only: no tuple lock, no WAL on the hot path. The scheduler's
booking transaction takes the shared lock in its first statement, which also makes the lease
takeover of a standby scheduler (exclusive) wait for the old scheduler's last batch.

Concurrent writers of one unmanaged show additionally take an exclusive lock per show
(`LOCK_DB_SHOWS`) before they touch a counter row, so bookings and releases of the show apply
one transaction at a time instead of deadlocking on the shared subscription, folder and point
rows.

Cost (`manage.py bench_triggers`, see docs/benchmarks.md): statement-level triggers with
transition tables send one aggregated message per key per statement; a bulk delete of 10,000
procs sends 20 messages, not 10,000. Keys are read once per statement into arrays, which the
notification and the database-enforced halves then share.
"""

from __future__ import annotations

from collections.abc import Callable

import pgtrigger

from accounting.notify import (
    LIMIT_CHANNEL,
    NOTIFY_SEQ_SETTING,
    RELEASE_CHANNEL,
    RESYNC_CHANNEL,
    STORE_ACCOUNTED_SETTING,
)
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


# --- the accounting-keys lock ---------------------------------------------------------------

# One key in its own two-int4 space (classid 'acct'): shared by every proc statement and by the
# scheduler's booking and display transactions, exclusive for flips, key moves and a lease
# takeover (see the module docstring).
ACCT_LOCK_CLASS = 0x61636374
ACCT_LOCK_KEY = 0
LOCK_KEYS_SHARED = f"PERFORM pg_advisory_xact_lock_shared({ACCT_LOCK_CLASS}, {ACCT_LOCK_KEY});"
# The exclusive side never queues: PostgreSQL would put every later shared request behind a
# waiting exclusive one, so one idle transaction holding the shared lock (a psql session left
# open after a DELETE FROM proc) would stall every proc write of the farm behind a mover. A
# mover polls instead, and gives up with a clear error after MOVE_LOCK_SECONDS.
MOVE_LOCK_SECONDS = 10
LOCK_KEYS_EXCLUSIVE = f"""
    IF NOT pg_try_advisory_xact_lock({ACCT_LOCK_CLASS}, {ACCT_LOCK_KEY}) THEN
        v_lock_deadline := clock_timestamp() + interval '{MOVE_LOCK_SECONDS} seconds';
        LOOP
            PERFORM pg_sleep(0.005);
            EXIT WHEN pg_try_advisory_xact_lock({ACCT_LOCK_CLASS}, {ACCT_LOCK_KEY});
            IF clock_timestamp() > v_lock_deadline THEN
                RAISE EXCEPTION USING
                    MESSAGE = 'cuesched: could not take the accounting-keys lock within {MOVE_LOCK_SECONDS} s',
                    HINT = 'Proc writes kept it busy (or a transaction that wrote procs is left open); '
                           'this statement moves the accounting of running procs or flips a show: retry it.',
                    ERRCODE = 'lock_not_available';
            END IF;
        END LOOP;
    END IF;"""
LOCK_DECLARE = [("v_lock_deadline", "timestamptz")]
# The same from a client. Run it as its own statement, so that the next one's snapshot starts
# after any flip or move it waited for.
LOCK_KEYS_SHARED_SQL = f"SELECT pg_advisory_xact_lock_shared({ACCT_LOCK_CLASS}, {ACCT_LOCK_KEY})"
LOCK_KEYS_TRY_EXCLUSIVE_SQL = f"SELECT pg_try_advisory_xact_lock({ACCT_LOCK_CLASS}, {ACCT_LOCK_KEY})"

# A proc writer at REPEATABLE READ / SERIALIZABLE reads keys from its transaction snapshot, which
# may predate a flip or move it waited for: locking the epoch row makes PostgreSQL fail it (40001)
# if a mover bumped the row after that snapshot.
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

# --- keyed deltas ---------------------------------------------------------------------------
# Every source yields (pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g): a signed
# amount in centicores and GPUs against the full key of non-local procs.

PROC_INSERT_KEYED = """
    SELECT n.pk_show, h.pk_alloc, j.pk_folder, n.pk_job, n.pk_layer, j.pk_dept,
           n.int_cores_reserved::bigint, n.int_gpus_reserved::bigint
    FROM new_procs n JOIN host h ON h.pk_host = n.pk_host JOIN job j ON j.pk_job = n.pk_job
    WHERE NOT n.b_local
"""
PROC_DELETE_KEYED = """
    SELECT o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept,
           -o.int_cores_reserved::bigint, -o.int_gpus_reserved::bigint
    FROM old_procs o JOIN host h ON h.pk_host = o.pk_host JOIN job j ON j.pk_job = o.pk_job
    WHERE NOT o.b_local
"""
# A changed proc counts as its old row removed and its new row added: this covers a proc moved
# to another host (allocation), job, layer or show, turned local, or resized in place.
PROC_CHANGED = """
    ROW(o.pk_show, o.pk_host, o.pk_job, o.pk_layer, o.b_local, o.int_cores_reserved, o.int_gpus_reserved)
    IS DISTINCT FROM
    ROW(n.pk_show, n.pk_host, n.pk_job, n.pk_layer, n.b_local, n.int_cores_reserved, n.int_gpus_reserved)
"""
PROC_UPDATE_KEYED = f"""
    SELECT n.pk_show, h.pk_alloc, j.pk_folder, n.pk_job, n.pk_layer, j.pk_dept,
           n.int_cores_reserved::bigint, n.int_gpus_reserved::bigint
    FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc
    JOIN host h ON h.pk_host = n.pk_host JOIN job j ON j.pk_job = n.pk_job
    WHERE NOT n.b_local AND {PROC_CHANGED}
    UNION ALL
    SELECT o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept,
           -o.int_cores_reserved::bigint, -o.int_gpus_reserved::bigint
    FROM old_procs o JOIN new_procs n ON n.pk_proc = o.pk_proc
    JOIN host h ON h.pk_host = o.pk_host JOIN job j ON j.pk_job = o.pk_job
    WHERE NOT o.b_local AND {PROC_CHANGED}
"""
# Row-level: the running procs of a host whose allocation changed, off the old one, onto the new.
HOST_MOVE_KEYED = """
    SELECT p.pk_show, OLD.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
           -p.int_cores_reserved::bigint, -p.int_gpus_reserved::bigint
    FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE p.pk_host = OLD.pk_host AND NOT p.b_local
    UNION ALL
    SELECT p.pk_show, NEW.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
           p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
    FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE p.pk_host = NEW.pk_host AND NOT p.b_local
"""
# Row-level: the running procs of a job whose folder or department changed.
JOB_MOVE_KEYED = """
    SELECT p.pk_show, h.pk_alloc, OLD.pk_folder, p.pk_job, p.pk_layer, OLD.pk_dept,
           -p.int_cores_reserved::bigint, -p.int_gpus_reserved::bigint
    FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = OLD.pk_job AND NOT p.b_local
    UNION ALL
    SELECT p.pk_show, h.pk_alloc, NEW.pk_folder, p.pk_job, p.pk_layer, NEW.pk_dept,
           p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
    FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = NEW.pk_job AND NOT p.b_local
"""

# The keyed deltas are read once per trigger into these arrays (with each show's flag, read in
# the same statement), then shared by both halves.
DELTA_DECLARE = [
    ("v_show", "text[]"),
    ("v_alloc", "text[]"),
    ("v_folder", "text[]"),
    ("v_job", "text[]"),
    ("v_layer", "text[]"),
    ("v_dept", "text[]"),
    ("v_cc", "bigint[]"),
    ("v_g", "bigint[]"),
    ("v_managed", "boolean[]"),
    ("v_xid", "bigint"),
    ("v_seq", "bigint"),
    ("v_constraint", "text"),
    ("v_message", "text"),
    ("v_enabled", "boolean"),
    *GENERATION_DECLARE,
    *LOCK_DECLARE,
]
DELTAS = (
    "unnest(v_show, v_alloc, v_folder, v_job, v_layer, v_dept, v_cc, v_g, v_managed) "
    "AS d(pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g, managed)"
)


def read_deltas(keyed: str) -> str:
    """Collect the keyed deltas and each show's flag; a fresh statement after the lock."""
    return f"""
    SELECT array_agg(d.pk_show), array_agg(d.pk_alloc), array_agg(d.pk_folder), array_agg(d.pk_job),
           array_agg(d.pk_layer), array_agg(d.pk_dept), array_agg(d.cc), array_agg(d.g),
           array_agg(s.b_scheduler_managed)
    INTO v_show, v_alloc, v_folder, v_job, v_layer, v_dept, v_cc, v_g, v_managed
    FROM ({keyed}) AS d(pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g)
    JOIN show s ON s.pk_show = d.pk_show
    WHERE d.cc <> 0 OR d.g <> 0;"""


# --- managed shows: acct_release -------------------------------------------------------------

RELEASE_PAYLOAD = (
    "'{\"show\":' || "
    + json_id("g.pk_show")
    + " || ',\"alloc\":' || "
    + json_id("g.pk_alloc")
    + " || ',\"folder\":' || "
    + json_id("g.pk_folder")
    + " || ',\"job\":' || "
    + json_id("g.pk_job")
    + " || ',\"layer\":' || "
    + json_id("g.pk_layer")
    + " || ',\"dept\":' || "
    + json_id("g.pk_dept")
    + " || ',\"cores\":' || "
    + usage_cores("g.cc")
    + " || ',\"gpus\":' || g.g || "
    + _tail()
)

# The kill switch silences releases only (what it loses reads high). A positive delta (a proc
# written or grown outside the scheduler, the new side of a move) is always sent: losing one
# would leave the Store LOW.
_MANAGED_GROUPED = f"""
            SELECT d.pk_show, d.pk_alloc, d.pk_folder, d.pk_job, d.pk_layer, d.pk_dept,
                   SUM(d.cc)::bigint AS cc, SUM(d.g)::bigint AS g
            FROM {DELTAS}
            WHERE d.managed
            GROUP BY d.pk_show, d.pk_alloc, d.pk_folder, d.pk_job, d.pk_layer, d.pk_dept"""
_RELEASE_ORDER = ["pk_show", "pk_alloc", "pk_folder", "pk_job", "pk_layer", "pk_dept"]
_RELEASE_ROWS = (
    f"SELECT {RELEASE_PAYLOAD} AS payload, g.pk_show AS gen_show, "
    + ", ".join("g." + c for c in _RELEASE_ORDER)
    + f" FROM ({_MANAGED_GROUPED}) g WHERE (g.cc <> 0 OR g.g <> 0) AND (v_enabled OR g.cc > 0 OR g.g > 0)"
)
_BUMP_OUTSIDE = bump_generation(f"SELECT g.pk_show FROM ({_MANAGED_GROUPED}) g WHERE g.cc > 0 OR g.g > 0", "outside")
_RELEASE_MESSAGES = with_generation(_RELEASE_ROWS, _RELEASE_ORDER, add_show=False)
_RELEASE_MESSAGES_PLAIN = _RELEASE_ROWS + " ORDER BY " + ", ".join("g." + c for c in _RELEASE_ORDER)
# Only a statement with a positive managed delta can bump: the releases of the completion path
# (all negative) skip the bump and send their messages as before.
_ANY_POSITIVE = (
    "EXISTS (SELECT 1 FROM unnest(v_cc, v_g, v_managed) AS p(cc, g, managed) WHERE p.managed AND (p.cc > 0 OR p.g > 0))"
)
NOTIFY_MANAGED = f"""
    IF true = ANY(v_managed) AND NOT {STORE_ACCOUNTED} THEN
        v_enabled := {NOTIFY_ENABLED};
        v_xid := {CURRENT_XID};
        v_seq := {NEXT_SEQ};
        IF {_ANY_POSITIVE} THEN
            -- A positive delta on any key (a proc written or grown outside the scheduler, the new
            -- side of a move) is one the Store has not checked: its show's generation moves.
            {_BUMP_OUTSIDE}
            PERFORM pg_notify('{RELEASE_CHANNEL}', m.payload) FROM ({_RELEASE_MESSAGES}
            ) m;
        ELSE
            PERFORM pg_notify('{RELEASE_CHANNEL}', m.payload) FROM ({_RELEASE_MESSAGES_PLAIN}
            ) m;
        END IF;
    END IF;"""

# --- unmanaged shows: the five tables, caps enforced -------------------------------------------

# Constraint names carried by the errors (psycopg: exc.diag.constraint_name), so a caller can
# tell a cap rejection from any other failure without parsing the message.
CAP_SUBSCRIPTION_MISSING = "acct_subscription_missing"
CAP_SUBSCRIPTION_BURST = "acct_subscription_burst"
CAP_FOLDER_MISSING = "acct_folder_missing"
CAP_FOLDER_MAX_CORES = "acct_folder_max_cores"
CAP_JOB_MISSING = "acct_job_missing"
CAP_JOB_MAX_CORES = "acct_job_max_cores"
CAP_FOLDER_MAX_GPUS = "acct_folder_max_gpus"
CAP_JOB_MAX_GPUS = "acct_job_max_gpus"
CAP_LAYER_MISSING = "acct_layer_missing"  # beside Cuebot only: the outside top-up
CAP_CONSTRAINTS = frozenset(
    {
        CAP_SUBSCRIPTION_MISSING,
        CAP_SUBSCRIPTION_BURST,
        CAP_FOLDER_MISSING,
        CAP_FOLDER_MAX_CORES,
        CAP_JOB_MISSING,
        CAP_JOB_MAX_CORES,
        CAP_FOLDER_MAX_GPUS,
        CAP_JOB_MAX_GPUS,
        CAP_LAYER_MISSING,
    }
)

# Applies the unmanaged deltas to the five tables and returns the first cap violation, if any.
# Every UPDATE ... RETURNING locks the rows it changes, so concurrent writers of one subscription,
# folder or job queue up and each checks the values it wrote itself. Only keys whose delta is
# positive are checked: a release always succeeds, even above a cap lowered meanwhile; a positive
# delta against a missing row fails closed, as a missing subscription always did. The order is
# the Store's: subscription, folder cores, job cores, folder GPUs, job GPUs.
DB_APPLY = f"""
    WITH delta AS (SELECT * FROM {DELTAS} WHERE NOT d.managed),
    sub_d AS (
        SELECT pk_show, pk_alloc, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_show, pk_alloc HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    sub_u AS (
        UPDATE subscription t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM sub_d d WHERE t.pk_show = d.pk_show AND t.pk_alloc = d.pk_alloc
        RETURNING t.pk_show, t.pk_alloc, t.int_cores, t.int_burst
    ),
    folder_d AS (
        SELECT pk_folder, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_folder HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    folder_u AS (
        UPDATE folder_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM folder_d d WHERE t.pk_folder = d.pk_folder
        RETURNING t.pk_folder, t.int_cores, t.int_gpus, t.int_max_cores, t.int_max_gpus
    ),
    job_d AS (
        SELECT pk_job, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_job HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    job_u AS (
        UPDATE job_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM job_d d WHERE t.pk_job = d.pk_job
        RETURNING t.pk_job, t.int_cores, t.int_gpus, t.int_max_cores, t.int_max_gpus
    ),
    layer_u AS (
        UPDATE layer_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM (
            SELECT pk_layer, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
            FROM delta GROUP BY pk_layer HAVING SUM(cc) <> 0 OR SUM(g) <> 0
        ) d
        WHERE t.pk_layer = d.pk_layer
    ),
    point_u AS (
        INSERT INTO point AS t (pk_point, pk_show, pk_dept, int_cores, int_gpus)
        SELECT gen_random_uuid()::text, pk_show, pk_dept, SUM(cc)::int, SUM(g)::int
        FROM delta GROUP BY pk_show, pk_dept HAVING SUM(cc) <> 0 OR SUM(g) <> 0
        ON CONFLICT (pk_show, pk_dept) DO UPDATE
        SET int_cores = t.int_cores + EXCLUDED.int_cores, int_gpus = t.int_gpus + EXCLUDED.int_gpus
    )
    SELECT v.con, v.msg INTO v_constraint, v_message FROM (
        SELECT 1 AS ord, '{CAP_SUBSCRIPTION_MISSING}' AS con, format(
            'no subscription for show=%s alloc=%s: cannot book %s centicores',
            d.pk_show, d.pk_alloc, d.cc) AS msg
        FROM sub_d d
        WHERE d.cc > 0 AND NOT EXISTS (
            SELECT 1 FROM sub_u u WHERE u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc)
        UNION ALL
        SELECT 2, '{CAP_SUBSCRIPTION_BURST}', format(
            'subscription has exceeded burst size: show=%s alloc=%s cores=%s burst=%s (centicores)',
            u.pk_show, u.pk_alloc, u.int_cores, u.int_burst)
        FROM sub_d d JOIN sub_u u ON u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc
        WHERE d.cc > 0 AND u.int_cores > u.int_burst
        UNION ALL
        SELECT 3, '{CAP_FOLDER_MISSING}', format(
            'no folder_resource row for folder=%s: cannot book %s centicores', d.pk_folder, d.cc)
        FROM folder_d d
        WHERE (d.cc > 0 OR d.g > 0) AND NOT EXISTS (SELECT 1 FROM folder_u u WHERE u.pk_folder = d.pk_folder)
        UNION ALL
        SELECT 4, '{CAP_FOLDER_MAX_CORES}', format(
            'folder has exceeded max cores: folder=%s cores=%s max_cores=%s (centicores)',
            u.pk_folder, u.int_cores, u.int_max_cores)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.cc > 0 AND u.int_max_cores >= 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 5, '{CAP_JOB_MISSING}', format(
            'no job_resource row for job=%s: cannot book %s centicores', d.pk_job, d.cc)
        FROM job_d d
        WHERE (d.cc > 0 OR d.g > 0) AND NOT EXISTS (SELECT 1 FROM job_u u WHERE u.pk_job = d.pk_job)
        UNION ALL
        SELECT 6, '{CAP_JOB_MAX_CORES}', format(
            'job has exceeded max cores: job=%s cores=%s max_cores=%s (centicores)',
            u.pk_job, u.int_cores, u.int_max_cores)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.cc > 0 AND u.int_max_cores >= 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 7, '{CAP_FOLDER_MAX_GPUS}', format(
            'folder has exceeded max GPUs: folder=%s gpus=%s max_gpus=%s',
            u.pk_folder, u.int_gpus, u.int_max_gpus)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.g > 0 AND u.int_max_gpus >= 0 AND u.int_gpus > u.int_max_gpus
        UNION ALL
        SELECT 8, '{CAP_JOB_MAX_GPUS}', format(
            'job has exceeded max GPUs: job=%s gpus=%s max_gpus=%s',
            u.pk_job, u.int_gpus, u.int_max_gpus)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.g > 0 AND u.int_max_gpus >= 0 AND u.int_gpus > u.int_max_gpus
    ) v
    ORDER BY v.ord, v.msg
    LIMIT 1;"""

# A Cuebot database (its `verify_subscription` trigger is on `subscription`): Cuebot's Java code
# (ProcDaoJdbc.procCreated / procDestroyed, its after_job_moved and after_job_dept_update
# triggers) keeps the five tables of the shows it owns, the unmanaged ones, in the writing
# transaction, and its verify_* triggers enforce their caps. Applying the deltas here as well
# would count every Cuebot booking twice, so the unmanaged half does not apply them there for
# any writer but cuesched's own; for the others it records what they owe instead, settled at
# commit (RECORD_OUTSIDE below). cuesched's connections carry the writer mark (the claim
# WRITER_OPTION, set by accounting.db.connect and Django's settings, from a member of
# WRITER_ROLE): a frame the
# scheduler booked while the show was managed and completes after a flip back is deleted by
# our completion path, which Cuebot's Java never sees, so our trigger is the only one to
# count that release. Read per statement, and only when an unmanaged show is in it: the
# managed hot path never pays for it.
CUEBOT_ACCOUNTS = (
    "EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'verify_subscription' AND tgrelid = to_regclass('subscription'))"
)
WRITER_OPTION = f"-c {WRITER_SETTING}=on"
CUEBOT_WRITES = f"(NOT {WRITER_ON} AND {CUEBOT_ACCOUNTS})"

# --- beside Cuebot: writers that count nothing themselves ----------------------------------------
# Standing down for every unmarked writer trusted that writer to be Cuebot, whose Java updates the
# five tables in the same transaction. A psql session or script that writes a proc without those
# UPDATEs was counted by nobody: the counters read LOW and Cuebot booked past the burst. So an
# unmarked transaction in Cuebot mode keeps a ledger of what it owes each counter row: its proc
# deltas (recorded here, by the proc triggers) minus the change anybody else made to that row's
# int_cores / int_gpus in the same transaction (Cuebot's UPDATEs, its own triggers,
# recalculate_subs(); recorded by the counter tables' statement triggers). A deferred constraint
# trigger tops up at commit whatever is still owed (OUTSIDE_TOPUP_FUNC): Cuebot's own SQL owes
# nothing and is counted once; a raw INSERT owes its cores and is counted at commit, caps checked.
# Rows are the transaction's own (keyed by its xid), so a rollback, or a rollback to a savepoint,
# takes them back together with the writes they describe.
OUTSIDE_LEDGER_TABLE = "cuesched_outside_ledger"
# tbl: the counter table, numbered in the order Cuebot's procCreated updates them (and the top-up
# locks them): subscription, layer_resource, job_resource, folder_resource, point.
OUTSIDE_SUB, OUTSIDE_LAYER, OUTSIDE_JOB, OUTSIDE_FOLDER, OUTSIDE_POINT = 1, 2, 3, 4, 5
# cc, g: what the transaction still owes the row; bc, bg: what its proc writes booked on the row's
# key (net), which decides whether the top-up checks the row's cap (a transaction that booked
# nothing there, as Cuebot's recalculate_subs(), cannot breach it and is not refused).
_LEDGER_UPSERT = f"""
    INSERT INTO {OUTSIDE_LEDGER_TABLE} AS t (xid, tbl, k1, k2, cc, g, bc, bg)
    SELECT {CURRENT_XID}, x.tbl, x.k1, x.k2, SUM(x.cc)::bigint, SUM(x.g)::bigint, SUM(x.bc)::bigint, SUM(x.bg)::bigint
    FROM ({{owed}}) AS x(tbl, k1, k2, cc, g, bc, bg)
    GROUP BY x.tbl, x.k1, x.k2 HAVING SUM(x.cc) <> 0 OR SUM(x.g) <> 0 OR SUM(x.bc) <> 0 OR SUM(x.bg) <> 0
    ORDER BY x.tbl, x.k1, x.k2
    ON CONFLICT (xid, tbl, k1, k2) DO UPDATE
    SET cc = t.cc + EXCLUDED.cc, g = t.g + EXCLUDED.g, bc = t.bc + EXCLUDED.bc, bg = t.bg + EXCLUDED.bg;"""
RECORD_OUTSIDE = _LEDGER_UPSERT.format(
    owed="\n        UNION ALL ".join(
        f"SELECT {tbl}, {k1}, {k2}, d.cc, d.g, d.cc, d.g FROM {DELTAS} WHERE NOT d.managed"
        for tbl, k1, k2 in (
            (OUTSIDE_SUB, "d.pk_show", "d.pk_alloc"),
            (OUTSIDE_LAYER, "d.pk_layer", "''"),
            (OUTSIDE_JOB, "d.pk_job", "''"),
            (OUTSIDE_FOLDER, "d.pk_folder", "''"),
            (OUTSIDE_POINT, "d.pk_show", "d.pk_dept"),
        )
    )
)

APPLY_UNMANAGED = f"""
    IF false = ANY(v_managed) THEN
        IF NOT {CUEBOT_WRITES} THEN
            {LOCK_DB_SHOWS.format(rows=f"(SELECT * FROM {DELTAS} WHERE NOT d.managed)")}
            {DB_APPLY}
            IF v_message IS NOT NULL THEN
                RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = 'check_violation', CONSTRAINT = v_constraint;
            END IF;
        ELSE
            {RECORD_OUTSIDE}
        END IF;
    END IF;"""


def usage_func(
    keyed: str,
    *,
    guard: str = "",
    prologue: str = "",
    rows: str | None = None,
    outside_check: str = "",
    keyed_check: str = "",
) -> str:
    """A trigger body: optional cheap exit, the lock, the keyed deltas, then both halves.

    `rows` names the transition table of a proc trigger: a statement of the scheduler's own
    Store-accounted transaction that touches no unmanaged show has nothing to do, which is
    told from the show flags alone (no host or job join) on the booking hot path.
    `outside_check` runs for every other writer only: the scheduler's booking statement checks
    its rows' hosts and jobs itself (and keys them exactly), so it is spared a second join.
    `keyed_check` runs once the deltas and their shows' flags are read, before either half.
    """
    fast = ""
    if rows is not None:
        fast = f"""
    IF {STORE_ACCOUNTED} AND NOT EXISTS (
        SELECT 1 FROM {rows} r JOIN show s ON s.pk_show = r.pk_show AND NOT s.b_scheduler_managed
        WHERE NOT r.b_local
    ) THEN
        RETURN NULL;
    END IF;"""
    return f"""
    {guard}
    {prologue}
    {LOCK_KEYS_SHARED}
    {EPOCH_GUARD}
    {fast}
    {f"IF NOT {STORE_ACCOUNTED} THEN {outside_check} END IF;" if outside_check else ""}
    {read_deltas(keyed)}
    IF v_show IS NULL THEN
        RETURN NULL;
    END IF;{keyed_check}
    {NOTIFY_MANAGED}
    {APPLY_UNMANAGED}
    RETURN NULL;
"""


def _usage_trigger(name: str, operation: pgtrigger.Operation, func: str) -> pgtrigger.Trigger:
    referencing = {
        "INSERT": pgtrigger.Referencing(new="new_procs"),
        "DELETE": pgtrigger.Referencing(old="old_procs"),
        "UPDATE": pgtrigger.Referencing(old="old_procs", new="new_procs"),
    }[str(operation)]
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Statement,
        referencing=referencing,
        declare=DELTA_DECLARE,
        func=func,
    )


# --- rebuilding the database-enforced counters from SUM(proc) --------------------------------

# The five tables of the shows in `{shows}` (a SQL expression yielding pk_show values) set to
# SUM(proc) of their non-local procs, touching only rows whose value differs. Used by a flip to
# unmanaged (the Store kept them only approximately), by a TRUNCATE of proc, and by the
# scheduler's periodic reconcile of unmanaged shows (`RECONCILE_SQL`), which reports the
# centicores it corrected as drift. Caps are not checked: a rebuild writes the truth.
_IN_TARGET = "IN (SELECT pk_show FROM target)"
# Finished history holding nothing is skipped: a rebuild costs the live jobs, not years of them.
_LIVE_OR_HOLDING = "(j.str_state <> 'FINISHED' OR {a}.int_cores <> 0 OR {a}.int_gpus <> 0 OR l.{key} IS NOT NULL)"
# name -> (table, alias, primary key, FROM clause, how live procs join, which rows)
_REBUILT = {
    "sub": (
        "subscription",
        "s",
        "pk_subscription",
        "subscription s",
        "l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc",
        f"s.pk_show {_IN_TARGET}",
    ),
    "folder": (
        "folder_resource",
        "fr",
        "pk_folder_resource",
        "folder_resource fr JOIN folder f ON f.pk_folder = fr.pk_folder",
        "l.pk_folder = fr.pk_folder",
        f"f.pk_show {_IN_TARGET}",
    ),
    "job": (
        "job_resource",
        "jr",
        "pk_job_resource",
        "job_resource jr JOIN job j ON j.pk_job = jr.pk_job",
        "l.pk_job = jr.pk_job",
        f"j.pk_show {_IN_TARGET} AND " + _LIVE_OR_HOLDING.format(a="jr", key="pk_job"),
    ),
    "layer": (
        "layer_resource",
        "lr",
        "pk_layer_resource",
        "layer_resource lr JOIN job j ON j.pk_job = lr.pk_job",
        "l.pk_layer = lr.pk_layer",
        f"j.pk_show {_IN_TARGET} AND " + _LIVE_OR_HOLDING.format(a="lr", key="pk_layer"),
    ),
    "point": (
        "point",
        "pt",
        "pk_point",
        "point pt",
        "l.pk_show = pt.pk_show AND l.pk_dept = pt.pk_dept",
        f"pt.pk_show {_IN_TARGET}",
    ),
}
REBUILD_TABLES = tuple(spec[0] for spec in _REBUILT.values())


def _rebuild_ctes(name: str, *, low: bool = False) -> str:
    """The sum per row (`<name>_x`) and the write of the rows that differ (`<name>_u`, their drift).

    With `low`, each written row also returns how far its counter was BELOW the truth (cores
    and GPUs): the reconcile's integrity alarm. Off for the trigger bodies, which only need drift.
    """
    table, a, pk, source, live_on, where = _REBUILT[name]
    old_g = f", {a}.int_gpus AS old_g" if low else ""
    low_cols = ", GREATEST(x.cc - x.old_c, 0) AS low_cc, GREATEST(x.g - x.old_g, 0) AS low_g" if low else ""
    return f"""
    {name}_x AS (
        SELECT {a}.{pk} AS pk, {a}.int_cores AS old_c{old_g}, COALESCE(SUM(l.cc), 0) AS cc, COALESCE(SUM(l.g), 0) AS g
        FROM {source} LEFT JOIN live l ON {live_on}
        WHERE {where}
        GROUP BY {a}.{pk}
    ),
    {name}_u AS (
        UPDATE {table} t SET int_cores = x.cc, int_gpus = x.g FROM {name}_x x
        WHERE t.{pk} = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
        RETURNING abs(x.cc - x.old_c) AS drift{low_cols}
    ),"""


def rebuild_sql(shows: str, *, into: str = "", low: bool = False) -> str:
    """Rebuild the five tables of `shows`; the last SELECT returns the centicores corrected per table.

    With `low` (the reconcile), then for each of the five tables the centicores and the GPUs by
    which its rows had read below SUM(proc) (a point row inserted now read 0).
    """
    drift = ", ".join(f"(SELECT COALESCE(SUM(drift), 0) FROM {n}_u)::bigint" for n in _REBUILT if n != "point")
    point_drift = "((SELECT COALESCE(SUM(drift), 0) FROM point_u) + (SELECT COALESCE(SUM(drift), 0) FROM point_new))"
    point_drift += "::bigint"
    lows = ""
    if low:
        lows = "".join(
            f", (SELECT COALESCE(SUM(low_cc), 0) FROM {n}_u)::bigint"
            f", (SELECT COALESCE(SUM(low_g), 0) FROM {n}_u)::bigint"
            for n in _REBUILT
            if n != "point"
        )
        lows += (
            ", ((SELECT COALESCE(SUM(low_cc), 0) FROM point_u)"
            " + (SELECT COALESCE(SUM(drift), 0) FROM point_new))::bigint"
            ", ((SELECT COALESCE(SUM(low_g), 0) FROM point_u) + (SELECT COALESCE(SUM(g), 0) FROM point_new))::bigint"
        )
    return f"""
    WITH target AS MATERIALIZED ({shows}),
    live AS (
        SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
               p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
        FROM proc p
        JOIN host h ON h.pk_host = p.pk_host
        JOIN job j ON j.pk_job = p.pk_job
        WHERE NOT p.b_local AND p.pk_show {_IN_TARGET}
    ),{"".join(_rebuild_ctes(n, low=low) for n in _REBUILT)}
    point_new AS (
        INSERT INTO point (pk_point, pk_show, pk_dept, int_cores, int_gpus)
        SELECT gen_random_uuid()::text, l.pk_show, l.pk_dept, SUM(l.cc)::int, SUM(l.g)::int
        FROM live l
        WHERE NOT EXISTS (SELECT 1 FROM point pt WHERE pt.pk_show = l.pk_show AND pt.pk_dept = l.pk_dept)
        GROUP BY l.pk_show, l.pk_dept
        ON CONFLICT (pk_show, pk_dept) DO NOTHING
        RETURNING int_cores AS drift{", int_gpus AS g" if low else ""}
    )
    SELECT {drift},
           {point_drift}{lows}
    {into}
"""


# The scheduler's reconcile of every unmanaged show, from a client: run after LOCK_KEYS_SHARED_SQL
# (no flip or move under it) and LOCK_DB_SHOWS_SQL for the same shows (no database-enforced writer
# between its read of proc and its write), in one READ COMMITTED transaction. Returns the
# centicores corrected per table.
UNMANAGED_SHOWS_SQL = "SELECT pk_show FROM show WHERE NOT b_scheduler_managed ORDER BY pk_show"
RECONCILE_SQL = rebuild_sql("SELECT unnest(%(shows)s::text[]) AS pk_show", low=True)


# --- proc triggers ---------------------------------------------------------------------------

# A proc row whose host, job or show this statement cannot see (deferred foreign keys: the host
# inserted later in the transaction) could not be keyed: its delta would be lost, a counter LOW.
KEYS_VISIBLE = """
    IF EXISTS (
        SELECT 1 FROM new_procs n
        LEFT JOIN host h ON h.pk_host = n.pk_host
        LEFT JOIN job j ON j.pk_job = n.pk_job
        LEFT JOIN show s ON s.pk_show = n.pk_show
        WHERE NOT n.b_local AND (h.pk_host IS NULL OR j.pk_job IS NULL OR s.pk_show IS NULL
                                 OR j.pk_show IS DISTINCT FROM n.pk_show)
    ) THEN
        RAISE EXCEPTION USING
            MESSAGE = 'cuesched: a proc names a host, job or show this statement cannot see, or a show other '
                      'than its job''s',
            HINT = 'Write the host, job and show before the proc that books on them (deferred foreign keys '
                   'are not enough: the proc is accounted when it is written), with the job''s own show.',
            ERRCODE = 'foreign_key_violation';
    END IF;"""

# A proc of a scheduler-managed show is booked by the scheduler only, on every database. Its
# booking transaction checks the Store's caps first and marks itself Store-accounted; anybody
# else's INSERT would reach the Store as a positive delta that no cap checked (a psql session's
# 5 x 5 cores against a burst of 20: SUM(proc) 25). So an INSERT by any connection without the
# writer mark (WRITER_ON: a member of the writer role claiming it) is refused whole. Beside
# Cuebot this is also a Cuebot booking that read the show as its own (DispatchQuery,
# b_scheduler_managed = false) before a flip to the scheduler committed: the flip's exclusive lock
# cannot hold it off, since Cuebot takes the shared one only at this INSERT; refused, Cuebot's
# startFrameAndProc rolls back, the frame stays WAITING, its dispatcher moves on. The flag read
# here follows the shared lock, so it sees every flip committed before and holds off every later
# one. The same holds for an UPDATE that grows a managed proc or moves it onto another key of a
# managed show (the positive half of the move books what the Store never checked): refused
# alike. Shrinking and releasing stay allowed: they can only lower what is booked.
MANAGED_BOOKED_OUTSIDE = "acct_managed_show_booked_outside"
# The managed keys this statement books more on, net (an UPDATE's deltas are its new rows plus
# its old rows negated: a shrink in place nets negative).
MANAGED_GROWN = f"""SELECT d.pk_show FROM {DELTAS} WHERE d.managed
    GROUP BY d.pk_show, d.pk_alloc, d.pk_folder, d.pk_job, d.pk_layer, d.pk_dept
    HAVING SUM(d.cc) > 0 OR SUM(d.g) > 0"""


def refuse_outside_booking_of_managed(message: str, hint: str) -> str:
    """The refusal, with what the operator should do for this kind of write."""
    return f"""
    IF true = ANY(v_managed) AND NOT {WRITER_ON}
       AND EXISTS ({MANAGED_GROWN}) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('{message}', ({MANAGED_GROWN} LIMIT 1)),
            HINT = '{hint}',
            ERRCODE = 'check_violation', CONSTRAINT = '{MANAGED_BOOKED_OUTSIDE}';
    END IF;"""


REFUSE_OUTSIDE_BOOKING_OF_MANAGED = refuse_outside_booking_of_managed(
    "cuesched: show %s is scheduler-managed: its frames are booked by the cuesched scheduler only",
    "Nothing was written. A managed show''s capacity is booked only by the scheduler''s connections "
    f"(a login role that is a member of {WRITER_ROLE}, with {WRITER_SETTING}=on), which check its caps "
    "first. Submit the work to cuesched, or flip the show to unmanaged (the console''s flip page) to book "
    "it from outside under caps the database enforces. Beside Cuebot, a Cuebot transaction that read the "
    "show as unmanaged before a flip to the scheduler meets this.",
)
# A host moved to another allocation (`UPDATE host SET pk_alloc`, Cuebot's
# HostDaoJdbc.updateHostSetAllocation, `cueadmin -move`) or a job to another folder or department
# (JobDaoJdbc.updateParent, updateDepartment) by anyone but the scheduler's writers books the
# running procs of a managed show on the new subscription, folder or point: the Store would be
# sent those cores unchecked against the new key's cap, and SUM(proc) could pass its burst. The
# same refusal as a booking, for the keys the move grows (net, per key).
REFUSE_OUTSIDE_MOVE_OF_MANAGED = refuse_outside_booking_of_managed(
    "cuesched: frames of scheduler-managed show %s run here: moving them to another allocation, "
    "folder or department would book them past the Store''s caps",
    "Nothing was moved. Move it once the managed show''s frames on it have ended, or flip the show "
    "back to unmanaged first (the console''s flip page); the move is then checked against its caps.",
)

PROC_INSERT_FUNC = usage_func(
    PROC_INSERT_KEYED,
    guard="IF NOT EXISTS (SELECT 1 FROM new_procs WHERE NOT b_local) THEN RETURN NULL; END IF;",
    outside_check=KEYS_VISIBLE,
    rows="new_procs",
    keyed_check=REFUSE_OUTSIDE_BOOKING_OF_MANAGED,
)
PROC_DELETE_FUNC = usage_func(
    PROC_DELETE_KEYED,
    guard="IF NOT EXISTS (SELECT 1 FROM old_procs WHERE NOT b_local) THEN RETURN NULL; END IF;",
    rows="old_procs",
)
# Agents update procs all the time (memory used, pings): leave before any lock unless an
# accounted column changed.
PROC_UPDATE_FUNC = usage_func(
    PROC_UPDATE_KEYED,
    guard=(
        "IF NOT EXISTS (SELECT 1 FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc "
        f"WHERE {PROC_CHANGED}) THEN RETURN NULL; END IF;"
    ),
    outside_check=KEYS_VISIBLE,
    keyed_check=REFUSE_OUTSIDE_BOOKING_OF_MANAGED,
)

PROC_TRUNCATE_FUNC = f"""
    {LOCK_KEYS_SHARED}
    -- No row is left to send a delta for: the unmanaged shows' counters are rebuilt (to zero,
    -- unless this transaction inserts again), and the scheduler is told to reseed.
    {rebuild_sql(UNMANAGED_SHOWS_SQL, into="INTO v_d1, v_d2, v_d3, v_d4, v_d5")};
    PERFORM pg_notify('{RESYNC_CHANNEL}', '{{"table":"proc","xid":' || {CURRENT_XID} || '}}');
    RETURN NULL;
"""


def proc_triggers() -> list[pgtrigger.Trigger]:
    return [
        _usage_trigger("acct_proc_insert", pgtrigger.Insert, PROC_INSERT_FUNC),
        _usage_trigger("acct_proc_delete", pgtrigger.Delete, PROC_DELETE_FUNC),
        _usage_trigger("acct_proc_update", pgtrigger.Update, PROC_UPDATE_FUNC),
        pgtrigger.Trigger(
            name="acct_proc_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            declare=[(f"v_d{i}", "bigint") for i in range(1, 6)],
            func=PROC_TRUNCATE_FUNC,
        ),
        # Every proc trigger pairs a statement's old and new rows by pk_proc: a row whose id
        # changed would be seen by none of them (its cores, keys or layer changed uncounted).
        pgtrigger.Trigger(
            name="acct_proc_keeps_id",
            when=pgtrigger.Before,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition("OLD.pk_proc IS DISTINCT FROM NEW.pk_proc"),
            func="""
    RAISE EXCEPTION USING
        MESSAGE = format('cuesched: a proc keeps its id (%s); delete it and insert a new one', OLD.pk_proc),
        ERRCODE = 'check_violation', CONSTRAINT = 'acct_proc_keeps_id';
""",
        ),
    ]


# --- key moves: host.pk_alloc, job.pk_folder / pk_dept ------------------------------------------


def _keys_lock_trigger(name: str, operation: pgtrigger.Operation) -> pgtrigger.Trigger:
    """BEFORE STATEMENT: the exclusive lock before any row of the statement is locked."""
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=operation,
        level=pgtrigger.Statement,
        declare=LOCK_DECLARE,
        func=f"{LOCK_KEYS_EXCLUSIVE}\n    RETURN NULL;",
    )


def _move_trigger(
    name: str, operation: pgtrigger.Operation, condition: str, keyed: str, what: str, *, check: str = ""
) -> pgtrigger.Trigger:
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Row,
        condition=pgtrigger.Condition(condition),
        declare=DELTA_DECLARE,
        func=usage_func(
            keyed,
            prologue=f"{_refuse_unless_read_committed(what)}\n    {check}\n    {LOCK_KEYS_EXCLUSIVE}\n    {EPOCH_BUMP}",
            keyed_check=REFUSE_OUTSIDE_MOVE_OF_MANAGED,
        ),
    )


def host_triggers() -> list[pgtrigger.Trigger]:
    return [
        _keys_lock_trigger("acct_host_keys_lock", pgtrigger.UpdateOf("pk_alloc")),
        _move_trigger(
            "acct_host_move",
            pgtrigger.UpdateOf("pk_alloc"),
            "OLD.pk_alloc IS DISTINCT FROM NEW.pk_alloc",
            HOST_MOVE_KEYED,
            "moving a host to another allocation",
        ),
    ]


# A proc is accounted by its own show; its job's folder must be a folder of that show, or the
# folder counter would be kept by the other show's side (read LOW by the rebuild of either).
JOB_SAME_SHOW = """
    IF NEW.pk_show IS DISTINCT FROM OLD.pk_show AND EXISTS (SELECT 1 FROM proc p WHERE p.pk_job = NEW.pk_job) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: job %s has running procs: it cannot move to another show', NEW.pk_job),
            ERRCODE = 'check_violation', CONSTRAINT = 'acct_job_show_with_procs';
    END IF;
    IF EXISTS (SELECT 1 FROM folder f WHERE f.pk_folder = NEW.pk_folder AND f.pk_show IS DISTINCT FROM NEW.pk_show) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: folder %s belongs to another show than job %s', NEW.pk_folder, NEW.pk_job),
            ERRCODE = 'check_violation', CONSTRAINT = 'acct_job_folder_of_its_show';
    END IF;"""


def job_triggers() -> list[pgtrigger.Trigger]:
    return [
        _keys_lock_trigger("acct_job_keys_lock", pgtrigger.UpdateOf("pk_folder", "pk_dept", "pk_show")),
        _move_trigger(
            "acct_job_move",
            pgtrigger.UpdateOf("pk_folder", "pk_dept", "pk_show"),
            "OLD.pk_folder IS DISTINCT FROM NEW.pk_folder OR OLD.pk_dept IS DISTINCT FROM NEW.pk_dept "
            "OR OLD.pk_show IS DISTINCT FROM NEW.pk_show",
            JOB_MOVE_KEYED,
            "moving a job to another folder or department",
            check=JOB_SAME_SHOW,
        ),
    ]


# A folder's caps are bumped, sent and rebuilt by the folder's show as its row reads at the time:
# a folder moved to another show than its jobs' would have a cap lowering bump the other show's
# generation (and a round trip through another show within one transaction would hide the
# lowering from the managed show's bookings), and its counter would be kept by the wrong show.
# So a folder moves between shows only with no job of another show in it. Nothing in cuesched or
# in Cuebot's SQL moves a folder between shows. The EXISTS runs after the folder row is locked
# (a job insert or move into it holds or waits for that lock through its foreign key and
# acct_job_move), on a fresh READ COMMITTED snapshot, so a job that committed into the folder
# first is seen.
FOLDER_SHOW_OF_ITS_JOBS = "acct_folder_show_of_its_jobs"


def folder_triggers() -> list[pgtrigger.Trigger]:
    return [
        pgtrigger.Trigger(
            name=FOLDER_SHOW_OF_ITS_JOBS,
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf("pk_show"),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition("OLD.pk_show IS DISTINCT FROM NEW.pk_show"),
            func=f"""
    IF EXISTS (SELECT 1 FROM job j WHERE j.pk_folder = NEW.pk_folder AND j.pk_show IS DISTINCT FROM NEW.pk_show) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: folder %s holds jobs of show %s: it cannot move to show %s', NEW.pk_folder,
                             (SELECT j.pk_show FROM job j WHERE j.pk_folder = NEW.pk_folder
                              AND j.pk_show IS DISTINCT FROM NEW.pk_show LIMIT 1), NEW.pk_show),
            HINT = 'Nothing was moved. A folder''s caps are accounted by its show: move its jobs to a folder of '
                   'their show first, or create the folder in the other show.',
            ERRCODE = 'check_violation', CONSTRAINT = '{FOLDER_SHOW_OF_ITS_JOBS}';
    END IF;
    RETURN NEW;
""",
        )
    ]


# --- acct_limit_change: caps of every show -----------------------------------------------------
# Sent whatever the show's flag: a cap write that read "unmanaged" just before a flip to managed
# committed would otherwise be missed by the flip's seed if it committed after the seed's read.
# The Store ignores caps of shows it does not enforce, and the limit reseed prunes them. Sent
# whatever the kill switch says, too: a missed cap decrease is the one drift that over-books,
# and cap changes are rare.

SUB_PAYLOAD = (
    '\'{"vertex":"sub","show":\' || '
    + json_id("n.pk_show")
    + " || ',\"alloc\":' || "
    + json_id("n.pk_alloc")
    + " || ',\"burst\":' || "
    + cores_from_centicores("n.int_burst")
    + " || "
    + _tail()
)
SUB_REMOVED_PAYLOAD = (
    '\'{"vertex":"sub","show":\' || '
    + json_id("n.pk_show")
    + " || ',\"alloc\":' || "
    + json_id("n.pk_alloc")
    + " || ',\"removed\":true' || "
    + _tail()
)


def cap_payload(vertex: str, id_column: str) -> str:
    """Both caps of a folder or job row: a partial message could not create a missing Store entry."""
    return (
        f'\'{{"vertex":"{vertex}","id":\' || {json_id("n." + id_column)}'
        f" || ',\"max_cores\":' || {cores_cap('n.int_max_cores')}"
        f" || ',\"max_gpus\":' || {gpus_cap('n.int_max_gpus')}"
        f" || {_tail()}"
    )


def cap_removed_payload(vertex: str, id_column: str) -> str:
    return f'\'{{"vertex":"{vertex}","id":\' || {json_id("n." + id_column)} || \',"removed":true\' || {_tail()}'


# Beside Cuebot, the recompute's display write of a managed show must pass Cuebot's
# verify_subscription / verify_job_resources (they refuse an int_cores increase above the cap
# when the cap is unchanged in the same UPDATE). It does what Cuebot's own recalculate_subs()
# does (V45): in one transaction it lifts the cap to the value it writes, writes, and puts the
# cap back. The lift is not announced to the Store: under this transaction-local marker a cap
# INCREASE alone (same key, a larger positive job cap, a larger burst) sends nothing. The
# restore is a decrease and is sent as usual. Misused, the marker can only hide a loosening,
# so the Store would read a cap low (it books less), never high.
DISPLAY_LIFT_SETTING = "cuesched.display_lift"
DISPLAY_LIFT_SQL = f"SELECT set_config('{DISPLAY_LIFT_SETTING}', 'on', true)"
DISPLAY_LIFT = f"COALESCE(current_setting('{DISPLAY_LIFT_SETTING}', true), '') = 'on'"

def _lowered(column: str, cap: Callable[[str], str]) -> str:
    """The cap as the Store holds it (whole units, -1 unlimited) went down: a limit where there was none, or less."""
    new, old = cap(f"n.{column}"), cap(f"o.{column}")
    return f"({new} >= 0 AND ({old} < 0 OR {new} < {old}))"


_SUB = {
    "pk": "pk_subscription",
    "changed": "(n.int_burst IS DISTINCT FROM o.int_burst OR n.pk_show IS DISTINCT FROM o.pk_show "
    "OR n.pk_alloc IS DISTINCT FROM o.pk_alloc) "
    f"AND NOT ({DISPLAY_LIFT} AND n.pk_show = o.pk_show AND n.pk_alloc = o.pk_alloc AND n.int_burst > o.int_burst)",
    "payload": SUB_PAYLOAD,
    "removed": SUB_REMOVED_PAYLOAD,
    "order": "n.pk_show, n.pk_alloc",
    "show": "n.pk_show",
    "lowered": "n.int_burst < o.int_burst",
}
_FOLDER = {
    "pk": "pk_folder_resource",
    "changed": "n.int_max_cores IS DISTINCT FROM o.int_max_cores OR n.int_max_gpus IS DISTINCT FROM o.int_max_gpus "
    "OR n.pk_folder IS DISTINCT FROM o.pk_folder",
    "payload": cap_payload("folder", "pk_folder"),
    "removed": cap_removed_payload("folder", "pk_folder"),
    "order": "n.pk_folder",
    "show": "(SELECT f.pk_show FROM folder f WHERE f.pk_folder = n.pk_folder)",
    "lowered": f"{_lowered('int_max_cores', cores_cap)} OR {_lowered('int_max_gpus', gpus_cap)}",
}
_JOB = {
    "pk": "pk_job_resource",
    "changed": "(n.int_max_cores IS DISTINCT FROM o.int_max_cores OR n.int_max_gpus IS DISTINCT FROM o.int_max_gpus "
    "OR n.pk_job IS DISTINCT FROM o.pk_job) "
    f"AND NOT ({DISPLAY_LIFT} AND n.pk_job = o.pk_job AND n.int_max_gpus IS NOT DISTINCT FROM o.int_max_gpus "
    "AND o.int_max_cores >= 0 AND n.int_max_cores > o.int_max_cores)",
    "payload": cap_payload("job", "pk_job"),
    "removed": cap_removed_payload("job", "pk_job"),
    "order": "n.pk_job",
    "show": "(SELECT j.pk_show FROM job j WHERE j.pk_job = n.pk_job)",
    "lowered": f"{_lowered('int_max_cores', cores_cap)} OR {_lowered('int_max_gpus', gpus_cap)}",
}


def limit_update_func(spec: dict[str, str]) -> str:
    """Cap UPDATE: cheap exit first, since the booking path updates int_cores of these rows.

    A row whose key itself changed (a subscription moved to another show) is announced as the
    old key removed and the new one set. A cap lowered, and both keys of a row re-keyed, bump
    their shows' generations (a raise does not: it only makes room), carried by the last
    message of each show.
    """
    changed = f"FROM new_rows n JOIN old_rows o ON o.{spec['pk']} = n.{spec['pk']} WHERE ({spec['changed']})"
    removed = spec["removed"].replace("n.", "o.")
    old_show = spec["show"].replace("n.", "o.")
    key_changed = _key_changed(spec)
    bump = bump_generation(
        f"SELECT {spec['show']} {changed} AND ({spec['lowered']} OR {key_changed}) "
        f"UNION ALL SELECT {old_show} {changed} AND ({key_changed})",
        "cap",
    )
    n_order = spec["order"].count(",") + 1
    order = ["ord"] + [f"k{i}" for i in range(n_order)]
    keys_new = ", ".join(f"{c.strip()} AS k{i}" for i, c in enumerate(spec["order"].split(",")))
    keys_old = keys_new.replace("n.", "o.")
    rows = f"""
        SELECT 1 AS ord, {removed} AS payload, {old_show} AS gen_show, {keys_old}
        {changed} AND ({key_changed})
        UNION ALL
        SELECT 2, {spec["payload"]}, {spec["show"]}, {keys_new}
        {changed}"""
    messages = with_generation(rows, order, add_show=spec["pk"] != "pk_subscription")
    return f"""
    IF NOT EXISTS (SELECT 1 {changed}) THEN
        RETURN NULL;
    END IF;
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    {bump}
    PERFORM pg_notify('{LIMIT_CHANNEL}', p.payload) FROM ({messages}
    ) p;
    RETURN NULL;
"""


def _key_changed(spec: dict[str, str]) -> str:
    if spec["pk"] == "pk_subscription":
        return "n.pk_show IS DISTINCT FROM o.pk_show OR n.pk_alloc IS DISTINCT FROM o.pk_alloc"
    column = spec["order"].removeprefix("n.")
    return f"n.{column} IS DISTINCT FROM o.{column}"


def limit_insert_func(spec: dict[str, str]) -> str:
    return f"""
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM pg_notify('{LIMIT_CHANNEL}', p.payload) FROM (
        SELECT {spec["payload"]} AS payload FROM new_rows n ORDER BY {spec["order"]}
    ) p;
    RETURN NULL;
"""


def limit_delete_func(spec: dict[str, str]) -> str:
    """A deleted cap row: the Store forgets the cap, so the key fails closed until a reseed or fill.

    Until it has, the Store still holds the old cap: the removal bumps the show's generation.
    A row deleted with its show's job or folder (a cascade) has no show left to book under.
    """
    keys = ", ".join(f"{c.strip()} AS k{i}" for i, c in enumerate(spec["order"].split(",")))
    order = [f"k{i}" for i in range(spec["order"].count(",") + 1)]
    rows = f"SELECT {spec['removed']} AS payload, {spec['show']} AS gen_show, {keys} FROM old_rows n"
    messages = with_generation(rows, order, add_show=spec["pk"] != "pk_subscription")
    return f"""
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    {bump_generation(f"SELECT {spec['show']} FROM old_rows n", "cap")}
    PERFORM pg_notify('{LIMIT_CHANNEL}', p.payload) FROM ({messages}
    ) p;
    RETURN NULL;
"""


def resync_func(table: str) -> str:
    return f"""
    PERFORM pg_notify('{RESYNC_CHANNEL}', '{{"table":"{table}","xid":' || {CURRENT_XID} || '}}');
    RETURN NULL;
"""


def _limit_triggers(vertex: str, table: str, spec: dict[str, str]) -> list[pgtrigger.Trigger]:
    declare = [("v_xid", "bigint"), ("v_seq", "bigint"), *GENERATION_DECLARE]
    return [
        pgtrigger.Trigger(
            name=f"acct_limit_{vertex}_insert",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_rows"),
            declare=declare,
            func=limit_insert_func(spec),
        ),
        pgtrigger.Trigger(
            name=f"acct_limit_{vertex}_update",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows", new="new_rows"),
            declare=declare,
            func=limit_update_func(spec),
        ),
        pgtrigger.Trigger(
            name=f"acct_limit_{vertex}_delete",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows"),
            declare=declare,
            func=limit_delete_func(spec),
        ),
        pgtrigger.Trigger(
            name=f"acct_limit_{vertex}_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            func=resync_func(table),
        ),
    ]


def subscription_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("sub", "subscription", _SUB),
        *usage_guard_triggers("subscription"),
        *counter_outside_triggers("subscription"),
    ]


def folder_resource_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("folder", "folder_resource", _FOLDER),
        *usage_guard_triggers("folder_resource"),
        *counter_outside_triggers("folder_resource"),
    ]


def job_resource_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("job", "job_resource", _JOB),
        *usage_guard_triggers("job_resource"),
        cuebot_job_caps_trigger(),
        *counter_outside_triggers("job_resource"),
    ]


# --- unlimited job caps beside Cuebot ----------------------------------------------------------

# Why in the database, in one BEFORE trigger: the writers of a job cap are many (the submit, the
# job CLI, the API, the console, the recompute's lift and restore, a psql UPDATE, a row written
# before this trigger existed and touched again by a booking) and a missed one leaves a job that
# Cuebot can never book once its show is Cuebot's again. A BEFORE row trigger rewrites NEW before
# the row is stored and before Cuebot's verify_job_resources (a later trigger name; PostgreSQL
# runs BEFORE triggers by name and evaluates their WHEN on the NEW they leave) reads it, so a
# booking's own `int_cores = int_cores + n` against an old -1 row passes. Only on a Cuebot
# database: elsewhere -1 stays cuesched's unlimited. Folders keep -1 (Cuebot's folder -1 is
# unlimited and it has no folder verify trigger).
CUEBOT_JOB_CAPS_FUNC = f"""
    IF {CUEBOT_ACCOUNTS} THEN
        IF NEW.int_max_cores < 0 THEN
            NEW.int_max_cores := {CUEBOT_UNLIMITED_CAP};
        END IF;
        IF NEW.int_max_gpus < 0 THEN
            NEW.int_max_gpus := {CUEBOT_UNLIMITED_CAP};
        END IF;
    END IF;
    RETURN NEW;
"""
# The rows written before the trigger was installed (the migration that installs it runs this).
NORMALIZE_CUEBOT_JOB_CAPS_SQL = f"""
UPDATE job_resource
SET int_max_cores = CASE WHEN int_max_cores < 0 THEN {CUEBOT_UNLIMITED_CAP} ELSE int_max_cores END,
    int_max_gpus = CASE WHEN int_max_gpus < 0 THEN {CUEBOT_UNLIMITED_CAP} ELSE int_max_gpus END
WHERE (int_max_cores < 0 OR int_max_gpus < 0) AND {CUEBOT_ACCOUNTS}
"""


def cuebot_job_caps_trigger() -> pgtrigger.Trigger:
    return pgtrigger.Trigger(
        name="cuebot_job_caps_unlimited",
        when=pgtrigger.Before,
        operation=pgtrigger.Insert | pgtrigger.Update,
        level=pgtrigger.Row,
        condition=pgtrigger.Condition("NEW.int_max_cores < 0 OR NEW.int_max_gpus < 0"),
        func=CUEBOT_JOB_CAPS_FUNC,
    )


# --- the usage columns of unmanaged shows: only the triggers write them -------------------------

# The database-enforced path keeps subscription / folder_resource / job_resource usage by deltas;
# a row written with any other value would read wrong until the reconcile. A new row of an
# unmanaged show (a subscription deleted and inserted again while procs run) therefore starts at
# SUM(proc), and a client statement that writes the usage of an unmanaged show is refused. The
# triggers' own writes run inside another trigger (pg_trigger_depth() > 0 in the WHEN clause); the
# reconcile, a client, marks its transaction with `cuesched.counter_rebuild`, which is honoured
# only together with the writer mark: set by anybody else, it would let a session write an
# unmanaged counter below SUM(proc), and the caps checked against it would pass bookings over them.
COUNTER_REBUILD_SETTING = "cuesched.counter_rebuild"
COUNTER_REBUILD_SQL = f"SELECT set_config('{COUNTER_REBUILD_SETTING}', 'on', true)"
_USAGE_SOURCES = {
    "subscription": (
        "SELECT 1 FROM show s WHERE s.pk_show = NEW.pk_show AND NOT s.b_scheduler_managed",
        "FROM proc p JOIN host h ON h.pk_host = p.pk_host JOIN show s ON s.pk_show = p.pk_show "
        "WHERE p.pk_show = NEW.pk_show AND h.pk_alloc = NEW.pk_alloc AND NOT p.b_local AND NOT s.b_scheduler_managed",
    ),
    "folder_resource": (
        "SELECT 1 FROM folder f JOIN show s ON s.pk_show = f.pk_show WHERE f.pk_folder = NEW.pk_folder "
        "AND NOT s.b_scheduler_managed",
        "FROM proc p JOIN job j ON j.pk_job = p.pk_job JOIN show s ON s.pk_show = p.pk_show "
        "WHERE j.pk_folder = NEW.pk_folder AND NOT p.b_local AND NOT s.b_scheduler_managed",
    ),
    "job_resource": (
        "SELECT 1 FROM job j JOIN show s ON s.pk_show = j.pk_show WHERE j.pk_job = NEW.pk_job "
        "AND NOT s.b_scheduler_managed",
        "FROM proc p JOIN show s ON s.pk_show = p.pk_show "
        "WHERE p.pk_job = NEW.pk_job AND NOT p.b_local AND NOT s.b_scheduler_managed",
    ),
}


_USAGE_KEYS = {"subscription": ("pk_show", "pk_alloc"), "folder_resource": ("pk_folder",), "job_resource": ("pk_job",)}


def usage_guard_triggers(table: str) -> list[pgtrigger.Trigger]:
    unmanaged, procs = _USAGE_SOURCES[table]
    keys = _USAGE_KEYS[table]
    # Under the shared accounting-keys lock, in a statement of its own: a flip to unmanaged that
    # the row would miss (its rebuild cannot see an uncommitted row) waits for it, and one that
    # committed first is seen by the flag read below.
    seed = f"""
    {LOCK_KEYS_SHARED}
    IF EXISTS ({unmanaged}) THEN
        SELECT COALESCE(SUM(p.int_cores_reserved), 0), COALESCE(SUM(p.int_gpus_reserved), 0)
        INTO NEW.int_cores, NEW.int_gpus {procs};
    END IF;
    RETURN NEW;
"""
    return [
        pgtrigger.Trigger(
            name="acct_usage_seed",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert,
            level=pgtrigger.Row,
            func=seed,
        ),
        # A row moved to another key (a subscription to another allocation) would carry the old
        # key's usage to the new one: the new key starts at its own SUM(proc) instead.
        pgtrigger.Trigger(
            name="acct_usage_rekey",
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf(*keys),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(" OR ".join(f"OLD.{k} IS DISTINCT FROM NEW.{k}" for k in keys)),
            func=seed,
        ),
        pgtrigger.Trigger(
            name="acct_usage_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf("int_cores", "int_gpus"),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(
                "pg_trigger_depth() = 0 AND (OLD.int_cores IS DISTINCT FROM NEW.int_cores "
                "OR OLD.int_gpus IS DISTINCT FROM NEW.int_gpus)"
            ),
            func=f"""
    IF NOT (COALESCE(current_setting('{COUNTER_REBUILD_SETTING}', true), '') = 'on' AND {WRITER_ON})
       AND EXISTS ({unmanaged}) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: %s usage of an unmanaged show is kept by the proc triggers', TG_TABLE_NAME),
            HINT = 'int_cores and int_gpus follow SUM(proc); change the procs, not the counter '
                   '(only the scheduler''s reconcile rewrites them).',
            ERRCODE = 'check_violation', CONSTRAINT = 'acct_usage_written_by_triggers';
    END IF;
    RETURN NEW;
""",
        ),
    ]


# --- beside Cuebot: the counter tables' side of the outside writers' ledger ----------------------
# (table, primary key, the two key columns of a counter row; '' where the row has one key)
_OUTSIDE_COUNTERS = {
    "subscription": (OUTSIDE_SUB, "pk_subscription", "pk_show", "pk_alloc"),
    "layer_resource": (OUTSIDE_LAYER, "pk_layer_resource", "pk_layer", None),
    "job_resource": (OUTSIDE_JOB, "pk_job_resource", "pk_job", None),
    "folder_resource": (OUTSIDE_FOLDER, "pk_folder_resource", "pk_folder", None),
    "point": (OUTSIDE_POINT, "pk_point", "pk_show", "pk_dept"),
}


def counter_outside_func(table: str, operation: str) -> str:
    """What anybody else changed in a counter row, subtracted from what the transaction owes it.

    Cuebot's procCreated adds a proc's cores to the five rows itself: that change pays the
    proc's debt, so its booking owes nothing at commit. A row moved to another key (a
    subscription to another allocation) pays the new key and charges the old one back; a row
    deleted owes its old value back and a row inserted pays its new one, so a row deleted and
    inserted again under running procs is topped back to SUM(proc) at commit (cuesched's
    acct_usage_seed is Cuebot's to do on these tables and is not installed beside it). Every
    writer but cuesched's own is recorded, the top-up included: it empties the transaction's
    rows after its own writes, so they leave no debt and cannot be exempted by a setting.
    """
    tbl, pk, k1, k2 = _OUTSIDE_COUNTERS[table]
    keys = [k1] if k2 is None else [k1, k2]

    def key(alias: str) -> str:
        return f"{alias}.{k1}, " + (f"{alias}.{k2}" if k2 else "''")

    if operation == "UPDATE":
        changed = (
            f"FROM new_rows n JOIN old_rows o ON o.{pk} = n.{pk} WHERE "
            f"ROW(n.int_cores, n.int_gpus, {', '.join('n.' + k for k in keys)}) IS DISTINCT FROM "
            f"ROW(o.int_cores, o.int_gpus, {', '.join('o.' + k for k in keys)})"
        )
        owed = f"""
        SELECT {tbl}, {key("n")}, -n.int_cores::bigint, -n.int_gpus::bigint, 0, 0 {changed}
        UNION ALL
        SELECT {tbl}, {key("o")}, o.int_cores::bigint, o.int_gpus::bigint, 0, 0 {changed}"""
    elif operation == "INSERT":
        changed = "FROM new_rows n WHERE n.int_cores <> 0 OR n.int_gpus <> 0"
        owed = f"SELECT {tbl}, {key('n')}, -n.int_cores::bigint, -n.int_gpus::bigint, 0, 0 {changed}"
    else:
        changed = "FROM old_rows o WHERE o.int_cores <> 0 OR o.int_gpus <> 0"
        owed = f"SELECT {tbl}, {key('o')}, o.int_cores::bigint, o.int_gpus::bigint, 0, 0 {changed}"
    return f"""
    IF {WRITER_ON} THEN
        RETURN NULL;
    END IF;
    IF NOT EXISTS (SELECT 1 {changed}) OR NOT {CUEBOT_ACCOUNTS} THEN
        RETURN NULL;
    END IF;
    {_LEDGER_UPSERT.format(owed=owed)}
    RETURN NULL;
"""


# A TRUNCATE of a counter table has no transition table: beside Cuebot, an unmarked one owes every
# row of the table SUM(proc) of its key (unmanaged shows' live procs), settled at commit like any
# debt: a table emptied and filled again (a restore script) is topped back to SUM(proc), and one
# left empty under running procs is refused (the top-up's missing-row check). cuesched's own
# TRUNCATE triggers on subscription, folder_resource and job_resource still send acct_resync.
_TRUNCATE_OWED = {
    "subscription": f"""
        SELECT {OUTSIDE_SUB}, p.pk_show, h.pk_alloc, p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
        FROM proc p JOIN host h ON h.pk_host = p.pk_host""",
    "layer_resource": f"""
        SELECT {OUTSIDE_LAYER}, p.pk_layer, '', p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
        FROM proc p""",
    "job_resource": f"""
        SELECT {OUTSIDE_JOB}, p.pk_job, '', p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint FROM proc p""",
    "folder_resource": f"""
        SELECT {OUTSIDE_FOLDER}, j.pk_folder, '', p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
        FROM proc p JOIN job j ON j.pk_job = p.pk_job""",
    "point": f"""
        SELECT {OUTSIDE_POINT}, p.pk_show, j.pk_dept, p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
        FROM proc p JOIN job j ON j.pk_job = p.pk_job""",
}


def counter_truncate_func(table: str) -> str:
    owed = (
        f"SELECT x.*, 0, 0 FROM ({_TRUNCATE_OWED[table]}"
        " JOIN show s ON s.pk_show = p.pk_show AND NOT s.b_scheduler_managed WHERE NOT p.b_local) x"
    )
    return f"""
    IF {WRITER_ON} OR NOT {CUEBOT_ACCOUNTS} THEN
        RETURN NULL;
    END IF;
    {LOCK_KEYS_SHARED}
    {_LEDGER_UPSERT.format(owed=owed)}
    RETURN NULL;
"""


def counter_outside_triggers(table: str) -> list[pgtrigger.Trigger]:
    triggers = [
        pgtrigger.Trigger(
            name=name,
            when=pgtrigger.After,
            operation=operation,
            level=pgtrigger.Statement,
            referencing=referencing,
            func=counter_outside_func(table, str(operation)),
        )
        for name, operation, referencing in (
            ("acct_outside_paid", pgtrigger.Update, pgtrigger.Referencing(old="old_rows", new="new_rows")),
            ("acct_outside_row_new", pgtrigger.Insert, pgtrigger.Referencing(new="new_rows")),
            ("acct_outside_row_gone", pgtrigger.Delete, pgtrigger.Referencing(old="old_rows")),
        )
    ]
    triggers.append(
        pgtrigger.Trigger(
            name="acct_outside_truncated",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            func=counter_truncate_func(table),
        )
    )
    return triggers


def layer_resource_triggers() -> list[pgtrigger.Trigger]:
    return counter_outside_triggers("layer_resource")


def point_triggers() -> list[pgtrigger.Trigger]:
    return counter_outside_triggers("point")


# The top-up, at commit (a DEFERRABLE INITIALLY DEFERRED constraint trigger on the ledger: PREPARE
# TRANSACTION runs it too). Each ledger row inserted queues one event; the first takes every row
# of the transaction, the others find none.
#
# What it adds: at READ COMMITTED, the counter is raised to SUM(proc) of its key if below, read in
# a fresh statement after the counter rows are locked (a booking in flight either holds the row,
# and committed before the lock was granted, or will add its own share after this commit), so a
# counter that already read high absorbs the debt, and Cuebot's recalculate_subs(), which owes the
# excess it removed, is not undone. At REPEATABLE READ or SERIALIZABLE a SUM read from the
# snapshot could miss procs committed since, so the debt itself is added, relative to the row; a
# row changed by anybody since the snapshot fails the lock with a serialization failure (40001),
# and the writer retries: safe. Nothing is ever topped down (high is allowed).
#
# What it checks: every key the transaction booked on (net proc delta > 0) and still owes, against
# the counter as it will commit (GREATEST(counter, SUM(proc)) at READ COMMITTED), whether or not
# anything is added: a counter that read high absorbs the debt, and without the check the booking
# would pass the cap unchecked (Cuebot's own booking there is refused by its verify_* triggers on
# the same value). A key whose counter row is gone while procs run on it (a row deleted, a table
# truncated, and not written again) is refused with its `acct_*_missing` constraint: a proc whose
# counter is missing would be read as 0 by Cuebot's dispatcher. A point row is created instead,
# as the booking path creates it.
#
# Locks: the accounting-keys lock (shared), then the counter rows in Cuebot's procCreated order
# (subscription, layer, job, folder, point; by key within a table), so it queues behind Cuebot's
# bookings instead of deadlocking with them. Caps are cuesched's (-1 unlimited, 0 books nothing,
# folder caps) and Cuebot's verify_* triggers fire on the write as well; a breach raises and the
# whole transaction rolls back. Its own counter writes are recorded in the ledger like anybody's
# (no setting can exempt a writer); it deletes the transaction's rows after them, and the events
# they queued find nothing.
_OWED = "unnest(v_tbl, v_k1, v_k2, v_cc, v_g, v_bc, v_bg) AS o(tbl, k1, k2, cc, g, bc, bg)"
_KEY_SHOW = f"""CASE o.tbl WHEN {OUTSIDE_SUB} THEN o.k1 WHEN {OUTSIDE_POINT} THEN o.k1
        WHEN {OUTSIDE_LAYER} THEN
            (SELECT j.pk_show FROM layer l JOIN job j ON j.pk_job = l.pk_job WHERE l.pk_layer = o.k1)
        WHEN {OUTSIDE_JOB} THEN (SELECT j.pk_show FROM job j WHERE j.pk_job = o.k1)
        WHEN {OUTSIDE_FOLDER} THEN (SELECT f.pk_show FROM folder f WHERE f.pk_folder = o.k1) END"""
# The counter row now, with its caps (max_c NULL: none; subscription: its burst, always enforced).
_COUNTER_NOW = f"""
        SELECT t.int_cores::bigint, t.int_gpus::bigint, t.int_burst::bigint, NULL::bigint FROM subscription t
        WHERE o.tbl = {OUTSIDE_SUB} AND t.pk_show = o.k1 AND t.pk_alloc = o.k2
        UNION ALL SELECT t.int_cores::bigint, t.int_gpus::bigint, NULL, NULL FROM layer_resource t
        WHERE o.tbl = {OUTSIDE_LAYER} AND t.pk_layer = o.k1
        UNION ALL SELECT t.int_cores::bigint, t.int_gpus::bigint, t.int_max_cores::bigint, t.int_max_gpus::bigint
        FROM job_resource t WHERE o.tbl = {OUTSIDE_JOB} AND t.pk_job = o.k1
        UNION ALL SELECT t.int_cores::bigint, t.int_gpus::bigint, t.int_max_cores::bigint, t.int_max_gpus::bigint
        FROM folder_resource t WHERE o.tbl = {OUTSIDE_FOLDER} AND t.pk_folder = o.k1
        UNION ALL SELECT t.int_cores::bigint, t.int_gpus::bigint, NULL, NULL FROM point t
        WHERE o.tbl = {OUTSIDE_POINT} AND t.pk_show = o.k1 AND t.pk_dept = o.k2"""
_SUM_PROC = "SELECT SUM(p.int_cores_reserved)::bigint AS cc, SUM(p.int_gpus_reserved)::bigint AS g"
_PROC_NOW = f"""
        SELECT COALESCE(SUM(z.cc), 0)::bigint, COALESCE(SUM(z.g), 0)::bigint FROM (
            {_SUM_PROC} FROM proc p JOIN host h ON h.pk_host = p.pk_host
            WHERE o.tbl = {OUTSIDE_SUB} AND p.pk_show = o.k1 AND h.pk_alloc = o.k2 AND NOT p.b_local
            UNION ALL {_SUM_PROC} FROM proc p WHERE o.tbl = {OUTSIDE_LAYER} AND p.pk_layer = o.k1 AND NOT p.b_local
            UNION ALL {_SUM_PROC} FROM proc p WHERE o.tbl = {OUTSIDE_JOB} AND p.pk_job = o.k1 AND NOT p.b_local
            UNION ALL {_SUM_PROC} FROM proc p JOIN job j ON j.pk_job = p.pk_job
            WHERE o.tbl = {OUTSIDE_FOLDER} AND j.pk_folder = o.k1 AND NOT p.b_local
            UNION ALL {_SUM_PROC} FROM proc p JOIN job j ON j.pk_job = p.pk_job
            WHERE o.tbl = {OUTSIDE_POINT} AND p.pk_show = o.k1 AND j.pk_dept = o.k2 AND NOT p.b_local
        ) z"""
_TOPUP_LOCKS = "\n    ".join(
    f"PERFORM 1 FROM {table} t WHERE ({', '.join('t.' + k for k in keys)}) IN "
    f"(SELECT {', '.join(cols)} FROM {_OWED} WHERE o.tbl = {tbl}) "
    f"ORDER BY {', '.join('t.' + k for k in keys)} FOR UPDATE OF t;"
    for table, tbl, keys, cols in (
        ("subscription", OUTSIDE_SUB, ("pk_show", "pk_alloc"), ("o.k1", "o.k2")),
        ("layer_resource", OUTSIDE_LAYER, ("pk_layer",), ("o.k1",)),
        ("job_resource", OUTSIDE_JOB, ("pk_job",), ("o.k1",)),
        ("folder_resource", OUTSIDE_FOLDER, ("pk_folder",), ("o.k1",)),
        ("point", OUTSIDE_POINT, ("pk_show", "pk_dept"), ("o.k1", "o.k2")),
    )
)
_ARRAYS = ", ".join(f"array_agg(x.{c})" for c in ("tbl", "k1", "k2", "cc", "g", "bc", "bg"))
_INTO = "INTO v_tbl, v_k1, v_k2, v_cc, v_g, v_bc, v_bg"
# A booking (bc / bg > 0) still owing (cc / g > 0) is checked against the counter as it commits.
_BOOKED_C = "n.cc > 0 AND n.bc > 0"
_BOOKED_G = "n.g > 0 AND n.bg > 0"
_MISSING = "n.cur_c IS NULL AND (n.ac > 0 OR n.ag > 0)"
OUTSIDE_TOPUP_FUNC = f"""
    WITH gone AS (DELETE FROM {OUTSIDE_LEDGER_TABLE} WHERE xid = NEW.xid RETURNING tbl, k1, k2, cc, g, bc, bg)
    SELECT {_ARRAYS} {_INTO}
    FROM (SELECT tbl::int, k1, k2, GREATEST(cc, 0) AS cc, GREATEST(g, 0) AS g, bc, bg
          FROM gone WHERE cc > 0 OR g > 0) x;
    IF v_tbl IS NULL THEN
        RETURN NULL;
    END IF;
    {LOCK_KEYS_SHARED}
    v_rc := {READ_COMMITTED};
    -- Only the shows Cuebot keeps: a managed show's counters are the Store's display.
    SELECT {_ARRAYS} {_INTO}
    FROM (SELECT o.* FROM {_OWED} JOIN show s ON s.pk_show = {_KEY_SHOW} WHERE NOT s.b_scheduler_managed) x;
    IF v_tbl IS NULL THEN
        RETURN NULL;
    END IF;
    {_TOPUP_LOCKS}
    -- A fresh statement: at READ COMMITTED it sees every booking that held a row locked above. The
    -- checks read the rows as this statement found them (locked), plus what it adds.
    WITH n AS MATERIALIZED (
        SELECT o.tbl, o.k1, o.k2, o.cc, o.g, o.bc, o.bg, c.cc AS cur_c, c.g AS cur_g, c.max_c, c.max_g,
               CASE WHEN v_rc OR c.cc IS NULL THEN GREATEST(0, u.cc - COALESCE(c.cc, 0)) ELSE o.cc END AS ac,
               CASE WHEN v_rc OR c.cc IS NULL THEN GREATEST(0, u.g - COALESCE(c.g, 0)) ELSE o.g END AS ag
        FROM {_OWED}
        LEFT JOIN LATERAL ({_COUNTER_NOW}) AS c(cc, g, max_c, max_g) ON true
        LEFT JOIN LATERAL ({_PROC_NOW}) AS u(cc, g) ON v_rc OR c.cc IS NULL
    ),
    a AS (SELECT n.tbl, n.k1, n.k2, n.ac AS cc, n.ag AS g FROM n WHERE n.cur_c IS NOT NULL OR n.tbl = {OUTSIDE_POINT}),
    sub_u AS (
        UPDATE subscription t SET int_cores = t.int_cores + a.cc, int_gpus = t.int_gpus + a.g
        FROM a WHERE a.tbl = {OUTSIDE_SUB} AND (a.cc > 0 OR a.g > 0) AND t.pk_show = a.k1 AND t.pk_alloc = a.k2
    ),
    layer_u AS (
        UPDATE layer_resource t SET int_cores = t.int_cores + a.cc, int_gpus = t.int_gpus + a.g
        FROM a WHERE a.tbl = {OUTSIDE_LAYER} AND (a.cc > 0 OR a.g > 0) AND t.pk_layer = a.k1
    ),
    job_u AS (
        UPDATE job_resource t SET int_cores = t.int_cores + a.cc, int_gpus = t.int_gpus + a.g
        FROM a WHERE a.tbl = {OUTSIDE_JOB} AND (a.cc > 0 OR a.g > 0) AND t.pk_job = a.k1
    ),
    folder_u AS (
        UPDATE folder_resource t SET int_cores = t.int_cores + a.cc, int_gpus = t.int_gpus + a.g
        FROM a WHERE a.tbl = {OUTSIDE_FOLDER} AND (a.cc > 0 OR a.g > 0) AND t.pk_folder = a.k1
    ),
    point_u AS (
        INSERT INTO point AS t (pk_point, pk_show, pk_dept, int_cores, int_gpus)
        SELECT gen_random_uuid()::text, a.k1, a.k2, a.cc, a.g FROM a
        WHERE a.tbl = {OUTSIDE_POINT} AND (a.cc > 0 OR a.g > 0)
        ON CONFLICT (pk_show, pk_dept) DO UPDATE
        SET int_cores = t.int_cores + EXCLUDED.int_cores, int_gpus = t.int_gpus + EXCLUDED.int_gpus
    )
    SELECT v.con, v.msg INTO v_constraint, v_message FROM (
        SELECT 1 AS ord, '{CAP_SUBSCRIPTION_MISSING}' AS con, format(
            'no subscription for show=%s alloc=%s: cannot book %s centicores', n.k1, n.k2, n.ac) AS msg
        FROM n WHERE n.tbl = {OUTSIDE_SUB} AND {_MISSING}
        UNION ALL
        SELECT 2, '{CAP_SUBSCRIPTION_BURST}', format(
            'subscription has exceeded burst size: show=%s alloc=%s cores=%s burst=%s (centicores)',
            n.k1, n.k2, n.cur_c + n.ac, n.max_c)
        FROM n WHERE n.tbl = {OUTSIDE_SUB} AND {_BOOKED_C} AND n.cur_c + n.ac > n.max_c
        UNION ALL
        SELECT 3, '{CAP_FOLDER_MISSING}', format(
            'no folder_resource row for folder=%s: cannot book %s centicores', n.k1, n.ac)
        FROM n WHERE n.tbl = {OUTSIDE_FOLDER} AND {_MISSING}
        UNION ALL
        SELECT 4, '{CAP_FOLDER_MAX_CORES}', format(
            'folder has exceeded max cores: folder=%s cores=%s max_cores=%s (centicores)',
            n.k1, n.cur_c + n.ac, n.max_c)
        FROM n WHERE n.tbl = {OUTSIDE_FOLDER} AND {_BOOKED_C} AND n.max_c >= 0 AND n.cur_c + n.ac > n.max_c
        UNION ALL
        SELECT 5, '{CAP_JOB_MISSING}', format('no job_resource row for job=%s: cannot book %s centicores', n.k1, n.ac)
        FROM n WHERE n.tbl = {OUTSIDE_JOB} AND {_MISSING}
        UNION ALL
        SELECT 6, '{CAP_JOB_MAX_CORES}', format(
            'job has exceeded max cores: job=%s cores=%s max_cores=%s (centicores)', n.k1, n.cur_c + n.ac, n.max_c)
        FROM n WHERE n.tbl = {OUTSIDE_JOB} AND {_BOOKED_C} AND n.max_c >= 0 AND n.cur_c + n.ac > n.max_c
        UNION ALL
        SELECT 7, '{CAP_FOLDER_MAX_GPUS}', format(
            'folder has exceeded max GPUs: folder=%s gpus=%s max_gpus=%s', n.k1, n.cur_g + n.ag, n.max_g)
        FROM n WHERE n.tbl = {OUTSIDE_FOLDER} AND {_BOOKED_G} AND n.max_g >= 0 AND n.cur_g + n.ag > n.max_g
        UNION ALL
        SELECT 8, '{CAP_JOB_MAX_GPUS}', format(
            'job has exceeded max GPUs: job=%s gpus=%s max_gpus=%s', n.k1, n.cur_g + n.ag, n.max_g)
        FROM n WHERE n.tbl = {OUTSIDE_JOB} AND {_BOOKED_G} AND n.max_g >= 0 AND n.cur_g + n.ag > n.max_g
        UNION ALL
        SELECT 9, '{CAP_LAYER_MISSING}', format(
            'no layer_resource row for layer=%s: cannot book %s centicores', n.k1, n.ac)
        FROM n WHERE n.tbl = {OUTSIDE_LAYER} AND {_MISSING}
    ) v
    ORDER BY v.ord, v.msg
    LIMIT 1;
    -- What the writes above recorded (they are recorded like anybody's) pays nothing: gone.
    DELETE FROM {OUTSIDE_LEDGER_TABLE} WHERE xid = NEW.xid;
    IF v_message IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = 'check_violation', CONSTRAINT = v_constraint;
    END IF;
    RETURN NULL;
"""

# Only the triggers above write the ledger (from inside a trigger: pg_trigger_depth() > 0 when the
# WHEN clause is read). A client's INSERT, UPDATE or DELETE of it (cancelling a debt before the
# commit's top-up reads it) is refused. A TRUNCATE is refused by PostgreSQL itself while this
# transaction has top-up events pending ("pending trigger events"), and waits for every other
# writer of the ledger to commit (its ACCESS EXCLUSIVE lock), so it cannot erase a debt either;
# Django's test flush truncates it, so it stays allowed.
OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS = "acct_outside_ledger_written_by_triggers"


def outside_ledger_triggers() -> list[pgtrigger.Trigger]:
    return [
        pgtrigger.Trigger(
            name="acct_outside_topup",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Row,
            timing=pgtrigger.Deferred,
            declare=[
                ("v_tbl", "int[]"),
                ("v_k1", "text[]"),
                ("v_k2", "text[]"),
                ("v_cc", "bigint[]"),
                ("v_g", "bigint[]"),
                ("v_bc", "bigint[]"),
                ("v_bg", "bigint[]"),
                ("v_rc", "boolean"),
                ("v_constraint", "text"),
                ("v_message", "text"),
            ],
            func=OUTSIDE_TOPUP_FUNC,
        ),
        pgtrigger.Trigger(
            name="acct_outside_ledger_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert | pgtrigger.Update | pgtrigger.Delete,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition("pg_trigger_depth() = 0"),
            func=f"""
    RAISE EXCEPTION USING
        MESSAGE = 'cuesched: {OUTSIDE_LEDGER_TABLE} is written by the accounting triggers only',
        HINT = 'It holds what this transaction still owes the counters, settled at its commit; '
               'write the procs and counters, not the ledger.',
        ERRCODE = 'check_violation', CONSTRAINT = '{OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS}';
""",
        ),
    ]


# --- managed flips -------------------------------------------------------------

_ANY_FLIP = """
    (SELECT n.pk_show FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
     WHERE o.b_scheduler_managed IS DISTINCT FROM n.b_scheduler_managed)
"""
_TO_UNMANAGED = """
    SELECT n.pk_show FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
    WHERE o.b_scheduler_managed AND NOT n.b_scheduler_managed
"""
# Beside Cuebot, the rebuild of a flip to unmanaged writes SUM(proc) into rows whose cap Cuebot's
# verify_subscription / verify_job_resources check on every increase: a burst or job max lowered
# while the show was the scheduler's, under frames still running, failed the whole flip with
# Cuebot's "exceeded" error (the show could not be handed back until frames finished). A
# rebuild writes the truth, over a cap too, as Cuebot's own recalculate_subs() (V45) does: in
# the flip's transaction the caps of just the rows about to go over are lifted to the value
# written, then put back. The lift is hidden from the Store under DISPLAY_LIFT (only a
# loosening can be hidden: see DISPLAY_LIFT_SETTING), the mark is put back as it was after, and
# the rows stay locked to the commit, so no one books against a lifted cap. Cuebot then refuses
# new bookings of the show until it is under its caps again.
FLIP_LIFT_DECLARE = [
    ("v_lift_mark", "text"),
    ("v_lift_kind", "text[]"),
    ("v_lift_pk", "text[]"),
    ("v_lift_c", "bigint[]"),
    ("v_lift_g", "bigint[]"),
]
FLIP_LIFT_SQL = f"""
    WITH target AS MATERIALIZED ({_TO_UNMANAGED}),
    live AS (
        SELECT p.pk_show, h.pk_alloc, p.pk_job, p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
        FROM proc p JOIN host h ON h.pk_host = p.pk_host
        WHERE NOT p.b_local AND p.pk_show IN (SELECT pk_show FROM target)
    ),
    sub_lift AS (
        UPDATE subscription t SET int_burst = u.cc
        FROM (SELECT s.pk_subscription AS pk, s.int_burst AS old, SUM(l.cc) AS cc
              FROM subscription s JOIN live l ON l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc
              GROUP BY s.pk_subscription, s.int_burst, s.int_cores
              HAVING SUM(l.cc) > s.int_burst AND SUM(l.cc) > s.int_cores) u
        WHERE t.pk_subscription = u.pk
        RETURNING 's'::text AS kind, t.pk_subscription AS pk, u.old::bigint AS c, NULL::bigint AS g
    ),
    job_lift AS (
        UPDATE job_resource t SET int_max_cores = GREATEST(u.old_c, u.cc), int_max_gpus = GREATEST(u.old_g, u.g)
        FROM (SELECT jr.pk_job_resource AS pk, jr.int_max_cores AS old_c, jr.int_max_gpus AS old_g,
                     SUM(l.cc) AS cc, SUM(l.g) AS g
              FROM job_resource jr JOIN live l ON l.pk_job = jr.pk_job
              GROUP BY jr.pk_job_resource, jr.int_max_cores, jr.int_max_gpus
              HAVING SUM(l.cc) > jr.int_max_cores OR SUM(l.g) > jr.int_max_gpus) u
        WHERE t.pk_job_resource = u.pk
        RETURNING 'j'::text AS kind, t.pk_job_resource AS pk, u.old_c::bigint AS c, u.old_g::bigint AS g
    )
    SELECT array_agg(x.kind), array_agg(x.pk), array_agg(x.c), array_agg(x.g)
    INTO v_lift_kind, v_lift_pk, v_lift_c, v_lift_g
    FROM (SELECT * FROM sub_lift UNION ALL SELECT * FROM job_lift) x;"""
# A job of the show whose cap is still -1 (written before cuebot_job_caps_unlimited existed)
# would never be booked by Cuebot again: the flip that hands the show to Cuebot normalizes it
# (the write goes through that trigger).
FLIP_NORMALIZE_JOB_CAPS_SQL = f"""
    UPDATE job_resource t SET int_max_cores = t.int_max_cores, int_max_gpus = t.int_max_gpus
    FROM job j WHERE j.pk_job = t.pk_job AND (t.int_max_cores < 0 OR t.int_max_gpus < 0)
    AND j.pk_show IN ({_TO_UNMANAGED});"""
FLIP_RESTORE_SQL = """
    WITH lifted AS (SELECT * FROM unnest(v_lift_kind, v_lift_pk, v_lift_c, v_lift_g) AS l(kind, pk, c, g)),
    sub_back AS (
        UPDATE subscription t SET int_burst = l.c FROM lifted l WHERE l.kind = 's' AND t.pk_subscription = l.pk
        RETURNING 1
    )
    UPDATE job_resource t SET int_max_cores = l.c, int_max_gpus = l.g
    FROM lifted l WHERE l.kind = 'j' AND t.pk_job_resource = l.pk;"""

# Every flip, either way, bumps the show's generation. The scheduler publishes a show as managed
# with the generation its seed read, and its booking transaction checks it: a show that went
# unmanaged and back since the seed (however fast) books nothing until it is seeded again.
# The flip's rebuild writes the truth into counter rows, and beside Cuebot an unmarked writer's
# counter changes are recorded in its outside ledger as paid: a display below SUM(proc) (the
# scheduler's bookings since its last display write) raised by the rebuild would pay for a raw
# proc the same transaction writes next, which would then be neither counted nor checked. So the
# rebuild neither pays nor owes: the transaction's ledger is put back as it was before it. The
# ledger's guard lets a trigger write it (this runs inside the flip's).
FLIP_LEDGER_SAVE_SQL = f"""
            SELECT COALESCE(jsonb_agg(to_jsonb(l)), '[]'::jsonb) INTO v_ledger
            FROM {OUTSIDE_LEDGER_TABLE} l WHERE l.xid = {CURRENT_XID};"""
FLIP_LEDGER_RESTORE_SQL = f"""
            DELETE FROM {OUTSIDE_LEDGER_TABLE} WHERE xid = {CURRENT_XID};
            INSERT INTO {OUTSIDE_LEDGER_TABLE}
            SELECT * FROM jsonb_populate_recordset(NULL::{OUTSIDE_LEDGER_TABLE}, v_ledger);"""
FLIP_BUMP = bump_generation(_ANY_FLIP, "flip")
SHOW_FLIP_FUNC = f"""
    IF NOT EXISTS {_ANY_FLIP} THEN
        RETURN NULL;
    END IF;
    {_refuse_unless_read_committed("a managed flip")}
    -- Taken before any row by acct_show_flip_lock; again here for a flip whose statement did
    -- not name the column (it cannot happen through SQL, but costs nothing).
    {LOCK_KEYS_EXCLUSIVE}
    {EPOCH_BUMP}
    -- Generations come from one sequence, so a row deleted and re-created can never repeat a
    -- generation a seed was published with.
    INSERT INTO {SHOW_FLIP_TABLE} AS t (pk_show, int_generation, b_managed, ts_flipped)
    SELECT n.pk_show, nextval('{SHOW_FLIP_TABLE}_generation'), n.b_scheduler_managed, now()
    FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
    WHERE o.b_scheduler_managed IS DISTINCT FROM n.b_scheduler_managed
    ON CONFLICT (pk_show) DO UPDATE
    SET int_generation = EXCLUDED.int_generation, b_managed = EXCLUDED.b_managed, ts_flipped = EXCLUDED.ts_flipped;
    -- And its accounting generation: a flip sends no message, so only a seed catches up with it.
    {FLIP_BUMP}
    -- To unmanaged: the database path adds and subtracts from the five tables from now on, so
    -- they are rewritten to SUM(proc) in the flipping transaction, caps unchecked.
    IF EXISTS ({_TO_UNMANAGED}) THEN
        IF {CUEBOT_ACCOUNTS} THEN
            v_lift_mark := COALESCE(current_setting('{DISPLAY_LIFT_SETTING}', true), '');
            PERFORM set_config('{DISPLAY_LIFT_SETTING}', 'on', true);
            {FLIP_NORMALIZE_JOB_CAPS_SQL}
            {FLIP_LIFT_SQL}
            {FLIP_LEDGER_SAVE_SQL}
        END IF;
        {rebuild_sql(_TO_UNMANAGED, into="INTO v_d1, v_d2, v_d3, v_d4, v_d5")};
        IF v_ledger IS NOT NULL THEN
            {FLIP_LEDGER_RESTORE_SQL}
        END IF;
        IF v_lift_pk IS NOT NULL THEN
            {FLIP_RESTORE_SQL}
        END IF;
        IF v_lift_mark IS NOT NULL THEN
            PERFORM set_config('{DISPLAY_LIFT_SETTING}', v_lift_mark, true);
        END IF;
    END IF;
    RETURN NULL;
"""


def show_triggers() -> list[pgtrigger.Trigger]:
    return [
        _keys_lock_trigger("acct_show_flip_lock", pgtrigger.UpdateOf("b_scheduler_managed")),
        pgtrigger.Trigger(
            name="acct_show_flip",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows", new="new_rows"),
            declare=[
                *[(f"v_d{i}", "bigint") for i in range(1, 6)],
                *FLIP_LIFT_DECLARE,
                ("v_ledger", "jsonb"),
                *GENERATION_DECLARE,
                *LOCK_DECLARE,
            ],
            func=SHOW_FLIP_FUNC,
        ),
    ]


# --- the single rows -------------------------------------------------------------------------


def settings_triggers() -> list[pgtrigger.Trigger]:
    """Deleting the row would silently turn the switch into its default; refuse it."""
    return [pgtrigger.Protect(name="acct_settings_keep_row", operation=pgtrigger.Delete)]


# A generation row only ever moves forward by a bump (bump_generation: int_prev_generation takes
# the old value, int_generation a new one from the sequence, str_reason and ts_bumped say why and
# when). Any other UPDATE, whoever writes it (the triggers' bumps run in the outside writer's own
# transaction, so no role can tell them apart), is refused: putting a generation back, or moving
# it anywhere but forward, would let a Store that applied an older generation book under a cap
# change it never saw. A generation that only grows can never come back to a value a Store holds.
# A sequence set back below a row's generation makes the next bump of that row fail here, loudly,
# rather than repeat a value.
GENERATION_BUMP_ONLY = "acct_show_generation_bump_only"
_REAL_BUMP = (
    "COALESCE(NEW.pk_show = OLD.pk_show AND NEW.int_generation > OLD.int_generation "
    "AND NEW.int_prev_generation = OLD.int_generation, false)"
)


def show_generation_triggers() -> list[pgtrigger.Trigger]:
    """A deleted generation row would start its show's chain again from 0, a generation put back
    would hide the change its bump stood for: refuse both."""
    return [
        pgtrigger.Protect(name="acct_show_generation_keep_rows", operation=pgtrigger.Delete),
        pgtrigger.Trigger(
            name=GENERATION_BUMP_ONLY,
            when=pgtrigger.Before,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(f"NOT {_REAL_BUMP}"),
            func=f"""
    RAISE EXCEPTION USING
        MESSAGE = format('cuesched: the accounting generation of show %s only moves forward by a bump '
                         '(generation %s, previous %s: refused %s, previous %s)', OLD.pk_show,
                         OLD.int_generation, OLD.int_prev_generation, NEW.int_generation, NEW.int_prev_generation),
        HINT = 'Nothing was written. {GENERATION_TABLE} is written by the accounting triggers only: change '
               'the caps, keys or flags it stands for and their triggers bump it in the same transaction.',
        ERRCODE = 'check_violation', CONSTRAINT = '{GENERATION_BUMP_ONLY}';
""",
        ),
    ]


def show_flip_triggers() -> list[pgtrigger.Trigger]:
    """A deleted generation row would read as generation 0 again: refuse it."""
    return [pgtrigger.Protect(name="acct_show_flip_keep_rows", operation=pgtrigger.Delete)]


def epoch_triggers() -> list[pgtrigger.Trigger]:
    """The epoch row is the REPEATABLE READ writers' flip and move guard; refuse deleting it."""
    return [pgtrigger.Protect(name="acct_epoch_keep_row", operation=pgtrigger.Delete)]


# --- rows only the scheduler's roles write ----------------------------------------------------
# The lease row is the one-scheduler fence (accounting.singleton): a generation moved by anyone
# else makes the holder's next booking raise LeaseLostError (the scheduler exits), or puts a
# stale holder's generation back. The integrity alarms are the only trace of a counter found
# below SUM(proc). Both are written only by sessions whose login role is a member of WRITER_ROLE
# (the scheduler; the operator's `store_status --acknowledge-alarms`), or a superuser, which is a
# member of every role. Membership, not the claim: these writes carry no accounting, and a claim
# proves nothing anyway. BEFORE STATEMENT, so a statement that would touch no row is refused too
# and the check costs one lookup per statement, not per row.
LEASE_WRITERS_ONLY = "acct_lease_writers_only"
ALARM_WRITERS_ONLY = "acct_integrity_alarm_writers_only"


def _writers_only(name: str, operation: pgtrigger.Operation, what: str, hint: str) -> pgtrigger.Trigger:
    return pgtrigger.Trigger(
        name=name,
        when=pgtrigger.Before,
        operation=operation,
        level=pgtrigger.Statement,
        func=f"""
    IF NOT {WRITER_MEMBER} THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: %s may not %s {what}: only members of {WRITER_ROLE} write it',
                             session_user, lower(TG_OP)),
            HINT = '{hint}',
            ERRCODE = 'insufficient_privilege', CONSTRAINT = '{name}';
    END IF;
    RETURN NULL;
""",
    )


def scheduler_lease_triggers() -> list[pgtrigger.Trigger]:
    return [
        _writers_only(
            LEASE_WRITERS_ONLY,
            pgtrigger.Insert | pgtrigger.Update | pgtrigger.Delete | pgtrigger.Truncate,
            "the scheduler lease",
            "Nothing was written. The lease is taken and renewed by the scheduler itself (its login role is a "
            f"member of {WRITER_ROLE}); a standby takes it over once the holder''s deadline has passed. Stop the "
            "scheduler to release it.",
        )
    ]


def integrity_alarm_triggers() -> list[pgtrigger.Trigger]:
    """An alarm is never deleted (acknowledged, it stays as the record); only members write it."""
    return [
        pgtrigger.Protect(name="acct_integrity_alarm_keep_rows", operation=pgtrigger.Delete),
        _writers_only(
            ALARM_WRITERS_ONLY,
            pgtrigger.Insert | pgtrigger.Update | pgtrigger.Truncate,
            "an integrity alarm",
            "Nothing was written. Alarms are raised by the scheduler and acknowledged with "
            "`manage.py store_status --acknowledge-alarms NOTE`, run as a login role that is a member of "
            f"{WRITER_ROLE}.",
        ),
    ]
