"""Every accounting trigger, and the SQL it runs.

In OpenCue, Cuebot's DAOs send these signals; here PostgreSQL does, so every writer (our own
completion path, the admin, a script, a Cuebot sharing the database) produces them. The
triggers are attached in the farm models' `Meta.triggers` and installed by `migrate`.

What runs where (all AFTER ... FOR EACH STATEMENT with transition tables):

| table | event | trigger | does |
|---|---|---|---|
| proc | DELETE | acct_release | `acct_release` per (show, alloc, folder, job, layer, dept), managed shows |
| proc | INSERT, DELETE, UPDATE | acct_db_insert/delete/update | unmanaged shows: keep the five tables, enforce caps |
| subscription | INSERT, UPDATE | acct_limit_sub_insert/update | `acct_limit_change` vertex sub |
| folder_resource | INSERT, UPDATE | acct_limit_folder_insert/update | `acct_limit_change` vertex folder |
| job_resource | INSERT, UPDATE | acct_limit_job_insert/update | `acct_limit_change` vertex job |
| show | UPDATE | acct_show_flip | a flip waits for in-flight proc writes; to unmanaged: rewrite from SUM(proc) |
| cuesched_accounting_settings | DELETE | acct_settings_keep_row | the kill-switch row cannot be deleted |

Per-row against statement-level release (`manage.py bench_triggers`: 10,000 procs of one managed
show in 20 layers, DELETE + COMMIT, medians; ranges over three sessions on the shared 2-core dev
machine under a load of 2.5-4 from other work, so read them as ratios):

| release trigger | one DELETE of 10,000 procs | 10,000 single-row DELETEs, one transaction |
|---|---|---|
| statement-level, transition table (kept) | 98-112 ms, 20 messages | 0.96-2.8 s, 10,000 messages |
| per-row | 290-660 ms, 10,000 messages | 0.63-1.4 s, 10,000 messages |
| no triggers at all | 35-89 ms | 0.14-0.32 s |

Statement-level is 3-6x cheaper on a bulk delete and sends one aggregated message per key instead
of one per proc (the listener applies 20 deltas, not 10,000). Per-row is ~30-40 us cheaper per
single-row statement (fewer, simpler queries than a transition-table aggregate); against the
COMMIT of a one-proc completion transaction that difference is noise, so statement-level is kept.
The COMMIT that queues 10,000 notifications costs ~8 ms either way.

The database-enforced path of an unmanaged show costs about the same as a release on a bulk
delete (~100 ms), but 10,000 single-row statements in ONE transaction take 30-45 s: every
statement updates the same five counter rows, and row versions written by a still-open
transaction cannot be pruned, so each update walks all earlier ones (quadratic; Cuebot's legacy
path has the same shape). Write such changes as one statement, or one transaction per proc.

Concurrency with a managed flip: every proc trigger first takes a shared transaction-level
advisory lock per show of its rows, and only then reads `b_scheduler_managed` (a new statement,
hence a new snapshot under READ COMMITTED); the flip trigger takes the same locks exclusively
before it reads SUM(proc). A flip therefore waits for in-flight proc writes of the show to commit,
and proc writes that start after it wait for the flip; no proc is counted by both paths or by
neither.

Concurrent writers of one unmanaged show: the database-enforced triggers then also take an
exclusive lock per show (`LOCK_DB_SHOWS`) before they touch a counter row, so bookings and
releases of the show apply one transaction at a time instead of deadlocking on the shared
subscription, folder and point rows.
"""

from __future__ import annotations

import pgtrigger

from accounting.notify import LIMIT_CHANNEL, NOTIFY_SEQ_SETTING, RELEASE_CHANNEL, SUPPRESS_RELEASE_SETTING

SETTINGS_TABLE = "cuesched_accounting_settings"
CORE_MULTIPLIER = 100  # centicores per core, as Cuebot's CENTICORES_PER_CORE

# --- SQL expressions shared by the trigger bodies ---------------------------------------------

