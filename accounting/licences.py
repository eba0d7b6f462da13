"""Licence limits (OpenCue's `limit_record` / `layer_limit`): the database side, for every writer.

A limit spans shows, and `show.b_scheduler_managed` is per show: a limit can be used at the
same moment by frames the Store books (managed shows) and by frames an outside writer or the
database-enforced path writes (unmanaged shows). Two counters (the Store's managed part, the
database's unmanaged part) cannot be checked together atomically, because a booking on one
side cannot see the other side's bookings in flight. So there is ONE counter per limit, the
row `limit_record.int_running`, and every proc writer, the scheduler included, checks it
under that row's lock in its own transaction:

* a proc statement (INSERT, DELETE, an UPDATE of `pk_layer` or `pk_host`) that touches a
  layer with limits locks the limit rows FOR UPDATE (in key order, so two writers never
  deadlock on them), then, in a fresh statement (READ COMMITTED: after whatever it waited
  for), RECOUNTS the limit from `proc` JOIN `layer_limit`: frames, and distinct hosts for a
  `b_host_limit`. The count is therefore never a running sum that can drift: it is SUM(proc)
  of that moment, recomputed under the lock every write of the limit takes;
* if the count rose and is above the limit's max as `limit_max_sql` reads it (>= 0), the statement fails with
  `check_violation` and the constraint name `acct_limit_max` (the scheduler's batch writer
  then drops exactly that booking). A count that did not rise (a release, a max lowered below
  use) never fails: "refuse new bookings, never negative";
* at REPEATABLE READ or SERIALIZABLE, a limit row changed after the writer's snapshot fails
  the FOR UPDATE with a serialization failure (every write that changes a limit's use updates
  its row), so a stale snapshot can never recount low;
* adding a `layer_limit` row puts running frames of the layer under the limit: it takes the
  layer's row FOR UPDATE (like every other mover of running procs' keys, accounting.keylocks:
  each proc writer holds its layers' rows FOR KEY SHARE), so proc writers of that layer, and of
  no other, either committed before it (and are counted by its recount) or wait
  for it (and see the new row); it is refused when it would take the limit over its max. A
  layer created in the same transaction (a submission) has no proc anywhere yet, so it skips
  the lock. Removing a row only lowers the count and needs no lock: a writer that still read
  the row recounts after it, under the limit's lock;
* TRUNCATE proc recounts every limit (to 0). `int_running` and `int_frames` are written only
  by these triggers (a client write is refused); a `b_host_limit` change recounts.

The Store (accounting/store.py) checks the same number, as a vertex of its check-and-book, so
that a managed booking over a limit is refused in memory under the same lock as the caps
instead of failing in the database: each change of a limit row (its use, its max) is sent on
`acct_licence` with the absolute values and the writer's xid, and the Store adds its own
bookings in flight on top. The database check is the one that cannot be passed whatever the
writer; the Store's is the one that keeps the dispatch loop from sending bookings it would refuse.
"""

from __future__ import annotations

import pgtrigger

from accounting.keylocks import LOCK_DECLARE, lock_for_move, lock_keys_of
from accounting.notify import EMIT_FUNCTION, LICENCE_CHANNEL, RESYNC_CHANNEL
from accounting.triggers import (
    CUEBOT_ACCOUNTS,
    CURRENT_XID,
    EPOCH_BUMP,
    EPOCH_GUARD,
    NEXT_SEQ,
    READ_COMMITTED,
    json_id,
)
from accounting.triggers.definer import DefinerTrigger, written_by_triggers

LIMIT_MAX_CONSTRAINT = "acct_limit_max"
LIMIT_TABLE = "limit_record"
LAYER_LIMIT_TABLE = "layer_limit"


# --- what a limit's max means: decided here, once for SQL and once for Python ----------------
#
# cuesched's own schema reads a negative max as unlimited and 0 as "runs nothing"; its column is
# NOT NULL. Cuebot starts a frame under a limit only while `sum_running < int_max_value`
# (FrameDaoJdbc.UPDATE_FRAME_STARTED): a negative max starts nothing, and so does a NULL one (its
# column is nullable, with no default, and a comparison with NULL is never true). One
# limit_record row is shared by both on an adopted database, and reading -1 as unlimited there
# would book without bound what Cuebot never starts. So on a Cuebot database (CUEBOT_ACCOUNTS)
# a negative max reads as 0, and a NULL max reads as 0 on any schema: the stricter reading.
# Every reader (the triggers, the Store's reseed and notifications, the feed, why-not-booking,
# the console, the API) takes the max through one of these two.


