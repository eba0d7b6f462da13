"""Adopting an existing Cuebot (OpenCue) database: add what cuesched needs, change nothing of Cuebot's.

Why a separate command (`manage.py adopt_cuebot_db --check | --apply`) and not `migrate`:
cuesched's migrations assume they create the farm tables; on Cuebot's database they fail
(`relation "dept" already exists`), and forcing them through (`--fake-initial`) silently skips
triggers and constraints, retypes columns Cuebot's triggers use and drops Cuebot's indexes.
Adoption is a different operation, run once per cuesched upgrade by an operator who should read
what it will do first (`--check`) on a production database, so it is explicit, not a side
effect of `migrate` guessing from the schema.

How, generically (other engineers add migrations all the time, so nothing here is per migration):
a scratch reference database is migrated with cuesched's own migrations, exactly as a fresh
install is, and both catalogs are read (tables, columns, constraints, indexes, sequences,
functions, triggers, views). The difference is the plan, with these rules:

- a table cuesched has and Cuebot does not is created whole (columns, constraints, indexes,
  triggers) and gets the rows the migrations put there (settings row, groups, content types);
- a column missing on a Cuebot table is added only if it is nullable or has a default;
  otherwise adoption refuses (Cuebot's own INSERTs would fail);
- on Cuebot's tables nothing existing is dropped, retyped or re-indexed; cuesched's index is
  added only where Cuebot has no index on the same columns; constraints (unique, check, foreign
  keys) are never added to Cuebot's tables (they would refuse Cuebot's own writes), except the
  non-negative amounts of dispatch/nonnegative.py (a negative reserved amount cancels other
  procs' use; Cuebot never writes one): `--check` names the rows that break them and `--apply`
  refuses until they are fixed; and the move-lock unique indexes of accounting/move_locks.py,
  which lead with the table's primary key and so can refuse no row;
- cuesched's functions are added when missing; one whose name exists with another body is
  replaced only if it is certainly cuesched's (below), otherwise reported and left alone;
- cuesched's triggers are added, except where Cuebot keeps a trigger that does the same work
  (CUEBOT_OWNS): counting frames by state, the child rows of a folder/job/layer, the usage
  columns of the cap tables, dependency satisfaction. Installing both would count twice;
- Django's migration state (django_migrations) is then recorded as applied, so a later
  `migrate` has nothing to do. After upgrading cuesched, run adoption again before `migrate`:
  it adds what the new migrations add, under the same rules.

Upgrading (the same command after a cuesched release): `migrate` is refused on a Cuebot
database, so this is the only way a changed trigger body reaches an adopted farm. Functions and
triggers that are certainly cuesched's and differ from the reference are replaced, stale ones
(the reference no longer has them) dropped. "Certainly" is one of two proofs, never a name alone:

- adoption's mark: every function it creates or replaces gets `COMMENT ON FUNCTION ... IS MARK ||
  sha256(definition)`, hashed in the database from the definition as stored. A comment, not a
  table of our own, because it lives and dies with the object: a function dropped and recreated
  by someone else (Cuebot taking the name) has no mark, and one rewritten in place (CREATE OR
  REPLACE keeps the comment) no longer matches its hash, so it is reported, not overwritten;
- pgtrigger's own objects: a `pgtrigger_<name>_<5 hex>()` function whose body opens with
  pgtrigger's ignore guard (`_pgtrigger_should_ignore(TG_NAME)`) or, for the accounting triggers,
  `DEFINER_MARK` (accounting.triggers.definer), and a trigger of the same name
  with pgtrigger's 40-hex hash as its comment running such a function. No Cuebot object calls
  pgtrigger's guard, so this also covers databases adopted before the mark existed. pgtrigger's
  5-hex suffix hashes the model and trigger name, not the body: a new body keeps its name and is
  replaced in place; the comment hash (pgtrigger's own "is it current" test) is then rewritten.

Everything else of a cuesched name (Cuebot's `trigger__*`, `tier`, `recalculate_subs`, and the
library helpers `_pgtrigger_should_ignore` / `_pgh_attach_context` on a database adopted before
the mark, which no certain proof covers) is reported and kept. A body equal to cuesched's is no
proof either, so nothing is marked that adoption did not write.

Everything is one transaction: either all of the plan is applied or nothing is. The version
check needs Flyway's history at V45 or later (`show.b_scheduler_managed` is Cuebot's V45).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings as django_settings
from django.core.management.base import CommandError
from django.db import OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from accounting.host_memory import REBUILD_SQL as HOST_MEMORY_REBUILD_SQL
from accounting.licences import COUNT_LATERAL, limit_max_problem, limit_max_sql
from accounting.trigger_health import CUEBOT_OWNS, ENABLED, PGTRIGGER_NAME, trigger_base
from accounting.triggers import CUEBOT_ACCOUNTS, NORMALIZE_CUEBOT_JOB_CAPS_SQL
from accounting.triggers.definer import DEFINER_MARK
from accounting.writer_role import ENSURE_SQL as ENSURE_WRITER_ROLE_SQL
from cuesched_project.dburl import url_from_settings
from dispatch import conf, nonnegative

MIN_FLYWAY_VERSION = 45
# A Cuebot database built by applying its migrations with psql (a test farm, a restored dump
# without Flyway's table) is still Cuebot's: it is recognised by its objects, and its version
# by V45's column, which is what adoption needs of V45.
NO_FLYWAY = (
    "recognised as Cuebot's schema by its verify_subscription trigger; "
    "the version is judged by V45's show.b_scheduler_managed"
)
NOT_CUEBOT = (
    "this is not a Cuebot database (no flyway_schema_history and no verify_subscription trigger on "
    "subscription); use `manage.py migrate`"
)
REFERENCE_ALIAS = "cuesched_adopt_reference"


# Which missing objects are cuesched's own (adoption adds them) and which are Cuebot's from a
# later Cuebot version (adoption must not add them: that Flyway migration would then fail on
# "already exists", as V47's layer.ts_start_after would on a V46 database). Tables: cuesched's
# and Django's own carry these prefixes; Cuebot's never do. Columns on Cuebot's tables: listed.
# A new cuesched column on a Cuebot table must be listed here, or adoption reports it as a
# missing Cuebot column (tests/integration/test_cuebot_adoption.py fails loudly on that).
OWN_TABLE_PREFIXES = ("cuesched_", "django_", "auth_", "ops_", "dispatch_", "pghistory_", "accounting_")
OWN_COLUMNS = frozenset(
    {
        ("host", "ts_last_updated"),  # placement's incremental host read
        ("job_stat", "int_total_count"),  # frames of the job (Cuebot keeps it per layer only)
        # cuesched keeps these on show; Cuebot keeps them in show_stats (V16).
        ("show", "int_job_insert_count"),
        ("show", "int_frame_insert_count"),
        ("show", "int_frame_success_count"),
        ("show", "int_frame_fail_count"),
        ("host", "str_rqd_address"),  # where the host's RQD answers (the rqd launcher)
        # A kill in progress: the proc stays booked until its run has ended (dispatch.engine.kills).
        ("proc", "ts_kill"),
        ("proc", "str_kill"),
        # Why a frame's last run ended as it did (a memory failure, a timeout, NIMBY: issue 29).
        ("frame", "str_reason"),
        # A licence limit's use, counted from proc by cuesched's triggers (see LICENCE_RECOUNT).
        ("limit_record", "int_running"),
        ("limit_record", "int_frames"),
    }
)

# Added beside Cuebot's running frames, a limit's use column starts at its default, 0: LOW, and
# the Store books against it. So it is recounted from proc in the adoption transaction, with
# proc's writers held off (SHARE) from that moment to the commit, by when the triggers that keep
# it from then on are installed: no proc write falls between the recount and the triggers.
LICENCE_RECOUNT = [
    "LOCK TABLE proc IN SHARE MODE",
    f"""UPDATE limit_record t
    SET int_running = CASE WHEN t.b_host_limit THEN x.hosts ELSE x.frames END, int_frames = x.frames
    FROM (SELECT r.pk_limit_record, c.frames, c.hosts FROM limit_record r {COUNT_LATERAL}) x
    WHERE t.pk_limit_record = x.pk_limit_record""",
]

# A migration's data step, which adoption runs (after the triggers) in the transaction that
# records the migration as applied: the schema part of a migration reaches an adopted database
# through the catalog diff, but its RunSQL on existing rows would be skipped with it, and a row
# the new triggers assume rewritten would stay as it was. dispatch.0041_services_seed has none on
# purpose: `service` and `show_service` are Cuebot's tables there (0040 creates nothing on them,
# since they exist), with Cuebot's own seed and its operators' edits, which a reseed would undo.
DATA_STEPS: dict[tuple[str, str], tuple[str, str]] = {
    ("dispatch", "0016_cuebot_job_caps"): (
        "job caps written as -1 before, which Cuebot can never book, stored as its unlimited",
        NORMALIZE_CUEBOT_JOB_CAPS_SQL,
    ),
    # Cuebot keeps host idle memory in its Java; a host it left off the truth would refuse every
    # later write of its procs' memory, so each host is recounted once (Cuebot's own
    # RECONCILE_IDLE_RESOURCES rule) in the transaction that installs the ledger's triggers.
    ("dispatch", "0032_memuse_host_memory"): (
        "every host's idle memory recounted from SUM(proc.int_mem_reserved) (accounting.host_memory)",
        ";\n".join(HOST_MEMORY_REBUILD_SQL),
    ),
    # A role is no catalog object of the database, so no diff brings it: the triggers honour the
    # writer claim of its members only, and without it cuesched's own bookings would be refused.
    ("accounting", "0009_writer_role"): (
        "the writer role whose members write as the scheduler, created if the cluster has none",
        ENSURE_WRITER_ROLE_SQL,
    ),
}

# Every function pgtrigger compiles opens with this guard, and every one cuesched's accounting
# triggers compile (accounting.triggers.definer) with DEFINER_MARK instead; no Cuebot function has either.
PGTRIGGER_GUARD = '"public"._pgtrigger_should_ignore(TG_NAME)'
# The COMMENT adoption puts on every function it creates or replaces: the proof, on later runs,
# that the function is cuesched's and unchanged since (the hash is of its whole definition).
MARK = "cuesched adopt_cuebot_db: installed by cuesched, definition sha256 "


class AdoptionError(Exception):
    """The database cannot be adopted as it is; nothing was written."""


# ---------------------------------------------------------------------------------------------
# Catalog


@dataclass
class Column:
    name: str
    type: str
    not_null: bool
    default: str | None
    identity: str  # '' | 'a' (ALWAYS) | 'd' (BY DEFAULT)


@dataclass
class Catalog:
    """The public schema of one database, as the DDL that would recreate each object."""

    tables: dict[str, list[Column]] = field(default_factory=dict)
    constraints: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # (table, name) -> (type, def)
    indexes: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # -> (def, columns)
    triggers: dict[tuple[str, str], tuple[str, str | None]] = field(default_factory=dict)  # -> (def, comment)
    # -> pg_trigger.tgenabled: 'O' or 'A' fire in every session; 'D' never, 'R' only on a replica.
    trigger_enabled: dict[tuple[str, str], str] = field(default_factory=dict)
    functions: dict[str, str] = field(default_factory=dict)  # 'name(args)' -> definition
    function_comments: dict[str, str | None] = field(default_factory=dict)  # 'name(args)' -> COMMENT
    function_ids: dict[str, str] = field(default_factory=dict)  # 'name(args)' -> regprocedure text
    sequences: dict[str, str] = field(default_factory=dict)  # name -> owning 'table.column' or ''
    views: dict[str, str] = field(default_factory=dict)
    unlogged: set[str] = field(default_factory=set)
    flyway_version: int | None = None

    @property
    def cuebot(self) -> bool:
        """Cuebot's schema, told by its objects: Flyway's history, or Cuebot's verify_subscription
        trigger (the same test as Cuebot mode's), for a database built without Flyway."""
        return self.flyway_version is not None or ("subscription", "verify_subscription") in self.triggers


def _rows(conn: BaseDatabaseWrapper, sql: str) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(sql)
        return list(cur.fetchall())


def read_catalog(conn: BaseDatabaseWrapper) -> Catalog:
    """Read the public schema through pg_catalog (no pg_dump needed on the scheduler's host)."""
    cat = Catalog()
    for table, name, typ, not_null, default, identity in _rows(
        conn,
        """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
        ORDER BY c.relname, a.attnum
        """,
    ):
        cat.tables.setdefault(table, []).append(Column(name, typ, not_null, default, identity or ""))
    for (table,) in _rows(
        conn,
        """
        SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relpersistence = 'u'
        """,
    ):
        cat.unlogged.add(table)
    for table, name, typ, definition in _rows(
        conn,
        """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
        """,
    ):
        cat.constraints[(table, name)] = (typ, definition)
    for table, name, definition, columns in _rows(
        conn,
        """
        SELECT t.relname, i.relname, pg_get_indexdef(x.indexrelid),
               ARRAY(SELECT pg_get_indexdef(x.indexrelid, k, true)
                     FROM generate_series(1, x.indnkeyatts) AS k ORDER BY k)
        FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid
        JOIN pg_namespace n ON n.oid = t.relnamespace
        WHERE n.nspname = 'public'
          AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = x.indexrelid AND k.contype IN ('p','u','x'))
        """,
    ):
        cat.indexes[(table, name)] = (definition, tuple(columns))
    for table, name, definition, comment, enabled in _rows(
        conn,
        """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), obj_description(t.oid, 'pg_trigger'),
               t.tgenabled::text
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND NOT t.tgisinternal
        """,
    ):
        # pgtrigger keeps each trigger's hash in its comment (how `pgtrigger ls` tells it is current).
        cat.triggers[(table, name)] = (definition, comment)
        # pg_get_triggerdef omits it: a disabled trigger reads as current, counting nothing.
        cat.trigger_enabled[(table, name)] = enabled
    for signature, definition, comment, ident in _rows(
        conn,
        """
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', pg_get_functiondef(p.oid),
               obj_description(p.oid, 'pg_proc'), 'public.' || quote_ident(p.proname) || '('
               || COALESCE((SELECT string_agg(format_type(t, NULL), ', ' ORDER BY k)
                            FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS a(t, k)), '') || ')'
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.prokind IN ('f', 'p')
          AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = p.oid AND d.deptype = 'e')
        """,
    ):
        cat.functions[signature] = definition
        cat.function_comments[signature] = comment
        cat.function_ids[signature] = ident
    for name, owner in _rows(
        conn,
        """
        SELECT s.relname, COALESCE(t.relname || '.' || a.attname, '')
        FROM pg_class s JOIN pg_namespace n ON n.oid = s.relnamespace
        LEFT JOIN pg_depend d ON d.objid = s.oid AND d.classid = 'pg_class'::regclass
             AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
        LEFT JOIN pg_class t ON t.oid = d.refobjid
        LEFT JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
        WHERE n.nspname = 'public' AND s.relkind = 'S'
        """,
    ):
        cat.sequences[name] = owner
    for name, definition in _rows(
        conn,
        """
        SELECT c.relname, pg_get_viewdef(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind = 'v'
        """,
    ):
        cat.views[name] = definition
    if "flyway_schema_history" in cat.tables:
        found = _rows(
            conn,
            "SELECT max(version::int) FROM flyway_schema_history WHERE success AND version ~ '^[0-9]+$'",
        )
        cat.flyway_version = found[0][0]
    return cat


# ---------------------------------------------------------------------------------------------
# Plan


@dataclass
class Step:
    kind: str  # lock, table, column, recount, rows, index, constraint, function, trigger, sequence, view
    name: str
    sql: list[str]
    note: str = ""
    verb: str = "add"  # add | replace | drop | update | enable | lock

    def key(self) -> tuple[str, str, str, tuple[str, ...]]:
        return (self.verb, self.kind, self.name, tuple(self.sql))


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what cuesched has and adoption leaves out, and why
    differences: list[str] = field(default_factory=list)  # Cuebot's definition kept where cuesched's differs
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # rows an operator should fix first (see limit_warnings)
    missing_cuebot: list[str] = field(default_factory=list)  # Cuebot's objects a later Cuebot version adds
    migrations: list[tuple[str, str]] = field(default_factory=list)
    new_tables: list[str] = field(default_factory=list)
    flyway_version: int | None = None

    def lines(self) -> list[str]:
        out = [
            f"Cuebot schema version: V{self.flyway_version}"
            if self.flyway_version
            else f"no Flyway history: {NO_FLYWAY}"
        ]
        out += [f"ERROR: {e}" for e in self.errors]
        out += [f"WARNING: {w}" for w in self.warnings]
        out += [
            f"NOT READY: Cuebot's {m} is missing (a later Cuebot migration adds it; adoption leaves it to Flyway):"
            " apply Cuebot's Flyway migrations before starting run_scheduler"
            for m in self.missing_cuebot
        ]
        out += [
            f"lock {s.name} in {s.note} mode, its writers held off until the commit"
            if s.kind == "lock"
            else f"{s.verb} {s.kind} {s.name}" + (f" ({s.note})" if s.note else "")
            for s in self.steps
        ]
        if self.migrations:
            out.append(f"record {len(self.migrations)} Django migrations as applied")
        out += [f"skip {s}" for s in self.skipped]
        out += [f"keep Cuebot's {d}" for d in self.differences]
        if not self.steps and not self.migrations and not self.errors:
            out.append("nothing to add: the database is adopted and cuesched's own objects are current")
        return out


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _column_sql(col: Column) -> str:
    sql = f"{_q(col.name)} {col.type}"
    if col.identity:
        sql += " GENERATED " + ("ALWAYS" if col.identity == "a" else "BY DEFAULT") + " AS IDENTITY"
    elif col.default is not None:
        sql += f" DEFAULT {col.default}"
    if col.not_null:
        sql += " NOT NULL"
    return sql


def _fk_target(definition: str) -> str | None:
    m = re.search(r"REFERENCES\s+(?:public\.)?\"?([A-Za-z0-9_]+)\"?", definition)
    return m.group(1) if m else None


def _owns_column(col: Column) -> bool:
    return bool(col.default and col.default.startswith("nextval("))


def make_plan(ref: Catalog, live: Catalog, applied: set[tuple[str, str]], recorded: list[tuple[str, str]]) -> Plan:
    """The additions that make `live` hold everything of `ref` that adoption may add."""
    plan = Plan(flyway_version=live.flyway_version)
    if not live.cuebot:
        plan.errors.append(NOT_CUEBOT)
        return plan
    if live.flyway_version is not None and live.flyway_version < MIN_FLYWAY_VERSION:
        plan.errors.append(
            f"Cuebot schema V{live.flyway_version} is older than V{MIN_FLYWAY_VERSION} "
            "(show.b_scheduler_managed); upgrade Cuebot's schema with Flyway first"
        )
    if not any(c.name == "b_scheduler_managed" for c in live.tables.get("show", [])):
        plan.errors.append("show.b_scheduler_managed is missing (Cuebot V45)")
    for needed in ("show", "subscription", "folder_resource", "job_resource", "proc", "frame", "host"):
        if needed not in live.tables:
            plan.errors.append(f"Cuebot table {needed} is missing")

    new_tables = [t for t in ref.tables if t not in live.tables and t.startswith(OWN_TABLE_PREFIXES)]
    plan.missing_cuebot += [
        f"table {t}" for t in ref.tables if t not in live.tables and not t.startswith(OWN_TABLE_PREFIXES)
    ]
    plan.new_tables = new_tables
    cuebot = set(live.tables)
    present = cuebot | set(new_tables)

    for seq, owner in sorted(ref.sequences.items()):
        if seq in live.sequences or owner:
            continue  # owned sequences come with their table or identity column
        plan.steps.append(Step("sequence", seq, [f"CREATE SEQUENCE {_q(seq)}"]))

    for table in new_tables:
        cols = ref.tables[table]
        serial_seqs = [s for s, o in ref.sequences.items() if o.startswith(table + ".")]
        sql = []
        for col in cols:
            if _owns_column(col):
                seq = re.search(r"nextval\('(?:public\.)?\"?([^'\"]+)\"?'", col.default or "")
                if seq and seq.group(1) in serial_seqs:
                    sql.append(f"CREATE SEQUENCE IF NOT EXISTS {_q(seq.group(1))}")
        unlogged = "UNLOGGED " if table in ref.unlogged else ""
        sql.append(f"CREATE {unlogged}TABLE {_q(table)} (" + ", ".join(_column_sql(c) for c in cols) + ")")
        for col in cols:
            if _owns_column(col):
                seq = re.search(r"nextval\('(?:public\.)?\"?([^'\"]+)\"?'", col.default or "")
                if seq:
                    sql.append(f"ALTER SEQUENCE {_q(seq.group(1))} OWNED BY {_q(table)}.{_q(col.name)}")
        plan.steps.append(Step("table", table, sql))

    for table, cols in ref.tables.items():
        if table not in cuebot:
            continue
        have = {c.name: c for c in live.tables[table]}
        for col in cols:
            if col.name not in have:
                if (table, col.name) not in OWN_COLUMNS:
                    plan.missing_cuebot.append(f"column {table}.{col.name}")
                    continue
                if col.not_null and col.default is None and not col.identity:
                    plan.errors.append(
                        f"column {table}.{col.name} is NOT NULL without a default in cuesched: "
                        "adding it would break Cuebot's INSERTs"
                    )
                    continue
                plan.steps.append(
                    Step("column", f"{table}.{col.name}", [f"ALTER TABLE {_q(table)} ADD COLUMN {_column_sql(col)}"])
                )
                if (table, col.name) == ("limit_record", "int_running"):
                    plan.steps.append(
                        Step("recount", "limit_record use", LICENCE_RECOUNT, note="from the running procs")
                    )
            else:
                mine = have[col.name]
                if (mine.type, mine.not_null) != (col.type, col.not_null):
                    plan.differences.append(
                        f"{table}.{col.name} {mine.type}{' NOT NULL' if mine.not_null else ''}"
                        f" (cuesched: {col.type}{' NOT NULL' if col.not_null else ''})"
                    )

    # Constraints: whole on new tables (primary and unique first, foreign keys last); never on Cuebot's.
    order = {"p": 0, "u": 1, "c": 2, "x": 2, "f": 3}
    for (table, name), (typ, definition) in sorted(ref.constraints.items(), key=lambda kv: order.get(kv[1][0], 9)):
        # A constraint trigger's constraint ("t") comes with its CREATE CONSTRAINT TRIGGER below.
        if typ in ("n", "t") or table not in present:
            continue
        if table in cuebot:
            same = any(t == table and d == definition for (t, _n), (_ty, d) in live.constraints.items())
            if (table, name) in live.constraints or same:
                continue
            if typ == "c" and name in nonnegative.ADOPTED_NAMES:
                # A negative amount has no meaning to Cuebot either (its own writes never make
                # one), and on these columns it cancels other rows' use: the one exception.
                (amount,) = [a for a in nonnegative.AMOUNTS if a.name == name]
                plan.steps.append(
                    Step(
                        "constraint",
                        f"{table}.{name}",
                        nonnegative.add_sql(amount),
                        note=f"{amount.condition}, the rows checked first",
                    )
                )
                continue
            plan.skipped.append(f"constraint {name} on Cuebot's {table}: {definition} (would refuse its writes)")
            continue
        if typ == "f" and _fk_target(definition) in cuebot:
            plan.skipped.append(
                f"foreign key {table}.{name} -> Cuebot's {_fk_target(definition)} (would block Cuebot's deletes)"
            )
            continue
        plan.steps.append(
            Step("constraint", f"{table}.{name}", [f"ALTER TABLE {_q(table)} ADD CONSTRAINT {_q(name)} {definition}"])
        )

    for (table, name), (definition, columns) in sorted(ref.indexes.items()):
        if (table, name) in live.indexes or table not in present:
            continue
        if table in cuebot:
            names = {c.name for c in live.tables[table]}
            # cuesched's own columns this plan adds (an index on one comes in the same apply).
            names |= {
                st.name.split(".", 1)[1] for st in plan.steps if st.kind == "column" and st.name.startswith(f"{table}.")
            }
            absent = [c for c in columns if c.strip('"') not in names]
            if absent:
                plan.skipped.append(f"index {name} on {table}: needs Cuebot's missing {', '.join(absent)}")
                continue
            # A Cuebot index whose leading columns are cuesched's serves the same lookups.
            width = len(columns)
            covering = [n for (t, n), (_, cols) in live.indexes.items() if t == table and cols[:width] == columns]
            covering += [
                n
                for (t, n), (typ, d) in live.constraints.items()
                if t == table and typ in ("p", "u") and _key_columns(d)[:width] == columns
            ]
            if covering:
                plan.skipped.append(f"index {name} on {table}{columns}: Cuebot's {covering[0]} covers it")
                continue
            if definition.startswith("CREATE UNIQUE") and not _leads_with_primary_key(live, table, columns):
                plan.skipped.append(f"unique index {name} on Cuebot's {table} (would refuse Cuebot's writes)")
                continue
        plan.steps.append(Step("index", f"{table}.{name}", [definition]))

    _plan_functions_and_triggers(plan, ref, live, present)

    for view, definition in sorted(ref.views.items()):
        if view not in live.views:
            plan.steps.append(Step("view", view, [f"CREATE VIEW {_q(view)} AS {definition}"]))

    for table in new_tables:
        if table != "django_migrations":  # recorded below, from the migrations on disk
            plan.steps.append(Step("rows", table, [], note="the rows cuesched's migrations put there"))

    plan.migrations = [m for m in recorded if m not in applied]
    for migration in plan.migrations:
        if migration in DATA_STEPS:
            note, sql = DATA_STEPS[migration]
            plan.steps.append(Step("data", f"{migration[0]}.{migration[1]}", [sql], note=note))
    return plan


# ---------------------------------------------------------------------------------------------
# Ownership and upgrade of cuesched's functions and triggers


def function_mark_sql(ident: str) -> str:
    """COMMENT the function with MARK and the sha256 of its definition as PostgreSQL renders it
    back (computed in the database, so read_catalog's next read hashes the very same text)."""
    target = _literal(ident)
    return (
        f"DO $mark$ BEGIN EXECUTE format('COMMENT ON FUNCTION %s IS %L', {target}::regprocedure, "
        f"{_literal(MARK)} || encode(sha256(convert_to(pg_get_functiondef({target}::regprocedure), 'UTF8')), 'hex'));"
        " END $mark$"
    )


def _mark_of(definition: str) -> str:
    return MARK + hashlib.sha256(definition.encode("utf-8")).hexdigest()


def _function_name(signature: str) -> str:
    return signature.split("(", 1)[0]


def function_owner(live: Catalog, signature: str) -> str | None:
    """Why the live function `signature` is certainly cuesched's, or None when it is not certain.

    Two proofs, nothing else (a name alone is never one): the function carries adoption's MARK
    with the hash of the very definition it has now, or it is pgtrigger's (pgtrigger's name
    pattern and pgtrigger's ignore guard calling _pgtrigger_should_ignore(TG_NAME), or the
    accounting triggers' DEFINER_MARK, which no Cuebot function has). A marked function whose
    definition changed since was rewritten by someone else (a Cuebot migration reusing the name, a DBA): not certain."""
    definition = live.functions[signature]
    if live.function_comments.get(signature) == _mark_of(definition):
        return "marked by adoption"
    if PGTRIGGER_NAME.match(_function_name(signature)) and signature.endswith("()") and (
        PGTRIGGER_GUARD in definition or DEFINER_MARK in definition
    ):
        return "pgtrigger's"
    return None


def _executes(definition: str) -> str | None:
    m = re.search(r"EXECUTE (?:FUNCTION|PROCEDURE) (?:public\.)?\"?([A-Za-z0-9_]+)\"?\(", definition)
    return m.group(1) if m else None


def trigger_owned(live: Catalog, table: str, name: str) -> bool:
    """pgtrigger's name, pgtrigger's hash in its comment, and it runs a function of the same name
    that is certainly cuesched's (function_owner): a Cuebot trigger satisfies none of the three."""
    definition, comment = live.triggers[(table, name)]
    if not PGTRIGGER_NAME.match(name) or not re.fullmatch(r"[0-9a-f]{40}", comment or ""):
        return False
    if _executes(definition) != name or f"{name}()" not in live.functions:
        return False
    return function_owner(live, f"{name}()") is not None


def runs_cuesched_function(live: Catalog, table: str, name: str) -> str | None:
    """The function the live trigger runs, when that function is certainly cuesched's, whatever
    the trigger is called: a renamed copy of cuesched's trigger still does cuesched's counting,
    and beside the one adoption installs under pgtrigger's name it would count twice."""
    function = _executes(live.triggers[(table, name)][0])
    if function is None or f"{function}()" not in live.functions:
        return None
    return function if function_owner(live, f"{function}()") is not None else None


def _enable_step(live: Catalog, table: str, name: str) -> Step | None:
    """ALTER TABLE ... ENABLE TRIGGER for cuesched's trigger left disabled (by a site's DISABLE
    TRIGGER, or session_replication_role games): it counts nothing, so counters go LOW."""
    state = live.trigger_enabled.get((table, name), "O")
    if state in ENABLED:
        return None
    return Step(
        "trigger",
        f"{table}.{name}",
        [f"ALTER TABLE {_q(table)} ENABLE TRIGGER {_q(name)}"],
        note=f"disabled: tgenabled {state!r}, it counts nothing",
        verb="enable",
    )


def _trigger_sql(table: str, name: str, definition: str, comment: str | None) -> list[str]:
    sql = [definition]
    if comment is not None:
        sql.append(f"COMMENT ON TRIGGER {_q(name)} ON {_q(table)} IS {_literal(comment)}")
    return sql


def _plan_functions_and_triggers(plan: Plan, ref: Catalog, live: Catalog, present: set[str]) -> None:
    """Add what is missing; replace or drop what is certainly cuesched's and out of date; report
    (and keep) every function of that name that is not certainly cuesched's."""
    # Functions first: a trigger is only upgraded when the function it runs is cuesched's.
    for signature, definition in sorted(ref.functions.items()):
        mark = function_mark_sql(ref.function_ids[signature])
        if signature not in live.functions:
            plan.steps.append(Step("function", signature, [definition, mark]))
            continue
        if _norm(live.functions[signature]) == _norm(definition):
            continue
        owner = function_owner(live, signature)
        if owner is None:
            changed = (live.function_comments.get(signature) or "").startswith(MARK)
            why = "changed after adoption installed it" if changed else "not certainly cuesched's"
            plan.differences.append(f"function {signature} (a function of that name differs from cuesched's; {why})")
            continue
        plan.steps.append(
            Step("function", signature, [definition, mark], note=f"body differs; {owner}", verb="replace")
        )

    # Stale: cuesched's triggers and functions the reference no longer has (renamed, moved or removed).
    # A trigger the reference does not have is stale when it is cuesched's by pgtrigger's proofs,
    # or, whatever its name, when it runs a function certainly cuesched's (a site's rename): kept,
    # it would count beside the trigger adoption installs under pgtrigger's name. Dropped, not
    # refused: the function proves what it does, and the reference's trigger does the same work.
    stale = sorted(
        k
        for k in live.triggers
        if k not in ref.triggers and (trigger_owned(live, *k) or runs_cuesched_function(live, *k))
    )
    dropped = set(stale)
    for (table, name), (definition, comment) in sorted(ref.triggers.items()):
        owner = CUEBOT_OWNS.get((table, trigger_base(name)))
        cuebots = owner is not None and (table, owner[0]) in live.triggers
        if (table, name) in live.triggers:
            if cuebots and trigger_owned(live, table, name):
                # Installing both would count twice: a later cuesched leaves this work to Cuebot.
                plan.steps.append(
                    Step(
                        "trigger",
                        f"{table}.{name}",
                        [f"DROP TRIGGER {_q(name)} ON {_q(table)}"],
                        note=f"Cuebot's {owner[0]} does this ({owner[1]})",
                        verb="drop",
                    )
                )
                dropped.add((table, name))
                continue
            live_def, live_comment = live.triggers[(table, name)]
            owned = trigger_owned(live, table, name)
            enable = _enable_step(live, table, name)
            if enable is not None and not owned:
                plan.differences.append(f"trigger {name} on {table} is disabled (not certainly cuesched's: left so)")
                enable = None
            if live_comment == comment and (comment is not None or _norm(live_def) == _norm(definition)):
                # pgtrigger's own test: the hash of the whole compiled trigger matches.
                if enable is not None:
                    plan.steps.append(enable)
                continue
            if not owned:
                plan.differences.append(f"trigger {name} on {table} (not certainly cuesched's)")
                continue
            if _norm(live_def) == _norm(definition):
                # Only the function changed (replaced above, atomically): record pgtrigger's new hash.
                plan.steps.append(
                    Step(
                        "trigger",
                        f"{table}.{name}",
                        _trigger_sql(table, name, "", comment)[1:],
                        note="pgtrigger's hash, for its new body",
                        verb="update",
                    )
                )
                if enable is not None:
                    plan.steps.append(enable)
            else:
                plan.steps.append(
                    Step(
                        "trigger",
                        f"{table}.{name}",
                        [f"DROP TRIGGER {_q(name)} ON {_q(table)}", *_trigger_sql(table, name, definition, comment)],
                        note="definition differs",
                        verb="replace",
                    )
                )
            continue
        if table not in present:
            continue
        if cuebots:
            plan.skipped.append(f"trigger {name} on {table}: Cuebot's {owner[0]} does this ({owner[1]})")
            continue
        replaces = [
            n
            for (t, n) in stale
            if t == table
            and (trigger_base(n) == trigger_base(name) or _executes(live.triggers[(t, n)][0]) == _executes(definition))
        ]
        plan.steps.append(
            Step(
                "trigger",
                f"{table}.{name}",
                _trigger_sql(table, name, definition, comment),
                note=f"replaces stale {replaces[0]}" if replaces else "",
            )
        )
    for table, name in stale:
        newer = [n for (t, n) in ref.triggers if t == table and trigger_base(n) == trigger_base(name)]
        note = f"stale, replaced by {newer[0]}" if newer else "stale: cuesched no longer has it"
        if not trigger_owned(live, table, name):
            note = (
                f"not pgtrigger's name, but it runs cuesched's {runs_cuesched_function(live, table, name)}() "
                "(a renamed copy: beside cuesched's own trigger it would count twice)"
            )
        plan.steps.append(
            Step("trigger", f"{table}.{name}", [f"DROP TRIGGER {_q(name)} ON {_q(table)}"], note=note, verb="drop")
        )
    # A stale function goes too, unless a trigger that stays still runs it (DROP would then fail).
    kept_users = {_executes(d) for k, (d, _c) in live.triggers.items() if k not in dropped}
    for signature in sorted(live.functions):
        if signature in ref.functions or function_owner(live, signature) is None:
            continue
        if _function_name(signature) in kept_users:
            plan.differences.append(f"function {signature} (stale, but a trigger that stays runs it)")
            continue
        plan.steps.append(
            Step("function", signature, [f"DROP FUNCTION {live.function_ids[signature]}"], note="stale", verb="drop")
        )
    _plan_locks(plan, live)


def _plan_locks(plan: Plan, live: Catalog) -> None:
    """Hold off the writers of every existing table whose triggers change, from the first
    statement to the commit, when anything of cuesched's is replaced or dropped.

    Why: CREATE OR REPLACE FUNCTION takes no table lock, so without this a writer's transaction
    could run one statement under the old body and the next under the new one, and a DROP and
    CREATE of a trigger must not let a write fall between (they are atomic to other sessions
    anyway, being one transaction). ACCESS EXCLUSIVE where a trigger is dropped or a column
    added (what DROP TRIGGER and ALTER TABLE take; taken up front, so no lock is upgraded
    later, which is how a reader-then-writer would deadlock with us), SHARE ROW EXCLUSIVE
    (what CREATE TRIGGER takes; readers go on) elsewhere. One table after another in Cuebot's own
    write order (CUEBOT_WRITE_ORDER), then by name; each waits at most the adoption lock timeout."""
    if not any(s.verb in ("replace", "drop", "update", "enable") for s in plan.steps):
        return
    runs: dict[str, set[str]] = {}
    for (table, _name), (definition, _c) in live.triggers.items():
        runs.setdefault(_executes(definition) or "", set()).add(table)
    modes: dict[str, str] = {}
    for step in plan.steps:
        if step.kind == "function" and step.verb != "add":
            tables = runs.get(_function_name(step.name), set())
        elif step.kind in ("trigger", "column"):
            tables = {step.name.split(".", 1)[0]}
        else:
            continue
        strong = step.kind == "column" or (step.kind == "trigger" and step.verb in ("drop", "replace"))
        for table in tables & set(live.tables):
            if strong or modes.get(table) != "ACCESS EXCLUSIVE":
                modes[table] = "ACCESS EXCLUSIVE" if strong else "SHARE ROW EXCLUSIVE"
    plan.steps[:0] = [
        Step("lock", table, [f"LOCK TABLE {_q(table)} IN {mode} MODE"], note=mode, verb="lock")
        for table, mode in sorted(modes.items(), key=lambda kv: _lock_order(kv[0]))
    ]


# The tables Cuebot's own transactions write, in the order they write them (a frame is started,
# then ProcDaoJdbc.insertVirtualProc and procCreated: proc, host, subscription, layer_resource,
# job_resource, folder_resource, point). Adoption locks in the same order: locking in any other
# (name order took folder_resource before host) waits for a table a booking holds while holding
# one it wants next, and PostgreSQL ends that deadlock by rolling one side back.
CUEBOT_WRITE_ORDER = (
    "frame",
    "proc",
    "host",
    "subscription",
    "layer_resource",
    "job_resource",
    "folder_resource",
    "point",
)


def _leads_with_primary_key(live: Catalog, table: str, columns: tuple[str, ...]) -> bool:
    """A unique index whose leading columns are the table's primary key can refuse no row: it is
    added to Cuebot's table too (accounting.move_locks: it only makes its columns key columns)."""
    for (t, _), (typ, definition) in live.constraints.items():
        if t == table and typ == "p":
            key = _key_columns(definition)
            return bool(key) and columns[: len(key)] == key
    return False


def _lock_order(table: str) -> tuple[int, str]:
    return (CUEBOT_WRITE_ORDER.index(table) if table in CUEBOT_WRITE_ORDER else len(CUEBOT_WRITE_ORDER), table)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _key_columns(definition: str) -> tuple[str, ...]:
    m = re.search(r"\(([^)]*)\)", definition)
    return tuple(c.strip().strip('"') for c in m.group(1).split(",")) if m else ()


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------------------------
# Reference database


def _reference_settings(using: str) -> dict[str, Any]:
    settings = dict(connections.databases[using])
    # PostgreSQL cuts a name at 63 bytes and Django refuses a longer one: a long database name
    # (one up to the limit is legal) must still leave room for the suffix.
    suffix = f"_cuesched_ref_{os.getpid()}"
    settings["NAME"] = settings["NAME"].encode()[: 63 - len(suffix)].decode(errors="ignore") + suffix
    settings.pop("TEST", None)
    return settings


def build_reference(using: str = "default") -> tuple[str, dict[str, Any]]:
    """A scratch database on the same server with cuesched's migrations applied, as a fresh install.

    `migrate` runs in a child process pointed at the scratch database: data migrations use the
    default connection (not their schema editor's alias), so an in-process second alias would
    write their rows into the database being adopted."""
    settings = _reference_settings(using)
    name = settings["NAME"]
    with connections[using].cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {_q(name)} WITH (FORCE)")
        cur.execute(f"CREATE DATABASE {_q(name)}")
    env = {**os.environ, "DATABASE_URL": url_from_settings(settings)}
    done = subprocess.run(
        [sys.executable, str(Path(django_settings.BASE_DIR) / "manage.py"), "migrate", "--no-input", "-v", "0"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        with connections[using].cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {_q(name)} WITH (FORCE)")
        raise AdoptionError(f"migrating the reference database {name} failed: {done.stderr.strip()[-2000:]}")
    connections.databases[REFERENCE_ALIAS] = settings
    return name, settings


def drop_reference(using: str, name: str) -> None:
    if REFERENCE_ALIAS in connections:
        connections[REFERENCE_ALIAS].close()
    connections.databases.pop(REFERENCE_ALIAS, None)
    with connections[using].cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {_q(name)} WITH (FORCE)")


def _applied_migrations(conn: BaseDatabaseWrapper, cat: Catalog) -> list[tuple[str, str]]:
    if "django_migrations" not in cat.tables:
        return []
    return [(a, n) for a, n in _rows(conn, "SELECT app, name FROM django_migrations ORDER BY id")]


def _row_counts(conn: BaseDatabaseWrapper, tables: list[str]) -> dict[str, int]:
    out = {}
    with conn.cursor() as cur:
        for table in tables:
            cur.execute(f"SELECT count(*) FROM {_q(table)}")
            out[table] = cur.fetchone()[0]
    return out


def _copy_rows(ref: BaseDatabaseWrapper, live: BaseDatabaseWrapper, tables: Iterable[str], cat: Catalog) -> list[str]:
    """Copy each new table's rows from the reference, parents first; identity sequences follow."""
    tables = list(tables)
    deps = {t: set() for t in tables}
    for (table, _name), (typ, definition) in cat.constraints.items():
        target = _fk_target(definition) if typ == "f" else None
        if table in deps and target in deps and target != table:
            deps[table].add(target)
    ordered: list[str] = []
    while deps:
        ready = sorted(t for t, d in deps.items() if not d - set(ordered))
        if not ready:
            ready = sorted(deps)
        for t in ready:
            ordered.append(t)
            deps.pop(t)
    done = []
    for table in ordered:
        cols = [c.name for c in cat.tables[table]]
        with ref.cursor() as cur:
            cur.execute(f"SELECT {', '.join(_q(c) for c in cols)} FROM {_q(table)}")
            rows = cur.fetchall()
        if not rows:
            continue
        overriding = " OVERRIDING SYSTEM VALUE" if any(c.identity == "a" for c in cat.tables[table]) else ""
        with live.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {_q(table)} ({', '.join(_q(c) for c in cols)}){overriding}"
                f" VALUES ({', '.join(['%s'] * len(cols))})",
                rows,
            )
            for col in cat.tables[table]:
                if col.identity or _owns_column(col):
                    cur.execute(
                        f"SELECT setval(pg_get_serial_sequence(%s, %s), COALESCE(MAX({_q(col.name)}), 0) + 1, false)"
                        f" FROM {_q(table)}",
                        [table, col.name],
                    )
        done.append(f"{table}: {len(rows)} rows")
    return done


@dataclass
class Result:
    plan: Plan
    applied: bool
    rows: list[str] = field(default_factory=list)
    reference_seconds: float = 0.0
    apply_seconds: float = 0.0

    def lines(self) -> list[str]:
        out = self.plan.lines()
        out += [f"copied {r}" for r in self.rows]
        out.append(f"reference database migrated in {self.reference_seconds:.2f} s")
        if self.applied:
            # The window in which Cuebot's writes to an altered table wait for adoption's locks.
            out.append(f"transaction applied in {self.apply_seconds:.2f} s (Cuebot's table locks held that long)")
        out.append("applied" if self.applied else "check only: nothing was written")
        return out


def adopt(*, apply: bool, using: str = "default") -> Result:
    """Plan the adoption of database `using` and, with apply, carry it out in one transaction.

    Raises AdoptionError (nothing written) when the database cannot be adopted."""
    live = connections[using]
    live_cat = read_catalog(live)
    if not live_cat.cuebot:
        raise AdoptionError(NOT_CUEBOT)
    early = make_plan(Catalog(), live_cat, set(), [])  # version and needed objects, before any work
    if early.errors:
        raise AdoptionError("; ".join(early.errors))
    started = time.monotonic()
    name, _settings = build_reference(using)
    reference_seconds = time.monotonic() - started
    try:
        ref = connections[REFERENCE_ALIAS]
        ref_cat = read_catalog(ref)
        recorded = _applied_migrations(ref, ref_cat)
        plan = make_plan(ref_cat, live_cat, set(_applied_migrations(live, live_cat)), recorded)
        counts = _row_counts(ref, [s.name for s in plan.steps if s.kind == "rows"])
        plan.steps = [s for s in plan.steps if s.kind != "rows" or counts[s.name]]
        for step in plan.steps:
            if step.kind == "rows":
                step.note = f"{counts[step.name]} rows that cuesched's migrations put there"
        if plan.errors:
            raise AdoptionError("; ".join(plan.errors))
        plan.warnings = limit_warnings(live) + job_cap_warnings(live)
        negative = negative_amounts(live, plan)
        if negative:
            if apply:
                raise AdoptionError(f"{negative}; nothing was written")
            plan.warnings.append(f"{negative}; --apply refuses until they are fixed")
        result = Result(plan, applied=False, reference_seconds=reference_seconds)
        if not apply:
            return result
        try:
            started = time.monotonic()
            result.rows = _apply(plan, live, ref, ref_cat, recorded, using)
            result.apply_seconds = time.monotonic() - started
        except OperationalError as exc:
            state = getattr(exc.__cause__, "sqlstate", None)
            if state == "55P03":  # lock_not_available
                raise AdoptionError(
                    f"a table lock was not granted within {conf.adopt_lock_timeout()} s ({exc}): a Cuebot "
                    "transaction holds it; retry at a quieter moment (CUESCHED_ADOPT_LOCK_TIMEOUT)"
                ) from exc
            if state == "40P01":  # deadlock_detected: PostgreSQL rolled adoption back, the writer went on
                first = str(exc).splitlines()[0]
                raise AdoptionError(
                    f"a table lock deadlocked with another transaction ({first}) and PostgreSQL rolled adoption "
                    "back; the other transaction went on: a writer that locks Cuebot's tables in another order "
                    "than Cuebot's own holds one; retry at a quieter moment"
                ) from exc
            raise
        result.applied = True
        return result
    finally:
        drop_reference(using, name)


def _phase(step: Step) -> int:
    """Order inside the transaction: locks first; stale triggers go before the functions they
    run; rows before constraints and triggers (the reference's rows satisfy them, and a
    keep-row trigger must not see its table half filled)."""
    if step.kind == "lock":
        return 0
    if step.kind == "function" and step.verb == "drop":
        return 4
    if step.kind in ("trigger", "data"):
        return 3 if step.verb == "drop" else 5
    order = ("sequence", "table", "column", "recount", "function", "view")
    if step.kind in order:
        return 1
    return 2  # constraint, index (after the rows)


def _step_keys(plan: Plan) -> list[tuple[str, str, str, tuple[str, ...]]]:
    return [s.key() for s in plan.steps if s.kind != "rows"]


# Limits whose max does not read as written: a NULL one anywhere, a negative one beside Cuebot.
LIMIT_MAX_CHECK_SQL = f"""
SELECT str_name, int_max_value FROM limit_record
WHERE {limit_max_sql("int_max_value")} IS DISTINCT FROM int_max_value
ORDER BY str_name
"""


# Cuebot books nothing of a job whose max is negative (its verify_job_resources refuses any
# increase, its dispatcher reads int_cores < int_max_cores); cuesched reads a negative cap as
# unlimited, and adoption stores it as Cuebot's unlimited (DATA_STEPS). Said before it happens.
NEGATIVE_JOB_CAPS_SQL = """
SELECT j.str_name FROM job_resource jr JOIN job j ON j.pk_job = jr.pk_job
WHERE (jr.int_max_cores < 0 OR jr.int_max_gpus < 0) AND j.str_state <> 'FINISHED'
ORDER BY j.str_name
"""


def job_cap_warnings(conn: BaseDatabaseWrapper) -> list[str]:
    """Unfinished jobs with a negative max that adoption will make unlimited, by name."""
    names = [r[0] for r in _rows(conn, NEGATIVE_JOB_CAPS_SQL)]
    if not names:
        return []
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return [
        f"{len(names)} unfinished job(s) have a negative max cores or GPUs, which Cuebot books nothing of: "
        f"{shown}; cuesched reads a negative job cap as unlimited and stores it as 2147483647, which Cuebot "
        "reads as unlimited too: set a max of 0 on any of them that must stay stopped before --apply"
    ]


def negative_amounts(conn: BaseDatabaseWrapper, plan: Plan) -> str | None:
    """The rows that the non-negative constraints this plan adds would refuse, named, or None."""
    adding = {s.name.split(".", 1)[1] for s in plan.steps if s.kind == "constraint"}
    amounts = tuple(a for a in nonnegative.AMOUNTS if a.name in adding)
    if not amounts:
        return None
    with conn.cursor() as cur:
        found = nonnegative.violations(cur, amounts)
    return nonnegative.describe(found) if found else None


def limit_warnings(conn: BaseDatabaseWrapper) -> list[str]:
    """Limits that run nothing although their max does not say 0, for the operator to fix first.

    Cuebot starts nothing under a NULL or negative max, and cuesched reads them the same way on
    its database; an operator who meant "unlimited" by -1 finds out here, not from idle frames.
    """
    out = []
    for name, raw in _rows(conn, LIMIT_MAX_CHECK_SQL):
        problem = limit_max_problem(name, raw, cuebot=True)
        out.append(
            f"{problem} (runs nothing under cuesched as under Cuebot); give it a max: 0 keeps that, "
            "a large number lets its frames run"
        )
    return out


def _apply(
    plan: Plan,
    live: BaseDatabaseWrapper,
    ref: BaseDatabaseWrapper,
    ref_cat: Catalog,
    recorded: list[tuple[str, str]],
    using: str,
) -> list[str]:
    """The plan in one transaction: a failure anywhere (a lock not granted, the connection lost)
    rolls all of it back, so the database is either adopted or untouched. Each lock is waited
    for at most CUESCHED_ADOPT_LOCK_TIMEOUT: a longer wait would queue Cuebot's writes behind it.

    The plan was made from a catalog read before the transaction (the reference takes seconds to
    build); once the writers are held off it is made again from the catalog as it is now, and a
    difference (a Cuebot migration or a second adoption ran meanwhile) fails it whole, so no step
    acts on ownership decided from a stale read."""
    kinds = ("sequence", "table", "column", "recount", "function", "view")
    with transaction.atomic(using=using, durable=True):
        with live.cursor() as cur:
            cur.execute("SELECT set_config('lock_timeout', %s, true)", [f"{int(conf.adopt_lock_timeout() * 1000)}ms"])
            for step in plan.steps:
                if _phase(step) == 0:
                    for sql in step.sql:
                        cur.execute(sql)
        live_cat = read_catalog(live)
        again = make_plan(ref_cat, live_cat, set(_applied_migrations(live, live_cat)), recorded)
        if _step_keys(again) != _step_keys(plan) or again.migrations != plan.migrations:
            raise AdoptionError(
                "the database changed while the plan was being made (a Cuebot migration or another adoption?): "
                "nothing was written; run --check again"
            )
        with live.cursor() as cur:
            for kind in kinds:
                for step in plan.steps:
                    if step.kind == kind and _phase(step) == 1:
                        for sql in step.sql:
                            cur.execute(sql)
        rows = _copy_rows(ref, live, [s.name for s in plan.steps if s.kind == "rows"], ref_cat)
        with live.cursor() as cur:
            for phase in (2, 3, 4, 5):
                for kind in ("constraint", "index", "trigger", "function", "data"):
                    for step in plan.steps:
                        if step.kind == kind and _phase(step) == phase:
                            for sql in step.sql:
                                cur.execute(sql)
            for app, mig in plan.migrations:
                cur.execute("INSERT INTO django_migrations (app, name, applied) VALUES (%s, %s, now())", [app, mig])
    return rows


def refuse_migrate_on_cuebot(using: str, plan: list[tuple[Any, bool]]) -> None:
    """Raise CommandError when `migrate` is about to apply migrations to a Cuebot database."""
    with connections[using].cursor() as cur:
        cur.execute(f"SELECT to_regclass('public.flyway_schema_history') IS NOT NULL OR {CUEBOT_ACCOUNTS}")
        cuebot = cur.fetchone()[0]
    if cuebot:
        names = ", ".join(f"{m.app_label}.{m.name}" for m, _backwards in plan[:5])
        raise CommandError(
            f"this is a Cuebot database (Flyway's history or Cuebot's verify_subscription trigger) and migrate "
            f"would apply {len(plan)} "
            f"migration(s) ({names}{', ...' if len(plan) > 5 else ''}), creating or altering Cuebot's "
            "objects; run `manage.py adopt_cuebot_db --check`, then `--apply`, instead (nothing was written)"
        )
