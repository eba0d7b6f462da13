"""The host memory ledger's recount inside the booking transaction: once per booking statement, still per booking.

The booking sets its constraints IMMEDIATE, so that a deferred check fails inside the group's
savepoint (one booking refused) instead of at COMMIT (the whole batch lost). The ledger's
recount is such a check. Its booking statement records the same hosts twice, from the proc
INSERT and from the host UPDATE, and each record used to run a recount of its own at once.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from accounting.host_memory import HOST_LEDGER_RECOUNT_CONSTRAINT
from accounting.models import HostLedger
from dispatch.engine.booking import write_batch
from tests.integration.dispatch_support import ONE_CORE, autocommit, plan, scalar, seed, violations

pytestmark = pytest.mark.django_db(transaction=True)

RECOUNT_CALLS_SQL = "SELECT COALESCE(SUM(calls), 0) FROM pg_stat_user_functions WHERE funcname LIKE %s"
RECOUNT_FUNCTION = "pgtrigger_acct_host_mem_recount_%"


def _recounts(conn: psycopg.Connection) -> int:
    """This server's recount calls so far: this session's flushed first (the next idle flushes them)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(scalar(conn, RECOUNT_CALLS_SQL, (RECOUNT_FUNCTION,)))


def test_a_booking_statement_recounts_its_hosts_once() -> None:
    seed("brc1", jobs=2, **ONE_CORE)
    with autocommit() as conn:
        conn.execute("SET track_functions = 'all'")
        _jobs, bookings = plan(conn, {0: 2, 1: 2}, managed=True)
        before = _recounts(conn)
        result = write_batch(conn, bookings, mem_used=256_000)
        assert len(result.written) == 4
        assert _recounts(conn) - before == 1
        assert violations(conn) == []


def test_a_booking_past_its_hosts_memory_is_still_refused_alone() -> None:
    seed("brc2", jobs=2, **ONE_CORE)
    with autocommit() as conn:
        _jobs, bookings = plan(conn, {0: 2, 1: 2}, managed=True)
        target = bookings[0]
        # A proc the ledger never saw (triggers off, as a superuser may): the host's idle memory
        # reads high, so the booking's own guard lets it through and only the recount can refuse it.
        (int_mem,) = conn.execute("SELECT int_mem FROM host WHERE pk_host = %s", (target.host.pk,)).fetchone()
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
                " int_mem_reserved) SELECT %s, %s, j.pk_show, j.pk_job, f.pk_layer, f.pk_frame, 1, %s"
                " FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE f.pk_job = %s AND f.pk_frame <> ALL(%s)"
                " LIMIT 1",
                (
                    str(uuid.uuid4()),
                    target.host.pk,
                    int_mem,
                    target.layer.job.pk,
                    [b.frame.pk for b in bookings],
                ),
            )

        result = write_batch(conn, bookings, mem_used=256_000)

        refused = {b.pk_proc: table for b, table in result.rejected}
        on_target = {b.pk_proc for b in bookings if b.host.pk == target.host.pk}
        assert set(refused) == on_target
        assert set(refused.values()) == {"database"}
        written = {b.pk_proc for b in result.written}
        assert written == {b.pk_proc for b in bookings} - on_target
        procs = {r[0] for r in conn.execute("SELECT pk_proc FROM proc").fetchall()}
        assert written <= procs and not (on_target & procs)


def test_the_recount_constraint_named_is_the_installed_one() -> None:
    (recount,) = [t for t in HostLedger._meta.triggers if t.name == "acct_host_mem_recount"]
    assert recount.get_pgid(HostLedger) == HOST_LEDGER_RECOUNT_CONSTRAINT
    with autocommit() as conn:
        assert scalar(
            conn,
            "SELECT tginitdeferred FROM pg_trigger WHERE tgname = %s AND tgconstraint <> 0",
            (HOST_LEDGER_RECOUNT_CONSTRAINT,),
        )
