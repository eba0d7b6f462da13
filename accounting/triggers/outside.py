"""Beside Cuebot: the counter tables' side of the outside writers' ledger and its top-up at
commit, so a writer that counts nothing itself is counted once.
"""

from __future__ import annotations

import pgtrigger

from accounting.keylocks import LOCK_EVERY_SHOW
from accounting.triggers.common import READ_COMMITTED, WRITER_ON
from accounting.triggers.definer import DefinerTrigger, written_by_triggers
from accounting.triggers.deltas import (
    _LEDGER_UPSERT,
    CAP_FOLDER_MAX_CORES,
    CAP_FOLDER_MAX_GPUS,
    CAP_FOLDER_MISSING,
    CAP_JOB_MAX_CORES,
    CAP_JOB_MAX_GPUS,
    CAP_JOB_MISSING,
    CAP_LAYER_MISSING,
    CAP_SUBSCRIPTION_BURST,
    CAP_SUBSCRIPTION_MISSING,
    CUEBOT_ACCOUNTS,
    OUTSIDE_FOLDER,
    OUTSIDE_JOB,
    OUTSIDE_LAYER,
    OUTSIDE_LEDGER_TABLE,
    OUTSIDE_POINT,
    OUTSIDE_SUB,
)

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
    {LOCK_EVERY_SHOW}
    {_LEDGER_UPSERT.format(owed=owed)}
    RETURN NULL;
"""


def counter_outside_triggers(table: str) -> list[pgtrigger.Trigger]:
    triggers = [
        DefinerTrigger(
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
        DefinerTrigger(
            name="acct_outside_truncated",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            func=counter_truncate_func(table),
        )
    )
    return triggers


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
# Locks: the rows of the owed keys' shows (FOR KEY SHARE: no flip of them under it), then the
# counter rows in Cuebot's procCreated order
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
    PERFORM 1 FROM show t WHERE t.pk_show IN (SELECT {_KEY_SHOW} FROM {_OWED}) ORDER BY t.pk_show
    FOR KEY SHARE OF t;
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

# Only the triggers above write the ledger (from inside their SECURITY DEFINER functions:
# written_by_triggers, read in the WHEN clause). A client's INSERT, UPDATE or DELETE of it (cancelling a debt before the
# commit's top-up reads it) is refused. A TRUNCATE is refused by PostgreSQL itself while this
# transaction has top-up events pending ("pending trigger events"), and waits for every other
# writer of the ledger to commit (its ACCESS EXCLUSIVE lock), so it cannot erase a debt either;
# Django's test flush truncates it, so it stays allowed.
OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS = "acct_outside_ledger_written_by_triggers"


def outside_ledger_triggers() -> list[pgtrigger.Trigger]:
    return [
        DefinerTrigger(
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
        DefinerTrigger(
            name="acct_outside_ledger_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert | pgtrigger.Update | pgtrigger.Delete,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(f"NOT {written_by_triggers(OUTSIDE_LEDGER_TABLE)}"),
            func=f"""
    RAISE EXCEPTION USING
        MESSAGE = 'cuesched: {OUTSIDE_LEDGER_TABLE} is written by the accounting triggers only',
        HINT = 'It holds what this transaction still owes the counters, settled at its commit; '
               'write the procs and counters, not the ledger.',
        ERRCODE = 'check_violation', CONSTRAINT = '{OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS}';
""",
        ),
    ]