def limit_max_sql(column: str) -> str:
    """The max the count is compared with, from a raw `int_max_value`: NULL reads 0; below 0 it is
    unlimited on cuesched's own schema and 0 beside Cuebot (Cuebot starts nothing under it); 0 lets
    nothing run.

    The Cuebot test is an uncorrelated subquery, evaluated once per statement and only when a
    negative max is met: the recount on every proc write pays nothing for it.
    """
    return (
        f"(CASE WHEN {column} IS NULL THEN 0 WHEN {column} >= 0 THEN {column}"
        f" WHEN {CUEBOT_ACCOUNTS} THEN 0 ELSE {column} END)"
    )


def limit_max(raw: int | None, *, cuebot: bool) -> int:
    """`limit_max_sql` for a value already in Python (a notification, a model row)."""
    if raw is None or (raw < 0 and cuebot):
        return 0
    return raw


def limit_max_problem(name: str, raw: int | None, *, cuebot: bool) -> str | None:
    """Why a limit runs nothing although its max does not say 0, or None when it says what it means."""
    if raw is None:
        return f"limit {name} has no max (NULL), which Cuebot reads as none: nothing runs under it"
    if raw < 0 and cuebot:
        return f"limit {name} has a negative max ({raw}), which Cuebot reads as none: nothing runs under it"
    return None


# The same, in SQL, for the trigger's refusal message and the adoption check.
LIMIT_MAX_NOTE_SQL = (
    "(CASE WHEN {col} IS NULL THEN ', no max (NULL), which Cuebot reads as none'"
    " WHEN {col} < 0 AND " + CUEBOT_ACCOUNTS + " THEN ', a negative max, which Cuebot reads as none'"
    " ELSE '' END)"
)

# The use of one limit, from proc: frames, and distinct hosts (what a b_host_limit compares).
# Local procs count too: a frame run by hand on a workstation holds its licence all the same.
COUNT_LATERAL = """
    CROSS JOIN LATERAL (
        SELECT count(*)::int AS frames, count(DISTINCT p.pk_host)::int AS hosts
        FROM layer_limit ll JOIN proc p ON p.pk_layer = ll.pk_layer
        WHERE ll.pk_limit_record = r.pk_limit_record
    ) c"""

# The SQL a reader uses to see every limit's use from proc (the audit, the recompute, the reseed).
LIMIT_USE_SQL = f"""
SELECT r.pk_limit_record, r.str_name, r.int_max_value, r.b_host_limit, r.int_running,
       CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END AS counted, c.frames,
       {limit_max_sql("r.int_max_value")} AS max_read
FROM limit_record r {COUNT_LATERAL}
"""

_DECLARE = [("v_limits", "text[]"), ("v_message", "text"), *LOCK_DECLARE]


_MAX_U = limit_max_sql("u.int_max_value")
_MAX_NEW = limit_max_sql("NEW.int_max_value")


def _recount(grow: bool) -> str:
    """Lock the limits in v_limits, recount them from proc, refuse a count that rose above max."""
    check = ""
    if grow:
        check = f"""
    IF v_message IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = 'check_violation',
            CONSTRAINT = '{LIMIT_MAX_CONSTRAINT}',
            HINT = 'Raise the limit''s int_max_value, or wait for frames of the limit to finish.';
    END IF;"""
    return f"""
    PERFORM 1 FROM limit_record r WHERE r.pk_limit_record = ANY(v_limits)
    ORDER BY r.pk_limit_record FOR UPDATE;
    WITH c AS (
        SELECT r.pk_limit_record, r.int_running AS old_running,
               CASE WHEN r.b_host_limit THEN c.hosts ELSE c.frames END AS counted, c.frames
        FROM limit_record r {COUNT_LATERAL}
        WHERE r.pk_limit_record = ANY(v_limits)
    ),
    u AS (
        UPDATE limit_record t SET int_running = c.counted, int_frames = c.frames
        FROM c WHERE t.pk_limit_record = c.pk_limit_record
        RETURNING t.pk_limit_record, t.str_name, t.int_max_value, t.b_host_limit, t.int_running, c.old_running
    )
    SELECT format('limit %s is full: running=%s max=%s (%s%s)', u.str_name, u.int_running,
                  COALESCE(u.int_max_value::text, 'NULL'), CASE WHEN u.b_host_limit THEN 'hosts' ELSE 'frames' END,
                  {LIMIT_MAX_NOTE_SQL.format(col="u.int_max_value")})
    INTO v_message FROM u
    WHERE {_MAX_U} >= 0 AND u.int_running > u.old_running AND u.int_running > {_MAX_U}
    ORDER BY u.pk_limit_record LIMIT 1;
    {check}"""