# The kill switch. A missing row reads as on: a notification is only a hint, an extra one is safe.
NOTIFY_ENABLED = f"COALESCE((SELECT notify_enabled FROM {SETTINGS_TABLE} WHERE id = 1), true)"
RELEASE_SUPPRESSED = f"COALESCE(current_setting('{SUPPRESS_RELEASE_SETTING}', true), '') = 'on'"
CURRENT_XID = "pg_current_xact_id()::text::bigint"
# Next value of the transaction-local payload counter (reset by COMMIT / ROLLBACK).
NEXT_SEQ = (
    f"set_config('{NOTIFY_SEQ_SETTING}', "
    f"(COALESCE(NULLIF(current_setting('{NOTIFY_SEQ_SETTING}', true), ''), '0')::bigint + 1)::text, "
    "true)::bigint"
)


def json_id(expr: str) -> str:
    """A text id as a JSON string; to_json escapes, so an odd id cannot break the payload."""
    return f"to_json({expr})::text"


def cores_from_centicores(expr: str) -> str:
    """Integer division truncating toward zero, as Java and Rust (-250 -> -2)."""
    return f"(({expr})::bigint / {CORE_MULTIPLIER})"


def cores_cap(expr: str) -> str:
    """Folder/job max cores: any negative value is the unlimited sentinel -1."""
    return f"(CASE WHEN ({expr}) < 0 THEN -1 ELSE ({expr})::bigint / {CORE_MULTIPLIER} END)"


def _tail() -> str:
    return "',\"xid\":' || v_xid || ',\"seq\":' || v_seq || '}'"


# --- acct_release --------------------------------------------------------------------------

# One row per key of the statement's deleted, non-local procs of managed shows.
RELEASE_GROUPS = """
    SELECT o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept,
           SUM(o.int_cores_reserved)::bigint AS centicores, SUM(o.int_gpus_reserved)::bigint AS gpus
    FROM old_procs o
    JOIN show s ON s.pk_show = o.pk_show AND s.b_scheduler_managed
    JOIN host h ON h.pk_host = o.pk_host
    JOIN job j ON j.pk_job = o.pk_job
    WHERE NOT o.b_local
    GROUP BY o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept
    ORDER BY o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept
"""

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
    + cores_from_centicores("-g.centicores")
    + " || ',\"gpus\":' || (-g.gpus) || "
    + _tail()
)

# Orders proc writes and managed flips of a show (see the module docstring): proc triggers take
# a shared transaction-level advisory lock per show, the flip an exclusive one. Advisory locks
# live in the lock table only: no tuple lock, no WAL, no MultiXact on the hot show row.
# Two-int4 key space (classid 'acct'), separate from the single-bigint keys used elsewhere.
SHOW_LOCK_CLASS = 0x61636374
LOCK_SHOWS = (
    f"PERFORM pg_advisory_xact_lock_shared({SHOW_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(d.pk_show) AS k FROM {rows} d ORDER BY 1) x;"
)
LOCK_SHOWS_EXCLUSIVE = (
    f"PERFORM pg_advisory_xact_lock({SHOW_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(d.pk_show) AS k FROM {rows} d ORDER BY 1) x;"
)
# The same shared lock from a client, for the shows in %(shows)s: a writer that must see the
# managed flag no flip can change under it (the dispatcher's batch, the recompute's display
# write). Run it as its own statement, so the next one's snapshot starts after any flip it
# waited for.
LOCK_SHOWS_SQL = (
    f"SELECT pg_advisory_xact_lock_shared({SHOW_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(s) AS k FROM unnest(%(shows)s::text[]) AS s ORDER BY 1) AS x"
)
# Database-enforced accounting of a show is one writer at a time: an exclusive lock per
# unmanaged show (its own key space, 'acdb'), taken in show order before any counter row.
# Concurrent bookers and releasers of one show update the same subscription, folder and point
# rows in whatever order their statements' plans reach them; without this they deadlocked
# (measured: 4 deadlocks, each a 1 s deadlock_timeout stall, in one 6,000-frame drain with two
# dispatch workers). Writers of one show that share a subscription, folder or department
# already queued on those rows; the cost is that writers of different allocations, folders and
# departments of one show now queue too, for the rest of their transactions.
DB_ACCOUNTING_LOCK_CLASS = 0x61636462
LOCK_DB_SHOWS = (
    f"PERFORM pg_advisory_xact_lock({DB_ACCOUNTING_LOCK_CLASS}, x.k) "
    "FROM (SELECT DISTINCT hashtext(d.pk_show) AS k FROM {rows} d "
    "JOIN show s ON s.pk_show = d.pk_show AND NOT s.b_scheduler_managed ORDER BY 1) x;"
)

