"""The usage columns of unmanaged shows: written by the accounting triggers only, or a counter
could be written below SUM(proc) and a cap breached.
"""

from __future__ import annotations

import pgtrigger

from accounting.triggers.common import WRITER_ON
from accounting.triggers.definer import DefinerTrigger, written_by_triggers

# --- the usage columns of unmanaged shows: only the triggers write them -------------------------

# The database-enforced path keeps subscription / folder_resource / job_resource usage by deltas;
# a row written with any other value would read wrong until the reconcile. A new row of an
# unmanaged show (a subscription deleted and inserted again while procs run) therefore starts at
# SUM(proc), and a client statement that writes the usage of an unmanaged show is refused. The
# triggers' own writes run inside one of their SECURITY DEFINER functions (written_by_triggers, in
# the WHEN clause: a session's own TEMP trigger does not pass, as pg_trigger_depth() > 0 did); the
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


_USAGE_SHOW = {
    "subscription": "SELECT NEW.pk_show",
    "folder_resource": "SELECT f.pk_show FROM folder f WHERE f.pk_folder = NEW.pk_folder",
    "job_resource": "SELECT j.pk_show FROM job j WHERE j.pk_job = NEW.pk_job",
}
_USAGE_KEYS = {"subscription": ("pk_show", "pk_alloc"), "folder_resource": ("pk_folder",), "job_resource": ("pk_job",)}


def usage_guard_triggers(table: str) -> list[pgtrigger.Trigger]:
    unmanaged, procs = _USAGE_SOURCES[table]
    keys = _USAGE_KEYS[table]
    # Under its show's row FOR KEY SHARE (accounting.keylocks), in a statement of its own: a flip
    # to unmanaged that the row would miss (its rebuild cannot see an uncommitted row) waits for
    # it, and one that committed first is seen by the flag read below.
    seed = f"""
    PERFORM 1 FROM show t WHERE t.pk_show IN ({_USAGE_SHOW[table]}) FOR KEY SHARE OF t;
    IF EXISTS ({unmanaged}) THEN
        SELECT COALESCE(SUM(p.int_cores_reserved), 0), COALESCE(SUM(p.int_gpus_reserved), 0)
        INTO NEW.int_cores, NEW.int_gpus {procs};
    END IF;
    RETURN NEW;
"""
    return [
        DefinerTrigger(
            name="acct_usage_seed",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert,
            level=pgtrigger.Row,
            func=seed,
        ),
        # A row moved to another key (a subscription to another allocation) would carry the old
        # key's usage to the new one: the new key starts at its own SUM(proc) instead.
        DefinerTrigger(
            name="acct_usage_rekey",
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf(*keys),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(" OR ".join(f"OLD.{k} IS DISTINCT FROM NEW.{k}" for k in keys)),
            func=seed,
        ),
        DefinerTrigger(
            name="acct_usage_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf("int_cores", "int_gpus"),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(
                f"NOT {written_by_triggers(table)} "
                "AND (OLD.int_cores IS DISTINCT FROM NEW.int_cores OR OLD.int_gpus IS DISTINCT FROM NEW.int_gpus)"
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
