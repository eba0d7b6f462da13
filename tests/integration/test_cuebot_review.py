"""Adversarial review of Cuebot mode's accounting (issue 22): holes found through plain connections.

Each test writes the way a psql session, a script or Cuebot's own SQL does (a connection without
`cuesched.writer=on`) on an adopted Cuebot database, and checks the product rule after commit:
no cap breached, no counter below SUM(proc). The first six were strict xfails until their hole was
closed; the tests after them probe the fixes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.integration.cuebot_standin import CuebotStandIn
from tests.integration.cuebot_support import adopted_cuebot_db, zeroed_counters
from tests.integration.test_cuebot_mode import ALLOC, DEPT, SHOW, Farm, counters
from tests.integration.test_cuebot_outside_writers import RAW_INSERT

CLOUD = "00000000-0000-0000-0000-000000000003"  # the seed's cloud.general, also subscribed by 'testing'


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("review") as url:
        yield url


@pytest.fixture
def conn(cuebot_url: str) -> Iterator[psycopg.Connection]:
    with zeroed_counters(cuebot_url, SHOW) as c:
        c.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s", (SHOW,))
        yield c
        c.execute("DELETE FROM proc")


@pytest.fixture
def raw(cuebot_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(cuebot_url, autocommit=True) as c:
        yield c


def _insert(raw: psycopg.Connection, farm: Farm, frame: int, cores: int = 100) -> str:
    pk = str(uuid.uuid4())
    raw.execute(RAW_INSERT, (pk, farm.host, SHOW, farm.job, farm.layer, farm.frames[frame], cores))
    return pk


def _sub_sum(conn: psycopg.Connection, alloc: str) -> int:
    return conn.execute(
        "SELECT COALESCE(SUM(p.int_cores_reserved), 0) FROM proc p JOIN host h ON h.pk_host = p.pk_host "
        "WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local",
        (SHOW, alloc),
    ).fetchone()[0]


def _low(got: dict[str, int]) -> dict[str, int]:
    """Counters of the farm's keys below SUM(proc) (one farm per test: all five share its sum)."""
    return {k: v for k, v in got.items() if k != "sum_proc" and v < got["sum_proc"]}