# After a TRUNCATE of proc or layer_limit every limit's use is recounted (to what is left: 0 for
# proc); the statement names no rows to narrow it to.
_RECOUNT_EVERY_LIMIT = f"""
    SELECT array_agg(pk_limit_record) INTO v_limits FROM limit_record;
    IF v_limits IS NULL THEN
        RETURN NULL;
    END IF;
    {_recount(False)}
    RETURN NULL;
"""


# A proc whose layer this statement cannot see (written before its layer, foreign keys being
# deferred) would be counted by no limit the layer gets with it: refused, as a proc written
# before its host, job or show is.
_PROC_LAYER_VISIBLE = """
    IF EXISTS (SELECT 1 FROM new_procs n WHERE NOT EXISTS (SELECT 1 FROM layer l WHERE l.pk_layer = n.pk_layer)) THEN
        RAISE EXCEPTION USING
            MESSAGE = 'cuesched: a proc was written before its layer',
            HINT = 'Write the layer (and its layer_limit rows) first: a licence limit counts the procs of its layers.',
            ERRCODE = 'foreign_key_violation';
    END IF;"""


def _proc_func(layers: str, *, grow: bool, changed: str = "", check_layers: bool = False) -> str:
    early = ""
    if changed:
        early = f"""
    IF NOT EXISTS ({changed}) THEN
        RETURN NULL;
    END IF;"""
    if check_layers:
        early += _PROC_LAYER_VISIBLE
    return f"""
    {early}
    {lock_keys_of(f"({layers})", tables=("layer",))}
    {EPOCH_GUARD}
    SELECT array_agg(DISTINCT ll.pk_limit_record) INTO v_limits
    FROM ({layers}) x JOIN layer_limit ll ON ll.pk_layer = x.pk_layer;
    IF v_limits IS NULL THEN
        RETURN NULL;
    END IF;
    {_recount(grow)}
    RETURN NULL;
"""


_PROC_MOVED = (
    "SELECT 1 FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc "
    "WHERE n.pk_layer IS DISTINCT FROM o.pk_layer OR n.pk_host IS DISTINCT FROM o.pk_host"
)


def proc_licence_triggers() -> list[pgtrigger.Trigger]:
    """The proc side: every statement that starts, ends or moves a frame of a limited layer."""
    return [
        DefinerTrigger(
            name="acct_licence_insert",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_procs"),
            declare=_DECLARE,
            func=_proc_func("SELECT DISTINCT pk_layer FROM new_procs", grow=True, check_layers=True),
        ),
        DefinerTrigger(
            name="acct_licence_delete",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_procs"),
            declare=_DECLARE,
            func=_proc_func("SELECT DISTINCT pk_layer FROM old_procs", grow=False),
        ),
        DefinerTrigger(
            name="acct_licence_update",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_procs", new="new_procs"),
            declare=_DECLARE,
            func=_proc_func(
                "SELECT pk_layer FROM new_procs UNION SELECT pk_layer FROM old_procs",
                grow=True,
                changed=_PROC_MOVED,
                check_layers=True,
            ),
        ),
        DefinerTrigger(
            name="acct_licence_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            declare=_DECLARE,
            func=_RECOUNT_EVERY_LIMIT,
        ),
    ]


# The layers this transaction inserted, recorded by an AFTER INSERT trigger on layer (a row's
# xmin is no such record: any UPDATE of the row in the transaction sets it too). A client can
# set it as it can set the other markers (the trust boundary of docs/concepts.md).
LAYERS_CREATED = "cuesched.layers_created"


