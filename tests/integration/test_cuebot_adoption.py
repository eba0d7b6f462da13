"""Adopting a real Cuebot database (issue 22): OpenCue's schema V1-V47 and seed data, built from
tests/data/opencue-schema/, then `manage.py adopt_cuebot_db` run on it as an operator runs it.

What must hold: `--check` writes nothing; `--apply` only adds (every object of Cuebot's dump and
catalog is still there, identical); a second `--apply` has nothing to do; `migrate` afterwards
applies nothing; a database that is not Cuebot's, or older than V45, is refused unchanged; and a
later Cuebot Flyway migration (V47, on a V46 database) still applies after adoption.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg
import pytest

from dispatch.adoption import Catalog, read_catalog
from dispatch.engine.feed import fetch_pending
from tests.integration import cuebot_support as cb
from tests.integration.cuebot_standin import CuebotStandIn
from tests.integration.test_stat_triggers import JOB_MISMATCH, LAYER_MISMATCH


def catalog(url: str) -> Catalog:
    with psycopg.connect(url) as conn:
        return read_catalog(conn)


@dataclass
class Adopted:
    url: str
    before: str
    before_catalog: Catalog
    check: str
    after_check: str
    apply: str
    after_apply: str
    after_catalog: Catalog
    again: str
    after_again: str
    migrate: str
    after_migrate: str


@pytest.fixture(scope="module")
def adopted() -> Adopted:
    name = cb.cuebot_db_name("adopt")
    url = cb.build_cuebot_db(name)
    try:
        # A farm's own services, as its operators left them: Cuebot's seed edited and one deleted.
        # Adoption must keep them (cuesched's 0041_services_seed is not run there).
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE service SET int_mem_min = 16777216 WHERE str_name = 'arnold'")
            conn.execute("DELETE FROM service WHERE str_name = 'nuke'")
        before, before_catalog = cb.schema_dump(url), catalog(url)
        check = cb.manage(url, "adopt_cuebot_db", "--check").stdout
        after_check = cb.schema_dump(url)
        apply = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        after_apply, after_catalog = cb.schema_dump(url), catalog(url)
        again = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        after_again = cb.schema_dump(url)
        migrate = cb.manage(url, "migrate", "--no-input").stdout
        after_migrate = cb.schema_dump(url)
        yield Adopted(
            url,
            before,
            before_catalog,
            check,
            after_check,
            apply,
            after_apply,
            after_catalog,
            again,
            after_again,
            migrate,
            after_migrate,
        )
    finally:
        cb.drop_database(name)


def test_check_reports_the_plan_and_writes_nothing(adopted: Adopted) -> None:
    assert "Cuebot schema version: V47" in adopted.check
    assert "add table cuesched_accounting_settings" in adopted.check
    assert "add column host.ts_last_updated" in adopted.check
    assert "add trigger proc.pgtrigger_acct_proc_delete_" in adopted.check
    assert "skip trigger pgtrigger_frame_stat_update_" in adopted.check
    assert "skip trigger pgtrigger_job_finished_satisfy_depends_" in adopted.check
    assert "check only: nothing was written" in adopted.check
    assert adopted.after_check == adopted.before
    assert "NOT READY" not in adopted.check and "ERROR" not in adopted.check


def test_apply_only_adds_every_cuebot_object_is_unchanged(adopted: Adopted) -> None:
    # The dump, line by line: nothing of Cuebot's lost or rewritten.
    lost = cb.dump_lines(adopted.before) - cb.dump_lines(adopted.after_apply)
    assert not lost, f"lines of Cuebot's schema changed or gone: {sorted(lost)[:20]}"
    assert len(adopted.after_apply) > len(adopted.before)
    # The catalog, object by object: every pre-existing one identical.
    b, a = adopted.before_catalog, adopted.after_catalog
    for table, cols in b.tables.items():
        assert a.tables[table][: len(cols)] == cols, table
    for kind in ("constraints", "indexes", "triggers", "functions", "sequences", "views"):
        old, new = getattr(b, kind), getattr(a, kind)
        changed = [k for k in old if new.get(k) != old[k]]
        assert not changed, f"{kind} changed or dropped: {changed}"
    # The indexes issue 22 saw `migrate` drop are Cuebot's and stay.
    assert {
        ("depend", "i_depend_pk_er_job"),
        ("depend", "i_depend_pk_on_job"),
        ("depend", "i_depend_active_er_job_only"),
    } <= set(a.indexes)
    assert "applied" in adopted.apply.splitlines()[-1]


def test_apply_installs_cuesched_objects_and_their_rows(adopted: Adopted) -> None:
    a = adopted.after_catalog
    triggers = {name.rsplit("_", 1)[0] for (_t, name) in a.triggers if name.startswith("pgtrigger_")}
    assert {
        "pgtrigger_acct_proc_insert",
        "pgtrigger_acct_proc_delete",
        "pgtrigger_acct_show_flip",
        "pgtrigger_acct_limit_sub_update",
        "pgtrigger_acct_host_move",
    } <= triggers
    # Where Cuebot's own trigger does the work, cuesched's is not installed (it would count twice).
    assert not triggers & {
        "pgtrigger_frame_stat_insert",
        "pgtrigger_frame_stat_update",
        "pgtrigger_job_fanout",
        "pgtrigger_layer_fanout",
        "pgtrigger_folder_fanout",
        "pgtrigger_acct_usage_guard",
        "pgtrigger_frame_when_done_satisfy_depends",
        "pgtrigger_job_finished_satisfy_depends",
    }
    names = {c.name for c in a.tables["show"]}
    assert {"int_job_insert_count", "int_frame_fail_count", "b_scheduler_managed"} <= names
    # The console's frame list reads its order from this index (Cuebot has none on ts_updated).
    assert ("frame", "i_frame_updated") not in adopted.before_catalog.indexes
    assert a.indexes[("frame", "i_frame_updated")][1] == ("ts_updated", "pk_frame")
    # A mover's UPDATE locks its row FOR UPDATE up front (accounting.move_locks), beside Cuebot
    # too: a unique index that leads with the primary key refuses none of Cuebot's writes.
    assert a.indexes[("host", "i_host_move_lock")][1] == ("pk_host", "pk_alloc")
    assert a.indexes[("job", "i_job_move_lock")][1] == ("pk_job", "pk_folder", "pk_dept", "pk_show")
    with psycopg.connect(adopted.url) as conn:
        assert conn.execute("SELECT notify_enabled FROM cuesched_accounting_settings WHERE id = 1").fetchone() == (
            True,
        )
        assert conn.execute("SELECT count(*) FROM auth_group").fetchone()[0] >= 1
        recorded = conn.execute("SELECT count(*) FROM django_migrations WHERE app = 'dispatch'").fetchone()[0]
        assert recorded >= 9


def test_cuebots_service_tables_get_nothing_added_and_keep_their_rows(adopted: Adopted) -> None:
    """cuesched's migrations create `service` and `show_service` too (issue 29) and seed Cuebot's
    default services: on Cuebot's database both tables are Cuebot's, so the models must match
    Cuebot's columns (names, types, nullability, defaults), adoption adds nothing to them, and
    the reference database's seeded rows are not copied over Cuebot's. The same holds for
    `comments` (issue 30: its ts_created is Cuebot's TIMESTAMP without time zone)."""
    b, a = adopted.before_catalog, adopted.after_catalog
    for table in ("service", "show_service", "comments"):
        assert a.tables[table] == b.tables[table], table
        assert {k: v for k, v in a.indexes.items() if k[0] == table} == {
            k: v for k, v in b.indexes.items() if k[0] == table
        }
        assert {k for k in a.triggers if k[0] == table} == {k for k in b.triggers if k[0] == table}
        assert {k for k in a.constraints if k[0] == table} == {k for k in b.constraints if k[0] == table}
        steps = [line for line in adopted.apply.splitlines() if f" {table}." in line or line.endswith(f" {table}")]
        assert not [s for s in steps if not s.startswith("skip ")], steps
        # Column types and nullability: no "keep Cuebot's service.x ..." difference either.
        assert f"keep Cuebot's {table}." not in adopted.check
    with psycopg.connect(adopted.url) as conn:
        rows = conn.execute("SELECT pk_service, str_name, int_mem_min FROM service ORDER BY str_name").fetchall()
        seeded = conn.execute(
            "SELECT count(*) FROM django_migrations WHERE app = 'dispatch' AND name IN"
            " ('0040_services_tables', '0041_services_seed')"
        ).fetchone()[0]
    # The farm's edit and its deletion stand: nothing reseeded, nothing copied over Cuebot's rows.
    assert len(rows) == 9 and ("AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA2", "arnold", 16777216) in rows
    assert "nuke" not in {name for _pk, name, _mem in rows}
    assert seeded == 2  # recorded as applied, so a later `migrate` has nothing to run on them
    assert "copied service" not in adopted.apply and "copied show_service" not in adopted.apply


def test_a_second_apply_has_nothing_to_do_and_migrate_applies_nothing(adopted: Adopted) -> None:
    assert "nothing to add: the database is adopted" in adopted.again
    assert adopted.after_again == adopted.after_apply
    assert "No migrations to apply." in adopted.migrate
    assert adopted.after_migrate == adopted.after_apply


def test_a_database_that_is_not_cuebots_or_older_than_v45_is_refused_unchanged() -> None:
    name = cb.cuebot_db_name("old")
    url = cb.build_cuebot_db(name, stop_at=44, seed=False)
    try:
        before = cb.schema_dump(url)
        done = cb.manage(url, "adopt_cuebot_db", "--apply", check=False)
        assert done.returncode == 1
        assert "older than V45" in done.stderr and "nothing was written" in done.stderr
        assert cb.schema_dump(url) == before
        # Without Flyway's history it is still recognised as Cuebot's, and still too old.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE flyway_schema_history")
        done = cb.manage(url, "adopt_cuebot_db", "--check", check=False)
        assert done.returncode == 1 and "show.b_scheduler_managed is missing" in done.stderr, done.stderr
        # Not Cuebot's at all: neither Flyway's history nor Cuebot's verify_subscription trigger.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER verify_subscription ON subscription")
        done = cb.manage(url, "adopt_cuebot_db", "--check", check=False)
        assert done.returncode == 1 and "not a Cuebot database" in done.stderr
    finally:
        cb.drop_database(name)


def test_a_cuebot_database_built_without_flyway_is_adopted_and_migrate_is_refused_on_it() -> None:
    """A Cuebot schema loaded with psql (OpenCue's migrations in order, no Flyway, so no
    flyway_schema_history) was refused as "not a Cuebot database", and `migrate` was let loose on
    it. It is recognised by Cuebot's verify_subscription trigger, as Cuebot mode recognises it."""
    name = cb.cuebot_db_name("noflyway")
    url = cb.build_cuebot_db(name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE flyway_schema_history")
        before = cb.schema_dump(url)
        done = cb.manage(url, "migrate", "--no-input", check=False)
        assert done.returncode == 1 and "this is a Cuebot database" in done.stderr, done.stdout + done.stderr
        assert cb.schema_dump(url) == before
        check = cb.manage(url, "adopt_cuebot_db", "--check").stdout
        assert "no Flyway history: recognised as Cuebot's schema" in check
        assert "add column host.ts_last_updated" in check
        cb.manage(url, "adopt_cuebot_db", "--apply")
        after = cb.dump_lines(cb.schema_dump(url))
        assert not cb.dump_lines(before) - after, "adoption dropped or changed a Cuebot object"
        assert "nothing to add: the database is adopted" in cb.manage(url, "adopt_cuebot_db", "--check").stdout
        assert "No migrations to apply." in cb.manage(url, "migrate", "--no-input").stdout
    finally:
        cb.drop_database(name)


def test_cuebots_v47_applies_after_adoption_of_a_v46_database() -> None:
    name = cb.cuebot_db_name("v46")
    url = cb.build_cuebot_db(name, stop_at=46)
    try:
        out = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        # layer.ts_start_after is Cuebot's (V47): adoption must leave it to Flyway and say so.
        assert "NOT READY: Cuebot's column layer.ts_start_after is missing" in out
        cb.apply_migration(url, cb.migration(47))
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT max(version::int) FROM flyway_schema_history").fetchone()[0] == 47
        out = cb.manage(url, "adopt_cuebot_db", "--check").stdout
        assert "nothing to add: the database is adopted" in out and "NOT READY" not in out
        assert "No migrations to apply." in cb.manage(url, "migrate", "--no-input").stdout
    finally:
        cb.drop_database(name)


def test_a_job_submitted_through_cuesched_is_dispatchable_on_the_adopted_database(adopted: Adopted, tmp_path) -> None:
    """Issue 22: on Cuebot's schema the frame counters are Cuebot's trigger's, which counts no
    insert, so a job without dependencies never became dispatchable; and a dependency failed on
    Cuebot's `depend.str_signature NOT NULL`."""
    spec = {
        "show": "testing",
        "name": "testing-sh010-adopt_v1",
        "user": "alice",
        "layers": [
            {"name": "sim", "command": "sim #IFRAME#", "range": "1-4", "chunk_size": 2},
            {
                "name": "render",
                "command": "render #IFRAME#",
                "range": "1-4",
                "depends": [{"layer": "sim", "type": "frame"}],
            },
            {"name": "movie", "command": "movie", "range": "1", "depends": [{"layer": "render", "type": "layer"}]},
        ],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    cb.manage(adopted.url, "submit_job", str(path))
    with psycopg.connect(adopted.url) as conn:
        pk_job = conn.execute("SELECT pk_job FROM job WHERE str_name = %s", [spec["name"]]).fetchone()[0]
        # Every counter equals COUNT(frame), per job and per layer.
        assert conn.execute(JOB_MISMATCH).fetchall() == []
        assert conn.execute(LAYER_MISMATCH).fetchall() == []
        waiting = conn.execute("SELECT int_waiting_count, int_depend_count FROM job_stat WHERE pk_job = %s", [pk_job])
        assert waiting.fetchone() == (2, 5)
        signatures = conn.execute("SELECT str_signature FROM depend WHERE pk_job_depend_er = %s", [pk_job]).fetchall()
        assert len(signatures) == 5 and all(s for (s,) in signatures) and len(set(signatures)) == 5
        # Cuebot reads str_target back as its DependTarget enum: 'Internal', the column's default, is none.
        targets = conn.execute("SELECT DISTINCT str_target FROM depend WHERE pk_job_depend_er = %s", [pk_job])
        assert targets.fetchall() == [("INTERNAL",)]
        # The scheduler's feed sees the job and its two waiting sim frames.
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE str_name = 'testing'")
        conn.commit()
        work = fetch_pending(conn, managed_only=True, max_jobs=10, frames_per_layer=10)
        mine = [w for w in work if w.pk == pk_job]
        assert mine, "the submitted job is not dispatchable"
        frames = [f for layer in mine[0].layers for f in layer.frames]
        assert sorted(f.name for f in frames) == ["0001-sim", "0003-sim"]


EAT_FRAMES = "UPDATE frame SET str_state = 'EATEN', int_version = int_version + 1 WHERE pk_job = ANY(%s)"


def _submit_one(url: str, tmp_path, name: str) -> str:
    spec = {
        "show": "testing",
        "name": name,
        "user": "alice",
        "layers": [{"name": "main", "command": "true", "range": "1-2"}],
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    cb.manage(url, "submit_job", str(path))
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT pk_job FROM job WHERE str_name = %s", [name]).fetchone()[0]


def test_cuebot_satisfies_what_depends_on_a_job_it_finishes_once_beside_cuesched(adopted: Adopted, tmp_path) -> None:
    """Cuebot satisfies what waits on a job in Java, after the job is FINISHED (shutdownJob ->
    satisfyWhatDependsOn): adoption leaves cuesched's job trigger out, as it leaves the frame
    trigger out. Installed beside Cuebot, the trigger set Cuebot's FRAME_ON_JOB row inactive in
    the job's UPDATE without counting its frame down (a type cuesched does not write); Cuebot's
    own satisfy then found the row inactive and skipped it: the frame stayed DEPEND for ever. And
    it left the satisfied rows' signatures, which Cuebot resets so the depend can be made again.
    A dependency cuesched adds (`manage.py job depend`) is one Cuebot satisfies the same way, and
    its str_target one Cuebot's DependTarget enum reads (the column's default, 'Internal', is not)."""
    url = adopted.url
    on, frame_er, job_er, cli_er = (
        _submit_one(url, tmp_path, f"testing-sh040-{n}_v1") for n in ("target", "frame", "job", "cli")
    )
    with psycopg.connect(url, autocommit=True) as conn:
        managed = conn.execute("SELECT b_scheduler_managed FROM show WHERE str_name = 'testing'").fetchone()[0]
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE str_name = 'testing'")
        (first,) = conn.execute(
            "SELECT pk_frame FROM frame WHERE pk_job = %s AND int_number = 1", [frame_er]
        ).fetchone()
    standin = CuebotStandIn(url)
    try:
        standin.depend_on_job("FRAME_ON_JOB", er_job=frame_er, on_job=on, er_frame=first)
        standin.depend_on_job("JOB_ON_JOB", er_job=job_er, on_job=on)
        out = cb.manage(url, "job", "depend", "testing-sh040-cli_v1", "--on-job", "testing-sh040-target_v1").stdout
        assert "2 waiting frame(s) now DEPEND" in out, out
        with psycopg.connect(url) as conn:
            waiting = conn.execute(
                "SELECT pk_job, str_state, int_depend_count FROM frame WHERE pk_job = ANY(%s) AND str_state = 'DEPEND'",
                [[frame_er, job_er, cli_er]],
            ).fetchall()
        assert sorted((j, c) for j, _s, c in waiting) == sorted(
            [(frame_er, 1), (job_er, 1), (job_er, 1), (cli_er, 1), (cli_er, 1)]
        )
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(EAT_FRAMES, [[on]])  # the job is done: Cuebot finishes it
        assert standin.shutdown_job(on)
    finally:
        standin.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE show SET b_scheduler_managed = %s WHERE str_name = 'testing'", [managed])
    with psycopg.connect(url) as conn:
        frames = conn.execute(
            "SELECT str_state, int_depend_count FROM frame WHERE pk_job = ANY(%s)", [[frame_er, job_er, cli_er]]
        ).fetchall()
        assert frames == [("WAITING", 0)] * 6
        depends = conn.execute(
            "SELECT b_active, str_signature = pk_depend, ts_satisfied IS NOT NULL FROM depend "
            "WHERE pk_job_depend_on = %s",
            [on],
        ).fetchall()
        assert depends == [(False, True, True)] * 3
        # Across jobs, as Cuebot writes its own (the value its DependTarget enum reads back).
        target = "SELECT str_target FROM depend WHERE pk_job_depend_er = %s"
        assert conn.execute(target, [cli_er]).fetchall() == [("EXTERNAL",)]
        assert conn.execute(JOB_MISMATCH).fetchall() == []
        assert conn.execute(LAYER_MISMATCH).fetchall() == []
        # The later tests' scheduler runs until no frame waits: these are not its work.
        conn.execute(EAT_FRAMES, [[frame_er, job_er, cli_er]])


CLOUD_GENERAL = "00000000-0000-0000-0000-000000000003"  # the seed's cloud.general, in the default facility


def test_run_scheduler_books_a_managed_show_on_the_adopted_database(adopted: Adopted, tmp_path) -> None:
    """Issue 22: `run_scheduler` looped on `column h.ts_last_updated does not exist`. cuesched's
    own columns (host.ts_last_updated, job_stat.int_total_count, the show counters) are adoption
    additions, so the scheduler reads them there; it books and completes a managed show's job."""
    spec = {
        "show": "testing",
        "name": "testing-sh020-sched_v1",
        "user": "alice",
        "layers": [{"name": "main", "command": "true", "range": "1-3"}],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    cb.manage(adopted.url, "submit_job", str(path))
    cb.insert_host(adopted.url, "adopt-h1", alloc=CLOUD_GENERAL)
    with psycopg.connect(adopted.url) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE str_name = 'testing'")
    done = cb.manage(
        adopted.url,
        "run_scheduler",
        "--launcher",
        "simulated",
        "--runtime",
        "0.05",
        "--managed-only",
        "--exit-when-idle",
        "--metrics-port",
        "0",
        check=False,
        timeout=180,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "does not exist" not in log and "Traceback" not in log, log
    with psycopg.connect(adopted.url) as conn:
        states = conn.execute(
            "SELECT f.str_state, count(*) FROM frame f JOIN job j USING (pk_job) WHERE j.str_name = %s GROUP BY 1",
            [spec["name"]],
        ).fetchall()
        assert states == [("SUCCEEDED", 3)]
        assert conn.execute("SELECT count(*) FROM proc").fetchone()[0] == 0
        assert conn.execute(JOB_MISMATCH).fetchall() == []


def test_adoption_that_cannot_get_a_lock_fails_whole_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Cuebot transaction holding a table adoption must alter (here `host`, for its added
    column): adoption waits CUESCHED_ADOPT_LOCK_TIMEOUT, then gives up with nothing written,
    rather than queueing Cuebot's writes behind it; once the lock is free it applies."""
    name = cb.cuebot_db_name("locked")
    url = cb.build_cuebot_db(name, seed=False)
    try:
        before = cb.schema_dump(url)
        monkeypatch.setenv("CUESCHED_ADOPT_LOCK_TIMEOUT", "0.5")
        with psycopg.connect(url) as cuebot:
            cuebot.execute("LOCK TABLE host IN ROW EXCLUSIVE MODE")  # what Cuebot's host UPDATE holds
            done = cb.manage(url, "adopt_cuebot_db", "--apply", check=False)
            assert done.returncode == 1, done.stdout + done.stderr
            assert "lock was not granted" in done.stderr and "nothing was written" in done.stderr
        assert cb.schema_dump(url) == before
        out = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        assert "add column host.ts_last_updated" in out and out.rstrip().endswith("applied")
    finally:
        cb.drop_database(name)


def test_migrate_with_migrations_to_apply_on_a_cuebot_database_is_refused_before_writing() -> None:
    """Issue 22: `migrate` on Cuebot's database failed half way, or forced through dropped
    Cuebot's indexes. It now stops before the first migration and names the command to run;
    after adoption recorded them, a migration cuesched adds later (here: one forgotten in
    django_migrations) is refused the same way until adoption is run again."""
    name = cb.cuebot_db_name("migrate")
    url = cb.build_cuebot_db(name, seed=False)
    try:
        before = cb.schema_dump(url)
        done = cb.manage(url, "migrate", "--no-input", check=False)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "this is a Cuebot database" in done.stderr and "adopt_cuebot_db" in done.stderr
        assert cb.schema_dump(url) == before
        cb.manage(url, "adopt_cuebot_db", "--apply")
        with psycopg.connect(url) as conn:
            conn.execute("DELETE FROM django_migrations WHERE app = 'dispatch' AND name = '0009_integrity'")
        adopted = cb.schema_dump(url)
        done = cb.manage(url, "migrate", "--no-input", check=False)
        assert done.returncode == 1 and "dispatch.0009_integrity" in done.stderr
        assert cb.schema_dump(url) == adopted
        out = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        assert "record 1 Django migrations as applied" in out
        assert "No migrations to apply." in cb.manage(url, "migrate", "--no-input").stdout
    finally:
        cb.drop_database(name)


def test_adoption_counts_the_licences_cuebots_running_frames_already_hold() -> None:
    """limit_record.int_running is cuesched's column on Cuebot's table. Added with its default
    of 0 beside running Cuebot frames of a limit, it read LOW: the Store, which books against
    the database's count, would have booked those licences a second time. Adoption recounts
    it from proc, with proc's writers held off until the triggers that keep it are in place."""
    name = cb.cuebot_db_name("licences")
    url = cb.build_cuebot_db(name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            # The count joins only layer_limit and proc: the frames' parents are left out
            # (replica mode skips Cuebot's foreign-key and stat triggers for these rows).
            conn.execute("SET session_replication_role = replica")
            conn.execute(
                "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value, b_host_limit)"
                " VALUES ('lim-frames', 'arnold', 10, false), ('lim-hosts', 'nuke', 10, true)"
            )
            conn.execute(
                "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record)"
                " VALUES ('ll-1', 'layer-a', 'lim-frames'), ('ll-2', 'layer-a', 'lim-hosts')"
            )
            for i, host in enumerate(("host-1", "host-1", "host-2")):
                conn.execute(
                    "INSERT INTO proc (pk_proc, pk_host, pk_layer, pk_frame, int_cores_reserved, int_mem_reserved)"
                    " VALUES (%s, %s, 'layer-a', %s, 100, 1024)",
                    (f"proc-{i}", host, f"frame-{i}"),
                )
        cb.manage(url, "adopt_cuebot_db", "--apply")
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT str_name, int_running, int_frames FROM limit_record ORDER BY str_name"
            ).fetchall()
        assert rows == [("arnold", 3, 3), ("nuke", 2, 3)]
    finally:
        cb.drop_database(name)