def test_a_counter_reading_high_still_checks_the_burst(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    farm = Farm(conn, frames=8)
    with raw.transaction():
        pks = [_insert(raw, farm, i) for i in range(6)]
    with raw.transaction():  # a raw DELETE without Cuebot's counter UPDATEs: the counters read high (allowed)
        raw.execute("DELETE FROM proc WHERE pk_proc = ANY(%s)", (pks[:2],))
    conn.execute("UPDATE subscription SET int_burst = 500 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    assert counters(conn, farm)["subscription"] == 600 and _sub_sum(conn, ALLOC) == 400
    try:
        with raw.transaction():
            _insert(raw, farm, 6)
            _insert(raw, farm, 7)
    except psycopg.Error:
        pass
    # Cuebot's own booking is refused here (its verify_subscription reads 600 + 100 > 500); the raw one got in.
    assert _sub_sum(conn, ALLOC) <= 500, f"SUM(proc)={_sub_sum(conn, ALLOC)} over the burst of 500"


def test_a_counter_row_deleted_and_inserted_again_does_not_read_low(
    conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    farm = Farm(conn)
    with raw.transaction():
        for i in range(3):
            _insert(raw, farm, i)
    try:
        with raw.transaction():
            size, burst = raw.execute(
                "DELETE FROM subscription WHERE pk_show = %s AND pk_alloc = %s RETURNING int_size, int_burst",
                (SHOW, ALLOC),
            ).fetchone()
            raw.execute(
                "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst) "
                "VALUES (%s, %s, %s, %s, %s)",
                (str(uuid.uuid4()), ALLOC, SHOW, size, burst),
            )
            raw.execute("DELETE FROM layer_resource WHERE pk_layer = %s", (farm.layer,))
            raw.execute(
                "INSERT INTO layer_resource (pk_layer_resource, pk_layer, pk_job) VALUES (%s, %s, %s)",
                (str(uuid.uuid4()), farm.layer, farm.job),
            )
    except psycopg.Error:
        pass  # refusing it is a fix too
    got = counters(conn, farm)
    assert not _low(got), got


def test_a_writer_that_sets_the_top_up_marker_cannot_lower_a_counter(
    conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    farm = Farm(conn)
    with raw.transaction():
        for i in range(3):
            _insert(raw, farm, i)
    with raw.transaction():
        raw.execute("SELECT set_config('cuesched.outside_topup', 'on', true)")
        raw.execute("UPDATE subscription SET int_cores = 0 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    got = counters(conn, farm)
    assert not _low(got), got


def test_deleting_the_ledger_rows_cannot_skip_the_top_up(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    farm = Farm(conn)
    try:
        with raw.transaction():
            _insert(raw, farm, 0)
            raw.execute("DELETE FROM cuesched_outside_ledger")
    except psycopg.Error:
        pass  # refusing it is a fix too
    got = counters(conn, farm)
    assert not _low(got), got


def test_cuebot_moving_a_host_with_managed_procs_cannot_breach_the_burst(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        for i in range(3):
            standin.book(
                host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[i], cores=100
            )
        conn.execute("UPDATE subscription SET int_burst = 100 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, CLOUD))
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
        try:
            # HostDaoJdbc.updateHostSetAllocation, as `cueadmin -move` runs it
            standin.conn.execute("UPDATE host SET pk_alloc=%s WHERE pk_host=%s", (CLOUD, farm.host))
        except psycopg.Error:
            pass
        assert _sub_sum(conn, CLOUD) <= 100, f"SUM(proc)={_sub_sum(conn, CLOUD)} on a subscription with burst 100"
    finally:
        standin.close()
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("DELETE FROM proc")
        conn.execute("UPDATE subscription SET int_cores = 0 WHERE pk_show = %s", (SHOW,))


def test_the_store_accounted_marker_does_not_let_an_unmarked_writer_book_a_managed_show(
    conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    farm = Farm(conn)
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    try:
        with raw.transaction():
            raw.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
            _insert(raw, farm, 0)
    except psycopg.Error:
        pass
    assert conn.execute("SELECT count(*) FROM proc WHERE pk_show = %s", (SHOW,)).fetchone()[0] == 0


def _refused(conn: psycopg.Connection, sql: str, params: tuple, constraint: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as e, conn.transaction():
        conn.execute(sql, params)
    assert e.value.diag.constraint_name == constraint, e.value.diag.message_primary


def test_cuebot_moving_a_job_with_managed_procs_is_refused_and_says_what_to_do(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """JobDaoJdbc.updateParent's job move books the running procs on the new folder: refused like the host move."""
    farm = Farm(conn)
    other = str(uuid.uuid4())
    conn.execute(
        "INSERT INTO folder (pk_folder, pk_parent_folder, pk_show, pk_dept, str_name) VALUES (%s, NULL, %s, %s, %s)",
        (other, SHOW, DEPT, f"review{other[:6]}"),
    )
    standin = CuebotStandIn(cuebot_url)
    try:
        standin.book(
            host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
        )
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
        with pytest.raises(psycopg.errors.CheckViolation) as e:
            standin.conn.execute("UPDATE job SET pk_folder=%s, pk_dept=%s WHERE pk_job=%s", (other, DEPT, farm.job))
        assert e.value.diag.constraint_name == "acct_managed_show_booked_outside"
        assert "flip the show" in (e.value.diag.message_hint or "")
        assert conn.execute("SELECT pk_folder FROM job WHERE pk_job = %s", (farm.job,)).fetchone()[0] != other
        standin.conn.rollback()
        # Once the managed frames have ended the move goes through.
        conn.execute("DELETE FROM proc WHERE pk_job = %s", (farm.job,))
        standin.conn.execute("UPDATE job SET pk_folder=%s, pk_dept=%s WHERE pk_job=%s", (other, DEPT, farm.job))
        standin.conn.commit()
    finally:
        standin.close()
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))


def test_a_ledger_row_written_by_a_client_is_refused(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """A negative row inserted before the proc would cancel its debt: only the triggers write the ledger."""
    farm = Farm(conn)
    xid = raw.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]  # autocommit: a throwaway xid
    for sql in (
        "INSERT INTO cuesched_outside_ledger (xid, tbl, k1, k2, cc, g) "
        "VALUES (pg_current_xact_id()::text::bigint, 1, %s, %s, -100, 0)",
        "UPDATE cuesched_outside_ledger SET cc = 0 WHERE xid <> %s AND k1 = %s",
    ):
        with pytest.raises(psycopg.errors.CheckViolation) as e, raw.transaction():
            if "INSERT" in sql:  # before the proc, so the proc's own upsert would net it to nothing
                raw.execute(sql, (SHOW, ALLOC))
            _insert(raw, farm, 0)
            raw.execute(sql, (xid, SHOW))
        assert e.value.diag.constraint_name == "acct_outside_ledger_written_by_triggers"
    got = counters(conn, farm)
    assert got["sum_proc"] == 0 and not _low(got), got


def test_a_truncated_counter_table_is_topped_back_or_refused(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """TRUNCATE has no transition table: it owes every key SUM(proc), so a table emptied and filled
    again reads SUM(proc) at commit, and one left empty under running procs is refused."""
    farm = Farm(conn)
    with raw.transaction():
        for i in range(2):
            _insert(raw, farm, i)
    rows = raw.execute("SELECT pk_layer_resource, pk_layer, pk_job FROM layer_resource").fetchall()
    with pytest.raises(psycopg.errors.CheckViolation) as e, raw.transaction():
        raw.execute("TRUNCATE layer_resource")
    assert e.value.diag.constraint_name == "acct_layer_missing"
    with raw.transaction():
        raw.execute("TRUNCATE layer_resource")
        with raw.cursor() as cur:
            cur.executemany(
                "INSERT INTO layer_resource (pk_layer_resource, pk_layer, pk_job) VALUES (%s, %s, %s)", rows
            )
    got = counters(conn, farm)
    assert got["layer_resource"] == got["sum_proc"] == 200, got


def test_recalculate_subs_under_a_lowered_burst_is_not_a_booking(
    cuebot_url: str, conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    """The cap check covers keys the transaction booked on: Cuebot's recalculate_subs() lowering a
    high counter over a burst lowered meanwhile owes the excess it removed, books nothing, and commits."""
    farm = Farm(conn)
    with raw.transaction():
        pks = [_insert(raw, farm, i) for i in range(3)]
    with raw.transaction():
        raw.execute("DELETE FROM proc WHERE pk_proc = %s", (pks[0],))
    conn.execute("UPDATE subscription SET int_burst = 100 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    standin = CuebotStandIn(cuebot_url)
    try:
        standin.recalculate_subs()
    finally:
        standin.close()
    assert counters(conn, farm)["subscription"] == 200


def test_the_store_accounted_marker_still_works_for_cuesched(cuebot_url: str, conn: psycopg.Connection) -> None:
    """With cuesched.writer=on the marker is honoured: a managed booking sends no release and is not refused."""
    farm = Farm(conn)
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    try:
        with psycopg.connect(cuebot_url, options="-c cuesched.writer=on") as mine:
            mine.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
            _insert(mine, farm, 0)
            mine.commit()
        assert conn.execute("SELECT count(*) FROM proc WHERE pk_show = %s", (SHOW,)).fetchone()[0] == 1
    finally:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))


def test_a_role_outside_the_writer_role_cannot_pass_as_cuesched_beside_cuebot(
    cuebot_url: str, conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    """Issue 27 row 4 on an adopted database: a non-superuser login role that is not a member of the
    writer role sets `cuesched.writer=on` and the Store-accounted marker. Its managed booking is
    refused, and its counter writes stay in the outside ledger (topped back to SUM(proc) at commit)
    instead of being taken for cuesched's own."""
    from tests.integration.writer_roles import conninfo_as, login_role

    farm = Farm(conn, frames=6)
    with raw.transaction():
        for i in range(3):
            _insert(raw, farm, i)
    with login_role("impostor", writer=False, url=cuebot_url) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=True, url=cuebot_url), autocommit=True) as impostor:
            assert impostor.execute("SELECT current_setting('cuesched.writer')").fetchone()[0] == "on"
            with impostor.transaction():  # unmanaged: a counter lowered under running procs
                impostor.execute(
                    "UPDATE subscription SET int_cores = 0 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC)
                )
            got = counters(conn, farm)
            assert got["sum_proc"] == 300 and not _low(got), got
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
            try:
                with pytest.raises(psycopg.errors.CheckViolation) as e, impostor.transaction():
                    impostor.execute("SELECT set_config('cuesched.store_accounted', 'on', true)")
                    _insert(impostor, farm, 3)
                assert e.value.diag.constraint_name == "acct_managed_show_booked_outside"
                assert _sub_sum(conn, ALLOC) == 300
            finally:
                conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
