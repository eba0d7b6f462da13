"""Are cuesched's own triggers all installed and firing, once each? Asked at start-up, on any database.

Why: cuesched's counters are kept by its triggers alone, and nothing fails when one stops. A
trigger a site disabled (`ALTER TABLE ... DISABLE TRIGGER`), dropped, or copied under another
name beside the original raises no error in any writer: the counters go LOW (or, counted twice,
high for good), and a Store bootstrapped from them books past a cap. So `run_scheduler` refuses
to start and `store_status` exits non-zero while one is wrong, naming it and the fix.

What "should be installed" means: every trigger a model declares (pgtrigger's registry), on a
plain database as `migrate` installs them; on a Cuebot database less those adoption leaves to a
Cuebot trigger that does the same work (CUEBOT_OWNS below, which adoption reads too). A trigger
counts as cuesched's by the function it runs (pgtrigger names the function after the trigger), so a
renamed copy is still found. One catalog query: the scheduler starts on a farm of any size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pgtrigger

# pgtrigger's names: `pgtrigger_<name>_<5 hex>` for a trigger and the function it runs.
PGTRIGGER_NAME = re.compile(r"^pgtrigger_(?P<name>.+)_[0-9a-f]{5}$")
ENABLED = ("O", "A")  # tgenabled values that fire in an ordinary session


def trigger_base(name: str) -> str:
    """A pgtrigger name without its prefix and hash (the name the model declares)."""
    m = PGTRIGGER_NAME.match(name)
    return m.group("name") if m else name


# (table, cuesched trigger name without pgtrigger's prefix and hash) -> (Cuebot's trigger on that
# table that does the same work, why both would be wrong). Skipped only where Cuebot's exists.
_STATS = "Cuebot's trigger counts frames by state; both would count each change twice"
_USAGE = "Cuebot writes the usage columns itself and verifies them in this trigger"
CUEBOT_OWNS: dict[tuple[str, str], tuple[str, str]] = {
    ("frame", "frame_stat_insert"): ("update_frame_status_counts", _STATS),
    ("frame", "frame_stat_update"): ("update_frame_status_counts", _STATS),
    ("frame", "frame_stat_delete"): ("update_frame_status_counts", _STATS),
    ("folder", "folder_fanout"): ("after_insert_folder", "Cuebot's trigger creates folder_resource"),
    ("job", "job_fanout"): ("after_insert_job", "Cuebot's trigger creates job_stat, job_resource and job_mem"),
    ("layer", "layer_fanout"): (
        "after_insert_layer",
        "Cuebot's trigger creates layer_stat, layer_resource and layer_mem",
    ),
    ("frame", "frame_when_done_satisfy_depends"): (
        "update_frame_dep_to_wait",
        "Cuebot satisfies dependencies (its DependManager, then this trigger); both would count twice",
    ),
    # Cuebot's after_job_finished fires on the same change; what waits on the job Cuebot satisfies
    # in Java after it (JobManagerSupport.shutdownJob), with types cuesched's trigger does not count.
    ("job", "job_finished_satisfy_depends"): (
        "after_job_finished",
        "Cuebot satisfies what depends on a job it finishes or kills (its DependManager); this trigger "
        "would set Cuebot's FRAME_ON_JOB rows inactive uncounted, and their frames would wait for ever",
    ),
    **{
        (table, name): (cuebot, _USAGE)
        for table, cuebot in (
            ("subscription", "verify_subscription"),
            ("folder_resource", "tier_folder"),
            ("job_resource", "verify_job_resources"),
        )
        for name in ("acct_usage_guard", "acct_usage_seed", "acct_usage_rekey")
    },
}


TRIGGERS_SQL = """
SELECT c.relname, t.tgname, t.tgenabled::text, p.proname
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_proc p ON p.oid = t.tgfoid
WHERE n.nspname = 'public' AND NOT t.tgisinternal
"""


@dataclass(frozen=True)
class TriggerProblem:
    table: str
    trigger: str  # pgtrigger's name for it (also the function's)
    problem: str  # missing | disabled | doubled
    detail: str
    fix: str

    def line(self) -> str:
        return f"{self.table}.{self.trigger} {self.problem}: {self.detail}; fix: {self.fix}"


def expected_triggers() -> list[tuple[str, str]]:
    """(table, name) of every trigger cuesched's models declare, as pgtrigger installs it."""
    return sorted({(model._meta.db_table, trigger.get_pgid(model)) for model, trigger in pgtrigger.registered()})


def trigger_problems(conn: Any) -> list[TriggerProblem]:
    """Every declared cuesched trigger that is missing, disabled, or run by two triggers on one
    table, on the database `conn` (a Django connection or a psycopg one) reaches."""
    with conn.cursor() as cur:
        cur.execute(TRIGGERS_SQL)
        live = list(cur.fetchall())
    names = {(table, name) for table, name, _state, _function in live}
    cuebot = ("subscription", "verify_subscription") in names
    reinstall = "manage.py adopt_cuebot_db --apply" if cuebot else "manage.py pgtrigger install (or migrate)"
    problems = []
    for table, name in expected_triggers():
        owner = CUEBOT_OWNS.get((table, trigger_base(name)))
        runs = sorted((tg, state) for t, tg, state, function in live if t == table and function == name)
        if owner is not None and (table, owner[0]) in names:
            # Cuebot's own trigger does this work, so adoption leaves cuesched's out; installed
            # anyway (`pgtrigger install` on an adopted database) both would count.
            for tg, state in runs:
                if state in ENABLED:
                    problems.append(
                        TriggerProblem(
                            table,
                            name,
                            "doubled",
                            f"trigger {tg} does the work of Cuebot's {owner[0]} beside it: {owner[1]}",
                            f"DROP TRIGGER {tg} ON {table}",
                        )
                    )
            continue
        if not runs:
            problems.append(
                TriggerProblem(
                    table, name, "missing", "no trigger runs it, so its counting is done by nobody", reinstall
                )
            )
            continue
        for tg, state in runs:
            if state not in ENABLED:
                problems.append(
                    TriggerProblem(
                        table,
                        name,
                        "disabled",
                        f"trigger {tg} has tgenabled {state!r}, so it counts nothing",
                        f"ALTER TABLE {table} ENABLE TRIGGER {tg}" + (f" (or {reinstall})" if cuebot else ""),
                    )
                )
        if len(runs) > 1:
            others = [tg for tg, _state in runs if tg != name]
            problems.append(
                TriggerProblem(
                    table,
                    name,
                    "doubled",
                    f"{len(runs)} triggers run its function ({', '.join(tg for tg, _s in runs)}), so it counts twice",
                    reinstall if cuebot else "; ".join(f"DROP TRIGGER {tg} ON {table}" for tg in others),
                )
            )
    return problems


def describe(problems: list[TriggerProblem]) -> str:
    """One message naming every problem and its fix, for an operator who reads only the error."""
    return (
        f"{len(problems)} of cuesched's triggers are not installed and firing once each, so counters would go "
        "wrong (low, or counted twice) under every writer: " + " | ".join(p.line() for p in problems)
    )
