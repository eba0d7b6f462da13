"""Managed shows are booked by the scheduler only, and PostgreSQL decides who the scheduler is (issue 27).

Row 1: on a plain (non-Cuebot) database a plain `INSERT INTO proc` for a scheduler-managed show
by a connection that is not the scheduler's was accepted and sent to the Store, where no cap
checked it (SUM(proc) 25 against a burst of 20). It is refused now, like any UPDATE that grows a
managed proc or moves it (or its host or job) onto another key; shrinking and releasing stay allowed.

Row 4: the writer mark was the session setting `cuesched.writer=on`, which any session can set,
and with it the transaction-local Store-accounted marker. Now the claim is honoured only for a
login role that is a member of the writer role (`cuesched_writer`). The outside writers here are
non-superuser LOGIN roles with the table GRANTs an outside tool would have, so that the check is
PostgreSQL's membership, not the superuser shortcut.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pg_errors

from accounting import writer_role
from accounting.scheduler import SchedulerOptions, SchedulerProcess
from tests.integration.dispatch_support import drain, fast_launcher, make_loop, seed, violations
from tests.integration.runtime_support import MiniFarm, autocommit_conn, make_farm, running_scheduler, uid, wait_for
from tests.integration.test_outside_writers import BOUND, FAST, build_world, wait_store_matches
from tests.integration.writer_roles import WRITER_ROLE, conninfo_as, login_role, outside_conninfo, url_as

pytestmark = pytest.mark.django_db(transaction=True)

REFUSED = "acct_managed_show_booked_outside"
INSERT_PROC = (
    "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
    " int_mem_reserved, int_gpus_reserved) VALUES (%s, %s, %s, %s, %s, %s, %s, 1048576, 0)"
)


@pytest.fixture(autouse=True)
def _slow_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """No recompute, reseed or reconcile: what the Store shows must come from the write itself."""
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    """The test's own set-up connection: cuesched's (the writer claim, as the postgres superuser)."""
    c = autocommit_conn()
    yield c
    c.close()


@pytest.fixture
def outside() -> Iterator[psycopg.Connection]:
    """A psql session: the database superuser, without cuesched's writer claim."""
    with psycopg.connect(outside_conninfo(), autocommit=True) as c:
        assert c.execute("SELECT current_setting('cuesched.writer', true)").fetchone()[0] in (None, "")
        yield c


@pytest.fixture
def impostor() -> Iterator[psycopg.Connection]:
    """A non-superuser LOGIN role, not a member of the writer role, with cuesched.writer=on."""
    with login_role("impostor", writer=False) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=True), autocommit=True) as c:
            assert c.execute("SELECT current_setting('cuesched.writer')").fetchone()[0] == "on"
            assert c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is False
            yield c


def insert_procs(conn: psycopg.Connection, farm: MiniFarm, n: int, centicores: int, *, marker: bool = False) -> None:
    """`n` procs of `centicores` each on the farm's first job, in one transaction (a raw booking)."""
    job, layer = farm.jobs[0], farm.layers[0]
    with conn.transaction():
        if marker:
            conn.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
        for i in range(n):
            frame = farm.frames[job].pop()
            conn.execute(
                INSERT_PROC,
                (
                    uid(f"raw-{farm.show}", farm._proc_seq + i),
                    farm.hosts[i % len(farm.hosts)],
                    farm.show,
                    layer,
                    job,
                    frame,
                    centicores,
                ),
            )
    farm._proc_seq += n


def procs_of(conn: psycopg.Connection, show: str) -> tuple[int, int]:
    return conn.execute(
        "SELECT count(*), COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_show = %s", (show,)
    ).fetchone()


def assert_refused(exc: pytest.ExceptionInfo[pg_errors.CheckViolation]) -> None:
    diag = exc.value.diag
    assert diag.constraint_name == REFUSED, diag.message_primary
    assert "scheduler-managed" in (diag.message_primary or "")
    assert WRITER_ROLE in (diag.message_hint or ""), diag.message_hint


# --------------------------------------------------------------------------- row 1


def test_a_plain_insert_for_a_managed_show_is_refused_on_a_plain_database(conn, outside) -> None:
    """5 x 5 cores against a burst of 20 from psql: refused whole, nothing written, the Store untouched."""
    farm = make_farm(conn, "r1ins", managed=True, burst_cores=20, jobs=1, frames=10)
    with running_scheduler() as proc:
        store = proc.service.store
        for n, centicores in ((5, 500), (1, 100)):  # over the burst, and one core that would fit
            with pytest.raises(pg_errors.CheckViolation) as exc:
                insert_procs(outside, farm, n, centicores)
            assert_refused(exc)
            assert procs_of(conn, farm.show) == (0, 0)
        assert store.sub_counters(farm.show, farm.alloc) == (0, 20)