def layer_created_triggers() -> list[pgtrigger.Trigger]:
    """Record the layers this transaction inserts (see _NEEDS_KEYS_LOCK)."""
    return [
        DefinerTrigger(
            name="acct_layer_created",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_rows"),
            func=f"""
    PERFORM set_config('{LAYERS_CREATED}', concat_ws(',', NULLIF(current_setting('{LAYERS_CREATED}', true), ''),
                       (SELECT string_agg(pk_layer, ',') FROM new_rows)), true);
    RETURN NULL;
""",
        )
    ]


# A layer created by this very transaction cannot have a proc anywhere (a proc's layer must be
# visible to its writer, see _PROC_LAYER_VISIBLE): a submission tagging its new layers skips
# the layer's lock. A row whose layer is missing (deferred foreign key) takes it (and finds no row).
_NEEDS_KEYS_LOCK = (
    "SELECT 1 FROM new_rows n WHERE NOT n.pk_layer = ANY("
    f"string_to_array(COALESCE(current_setting('{LAYERS_CREATED}', true), ''), ','))"
)


def layer_limit_triggers() -> list[pgtrigger.Trigger]:
    """A limit put on, moved between or taken off layers: the frames they run are (un)counted."""
    insert = f"""
    IF EXISTS ({_NEEDS_KEYS_LOCK}) THEN
        IF NOT {READ_COMMITTED} THEN
            RAISE EXCEPTION USING
                MESSAGE = format('cuesched: putting a limit on an existing layer must run at READ COMMITTED, not %s',
                                 current_setting('transaction_isolation')),
                ERRCODE = 'feature_not_supported';
        END IF;
        {lock_for_move("layer", "SELECT n.pk_layer FROM new_rows n", "putting a limit on an existing layer")}
        {EPOCH_BUMP}
    END IF;
    SELECT array_agg(DISTINCT pk_limit_record) INTO v_limits FROM ({{rows}}) x;
    IF v_limits IS NULL THEN
        RETURN NULL;
    END IF;
    {_recount(True)}
    RETURN NULL;
"""
    delete = f"""
    SELECT array_agg(DISTINCT pk_limit_record) INTO v_limits FROM old_rows;
    IF v_limits IS NULL THEN
        RETURN NULL;
    END IF;
    {_recount(False)}
    RETURN NULL;
"""
    return [
        DefinerTrigger(
            name="acct_layer_limit_insert",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_rows"),
            declare=_DECLARE,
            func=insert.replace("{rows}", "SELECT pk_limit_record FROM new_rows"),
        ),
        DefinerTrigger(
            name="acct_layer_limit_update",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows", new="new_rows"),
            declare=_DECLARE,
            func=insert.replace(
                "{rows}", "SELECT pk_limit_record FROM new_rows UNION SELECT pk_limit_record FROM old_rows"
            ),
        ),
        DefinerTrigger(
            name="acct_layer_limit_delete",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows"),
            declare=_DECLARE,
            func=delete,
        ),
        DefinerTrigger(
            name="acct_layer_limit_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            declare=_DECLARE,
            func=_RECOUNT_EVERY_LIMIT,
        ),
    ]


def _payload(row: str) -> str:
    return (
        f"'{{\"id\":' || {json_id(row + '.pk_limit_record')}"
        f" || ',\"name\":' || {json_id(row + '.str_name')}"
        f" || ',\"max\":' || {limit_max_sql(row + '.int_max_value')}"
        f" || ',\"host\":' || CASE WHEN {row}.b_host_limit THEN 'true' ELSE 'false' END"
        f" || ',\"running\":' || {row}.int_running"
        "|| ',\"xid\":' || v_xid || ',\"seq\":' || v_seq || '}'"
    )


def _removed_payload() -> str:
    return (
        f"'{{\"id\":' || {json_id('OLD.pk_limit_record')} || ',\"removed\":true'"
        "|| ',\"xid\":' || v_xid || ',\"seq\":' || v_seq || '}'"
    )