RELEASE_FUNC = f"""
    IF {RELEASE_SUPPRESSED} OR NOT {NOTIFY_ENABLED} THEN
        RETURN NULL;
    END IF;
    {LOCK_SHOWS.format(rows="old_procs")}
    IF NOT EXISTS (
        SELECT 1 FROM old_procs o JOIN show s ON s.pk_show = o.pk_show AND s.b_scheduler_managed
        WHERE NOT o.b_local
    ) THEN
        RETURN NULL;
    END IF;
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM pg_notify('{RELEASE_CHANNEL}', {RELEASE_PAYLOAD}) FROM ({RELEASE_GROUPS}) g;
    RETURN NULL;
"""

# The per-row variant, kept only so that bench_triggers can measure it against the one above.
RELEASE_ROW_FUNC = f"""
    IF OLD.b_local OR {RELEASE_SUPPRESSED} OR NOT {NOTIFY_ENABLED} THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared({SHOW_LOCK_CLASS}, hashtext(OLD.pk_show));
    SELECT s.b_scheduler_managed INTO v_managed FROM show s WHERE s.pk_show = OLD.pk_show;
    IF NOT COALESCE(v_managed, false) THEN
        RETURN NULL;
    END IF;
    SELECT h.pk_alloc INTO v_alloc FROM host h WHERE h.pk_host = OLD.pk_host;
    SELECT j.pk_folder, j.pk_dept INTO v_folder, v_dept FROM job j WHERE j.pk_job = OLD.pk_job;
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM pg_notify('{RELEASE_CHANNEL}', {
    RELEASE_PAYLOAD.replace("g.pk_show", "OLD.pk_show")
    .replace("g.pk_alloc", "v_alloc")
    .replace("g.pk_folder", "v_folder")
    .replace("g.pk_job", "OLD.pk_job")
    .replace("g.pk_layer", "OLD.pk_layer")
    .replace("g.pk_dept", "v_dept")
    .replace("g.centicores", "OLD.int_cores_reserved")
    .replace("g.gpus", "OLD.int_gpus_reserved")
});
    RETURN NULL;
"""


def release_trigger() -> pgtrigger.Trigger:
    return pgtrigger.Trigger(
        name="acct_release",
        when=pgtrigger.After,
        operation=pgtrigger.Delete,
        level=pgtrigger.Statement,
        referencing=pgtrigger.Referencing(old="old_procs"),
        declare=[("v_xid", "bigint"), ("v_seq", "bigint")],
        func=RELEASE_FUNC,
    )


def release_row_trigger() -> pgtrigger.Trigger:
    """Not installed by any model: the alternative that bench_triggers measures."""
    return pgtrigger.Trigger(
        name="acct_release_row",
        when=pgtrigger.After,
        operation=pgtrigger.Delete,
        level=pgtrigger.Row,
        declare=[
            ("v_managed", "boolean"),
            ("v_alloc", "text"),
            ("v_folder", "text"),
            ("v_dept", "text"),
            ("v_xid", "bigint"),
            ("v_seq", "bigint"),
        ],
        func=RELEASE_ROW_FUNC,
    )


# --- database-enforced accounting (shows with b_scheduler_managed = false) -----------------

# Signed per-proc deltas (pk_show, pk_host, pk_job, pk_layer, cc, g) of non-local procs.
DB_INSERT_DELTAS = """
    SELECT n.pk_show, n.pk_host, n.pk_job, n.pk_layer,
           n.int_cores_reserved::bigint AS cc, n.int_gpus_reserved::bigint AS g
    FROM new_procs n WHERE NOT n.b_local
"""
DB_DELETE_DELTAS = """
    SELECT o.pk_show, o.pk_host, o.pk_job, o.pk_layer,
           -o.int_cores_reserved::bigint AS cc, -o.int_gpus_reserved::bigint AS g
    FROM old_procs o WHERE NOT o.b_local
"""
# A changed proc counts as its old row removed and its new row added; this also covers a proc
# moved to another host (allocation), job or layer, or turned local.
_PROC_CHANGED = """
    ROW(o.pk_show, o.pk_host, o.pk_job, o.pk_layer, o.b_local, o.int_cores_reserved, o.int_gpus_reserved)
    IS DISTINCT FROM
    ROW(n.pk_show, n.pk_host, n.pk_job, n.pk_layer, n.b_local, n.int_cores_reserved, n.int_gpus_reserved)
"""
DB_UPDATE_DELTAS = f"""
    SELECT n.pk_show, n.pk_host, n.pk_job, n.pk_layer,
           n.int_cores_reserved::bigint AS cc, n.int_gpus_reserved::bigint AS g
    FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc
    WHERE NOT n.b_local AND {_PROC_CHANGED}
    UNION ALL
    SELECT o.pk_show, o.pk_host, o.pk_job, o.pk_layer,
           -o.int_cores_reserved::bigint AS cc, -o.int_gpus_reserved::bigint AS g
    FROM old_procs o JOIN new_procs n ON n.pk_proc = o.pk_proc
    WHERE NOT o.b_local AND {_PROC_CHANGED}
"""

