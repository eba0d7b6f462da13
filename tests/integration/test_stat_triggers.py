"""job_stat and layer_stat always equal COUNT(*) of frames by state, and fan-out rows exist once.

Every check compares the trigger-kept counters with a fresh GROUP BY over frame, for both
stat tables, after bulk and single-row inserts, state changes and deletes, through raw
SQL (as a dispatcher or Cuebot writes) and through the ORM.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch.lab.seeding import FarmSeed, FarmSpec, seed_farm
from dispatch.models import Folder, Frame, Job, Layer
from dispatch.models.triggers import STATE_COLUMNS

pytestmark = pytest.mark.django_db

STATES = ("WAITING", "SETUP", "RUNNING", "SUCCEEDED", "DEPEND", "DEAD", "EATEN", "CHECKPOINT")

# Rows where a stat counter differs from the frames it counts; empty when the triggers are right.
MISMATCH_SQL = """
WITH truth AS (
  SELECT {key}, {counts}, count(*) AS int_total_count
  FROM frame GROUP BY {key}
)
SELECT s.{key}, {pairs}
FROM {table} s LEFT JOIN truth t ON t.{key} = s.{key}
WHERE {differs}
"""


def _mismatch_sql(table: str, key: str) -> str:
    columns = [*STATE_COLUMNS.values(), "int_total_count"]
    counts = ", ".join(f"count(*) FILTER (WHERE str_state = '{s}') AS {c}" for s, c in STATE_COLUMNS.items())
    pairs = ", ".join(f"s.{c}, coalesce(t.{c}, 0)" for c in columns)
    differs = " OR ".join(f"s.{c} <> coalesce(t.{c}, 0)" for c in columns)
    return MISMATCH_SQL.format(table=table, key=key, counts=counts, pairs=pairs, differs=differs)


JOB_MISMATCH = _mismatch_sql("job_stat", "pk_job")
LAYER_MISMATCH = _mismatch_sql("layer_stat", "pk_layer")


def assert_counters_match() -> None:
    with connection.cursor() as cur:
        cur.execute(JOB_MISMATCH)
        jobs = cur.fetchall()
        cur.execute(LAYER_MISMATCH)
        layers = cur.fetchall()
    assert jobs == [], "job_stat differs from COUNT(*) of frames"
    assert layers == [], "layer_stat differs from COUNT(*) of frames"


def execute(sql: str, params: Any = ()) -> int:
    """Always passes params, so `%%` means `%` in every statement here."""
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.rowcount


def counts(table: str, key: str, pk: str) -> dict[str, int]:
    with connection.cursor() as cur:
        cur.execute(f"SELECT * FROM {table} WHERE {key} = %s", [pk])
        row = cur.fetchone()
        names = [d.name for d in cur.description]
    return {n: v for n, v in zip(names, row, strict=True) if n.endswith("_count")}


@pytest.fixture
def farm() -> FarmSeed:
    """Two jobs of two layers each, no frames yet."""
    return seed_farm(FarmSpec(prefix="st", hosts=0, jobs=2, layers=2, frames_per_layer=0))


INSERT_FRAMES = """
INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, str_state, int_number, int_dispatch_order, int_layer_order)
SELECT gen_random_uuid()::text, l.pk_layer, l.pk_job, lpad(n::text, 4, '0') || '-' || l.str_name || %(tag)s,
       (%(states)s::text[])[1 + (n + %(shift)s) %% array_length(%(states)s::text[], 1)], n, n, n