def limit_record_triggers() -> list[pgtrigger.Trigger]:
    """Every change of a limit row reaches the Store; only the triggers write its use."""
    declare = [("v_xid", "bigint"), ("v_seq", "bigint")]
    return [
        DefinerTrigger(
            name="acct_licence_seed",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert,
            level=pgtrigger.Row,
            func=f"""
    -- Usually on no layer yet (0), but with deferred foreign keys layer_limit rows may name it
    -- already, or it is inserted again with the id of a row deleted in this transaction: count
    -- what those layers run, whatever the INSERT said, and refuse a count over its max. The
    -- layer_limit rows were written under their own lock, so no running frame is missed.
    SELECT CASE WHEN NEW.b_host_limit THEN c.hosts ELSE c.frames END, c.frames
    INTO NEW.int_running, NEW.int_frames
    FROM (SELECT NEW.pk_limit_record AS pk_limit_record) r {COUNT_LATERAL};
    IF {_MAX_NEW} >= 0 AND NEW.int_running > {_MAX_NEW} THEN
        RAISE EXCEPTION USING
            MESSAGE = format('limit %s is full: running=%s max=%s (%s%s)', NEW.str_name, NEW.int_running,
                             COALESCE(NEW.int_max_value::text, 'NULL'),
                             CASE WHEN NEW.b_host_limit THEN 'hosts' ELSE 'frames' END,
                             {LIMIT_MAX_NOTE_SQL.format(col="NEW.int_max_value")}),
            ERRCODE = 'check_violation', CONSTRAINT = '{LIMIT_MAX_CONSTRAINT}';
    END IF;
    RETURN NEW;
""",
        ),
        # The use is written only from inside the licence triggers' SECURITY DEFINER functions
        # (written_by_triggers: a session's own TEMP trigger, at depth 1, does not pass). Named to
        # fire before acct_licence_guard, so it reads the client's NEW, not the guard's recount.
        DefinerTrigger(
            name="acct_licence_counted",
            when=pgtrigger.Before,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(
                f"NOT {written_by_triggers('limit_record')} "
                "AND (NEW.int_running IS DISTINCT FROM OLD.int_running "
                "OR NEW.int_frames IS DISTINCT FROM OLD.int_frames)"
            ),
            func="""
    RAISE EXCEPTION USING
        MESSAGE = 'cuesched: limit_record.int_running and int_frames are counted from proc by the triggers',
        HINT = 'Change int_max_value or b_host_limit; the use follows the running frames.',
        ERRCODE = 'check_violation', CONSTRAINT = 'acct_limit_use_written_by_triggers';
""",
        ),
        DefinerTrigger(
            name="acct_licence_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            func=f"""
    IF NEW.b_host_limit IS DISTINCT FROM OLD.b_host_limit THEN
        -- The count changes meaning: recount it (this UPDATE holds the row's lock).
        SELECT CASE WHEN NEW.b_host_limit THEN c.hosts ELSE c.frames END, c.frames
        INTO NEW.int_running, NEW.int_frames
        FROM (SELECT NEW.pk_limit_record AS pk_limit_record) r {COUNT_LATERAL};
    END IF;
    IF NEW.pk_limit_record IS DISTINCT FROM OLD.pk_limit_record THEN
        RAISE EXCEPTION USING MESSAGE = 'cuesched: a limit keeps its id', ERRCODE = 'check_violation',
            CONSTRAINT = 'acct_limit_keeps_id';
    END IF;
    RETURN NEW;
""",
        ),
        DefinerTrigger(
            name="acct_licence_notify",
            when=pgtrigger.After,
            operation=pgtrigger.Insert | pgtrigger.Update,
            level=pgtrigger.Row,
            declare=declare,
            func=f"""
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM {EMIT_FUNCTION}('{LICENCE_CHANNEL}', {_payload("NEW")});
    RETURN NULL;
""",
        ),
        DefinerTrigger(
            name="acct_licence_removed",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Row,
            declare=declare,
            func=f"""
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM {EMIT_FUNCTION}('{LICENCE_CHANNEL}', {_removed_payload()});
    RETURN NULL;
""",
        ),
        DefinerTrigger(
            name="acct_licence_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            func=f"""
    PERFORM {EMIT_FUNCTION}('{RESYNC_CHANNEL}', '{{"table":"limit_record","xid":' || {CURRENT_XID} || '}}');
    RETURN NULL;
""",
        ),
    ]