# Constraint names carried by the errors (psycopg: exc.diag.constraint_name), so a caller can
# tell a cap rejection from any other failure without parsing the message.
CAP_SUBSCRIPTION_MISSING = "acct_subscription_missing"
CAP_SUBSCRIPTION_BURST = "acct_subscription_burst"
CAP_FOLDER_MAX_CORES = "acct_folder_max_cores"
CAP_JOB_MAX_CORES = "acct_job_max_cores"
CAP_FOLDER_MAX_GPUS = "acct_folder_max_gpus"
CAP_JOB_MAX_GPUS = "acct_job_max_gpus"
CAP_CONSTRAINTS = frozenset(
    {
        CAP_SUBSCRIPTION_MISSING,
        CAP_SUBSCRIPTION_BURST,
        CAP_FOLDER_MAX_CORES,
        CAP_JOB_MAX_CORES,
        CAP_FOLDER_MAX_GPUS,
        CAP_JOB_MAX_GPUS,
    }
)

# Applies the aggregated deltas to the five tables and returns the first cap violation, if any.
# Every UPDATE ... RETURNING locks the rows it changes, so concurrent bookers of one subscription,
# folder or job queue up and each checks the values it wrote itself. Only keys whose delta is
# positive are checked: a release always succeeds, even above a cap lowered meanwhile. The order
# is the Store's: subscription, folder cores, job cores, folder GPUs, job GPUs.
DB_APPLY = """
    WITH delta AS (
        SELECT d.pk_show, h.pk_alloc, j.pk_folder, d.pk_job, d.pk_layer, j.pk_dept, d.cc, d.g
        FROM ({deltas}) d
        JOIN show s ON s.pk_show = d.pk_show AND NOT s.b_scheduler_managed
        JOIN host h ON h.pk_host = d.pk_host
        JOIN job j ON j.pk_job = d.pk_job
    ),
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
        SELECT 1 AS ord, '{missing}' AS con, format(
            'no subscription for show=%s alloc=%s: cannot book %s centicores',
            d.pk_show, d.pk_alloc, d.cc) AS msg
        FROM sub_d d
        WHERE d.cc > 0 AND NOT EXISTS (
            SELECT 1 FROM sub_u u WHERE u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc)
        UNION ALL
        SELECT 2, '{burst}', format(
            'subscription has exceeded burst size: show=%s alloc=%s cores=%s burst=%s (centicores)',
            u.pk_show, u.pk_alloc, u.int_cores, u.int_burst)
        FROM sub_d d JOIN sub_u u ON u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc
        WHERE d.cc > 0 AND u.int_cores > u.int_burst
        UNION ALL
        SELECT 3, '{folder_cores}', format(
            'folder has exceeded max cores: folder=%s cores=%s max_cores=%s (centicores)',
            u.pk_folder, u.int_cores, u.int_max_cores)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.cc > 0 AND u.int_max_cores > 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 4, '{job_cores}', format(
            'job has exceeded max cores: job=%s cores=%s max_cores=%s (centicores)',
            u.pk_job, u.int_cores, u.int_max_cores)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.cc > 0 AND u.int_max_cores > 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 5, '{folder_gpus}', format(
            'folder has exceeded max GPUs: folder=%s gpus=%s max_gpus=%s',
            u.pk_folder, u.int_gpus, u.int_max_gpus)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.g > 0 AND u.int_max_gpus > 0 AND u.int_gpus > u.int_max_gpus
        UNION ALL
        SELECT 6, '{job_gpus}', format(
            'job has exceeded max GPUs: job=%s gpus=%s max_gpus=%s',
            u.pk_job, u.int_gpus, u.int_max_gpus)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.g > 0 AND u.int_max_gpus > 0 AND u.int_gpus > u.int_max_gpus
    ) v
    ORDER BY v.ord, v.msg
    LIMIT 1;
"""