FROM layer l CROSS JOIN generate_series(1, %(n)s) AS n
WHERE l.pk_layer = ANY(%(layers)s)
"""


def insert_frames(layers: list[str], n: int, states: tuple[str, ...] = STATES, shift: int = 0, tag: str = "") -> int:
    return execute(INSERT_FRAMES, {"layers": layers, "n": n, "states": list(states), "shift": shift, "tag": tag})


def test_bulk_insert_counts_every_state(farm: FarmSeed) -> None:
    assert insert_frames(list(farm.layer_ids), 16) == 64
    assert_counters_match()
    # 16 frames per layer cycling through the 8 states: 2 of each per layer, 4 per job.
    stat = counts("job_stat", "pk_job", farm.job_ids[0])
    assert stat == {column: 4 for column in STATE_COLUMNS.values()} | {"int_total_count": 32}
    layer = counts("layer_stat", "pk_layer", farm.layer_ids[0])
    assert layer == {column: 2 for column in STATE_COLUMNS.values()} | {"int_total_count": 16}


def test_orm_inserts_are_counted(farm: FarmSeed) -> None:
    layer = Layer.objects.get(pk=farm.layer_ids[0])
    Frame.objects.create(layer=layer, job_id=layer.job_id, str_name="0001-x", int_number=1)
    Frame.objects.bulk_create(
        [
            Frame(layer=layer, job_id=layer.job_id, str_name=f"{i:04d}-x", int_number=i, str_state="DEPEND")
            for i in range(2, 12)
        ]
    )
    assert_counters_match()
    stat = counts("layer_stat", "pk_layer", layer.pk)
    assert (stat["int_waiting_count"], stat["int_depend_count"], stat["int_total_count"]) == (1, 10, 11)


def test_single_state_change(farm: FarmSeed) -> None:
    insert_frames(list(farm.layer_ids), 5, states=("WAITING",))
    frame = Frame.objects.filter(layer_id=farm.layer_ids[0]).order_by("int_number").first()
    assert frame is not None
    assert (
        execute("UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1 WHERE pk_frame = %s", [frame.pk])
        == 1
    )
    assert_counters_match()
    stat = counts("layer_stat", "pk_layer", farm.layer_ids[0])
    assert (stat["int_waiting_count"], stat["int_running_count"], stat["int_total_count"]) == (4, 1, 5)

    Frame.objects.filter(pk=frame.pk).update(str_state="SUCCEEDED")  # ORM path
    frame.refresh_from_db()
    frame.str_state = "DEAD"
    frame.save(update_fields=["str_state"])
    assert_counters_match()
    assert counts("layer_stat", "pk_layer", farm.layer_ids[0])["int_dead_count"] == 1


def test_bulk_state_changes_across_jobs_and_layers(farm: FarmSeed) -> None:
    insert_frames(list(farm.layer_ids), 30, states=("WAITING", "DEPEND", "SETUP"))
    # One statement touching every layer of both jobs, from several old states at once.
    changed = execute("UPDATE frame SET str_state = CASE WHEN int_number %% 2 = 0 THEN 'RUNNING' ELSE 'EATEN' END")
    assert changed == 120
    assert_counters_match()
    execute("UPDATE frame SET str_state = 'WAITING' WHERE str_state = 'RUNNING'")
    execute("UPDATE frame SET str_state = 'CHECKPOINT' WHERE int_number <= 3")
    assert_counters_match()


def test_update_without_state_change_leaves_counts(farm: FarmSeed) -> None:
    insert_frames(list(farm.layer_ids), 10)
    before = counts("job_stat", "pk_job", farm.job_ids[0])
    execute("UPDATE frame SET int_version = int_version + 1, str_state = str_state")
    assert counts("job_stat", "pk_job", farm.job_ids[0]) == before
    assert_counters_match()


def test_setup_to_running_is_counted(farm: FarmSeed) -> None:
    """Cuebot's row trigger skips changes out of SETUP; ours must not drift there."""
    insert_frames(list(farm.layer_ids[:1]), 4, states=("SETUP",))
    execute("UPDATE frame SET str_state = 'RUNNING' WHERE pk_layer = %s", [farm.layer_ids[0]])
    assert_counters_match()
    stat = counts("layer_stat", "pk_layer", farm.layer_ids[0])
    assert (stat["int_running_count"], stat["int_total_count"]) == (4, 4)


