"""show's triggers: a flip between managed and unmanaged, with its generation and rebuild."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.common import (
    CURRENT_XID,
    GENERATION_DECLARE,
    SHOW_FLIP_TABLE,
    _refuse_unless_read_committed,
    bump_generation,
)
from accounting.triggers.definer import DefinerTrigger
from accounting.triggers.deltas import CUEBOT_ACCOUNTS, OUTSIDE_LEDGER_TABLE
from accounting.triggers.limits import DISPLAY_LIFT_SETTING
from accounting.triggers.moves import _keys_lock_trigger
from accounting.triggers.rebuild import rebuild_sql

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
    -- Locked FOR UPDATE, bounded, by acct_show_flip_lock (BEFORE ROW); again here for a flip
    -- whose statement did not name the column (it cannot happen through SQL; held, it costs
    -- nothing). Every proc writer of the show holds its row FOR KEY SHARE: none is in flight.
    PERFORM 1 FROM show t WHERE t.pk_show IN {_ANY_FLIP} ORDER BY t.pk_show FOR UPDATE OF t;
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
        _keys_lock_trigger(
            "acct_show_flip_lock",
            pgtrigger.UpdateOf("b_scheduler_managed"),
            "OLD.b_scheduler_managed IS DISTINCT FROM NEW.b_scheduler_managed",
            "show",
            "pk_show",
            "a managed flip",
        ),
        DefinerTrigger(
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
            ],
            func=SHOW_FLIP_FUNC,
        ),
    ]