def db_accounting_func(deltas: str) -> str:
    """The body of one proc accounting trigger, for a delta query over its transition tables."""
    apply_sql = DB_APPLY.format(
        deltas=deltas,
        missing=CAP_SUBSCRIPTION_MISSING,
        burst=CAP_SUBSCRIPTION_BURST,
        folder_cores=CAP_FOLDER_MAX_CORES,
        job_cores=CAP_JOB_MAX_CORES,
        folder_gpus=CAP_FOLDER_MAX_GPUS,
        job_gpus=CAP_JOB_MAX_GPUS,
    )
    # Lock first, then read the flag (a fresh snapshot): see the module docstring. The early exit
    # keeps statements that touch only managed shows, or no reservation at all, cheap.
    return f"""
    {LOCK_SHOWS.format(rows=f"({deltas})")}
    IF NOT EXISTS (
        SELECT 1 FROM ({deltas}) d JOIN show s ON s.pk_show = d.pk_show AND NOT s.b_scheduler_managed
    ) THEN
        RETURN NULL;
    END IF;
    {LOCK_DB_SHOWS.format(rows=f"({deltas})")}
    {apply_sql}
    IF v_message IS NOT NULL THEN
        RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = 'check_violation', CONSTRAINT = v_constraint;
    END IF;
    RETURN NULL;
"""


def _db_trigger(name: str, operation: pgtrigger.Operation, deltas: str) -> pgtrigger.Trigger:
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
        declare=[("v_constraint", "text"), ("v_message", "text")],
        func=db_accounting_func(deltas),
    )


def proc_triggers() -> list[pgtrigger.Trigger]:
    return [
        release_trigger(),
        _db_trigger("acct_db_insert", pgtrigger.Insert, DB_INSERT_DELTAS),
        _db_trigger("acct_db_delete", pgtrigger.Delete, DB_DELETE_DELTAS),
        _db_trigger("acct_db_update", pgtrigger.Update, DB_UPDATE_DELTAS),
    ]


# --- acct_limit_change ---------------------------------------------------------------------

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


def cap_payload(vertex: str, id_column: str, cores_field: str, gpus_field: str) -> str:
    """Payload with `max_cores` only if `cores_field` is true, `max_gpus` only if `gpus_field` is."""
    return (
        f'\'{{"vertex":"{vertex}","id":\' || {json_id("n." + id_column)}'
        f" || CASE WHEN {cores_field} THEN ',\"max_cores\":' || {cores_cap('n.int_max_cores')} ELSE '' END"
        f" || CASE WHEN {gpus_field} THEN ',\"max_gpus\":' || n.int_max_gpus ELSE '' END"
        f" || {_tail()}"
    )


_CORES_CHANGED = "n.int_max_cores IS DISTINCT FROM o.int_max_cores"
_GPUS_CHANGED = "n.int_max_gpus IS DISTINCT FROM o.int_max_gpus"

# (table, pk, join to the show, changed, payload for update, payload for insert, order)
_SUB = {
    "pk": "pk_subscription",
    "show_join": "JOIN show s ON s.pk_show = n.pk_show AND s.b_scheduler_managed",
    "changed": "n.int_burst IS DISTINCT FROM o.int_burst",
    "update_payload": SUB_PAYLOAD,
    "insert_payload": SUB_PAYLOAD,
    "order": "n.pk_show, n.pk_alloc",
}
_FOLDER = {
    "pk": "pk_folder_resource",
    "show_join": (
        "JOIN folder f ON f.pk_folder = n.pk_folder JOIN show s ON s.pk_show = f.pk_show AND s.b_scheduler_managed"
    ),
    "changed": f"({_CORES_CHANGED} OR {_GPUS_CHANGED})",
    "update_payload": cap_payload("folder", "pk_folder", _CORES_CHANGED, _GPUS_CHANGED),
    "insert_payload": cap_payload("folder", "pk_folder", "true", "true"),
    "order": "n.pk_folder",
}
_JOB = {
    "pk": "pk_job_resource",
    "show_join": ("JOIN job j ON j.pk_job = n.pk_job JOIN show s ON s.pk_show = j.pk_show AND s.b_scheduler_managed"),
    "changed": f"({_CORES_CHANGED} OR {_GPUS_CHANGED})",
    "update_payload": cap_payload("job", "pk_job", _CORES_CHANGED, _GPUS_CHANGED),
    "insert_payload": cap_payload("job", "pk_job", "true", "true"),
    "order": "n.pk_job",
}


