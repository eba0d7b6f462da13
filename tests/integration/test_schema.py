"""The migrated schema is Cuebot's: table and column names, types, defaults and keys.

The expectations are written out from the reference (farm-model-and-dispatch.md §1-2),
not derived from our models, so a model edit that drifts from Cuebot fails here. A second,
table-driven pass checks that every field of every farm model has its column with the
type Django would create, i.e. that the migrations and the models agree.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
from django.apps import apps
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db

TABLES = (
    "facility",
    "dept",
    "show",
    "alloc",
    "subscription",
    "point",
    "folder",
    "folder_resource",
    "job",
    "job_resource",
    "job_stat",
    "layer",
    "layer_resource",
    "layer_stat",
    "frame",
    "host",
    "host_stat",
    "host_tag",
    "proc",
    "service",  # Cuebot's, on every database since issue 29
    "show_service",
)

NOW = "<current time>"  # now(), CURRENT_TIMESTAMP, statement_timestamp() ...
NONE = "<no default>"
NOW_FUNCTIONS = {"now()", "current_timestamp", "statement_timestamp()", "transaction_timestamp()"}


class Col(NamedTuple):
    table: str
    column: str
    type: str  # information_schema data_type, with (n) for varchar
    default: str | None = None  # None: not checked
    nullable: bool | None = None  # None: not checked


def v36(table: str, column: str) -> Col:
    return Col(table, column, "character varying(36)", None, False)


Schema = dict[tuple[str, str], tuple[str, str, bool]]

REFERENCE: list[Any] = [
    # 2.1 organisation
    v36("facility", "pk_facility"),
    Col("facility", "str_name", "character varying(36)", NONE, False),
    v36("show", "pk_show"),
    Col("show", "str_name", "character varying(512)", NONE, False),
    Col("show", "b_active", "boolean", "true", False),
    Col("show", "b_scheduler_managed", "boolean", "false", False),
    Col("show", "b_paused", "boolean", "false", False),
    Col("show", "b_booking_enabled", "boolean", "true", False),
    Col("show", "b_dispatch_enabled", "boolean", "true", False),
    v36("alloc", "pk_alloc"),
    v36("alloc", "pk_facility"),
    Col("alloc", "str_name", "character varying(36)", NONE, False),
    Col("alloc", "str_tag", "character varying(24)"),
    Col("alloc", "b_enabled", "boolean", "true", False),
    v36("subscription", "pk_subscription"),
    v36("subscription", "pk_show"),
    v36("subscription", "pk_alloc"),
    Col("subscription", "int_size", "bigint", "0", False),
    Col("subscription", "int_burst", "bigint", "0", False),
    Col("subscription", "int_cores", "integer", "0", False),
    Col("subscription", "int_gpus", "integer", "0", False),
    v36("dept", "pk_dept"),
    Col("dept", "str_name", "character varying(36)", NONE, False),
    v36("point", "pk_point"),
    v36("point", "pk_show"),
    v36("point", "pk_dept"),
    Col("point", "int_cores", "integer", "0", False),
    Col("point", "int_gpus", "integer", "0", False),
    v36("folder", "pk_folder"),
    v36("folder", "pk_show"),
    Col("folder", "pk_parent_folder", "character varying(36)", NONE, True),
    v36("folder_resource", "pk_folder_resource"),
    v36("folder_resource", "pk_folder"),
    Col("folder_resource", "int_max_cores", "integer", "-1", False),
    Col("folder_resource", "int_max_gpus", "integer", "-1", False),
    Col("folder_resource", "int_cores", "integer", "0", False),
    Col("folder_resource", "int_gpus", "integer", "0", False),
    # 2.2 jobs, layers, frames
    v36("job", "pk_job"),
    v36("job", "pk_folder"),
    v36("job", "pk_show"),
    v36("job", "pk_facility"),
    v36("job", "pk_dept"),
    Col("job", "str_name", "character varying(255)", NONE, False),
    Col("job", "str_state", "character varying(16)", "PENDING", False),
    Col("job", "b_paused", "boolean", "false", False),
    Col("job", "str_os", "character varying(12)", NONE, True),
    Col("job", "str_show", "character varying(512)"),
    Col("job", "str_shot", "character varying(64)"),
    Col("job", "str_user", "character varying(32)"),
    Col("job", "int_uid", "bigint"),
    Col("job", "str_log_dir", "character varying(4000)"),
    Col("job", "str_loki_url", "character varying(4000)", NONE, True),
    v36("job_resource", "pk_job_resource"),
    v36("job_resource", "pk_job"),
    Col("job_resource", "int_priority", "integer", "1", False),
    Col("job_resource", "int_max_cores", "integer", "10000", False),
    Col("job_resource", "int_max_gpus", "integer", "100", False),
    Col("job_resource", "int_cores", "bigint", "0", False),
    Col("job_resource", "int_gpus", "integer", "0", False),
    v36("job_stat", "pk_job_stat"),
    v36("job_stat", "pk_job"),
    *(
        Col(table, f"int_{state}_count", "bigint", "0", False)
        for table in ("job_stat", "layer_stat")
        for state in ("waiting", "running", "dead", "depend", "eaten", "succeeded", "checkpoint", "total")
    ),
    v36("layer", "pk_layer"),
    v36("layer", "pk_job"),
    Col("layer", "str_name", "character varying(256)", NONE, False),
    Col("layer", "str_cmd", "character varying(4000)", NONE, False),
    Col("layer", "str_range", "character varying(4000)", NONE, False),
    Col("layer", "int_dispatch_order", "bigint", "1", False),
    Col("layer", "int_cores_min", "bigint", "100", False),
    Col("layer", "int_cores_max", "integer", "0", False),
    Col("layer", "int_mem_min", "bigint", "4194304", False),
    Col("layer", "int_gpus_min", "bigint", "0", False),
    Col("layer", "int_gpu_mem_min", "bigint", "0", False),
    Col("layer", "b_threadable", "boolean", "true", False),
    Col("layer", "str_tags", "character varying(4000)", "", False),
    Col("layer", "str_services", "character varying(128)", "default", False),
    Col("layer", "ts_start_after", "timestamp with time zone", NONE, True),
    v36("layer_stat", "pk_layer_stat"),
    v36("layer_stat", "pk_layer"),
    v36("layer_stat", "pk_job"),
    Col("layer_stat", "ts_started", "timestamp with time zone", NONE, True),
    Col("layer_stat", "ts_stopped", "timestamp with time zone", NONE, True),
    v36("layer_resource", "pk_layer_resource"),
    v36("layer_resource", "pk_layer"),
    v36("layer_resource", "pk_job"),
    v36("frame", "pk_frame"),
    v36("frame", "pk_layer"),
    v36("frame", "pk_job"),
    Col("frame", "str_name", "character varying(256)", NONE, False),
    Col("frame", "str_state", "character varying(24)", "WAITING", False),
    Col("frame", "int_version", "integer", "0"),
    Col("frame", "int_retries", "bigint", "0", False),
    Col("frame", "int_exit_status", "bigint", "-1", False),
    Col("frame", "str_host", "character varying(256)", NONE, True),
    Col("frame", "int_mem_reserved", "bigint", "0", False),
    Col("frame", "int_gpu_mem_reserved", "bigint", "0", False),
    Col("frame", "ts_started", "timestamp with time zone", NONE, True),
    Col("frame", "ts_stopped", "timestamp with time zone", NONE, True),
    Col("frame", "ts_updated", "timestamp with time zone", NOW),
    # 2.3 hosts and procs
    v36("host", "pk_host"),
    v36("host", "pk_alloc"),
    Col("host", "str_name", "character varying(45)", NONE, False),
    Col("host", "str_lock_state", "character varying(36)", "OPEN", False),
    *(Col("host", c, "bigint", None, False) for c in ("int_cores", "int_cores_idle", "int_mem", "int_mem_idle")),
    *(Col("host", c, "bigint", "0", False) for c in ("int_gpus", "int_gpus_idle", "int_gpu_mem", "int_gpu_mem_idle")),
    Col("host", "int_thread_mode", "integer", "0", False),
    Col("host", "b_nimby", "boolean", "false", False),
    Col("host", "str_tags", "character varying(128)"),
    v36("host_stat", "pk_host_stat"),
    v36("host_stat", "pk_host"),
    Col("host_stat", "str_state", "character varying(32)", "UP", False),
    Col("host_stat", "str_os", "character varying(32)"),
    Col("host_stat", "int_mem_total", "bigint", "0", False),
    Col("host_stat", "int_mem_free", "bigint", "0", False),
    Col("host_stat", "int_gpu_mem_free", "bigint", "0", False),
    Col("host_stat", "ts_ping", "timestamp with time zone", NOW, False),
    v36("host_tag", "pk_host_tag"),
    v36("host_tag", "pk_host"),
    Col("host_tag", "str_tag", "character varying(45)", NONE, False),
    Col("host_tag", "str_tag_type", "character varying(24)", "Hardware", False),
    v36("proc", "pk_proc"),
    *(v36("proc", c) for c in ("pk_host", "pk_show", "pk_job", "pk_layer", "pk_frame")),
    Col("proc", "int_cores_reserved", "bigint", NONE, False),
    Col("proc", "int_mem_reserved", "bigint", NONE, False),
    Col("proc", "int_mem_pre_reserved", "bigint", "0", False),
    Col("proc", "int_gpus_reserved", "integer", "0", False),
    Col("proc", "int_gpu_mem_reserved", "bigint", "0", False),
    Col("proc", "b_local", "boolean", "false", False),
    Col("proc", "ts_booked", "timestamp with time zone", NOW, False),
    # Cuebot's comments (issue 30): its ts_created has no time zone.
    v36("comments", "pk_comment"),
    Col("comments", "pk_job", "character varying(36)", NONE, True),
    Col("comments", "pk_host", "character varying(36)", NONE, True),
    Col("comments", "ts_created", "timestamp without time zone", NOW, False),
    v36("comments", "str_user"),
    Col("comments", "str_subject", "character varying(128)", NONE, False),
    Col("comments", "str_message", "character varying(4000)", NONE, False),
]

# Unique keys the dispatcher's ON CONFLICT clauses and lookups rely on.
UNIQUE_KEYS = [
    ("subscription", ("pk_alloc", "pk_show")),
    ("point", ("pk_dept", "pk_show")),
    ("layer", ("pk_job", "str_name")),
    ("frame", ("pk_job", "str_name")),
    ("proc", ("pk_frame",)),
    ("host", ("str_name",)),
    ("alloc", ("str_name",)),
    ("job", ("str_name",)),
    ("folder_resource", ("pk_folder",)),
    ("job_resource", ("pk_job",)),
    ("job_stat", ("pk_job",)),
    ("layer_resource", ("pk_layer",)),
    ("layer_stat", ("pk_layer",)),
    ("service", ("str_name",)),
    ("show_service", ("pk_show", "str_name")),
]

COLUMNS_SQL = """
SELECT table_name, column_name, data_type, character_maximum_length, column_default, is_nullable
FROM information_schema.columns WHERE table_schema = current_schema()
"""

UNIQUE_SQL = """
SELECT t.relname, array_agg(a.attname::text ORDER BY a.attname)
FROM pg_index i
JOIN pg_class t ON t.oid = i.indrelid
JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = ANY(i.indkey)
WHERE i.indisunique AND t.relnamespace = current_schema()::regnamespace
GROUP BY i.indexrelid, t.relname
"""

PRIMARY_KEY_SQL = """
SELECT tc.table_name, kcu.column_name
FROM information_schema.table_constraints tc
JOIN information_schema.key_column_usage kcu
  ON kcu.constraint_name = tc.constraint_name AND kcu.table_schema = tc.table_schema
