"""proc's triggers: every change of a booked amount, or of its key, is a delta applied once."""

from __future__ import annotations

import pgtrigger

from accounting.keylocks import LOCK_EVERY_SHOW, lock_proc_keys
from accounting.notify import EMIT_FUNCTION, RESYNC_CHANNEL
from accounting.triggers.common import CURRENT_XID, WRITER_ON, WRITER_ROLE, WRITER_SETTING
from accounting.triggers.definer import DefinerTrigger
from accounting.triggers.deltas import (
    DELTAS,
    PROC_CHANGED,
    PROC_DELETE_KEYED,
    PROC_INSERT_KEYED,
    PROC_UPDATE_KEYED,
    _usage_trigger,
    usage_func,
)
from accounting.triggers.rebuild import UNMANAGED_SHOWS_SQL, rebuild_sql

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
    lock=lock_proc_keys("new_procs"),
)
PROC_DELETE_FUNC = usage_func(
    PROC_DELETE_KEYED,
    guard="IF NOT EXISTS (SELECT 1 FROM old_procs WHERE NOT b_local) THEN RETURN NULL; END IF;",
    rows="old_procs",
    lock=lock_proc_keys("old_procs"),
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
    lock=lock_proc_keys("new_procs", "old_procs"),
)

PROC_TRUNCATE_FUNC = f"""
    {LOCK_EVERY_SHOW}
    -- No row is left to send a delta for: the unmanaged shows' counters are rebuilt (to zero,
    -- unless this transaction inserts again), and the scheduler is told to reseed.
    {rebuild_sql(UNMANAGED_SHOWS_SQL, into="INTO v_d1, v_d2, v_d3, v_d4, v_d5")};
    PERFORM {EMIT_FUNCTION}('{RESYNC_CHANNEL}', '{{"table":"proc","xid":' || {CURRENT_XID} || '}}');
    RETURN NULL;
"""


def proc_triggers() -> list[pgtrigger.Trigger]:
    return [
        _usage_trigger("acct_proc_insert", pgtrigger.Insert, PROC_INSERT_FUNC),
        _usage_trigger("acct_proc_delete", pgtrigger.Delete, PROC_DELETE_FUNC),
        _usage_trigger("acct_proc_update", pgtrigger.Update, PROC_UPDATE_FUNC),
        DefinerTrigger(
            name="acct_proc_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            declare=[(f"v_d{i}", "bigint") for i in range(1, 6)],
            func=PROC_TRUNCATE_FUNC,
        ),
        # Every proc trigger pairs a statement's old and new rows by pk_proc: a row whose id
        # changed would be seen by none of them (its cores, keys or layer changed uncounted).
        DefinerTrigger(
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