def limit_update_func(spec: dict[str, str]) -> str:
    """Cap UPDATE: cheap exit first, since the booking path updates int_cores of these rows."""
    changed_rows = f"FROM new_rows n JOIN old_rows o ON o.{spec['pk']} = n.{spec['pk']} WHERE {spec['changed']}"
    return f"""
    IF NOT EXISTS (SELECT 1 {changed_rows}) OR NOT {NOTIFY_ENABLED} THEN
        RETURN NULL;
    END IF;
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM pg_notify('{LIMIT_CHANNEL}', p.payload) FROM (
        SELECT {spec["update_payload"]} AS payload
        FROM new_rows n JOIN old_rows o ON o.{spec["pk"]} = n.{spec["pk"]}
        {spec["show_join"]}
        WHERE {spec["changed"]}
        ORDER BY {spec["order"]}
    ) p;
    RETURN NULL;
"""


def limit_insert_func(spec: dict[str, str]) -> str:
    return f"""
    IF NOT {NOTIFY_ENABLED} THEN
        RETURN NULL;
    END IF;
    v_xid := {CURRENT_XID};
    v_seq := {NEXT_SEQ};
    PERFORM pg_notify('{LIMIT_CHANNEL}', p.payload) FROM (
        SELECT {spec["insert_payload"]} AS payload
        FROM new_rows n {spec["show_join"]}
        ORDER BY {spec["order"]}
    ) p;
    RETURN NULL;
"""


def _limit_triggers(vertex: str, spec: dict[str, str]) -> list[pgtrigger.Trigger]:
    declare = [("v_xid", "bigint"), ("v_seq", "bigint")]
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
    ]


def subscription_triggers() -> list[pgtrigger.Trigger]:
    return _limit_triggers("sub", _SUB)


def folder_resource_triggers() -> list[pgtrigger.Trigger]:
    return _limit_triggers("folder", _FOLDER)


def job_resource_triggers() -> list[pgtrigger.Trigger]:
    return _limit_triggers("job", _JOB)


# --- managed flips -------------------------------------------------------------