def test_deletes_single_and_bulk(farm: FarmSeed) -> None:
    insert_frames(list(farm.layer_ids), 16)
    one = Frame.objects.filter(job_id=farm.job_ids[0]).first()
    assert one is not None
    one.delete()
    assert_counters_match()
    assert execute("DELETE FROM frame WHERE str_state IN ('WAITING', 'DEAD', 'SETUP')") > 0
    assert_counters_match()
    Frame.objects.filter(job_id=farm.job_ids[1]).delete()
    assert_counters_match()
    assert counts("job_stat", "pk_job", farm.job_ids[1])["int_total_count"] == 0


def test_seeded_frames_are_counted_by_the_triggers() -> None:
    seed = seed_farm(FarmSpec(prefix="sc", hosts=0, jobs=3, layers=2, frames_per_layer=7))
    assert_counters_match()
    for pk in seed.job_ids:
        stat = counts("job_stat", "pk_job", pk)
        assert (stat["int_waiting_count"], stat["int_total_count"]) == (14, 14)


frame_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.integers(1, 6), st.integers(0, 7)),
        st.tuples(st.just("update"), st.sampled_from(STATES), st.sampled_from(STATES), st.integers(1, 4)),
        st.tuples(st.just("delete"), st.sampled_from(STATES), st.integers(1, 4), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=frame_ops)
def test_random_statements_keep_counters_exact(farm: FarmSeed, ops: list[tuple[Any, ...]]) -> None:
    """Any mix of multi-row inserts, state changes and deletes leaves every counter exact."""
    layers = list(farm.layer_ids)
    # Each example runs in its own savepoint, rolled back, so examples never see each other's frames.
    with transaction.atomic():
        for step, op in enumerate(ops):
            kind = op[0]
            if kind == "insert":
                _, layer, n, shift = op
                insert_frames([layers[layer]], n, shift=shift, tag=f"-{step}")
            elif kind == "update":
                _, old, new, modulo = op
                sql = "UPDATE frame SET str_state = %s WHERE str_state = %s AND int_number %% %s = 0"
                execute(sql, [new, old, modulo])
            else:
                _, state, modulo, rest = op
                sql = "DELETE FROM frame WHERE str_state = %s AND int_number %% %s = %s"
                execute(sql, [state, modulo, rest % modulo])
            assert_counters_match()
        transaction.set_rollback(True)


def _children_per_parent(child: str, key: str) -> dict[str, int]:
    with connection.cursor() as cur:
        cur.execute(f"SELECT {key}, count(*) FROM {child} GROUP BY {key}")
        return dict(cur.fetchall())


FANOUT = [
    ("folder", "pk_folder", ["folder_resource"]),
    ("job", "pk_job", ["job_stat", "job_resource"]),
    ("layer", "pk_layer", ["layer_stat", "layer_resource"]),
]


def test_fanout_rows_exist_exactly_once() -> None:
    """Seeded (COPY), ORM-created and INSERT ... SELECT parents each get one row per child table."""
    seed = seed_farm(FarmSpec(prefix="fo", hosts=0, shows=2, folders_per_show=3, jobs=4, layers=3, frames_per_layer=1))
    show_id = seed.show_ids[0]
    root = Folder.objects.get(pk=seed.folder_ids[0])
    folder = Folder.objects.create(show_id=show_id, parent_folder=root, str_name="fo_orm")
    job = Job.objects.create(
        folder=folder,
        show_id=show_id,
        facility_id=seed.facility_ids[0],
        dept_id=seed.dept_ids[0],
        str_name="fo_orm_job",
    )
    Layer.objects.create(job=job, str_name="orm", str_cmd="true", str_range="1-1")
    # A multi-row INSERT ... SELECT: one statement, several new layers.
    execute(
        """INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range)
           SELECT gen_random_uuid()::text, %s, 'sql' || n, 'true', '1-1' FROM generate_series(1, 5) n""",
        [job.pk],
    )
    for parent, key, children in FANOUT:
        with connection.cursor() as cur:
            cur.execute(f"SELECT {key} FROM {parent}")
            parents = {r[0] for r in cur.fetchall()}
        assert parents
        for child in children:
            per_parent = _children_per_parent(child, key)
            assert set(per_parent) == parents, f"{child} rows missing or orphaned"
            assert set(per_parent.values()) == {1}, f"{child} has duplicates"
