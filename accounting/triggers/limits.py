"""`acct_limit_change`: every cap change of every show, in the writing transaction, and Cuebot's
unlimited job caps, which a Cuebot database cannot store as -1.
"""

from __future__ import annotations

from collections.abc import Callable

import pgtrigger

from accounting.notify import EMIT_FUNCTION, LIMIT_CHANNEL, RESYNC_CHANNEL
from accounting.triggers.common import (
    CURRENT_XID,
    GENERATION_DECLARE,
    NEXT_SEQ,
    _tail,
    bump_generation,
    cores_cap,
    cores_from_centicores,
    gpus_cap,
    json_id,
    with_generation,
)
from accounting.triggers.definer import DefinerTrigger
from accounting.triggers.deltas import CUEBOT_ACCOUNTS
from accounting.units import CUEBOT_UNLIMITED_CAP

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
    PERFORM {EMIT_FUNCTION}('{LIMIT_CHANNEL}', p.payload) FROM ({messages}
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
    PERFORM {EMIT_FUNCTION}('{LIMIT_CHANNEL}', p.payload) FROM (
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
    PERFORM {EMIT_FUNCTION}('{LIMIT_CHANNEL}', p.payload) FROM ({messages}
    ) p;
    RETURN NULL;
"""


def resync_func(table: str) -> str:
    return f"""
    PERFORM {EMIT_FUNCTION}('{RESYNC_CHANNEL}', '{{"table":"{table}","xid":' || {CURRENT_XID} || '}}');
    RETURN NULL;
"""


def _limit_triggers(vertex: str, table: str, spec: dict[str, str]) -> list[pgtrigger.Trigger]:
    declare = [("v_xid", "bigint"), ("v_seq", "bigint"), *GENERATION_DECLARE]
    return [
        DefinerTrigger(
            name=f"acct_limit_{vertex}_insert",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(new="new_rows"),
            declare=declare,
            func=limit_insert_func(spec),
        ),
        DefinerTrigger(
            name=f"acct_limit_{vertex}_update",
            when=pgtrigger.After,
            operation=pgtrigger.Update,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows", new="new_rows"),
            declare=declare,
            func=limit_update_func(spec),
        ),
        DefinerTrigger(
            name=f"acct_limit_{vertex}_delete",
            when=pgtrigger.After,
            operation=pgtrigger.Delete,
            level=pgtrigger.Statement,
            referencing=pgtrigger.Referencing(old="old_rows"),
            declare=declare,
            func=limit_delete_func(spec),
        ),
        DefinerTrigger(
            name=f"acct_limit_{vertex}_truncate",
            when=pgtrigger.After,
            operation=pgtrigger.Truncate,
            level=pgtrigger.Statement,
            func=resync_func(table),
        ),
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
    return DefinerTrigger(
        name="cuebot_job_caps_unlimited",
        when=pgtrigger.Before,
        operation=pgtrigger.Insert | pgtrigger.Update,
        level=pgtrigger.Row,
        condition=pgtrigger.Condition("NEW.int_max_cores < 0 OR NEW.int_max_gpus < 0"),
        func=CUEBOT_JOB_CAPS_FUNC,
    )