def test_an_outside_update_that_grows_or_moves_a_managed_proc_is_refused_and_shrinks_and_releases_pass(
    conn, outside
) -> None:
    farm = make_farm(conn, "r1upd", managed=True, burst_cores=20, jobs=2, frames=10)
    with running_scheduler() as proc:
        store = proc.service.store
        p0, p1 = farm.add_proc(conn, cores=4), farm.add_proc(conn, cores=4)  # cuesched's own: counted
        wait_for(lambda: store.sub_counters(farm.show, farm.alloc) == (8, 20), BOUND, "the Store to count 8")
        for sql, params in (
            ("UPDATE proc SET int_cores_reserved = 600 WHERE pk_proc = %s", (p0,)),
            ("UPDATE proc SET pk_job = %s, pk_layer = %s WHERE pk_proc = %s", (farm.jobs[1], farm.layers[1], p0)),
        ):
            with pytest.raises(pg_errors.CheckViolation) as exc:
                outside.execute(sql, params)
            assert_refused(exc)
        assert procs_of(conn, farm.show) == (2, 800)
        outside.execute("UPDATE proc SET int_cores_reserved = 200 WHERE pk_proc = %s", (p0,))
        wait_for(lambda: store.sub_counters(farm.show, farm.alloc) == (6, 20), BOUND, "the Store to follow a shrink")
        outside.execute("DELETE FROM proc WHERE pk_proc = %s", (p1,))
        wait_for(lambda: store.sub_counters(farm.show, farm.alloc) == (2, 20), BOUND, "the Store to follow a release")
        wait_store_matches(store, conn, [farm.show], "the Store to equal SUM(proc)")