# The scheduler's recompute kept the five tables of a managed show only approximately (and not
# at all for FINISHED jobs); the database-enforced path adds and subtracts from them from now on,
# so they are rewritten to the truth, SUM(proc) of non-local procs, in the flipping transaction.
# Caps are not checked: a flip must succeed even if the show is over a cap right now.
_FLIPPED = """
    (SELECT n.pk_show FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
     WHERE o.b_scheduler_managed AND NOT n.b_scheduler_managed)
"""
_ANY_FLIP = """
    (SELECT n.pk_show FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
     WHERE o.b_scheduler_managed IS DISTINCT FROM n.b_scheduler_managed)
"""
SHOW_FLIP_FUNC = f"""
    IF NOT EXISTS {_ANY_FLIP} THEN
        RETURN NULL;
    END IF;
    -- Both directions wait for proc writes of these shows that read the old flag, and later
    -- ones wait for our commit. To managed: the scheduler's managed-flip seed then reads
    -- SUM(proc) after every database-enforced booking of the show has committed, so none is
    -- missed. To unmanaged: the rewrite below counts every proc the Store enforced.
    {LOCK_SHOWS_EXCLUSIVE.format(rows=_ANY_FLIP)}
    IF NOT EXISTS {_FLIPPED} THEN
        RETURN NULL;
    END IF;
    WITH flipped AS (
        SELECT n.pk_show FROM new_rows n JOIN old_rows o ON o.pk_show = n.pk_show
        WHERE o.b_scheduler_managed AND NOT n.b_scheduler_managed
    ),
    live AS (
        SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
               p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
        FROM proc p
        JOIN host h ON h.pk_host = p.pk_host
        JOIN job j ON j.pk_job = p.pk_job
        WHERE NOT p.b_local AND p.pk_show IN (SELECT pk_show FROM flipped)
    ),
    sub_u AS (
        UPDATE subscription t SET int_cores = x.cc, int_gpus = x.g
        FROM (
            SELECT s.pk_subscription, COALESCE(SUM(l.cc), 0)::int AS cc, COALESCE(SUM(l.g), 0)::int AS g
            FROM subscription s
            LEFT JOIN live l ON l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc
            WHERE s.pk_show IN (SELECT pk_show FROM flipped)
            GROUP BY s.pk_subscription
        ) x
        WHERE t.pk_subscription = x.pk_subscription AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
    ),
    folder_u AS (
        UPDATE folder_resource t SET int_cores = x.cc, int_gpus = x.g
        FROM (
            SELECT fr.pk_folder, COALESCE(SUM(l.cc), 0)::int AS cc, COALESCE(SUM(l.g), 0)::int AS g
            FROM folder_resource fr
            JOIN folder f ON f.pk_folder = fr.pk_folder
            LEFT JOIN live l ON l.pk_folder = fr.pk_folder
            WHERE f.pk_show IN (SELECT pk_show FROM flipped)
            GROUP BY fr.pk_folder
        ) x
        WHERE t.pk_folder = x.pk_folder AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
    ),
    job_u AS (
        UPDATE job_resource t SET int_cores = x.cc, int_gpus = x.g
        FROM (
            SELECT jr.pk_job, COALESCE(SUM(l.cc), 0)::bigint AS cc, COALESCE(SUM(l.g), 0)::int AS g
            FROM job_resource jr
            JOIN job j ON j.pk_job = jr.pk_job
            LEFT JOIN live l ON l.pk_job = jr.pk_job
            WHERE j.pk_show IN (SELECT pk_show FROM flipped)
            GROUP BY jr.pk_job
        ) x
        WHERE t.pk_job = x.pk_job AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
    ),
    layer_u AS (
        UPDATE layer_resource t SET int_cores = x.cc, int_gpus = x.g
        FROM (
            SELECT lr.pk_layer, COALESCE(SUM(l.cc), 0)::bigint AS cc, COALESCE(SUM(l.g), 0)::int AS g
            FROM layer_resource lr
            JOIN job j ON j.pk_job = lr.pk_job
            LEFT JOIN live l ON l.pk_layer = lr.pk_layer
            WHERE j.pk_show IN (SELECT pk_show FROM flipped)
            GROUP BY lr.pk_layer
        ) x
        WHERE t.pk_layer = x.pk_layer AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
    ),
    point_zero AS (
        UPDATE point t SET int_cores = 0, int_gpus = 0
        WHERE t.pk_show IN (SELECT pk_show FROM flipped)
          AND (t.int_cores <> 0 OR t.int_gpus <> 0)
          AND NOT EXISTS (SELECT 1 FROM live l WHERE l.pk_show = t.pk_show AND l.pk_dept = t.pk_dept)
    )
    INSERT INTO point AS t (pk_point, pk_show, pk_dept, int_cores, int_gpus)
    SELECT gen_random_uuid()::text, l.pk_show, l.pk_dept, SUM(l.cc)::int, SUM(l.g)::int
    FROM live l GROUP BY l.pk_show, l.pk_dept
    ON CONFLICT (pk_show, pk_dept) DO UPDATE
    SET int_cores = EXCLUDED.int_cores, int_gpus = EXCLUDED.int_gpus
    WHERE (t.int_cores, t.int_gpus) IS DISTINCT FROM (EXCLUDED.int_cores, EXCLUDED.int_gpus);
    RETURN NULL;
"""


def show_triggers() -> list[pgtrigger.Trigger]:
    return [
        pgtrigger.Trigger(
            name="acct_show_flip",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows", new="new_rows"),
            func=SHOW_FLIP_FUNC,
        )
    ]


# --- the kill-switch row -------------------------------------------------------------------


def settings_triggers() -> list[pgtrigger.Trigger]:
    """Deleting the row would silently turn the switch into its default; refuse it."""
    return [pgtrigger.Protect(name="acct_settings_keep_row", operation=pgtrigger.Delete)]