WHERE tc.constraint_type = 'PRIMARY KEY' AND tc.table_schema = current_schema()
"""

FOREIGN_KEYS_SQL = """
SELECT tc.table_name, kcu.column_name, tc.is_deferrable, tc.initially_deferred
FROM information_schema.table_constraints tc
JOIN information_schema.key_column_usage kcu
  ON kcu.constraint_name = tc.constraint_name AND kcu.table_schema = tc.table_schema
WHERE tc.constraint_type = 'FOREIGN KEY' AND tc.table_schema = current_schema()
"""


def _columns() -> dict[tuple[str, str], tuple[str, str, bool]]:
    """(table, column) -> (type with length, normalised default, nullable)."""
    with connection.cursor() as cur:
        cur.execute(COLUMNS_SQL)
        rows = cur.fetchall()
    out = {}
    for table, column, data_type, length, default, nullable in rows:
        type_ = f"{data_type}({length})" if length else data_type
        out[(table, column)] = (type_, _normalise_default(default), nullable == "YES")
    return out


def _normalise_default(default: str | None) -> str:
    """`'-1'::integer` -> `-1`, `'UP'::character varying` -> `UP`, now() and friends -> NOW."""
    if default is None:
        return NONE
    if default.lower() in NOW_FUNCTIONS:
        return NOW
    text = re.sub(r"::[a-z ]+(\(\d+\))?$", "", default)
    if len(text) >= 2 and text[0] == text[-1] == "'":
        text = text[1:-1]
    return text


@pytest.fixture(scope="module")
def schema(django_db_setup: None, django_db_blocker: Any) -> dict[tuple[str, str], tuple[str, str, bool]]:
    with django_db_blocker.unblock():
        return _columns()


def test_migrations_are_all_applied() -> None:
    executor = MigrationExecutor(connection)
    assert executor.migration_plan(executor.loader.graph.leaf_nodes()) == []


@pytest.mark.parametrize("col", REFERENCE, ids=lambda c: f"{c.table}.{c.column}" if isinstance(c, Col) else None)
def test_reference_column(schema: Schema, col: Col) -> None:
    assert (col.table, col.column) in schema, f"{col.table}.{col.column} is missing"
    type_, default, nullable = schema[(col.table, col.column)]
    assert type_ == col.type
    if col.default is not None:
        assert default == col.default
    if col.nullable is not None:
        assert nullable is col.nullable


@pytest.mark.parametrize("table", TABLES)
def test_table_has_text_primary_key(schema: Schema, table: str) -> None:
    with connection.cursor() as cur:
        cur.execute(PRIMARY_KEY_SQL)
        primary = {(t, c) for t, c in cur.fetchall()}
    assert (table, f"pk_{table}") in primary
    assert [c for t, c in primary if t == table] == [f"pk_{table}"]
    assert schema[(table, f"pk_{table}")][0] == "character varying(36)"


@pytest.mark.parametrize("table", TABLES)
def test_every_model_field_has_its_column(schema: Schema, table: str) -> None:
    """Models and migrations agree: every field is a column of the type Django would create."""
    models = [m for m in apps.get_app_config("dispatch").get_models() if m._meta.db_table == table]
    assert len(models) == 1, f"no single model maps {table}"
    db_columns = {c for t, c in schema if t == table}
    for field in models[0]._meta.concrete_fields:
        assert field.column in db_columns, f"{table}.{field.column} is missing"
        type_ = schema[(table, field.column)][0]
        expected = field.rel_db_type(connection) if field.is_relation else field.db_type(connection)
        assert _django_type(expected) == type_, f"{table}.{field.column}"
        assert schema[(table, field.column)][2] is field.null, f"{table}.{field.column} nullability"
    assert db_columns == {f.column for f in models[0]._meta.concrete_fields}, "columns no model field maps"


def _django_type(db_type: str) -> str:
    db_type = db_type.replace("varchar", "character varying").replace("timestamp with time zone", "timestamptz")
    db_type = re.sub(r"numeric\(\d+, ?\d+\)", "numeric", db_type)
    return {"timestamptz": "timestamp with time zone", "bool": "boolean"}.get(db_type, db_type)


@pytest.mark.parametrize(("table", "columns"), UNIQUE_KEYS, ids=[f"{t}({','.join(c)})" for t, c in UNIQUE_KEYS])
def test_unique_key(table: str, columns: tuple[str, ...]) -> None:
    with connection.cursor() as cur:
        cur.execute(UNIQUE_SQL)
        keys = {(t, tuple(cols)) for t, cols in cur.fetchall()}
    assert (table, columns) in keys


def test_foreign_keys_are_deferred() -> None:
    """Writers (the seeder, Cuebot-style inserts) may write children before parents in one transaction."""
    with connection.cursor() as cur:
        cur.execute(FOREIGN_KEYS_SQL)
        rows = [r for r in cur.fetchall() if r[0] in TABLES]
    assert len(rows) >= 25
    assert [r for r in rows if r[2:] != ("YES", "YES")] == []