def test_an_outside_host_or_job_move_under_managed_procs_is_refused_on_a_plain_database(conn, outside) -> None:
    """The siblings of row 1: a move books the running procs on the new allocation or folder, unchecked."""
    w = build_world(conn, "r1mv", managed=True)
    with running_scheduler() as proc:
        for sql, params in (
            ("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (w.alloc_b, w.farm.hosts[0])),
            ("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (w.folder_b, w.farm.jobs[0])),
        ):
            with pytest.raises(pg_errors.CheckViolation) as exc:
                outside.execute(sql, params)
            assert exc.value.diag.constraint_name == REFUSED
            assert "flip the show" in (exc.value.diag.message_hint or "")
        # A host with no managed proc on it moves freely.
        outside.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (w.farm.alloc, w.host_b))
        wait_store_matches(proc.service.store, conn, w.shows, "the Store to equal SUM(proc)")


# --------------------------------------------------------------------------- row 4


def test_a_role_outside_the_writer_role_cannot_pass_as_the_scheduler_on_a_managed_show(conn, impostor) -> None:
    """Both settings set by a non-member: the over-cap booking is refused, the Store is not fooled."""
    farm = make_farm(conn, "r4ins", managed=True, burst_cores=20, jobs=1, frames=10)
    with running_scheduler() as proc:
        with pytest.raises(pg_errors.CheckViolation) as exc:
            insert_procs(impostor, farm, 5, 500, marker=True)
        assert_refused(exc)
        assert procs_of(conn, farm.show) == (0, 0)
        assert proc.service.store.sub_counters(farm.show, farm.alloc) == (0, 20)


def test_a_release_by_a_role_outside_the_writer_role_reaches_the_store(conn, impostor) -> None:
    """A spoofed Store-accounted marker on a DELETE used to keep the release from the Store (read high)."""
    farm = make_farm(conn, "r4rel", managed=True, burst_cores=20, jobs=1, frames=10)
    procs = [farm.add_proc(conn, cores=4) for _ in range(3)]
    with running_scheduler() as proc:
        store = proc.service.store
        wait_for(lambda: store.sub_counters(farm.show, farm.alloc) == (12, 20), BOUND, "the Store seeded at 12")
        with impostor.transaction():
            impostor.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
            impostor.execute("DELETE FROM proc WHERE pk_proc = ANY(%s)", (procs[:2],))
        wait_store_matches(store, conn, [farm.show], "the Store to apply the impostor's release")
        assert store.sub_counters(farm.show, farm.alloc) == (4, 20)


def test_a_role_outside_the_writer_role_is_counted_and_checked_on_an_unmanaged_show(conn, impostor) -> None:
    farm = make_farm(conn, "r4un", managed=False, burst_cores=20, jobs=1, frames=10)

    def counter() -> int:
        return conn.execute(
            "SELECT int_cores FROM subscription WHERE pk_show = %s AND pk_alloc = %s", (farm.show, farm.alloc)
        ).fetchone()[0]

    with pytest.raises(pg_errors.CheckViolation) as exc:
        insert_procs(impostor, farm, 5, 500, marker=True)
    assert exc.value.diag.constraint_name == "acct_subscription_burst"
    insert_procs(impostor, farm, 3, 500, marker=True)
    assert counter() == procs_of(conn, farm.show)[1] == 1500
    with impostor.transaction():
        impostor.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
        impostor.execute("DELETE FROM proc WHERE pk_show = %s", (farm.show,))
    assert counter() == 0


def test_a_role_outside_the_writer_role_cannot_rewrite_an_unmanaged_counter(conn, impostor) -> None:
    """The reconcile's `cuesched.counter_rebuild` marker, set by a non-member: a counter written
    below SUM(proc) would pass the next booking over the burst. Refused."""
    farm = make_farm(conn, "r4rb", managed=False, burst_cores=20, jobs=1, frames=10)
    insert_procs(conn, farm, 3, 500)
    with pytest.raises(pg_errors.CheckViolation) as exc, impostor.transaction():
        impostor.execute("SELECT set_config('cuesched.counter_rebuild', 'on', true)")
        impostor.execute("UPDATE subscription SET int_cores = 0 WHERE pk_show = %s", (farm.show,))
    assert exc.value.diag.constraint_name == "acct_usage_written_by_triggers"
    with pytest.raises(pg_errors.CheckViolation):
        insert_procs(impostor, farm, 2, 500)  # 15 + 10 > 20: the counter still says 15
    assert procs_of(conn, farm.show) == (3, 1500)


def test_the_scheduler_books_as_a_member_of_the_writer_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's own connections, as a non-superuser member of the writer role, book and drain."""
    farm = seed("wmember", jobs=2)
    with login_role("scheduler", writer=True) as role:
        monkeypatch.setenv("CUESCHED_SCHEDULER_DATABASE_URL", url_as(role))
        with running_scheduler() as proc:
            assert proc.service.is_managed(farm.show_ids[0])
            totals = drain(make_loop(proc.service, fast_launcher(), managed_only=True))
        assert totals.booked == totals.completed > 0
    with psycopg.connect(outside_conninfo(), autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM proc").fetchone()[0] == 0
        assert violations(c) == []


def test_a_scheduler_whose_role_is_not_a_member_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every managed booking of such a scheduler would be refused: it says so at start, with what to GRANT."""
    with login_role("notmember", writer=False) as role:
        monkeypatch.setenv("CUESCHED_SCHEDULER_DATABASE_URL", url_as(role))
        process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=10))
        try:
            with pytest.raises(Exception) as exc:
                process.start()
        finally:
            process.shutdown()
        assert type(exc.value).__name__ == "WriterRoleError", exc.value
        assert f"GRANT {WRITER_ROLE} TO" in str(exc.value), exc.value


def test_the_migration_created_the_writer_role(conn) -> None:
    row = conn.execute("SELECT rolcanlogin, rolsuper FROM pg_roles WHERE rolname = %s", (WRITER_ROLE,)).fetchone()
    assert row == (False, False), f"{WRITER_ROLE}: {row}"


def test_creating_the_writer_role_tolerates_an_existing_one_and_says_what_to_do_without_createrole(conn) -> None:
    """The migration's statement, run for a fresh role name (the real one is shared by the cluster)."""
    fresh = f"{conn.info.dbname}_wm_fresh"[:63]
    conn.execute(f'DROP ROLE IF EXISTS "{fresh}"')
    with login_role("migrator", writer=False) as migrator:
        with psycopg.connect(conninfo_as(migrator, claim_writer=False), autocommit=True) as weak:
            weak.execute(writer_role.ensure_sql(WRITER_ROLE))  # exists: nothing to do, no privilege needed
            with pytest.raises(pg_errors.InsufficientPrivilege) as exc:
                weak.execute(writer_role.ensure_sql(fresh))
            assert f"the role {fresh} does not exist and {migrator} may not create it" in str(exc.value)
            assert f"CREATE ROLE {fresh} NOLOGIN" in (exc.value.diag.message_hint or "")
    try:
        conn.execute(writer_role.ensure_sql(fresh))
        conn.execute(writer_role.ensure_sql(fresh))  # twice: still one role, no error
        row = conn.execute("SELECT rolcanlogin FROM pg_roles WHERE rolname = %s", (fresh,)).fetchone()
        assert row == (False,)
    finally:
        conn.execute(f'DROP ROLE IF EXISTS "{fresh}"')


def test_a_role_outside_the_writer_role_cannot_switch_the_accounting_triggers_off_with_pgtrigger_ignore(
    conn,
) -> None:
    farm = make_farm(conn, "r4ign", managed=True, burst_cores=20, jobs=1, frames=10)
    names = [
        n
        for (n,) in conn.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'proc'::regclass AND tgname LIKE 'pgtrigger_acct_proc_%'"
        )
    ]
    assert names, "no accounting trigger on proc"
    with login_role("ignorer", writer=False) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as outside:
            outside.execute("SELECT set_config('pgtrigger.ignore', %s, false)", ("{" + ",".join(names) + "}",))
            try:
                insert_procs(outside, farm, 5, 500)
            except pg_errors.CheckViolation:
                pass  # refused: what the fix must do
    assert procs_of(conn, farm.show) == (0, 0), "25 cores booked on a managed show with a burst of 20, unchecked"
