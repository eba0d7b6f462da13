"""The one way cuesched's accounting and integrity triggers are compiled: as the database's own.

pgtrigger compiles `IF _pgtrigger_should_ignore(TG_NAME) THEN RETURN ...` into every trigger
function, which reads the session setting `pgtrigger.ignore`: any session, of any role, that sets
it to a trigger's name switches that trigger off for itself (a managed show booked past its burst,
unchecked and uncounted). And a trigger function runs with the privileges of whoever fired it, so
a guard could tell the triggers' own counter writes from a client's only by pg_trigger_depth(),
which a client's own TEMP trigger raises too.

`DefinerTrigger` (and `DefinerProtect`) render the same trigger through `DefinerTriggerSql`, a
copy of pgtrigger's installation template with two changes:

* no ignore clause: no setting switches the trigger off; only `ALTER TABLE ... DISABLE TRIGGER`
  (the table's owner) or `session_replication_role` (a superuser) can, which the trigger-health
  watch and the recompute's integrity alarm report;
* `SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp`: the function runs as its
  owner, the role that ran `migrate`, whoever fired it. Outside writers therefore need no
  privilege on the cuesched_* tables the triggers write (SELECT at most), and inside the function
  `current_user` is the owner: a fact PostgreSQL enforces, which `written_by_triggers` reads.
  pg_temp is last, so no session's TEMP table or function can stand in for one of ours.

The template is part of the migrations that use it (they name this class): never edit it;
a change is a new class beside it, as pgtrigger itself versions its template.

A trigger function cannot be called directly (it returns `trigger`), so it needs no EXECUTE
revoke; a SECURITY DEFINER helper that can be called must `REVOKE EXECUTE ... FROM PUBLIC`.
"""

from __future__ import annotations

from typing import Any

import pgtrigger
from django.db import models
from pgtrigger import compiler

# The schema the triggers' tables live in, as pgtrigger's own guard assumes ('"public"').
SCHEMA = "public"
SEARCH_PATH = f"pg_catalog, {SCHEMA}, pg_temp"
# A line of every function this template installs: adoption's proof (dispatch.adoption) that a
# live function is cuesched's, where pgtrigger's functions carry their ignore guard instead.
DEFINER_MARK = "-- cuesched: accounting trigger, SECURITY DEFINER, no pgtrigger.ignore"


def written_by_triggers(table: str) -> str:
    """A trigger WHEN condition: the statement firing it was run by one of cuesched's trigger
    functions, so the row's "written by the triggers only" guard lets it through.

    Read in the WHEN clause, where current_user is the role running the firing statement: inside
    a DefinerTrigger's function, the functions' owner. The owner is the table's owner (one
    `migrate` creates both), told by the TRIGGER privilege on the table, which the owner holds
    and nobody else is granted (docs/deployment.md); a role holding it could attach a trigger of
    its own that rewrites NEW after any guard, so admitting it gives nothing away. A session's
    own TEMP trigger runs as that session's role (pg_trigger_depth() > 0 alone proved nothing);
    SET ROLE reaches only roles the login already belongs to. pg_trigger_depth() > 0 keeps the
    owner's own top-level statements (the embedded superuser's psql) refused as before: for such
    a session the guard is a safety rail, not a boundary (it may disable triggers anyway).
    has_table_privilege with an OID and the current user: one syscache lookup, no subquery
    (which a WHEN clause may not hold)."""
    return f"(pg_trigger_depth() > 0 AND has_table_privilege('{SCHEMA}.{table}'::regclass, 'TRIGGER'))"


class DefinerTriggerSql(compiler.UpsertTriggerSql):
    """pgtrigger's UpsertTriggerSql v1 without the ignore clause, as SECURITY DEFINER (v1 here)."""

    def get_template(self) -> str:
        return (
            """
            CREATE OR REPLACE FUNCTION {pgid}()
            RETURNS TRIGGER AS $$
                {declare}
                BEGIN
                    """
            + DEFINER_MARK
            + """
                    {func}
                END;
            $$ LANGUAGE plpgsql SECURITY DEFINER SET search_path = """
            + SEARCH_PATH
            + """;

            DROP TRIGGER IF EXISTS {pgid} ON {table};
            CREATE {constraint} TRIGGER {pgid}
                {when} {operation} ON {table}
                {timing}
                {referencing}
                FOR EACH {level} {condition}
                EXECUTE PROCEDURE {execute};

            COMMENT ON TRIGGER {pgid} ON {table} IS '{hash}';
        """
        )

    def get_defaults(self, pgid: str) -> dict[str, str]:
        return {
            "declare": "",
            "constraint": "",
            "timing": "",
            "referencing": "",
            "level": "ROW",
            "condition": "",
            "execute": f"{pgid}()",
        }


class _Definer:
    """compile() as pgtrigger's, through DefinerTriggerSql."""

    def compile(self, model: models.Model) -> compiler.Trigger:
        trigger: Any = self
        return compiler.Trigger(
            name=trigger.name,
            sql=DefinerTriggerSql(
                pgid=trigger.get_pgid(model),
                declare=trigger.render_declare(model),
                func=trigger.render_func(model),
                table=model._meta.db_table,
                constraint="CONSTRAINT" if trigger.timing else "",
                when=trigger.when,
                operation=trigger.operation,
                timing=f"DEFERRABLE INITIALLY {trigger.timing}" if trigger.timing else "",
                referencing=trigger.referencing or "",
                level=trigger.level,
                condition=trigger.render_condition(model),
                execute=trigger.render_execute(model),
            ),
        )


class DefinerTrigger(_Definer, pgtrigger.Trigger):
    """A pgtrigger.Trigger that no setting switches off and that runs as its owner."""


class DefinerProtect(_Definer, pgtrigger.Protect):
    """A pgtrigger.Protect that no setting switches off and that runs as its owner."""
