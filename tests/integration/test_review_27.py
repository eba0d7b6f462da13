"""Adversarial review of issue 27 as merged: holes a non-superuser outside role still opens.

Each test reproduces one confirmed hole through a plain connection of a non-superuser LOGIN role
that is NOT a member of the writer role (tests/integration/writer_roles.py: the DML GRANTs that
docs/deployment.md gives an outside writer), against a real scheduler Store, listener and dispatch
loop. Each is a strict xfail: it fails today for the reason it gives, and passes once the hole is
closed. The listener is frozen (FreezableProxy) only where the hole is a window behind a slow
listener, as in test_generation's row-2 test; nothing waits on a fixed sleep.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import psycopg
import pytest

from accounting.service import AccountingService
from dispatch.lab.netfreeze import FreezableProxy
from tests.integration.dispatch_support import fast_launcher, make_loop, seed
from tests.integration.runtime_support import autocommit_conn, wait_for
from tests.integration.writer_roles import conninfo_as, login_role

pytestmark = pytest.mark.django_db(transaction=True)

CENTI = 100
LONG = {"runtime_min": 600.0, "runtime_max": 600.0}  # nothing completes while a test looks
# A transaction id no snapshot will ever see as finished: a forged payload carrying it is never
# "already read" by a reseed or a recompute.
FAR_XID = 2**62

ONE_JOB = {
    "allocs": 1,
    "hosts": 2,
    "host_cores_choices": (64,),
    "host_mem_gb_choices": (256,),
    "layer_cores_choices": (1,),
    "layer_mem_gb_choices": (1,),
    "layers": 1,
    "manual_tags": 0,
    "sub_burst": 200 * CENTI,
}


@pytest.fixture(autouse=True)
def _quiet_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backstops effectively off: what a test sees is the hole, not a later heal by a reseed."""
    for key, value in {
        "CUESCHED_RECOMPUTE_INTERVAL": "3600",
        "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
        "CUESCHED_MANAGED_SHOWS_TTL": "3600",
        "CUESCHED_DB_RECONCILE_INTERVAL": "3600",
        "CUESCHED_HEARTBEAT_DEADLINE": "4.5",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUESCHED_SCHEDULER_DATABASE_URL", raising=False)


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    c = autocommit_conn()
    yield c
    c.close()


@contextmanager
def running_service(proxy: FreezableProxy | None = None) -> Iterator[AccountingService]:
    """A started, bootstrapped AccountingService (its listener through `proxy` when given)."""
    kw = {}
    if proxy is not None:
        kw["listener_connect"] = lambda: proxy.connect(application_name="cuesched-listener")
    service = AccountingService(**kw)
    stop = threading.Event()
    service.start(stop, bootstrap_timeout=30)
    try:
        yield service
    finally:
        stop.set()
        service.join(10)


def job_cores(conn: psycopg.Connection, job: str) -> int:
    row = conn.execute("SELECT SUM(int_cores_reserved) FROM proc WHERE pk_job = %s", (job,)).fetchone()
    return int(row[0] or 0) // CENTI


def run_until(loop, done, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {loop.totals}")
        loop.run_once()
        time.sleep(0.01)


def run_for(loop, seconds: float, *, tolerate: bool = False) -> int:  # type: ignore[no-untyped-def]
    """Cycles for `seconds`; with `tolerate`, a cycle that fails on a database error is counted and
    the next one runs (as run_scheduler's loop does), so the caller asserts what got booked."""
    deadline = time.monotonic() + seconds
    errors = 0
    while time.monotonic() < deadline:
        try:
            loop.run_once()
        except psycopg.Error:
            if not tolerate:
                raise
            errors += 1
        time.sleep(0.01)
    return errors


def keys_of(conn: psycopg.Connection, job: str) -> dict[str, str]:
    """The accounting keys of the job's booked procs (one allocation in these farms)."""
    row = conn.execute(
        "SELECT j.pk_show, h.pk_alloc, j.pk_folder, j.pk_job, p.pk_layer, j.pk_dept FROM proc p "
        "JOIN job j ON j.pk_job = p.pk_job JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = %s LIMIT 1",
        (job,),
    ).fetchone()
    assert row is not None, "the job has no booked proc"
    return dict(zip(("show", "alloc", "folder", "job", "layer", "dept"), row, strict=True))


def barrier(conn: psycopg.Connection, service: AccountingService, job: str, cores: int) -> None:
    """A real cap change of another job, waited for in the Store: notifications arrive in commit
    order on the one listener session, so everything NOTIFYed before it has been handled."""
    conn.execute("UPDATE job_resource SET int_max_cores = %s WHERE pk_job = %s", (cores * CENTI, job))
    wait_for(lambda: (service.store.job_cap(job) or (None,))[0] == cores, 10, "the barrier cap in the Store")


# --------------------------------------------------------------------------- forged NOTIFY


def test_a_forged_cap_notification_from_any_session_never_raises_a_managed_cap(conn) -> None:
    farm = seed("rv27a", jobs=2, frames_per_layer=40, job_max_cores=5 * CENTI, **ONE_JOB)
    job, other = farm.job_ids[0], farm.job_ids[1]
    with ExitStack() as stack, login_role("forger", writer=False) as role, running_service() as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        run_until(loop, lambda: job_cores(conn, job) == 5 and job_cores(conn, other) == 5, 30, "both jobs at max 5")
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as forger:
            payload = {"vertex": "job", "id": job, "max_cores": 1000, "max_gpus": -1, "xid": FAR_XID}
            forger.execute("SELECT pg_notify('acct_limit_change', %s)", (json.dumps(payload),))
        barrier(conn, service, other, 6)
        run_for(loop, 0.5)
        assert job_cores(conn, job) <= 5, (
            f"{job_cores(conn, job)} cores booked against the database's max of 5 after a forged notification "
            f"(the Store reads max {service.store.job_cap(job)})"
        )
        assert (service.store.job_cap(job) or (None,))[0] == 5


def test_a_forged_release_notification_from_any_session_never_makes_the_store_read_low(conn) -> None:
    farm = seed("rv27b", jobs=2, frames_per_layer=40, job_max_cores=5 * CENTI, **ONE_JOB)
    job, other = farm.job_ids[0], farm.job_ids[1]
    with ExitStack() as stack, login_role("forger", writer=False) as role, running_service() as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        run_until(loop, lambda: job_cores(conn, job) == 5, 30, "the job at its max of 5")
        keys = keys_of(conn, job)
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as forger:
            payload = {**keys, "cores": -5, "gpus": 0, "xid": FAR_XID}
            forger.execute("SELECT pg_notify('acct_release', %s)", (json.dumps(payload),))
        barrier(conn, service, other, 6)
        in_store = service.store.job_cores_in_use(job)
        run_for(loop, 0.5)
        assert in_store >= 5, f"the Store counts {in_store} cores for a job running 5"
        assert job_cores(conn, job) <= 5, f"{job_cores(conn, job)} cores booked against a max of 5"


def test_a_replayed_genuine_release_is_applied_once(conn) -> None:
    # Any session may LISTEN: an outside role hears a genuine release, then sends it again.
    farm = seed("rv27h", jobs=2, frames_per_layer=40, job_max_cores=5 * CENTI, **ONE_JOB)
    job, other = farm.job_ids[0], farm.job_ids[1]
    with ExitStack() as stack, login_role("replayer", writer=False) as role, running_service() as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        run_until(loop, lambda: job_cores(conn, job) == 5, 30, "the job at its max of 5")
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as replayer:
            replayer.execute("LISTEN acct_release")
            one = conn.execute("SELECT pk_proc FROM proc WHERE pk_job = %s LIMIT 1", (job,)).fetchone()[0]
            conn.execute("DELETE FROM proc WHERE pk_proc = %s", (one,))
            [heard] = [n for n in replayer.notifies(timeout=10, stop_after=1) if json.loads(n.payload)["job"] == job]
            wait_for(lambda: service.store.job_cores_in_use(job) == 4, 10, "the genuine release in the Store")
            for _ in range(3):  # three transactions: PostgreSQL folds a repeat within one
                replayer.execute("SELECT pg_notify('acct_release', %s)", (heard.payload,))
        barrier(conn, service, other, 6)
        in_store = service.store.job_cores_in_use(job)
        assert in_store == job_cores(conn, job) == 4, f"the Store counts {in_store} cores for a job running 4"
        run_for(loop, 0.5)
        assert job_cores(conn, job) <= 5, f"{job_cores(conn, job)} cores booked against a max of 5"


def test_an_outside_writer_can_neither_write_nor_consume_the_outbox(conn) -> None:
    # The listener applies the outbox's rows: one written there would be believed, one deleted
    # there (a licence's growing use) never applied. The role has DML GRANTs on every table.
    statements = (
        "INSERT INTO cuesched_acct_outbox (str_channel, str_payload) VALUES ('acct_release', '{}')",
        "SELECT cuesched_acct_emit('acct_release', '{}')",
        "UPDATE cuesched_acct_outbox SET str_payload = '{}'",
        "DELETE FROM cuesched_acct_outbox",
    )
    with login_role("outboxer", writer=False) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as outside:
            for sql in statements:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    outside.execute(sql)


# --------------------------------------------------------------------------- the generation row


def test_an_outside_writer_cannot_undo_the_generation_bump_of_its_cap_lowering(conn) -> None:
    farm = seed("rv27c", jobs=1, frames_per_layer=60, job_max_cores=40 * CENTI, **ONE_JOB)
    job = farm.job_ids[0]
    show = farm.show_ids[0]
    with (
        ExitStack() as stack,
        login_role("genundo", writer=False, cuesched_dml=True) as role,
        FreezableProxy().start() as proxy,
        running_service(proxy) as service,
    ):
        assert (service.store.job_cap(job) or (0,))[0] == 40
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        proxy.freeze()
        try:
            with psycopg.connect(conninfo_as(role, claim_writer=False)) as outside:
                outside.execute("UPDATE job_resource SET int_max_cores = 500 WHERE pk_job = %s", (job,))
                try:
                    outside.execute(
                        "UPDATE cuesched_show_generation SET int_generation = int_prev_generation WHERE pk_show = %s",
                        (show,),
                    )
                    outside.commit()
                except psycopg.errors.CheckViolation as exc:
                    # Refused (what the fix must do): the whole transaction, cap lowering included.
                    assert exc.diag.constraint_name == "acct_show_generation_bump_only", exc
                    outside.rollback()
            worst = 0
            deadline = time.monotonic() + 1.5  # well inside the 4.5 s freshness deadline
            while time.monotonic() < deadline:
                loop.run_once()
                worst = max(worst, job_cores(conn, job))
                time.sleep(0.01)
            assert (service.store.job_cap(job) or (0,))[0] == 40, "the frozen path delivered"
        finally:
            proxy.thaw()
        db_max = conn.execute("SELECT int_max_cores FROM job_resource WHERE pk_job = %s", (job,)).fetchone()[0] // CENTI
        assert worst <= db_max, (
            f"{worst} cores booked against the database's max of {db_max} (generation put back by a non-member)"
        )


# --------------------------------------------------------------------------- the lease row


def test_an_outside_writer_cannot_move_the_scheduler_lease(conn) -> None:
    conn.execute(
        "INSERT INTO cuesched_scheduler_lease (id, int_generation, str_holder, ts_acquired, ts_deadline) "
        "VALUES (1, 7, 'review', now(), now() + interval '1 hour') "
        "ON CONFLICT (id) DO UPDATE SET int_generation = 7"
    )
    with login_role("leasemover", writer=False, cuesched_dml=True) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as outside:
            try:
                outside.execute("UPDATE cuesched_scheduler_lease SET int_generation = int_generation + 1 WHERE id = 1")
            except psycopg.Error:
                pass  # refused: what the fix must do
    assert conn.execute("SELECT int_generation FROM cuesched_scheduler_lease WHERE id = 1").fetchone()[0] == 7


# --------------------------------------------------------------------------- the alarm rows


def test_an_outside_writer_cannot_erase_an_open_integrity_alarm(conn) -> None:
    conn.execute(
        "INSERT INTO cuesched_integrity_alarm (str_kind, str_summary, details, str_acknowledged_by, str_ack_note) "
        "VALUES ('store_low', 'review', '{}', '', '')"
    )
    with login_role("alarmeraser", writer=False, cuesched_dml=True) as role:
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as outside:
            try:
                outside.execute("DELETE FROM cuesched_integrity_alarm WHERE str_summary = 'review'")
            except psycopg.Error:
                pass  # refused: what the fix must do
    left = conn.execute(
        "SELECT count(*) FROM cuesched_integrity_alarm WHERE str_summary = 'review' AND ts_acknowledged IS NULL"
    ).fetchone()[0]
    assert left == 1, "the open alarm was erased by an outside writer"


# --------------------------------------------------------------------------- a folder's show


def test_a_folder_round_trip_through_another_show_cannot_hide_a_cap_lowering(conn) -> None:
    farm = seed(
        "rv27d",
        shows=2,
        managed_shows=1,
        jobs=1,
        frames_per_layer=60,
        folder_max_cores=40 * CENTI,
        job_max_cores=100 * CENTI,
        **ONE_JOB,
    )
    show = farm.managed_show_ids[0]
    other = next(s for s in farm.show_ids if s != show)
    job, folder = conn.execute("SELECT pk_job, pk_folder FROM job WHERE pk_show = %s LIMIT 1", (show,)).fetchone()
    with (
        ExitStack() as stack,
        login_role("folderhop", writer=False) as role,
        FreezableProxy().start() as proxy,
        running_service(proxy) as service,
    ):
        assert (service.store.folder_cap(folder) or (0,))[0] == 40
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        proxy.freeze()
        try:
            with psycopg.connect(conninfo_as(role, claim_writer=False)) as outside:
                try:
                    outside.execute("UPDATE folder SET pk_show = %s WHERE pk_folder = %s", (other, folder))
                    outside.execute("UPDATE folder_resource SET int_max_cores = 500 WHERE pk_folder = %s", (folder,))
                    outside.execute("UPDATE folder SET pk_show = %s WHERE pk_folder = %s", (show, folder))
                    outside.commit()
                except psycopg.errors.CheckViolation as exc:
                    # Refused (what the fix must do): the whole transaction, cap lowering included.
                    assert exc.diag.constraint_name == "acct_folder_show_of_its_jobs", exc
                    outside.rollback()
            worst = 0
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                loop.run_once()
                worst = max(worst, job_cores(conn, job))
                time.sleep(0.01)
            assert (service.store.folder_cap(folder) or (0,))[0] == 40, "the frozen path delivered"
        finally:
            proxy.thaw()
        db_max = (
            conn.execute("SELECT int_max_cores FROM folder_resource WHERE pk_folder = %s", (folder,)).fetchone()[0]
            // CENTI
        )
        assert worst <= db_max, (
            f"{worst} cores booked against the folder's max of {db_max} in the database (its bump went to {other})"
        )


# --------------------------------------------------------------------------- farm-wide stalls


def _booked(conn: psycopg.Connection, jobs: tuple[str, ...]) -> dict[str, int]:
    return {j: job_cores(conn, j) for j in jobs}


@contextmanager
def _two_show_farm(prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """A managed and an unmanaged show, one job each, and a running service and loop over them."""
    monkeypatch.setenv("CUESCHED_DB_LOCK_TIMEOUT", "1.0")
    farm = seed(prefix, shows=2, managed_shows=1, jobs=2, frames_per_layer=40, job_max_cores=100 * CENTI, **ONE_JOB)
    with ExitStack() as stack, running_service() as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        yield farm, service, loop


def test_a_session_holding_the_keys_lock_exclusively_stalls_at_most_its_own_show(conn, monkeypatch) -> None:
    with _two_show_farm("rv27e", monkeypatch) as (farm, _service, loop):
        with login_role("keyslock", writer=False) as role:
            with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as hostile:
                hostile.execute("SELECT pg_advisory_lock(%s, 0)", (0x61636374,))
                errors = run_for(loop, 3.0, tolerate=True)
                booked = _booked(conn, farm.job_ids)
        # The control: with the session gone, the same loop books.
        run_until(loop, lambda: any(_booked(conn, farm.job_ids).values()), 30, "booking once the session is gone")
        assert any(booked.values()), (
            f"no show booked a core while one session held the keys lock: {booked} ({errors} cycles failed)"
        )


def test_a_session_locking_the_lease_row_stalls_at_most_its_own_show(conn, monkeypatch) -> None:
    conn.execute(
        "INSERT INTO cuesched_scheduler_lease (id, int_generation, str_holder) VALUES (1, 1, 'review') "
        "ON CONFLICT (id) DO NOTHING"
    )
    with _two_show_farm("rv27f", monkeypatch) as (farm, _service, loop):
        with login_role("leaselock", writer=False) as role:
            with psycopg.connect(conninfo_as(role, claim_writer=False)) as hostile:
                try:
                    hostile.execute("SELECT 1 FROM cuesched_scheduler_lease WHERE id = 1 FOR UPDATE")
                except psycopg.errors.InsufficientPrivilege:
                    pass  # refused (SELECT only on cuesched_*): what the fix must do; the loop still runs below
                errors = run_for(loop, 3.0, tolerate=True)
                booked = _booked(conn, farm.job_ids)
                hostile.rollback()
        # The control: with the session gone, the same loop books.
        run_until(loop, lambda: any(_booked(conn, farm.job_ids).values()), 30, "booking once the session is gone")
        assert any(booked.values()), (
            f"no show booked a core while one session held the lease row: {booked} ({errors} cycles failed)"
        )


# --------------------------------------------------------------------------- "written by the triggers only"


def sub_cores(conn: psycopg.Connection, show: str) -> tuple[int, int]:
    """(SUM(proc) of the show's non-local procs, its subscription counter), whole cores."""
    row = conn.execute(
        "SELECT (SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_show = %(s)s AND NOT b_local), "
        "(SELECT SUM(int_cores) FROM subscription WHERE pk_show = %(s)s)",
        {"s": show},
    ).fetchone()
    return int(row[0]) // CENTI, int(row[1] or 0) // CENTI


def test_a_temp_trigger_cannot_write_an_unmanaged_counter_below_sum_proc(conn) -> None:
    farm = seed(
        "rv27g",
        managed=False,
        jobs=1,
        frames_per_layer=60,
        job_max_cores=100 * CENTI,
        **{**ONE_JOB, "sub_burst": 20 * CENTI},
    )
    show = farm.show_ids[0]
    with ExitStack() as stack, login_role("depth", writer=False) as role, running_service() as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        run_until(loop, lambda: sub_cores(conn, show)[0] == 20, 30, "the unmanaged show at its burst of 20")
        with psycopg.connect(conninfo_as(role, claim_writer=False), autocommit=True) as outside:
            outside.execute(
                "CREATE FUNCTION pg_temp.zero() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "UPDATE subscription SET int_cores = 0 WHERE pk_show = NEW.s; RETURN NULL; END $$"
            )
            outside.execute("CREATE TEMP TABLE poke (s text)")
            outside.execute(
                "CREATE TRIGGER poke AFTER INSERT ON pg_temp.poke FOR EACH ROW EXECUTE FUNCTION pg_temp.zero()"
            )
            try:
                outside.execute("INSERT INTO pg_temp.poke VALUES (%s)", (show,))
            except psycopg.Error:
                pass  # refused: what the fix must do
        run_for(loop, 0.5)
        used, counter = sub_cores(conn, show)
        assert counter >= used, f"the subscription counter reads {counter} under SUM(proc) {used}"
        assert used <= 20, f"{used} cores booked against a burst of 20"
