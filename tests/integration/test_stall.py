"""One stuck or hostile session slows at most its own show, never the farm (issue 27, row 7).

A psql session that wrote a proc of an unmanaged show and was then left idle holds that show's
database-accounting lock and its counter rows until it ends; one that locked a managed show's
row holds off the booking transaction's foreign-key check. The booking transaction, the
reconcile and the loop must skip that show for the cycle and book every other show, settle the
skipped bookings exactly, and name the session that blocks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from accounting import db
from accounting.reconcile import reconcile_unmanaged
from dispatch.engine.booking import REJECT_LOCKED, write_batch
from dispatch.engine.feed import fetch_pending
from tests.integration.dispatch_support import (
    ONE_CORE,
    autocommit,
    db_cores,
    fast_launcher,
    make_loop,
    plan,
    scalar,
    seed,
    store_cores,
    violations,
    wait_for,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

# Far longer than any lock wait of the booking transaction, far shorter than "forever".
RETURNS_WITHIN = 8.0


@contextmanager
def outside_session(application_name: str = "psql-stuck") -> Iterator[psycopg.Connection]:
    """A plain session, as psql opens it: no cuesched writer mark, no timeouts of ours."""
    conn = psycopg.connect(db.conninfo(), autocommit=True, application_name=application_name)
    try:
        yield conn
    finally:
        if not conn.closed:
            conn.execute("ROLLBACK")
            conn.close()


def hold_proc_insert(conn: psycopg.Connection, job: Any) -> str:
    """BEGIN; INSERT INTO proc ... for one frame of `job` (not booked by the test), left open."""
    layer = job.layers[0]
    frame = layer.frames[-1]
    host = scalar(conn, "SELECT pk_host FROM host ORDER BY pk_host LIMIT 1")
    pk = str(uuid.uuid4())
    conn.execute("BEGIN")
    conn.execute(
        "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
        " int_mem_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1)",
        (pk, host, job.show, job.pk, layer.pk, frame.pk),
    )
    return frame.pk


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported by the caller
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def plan_job(conn: psycopg.Connection, job_pk: str, n: int, *, managed: bool) -> list[Any]:
    """`plan` for one job, found by id in the same read `plan` makes."""
    jobs = fetch_pending(conn, managed_only=False, max_jobs=50, frames_per_layer=20)
    bookings = plan(conn, {[j.pk for j in jobs].index(job_pk): n}, managed=managed)[1]
    assert {b.layer.job.pk for b in bookings} == {job_pk}
    return bookings


def _store_status() -> str:
    from io import StringIO

    from django.core.management import call_command
    from django.db import connection

    out = StringIO()
    try:
        call_command("store_status", stdout=out)
    finally:
        connection.close()
    return out.getvalue()


def _by_show(jobs: list[Any]) -> dict[str, list[int]]:
    shows: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        shows.setdefault(job.show, []).append(i)
    return shows


def test_an_idle_transaction_on_one_unmanaged_show_does_not_stop_the_other_shows_booking() -> None:
    farm = seed("stl7", shows=3, managed=True, managed_shows=1, jobs=6, frames_per_layer=4, **ONE_CORE)
    managed, stuck_show, other = farm.show_ids
    with autocommit() as conn, outside_session() as psql:
        jobs, _ = plan(conn, {}, managed=True)
        idx = _by_show(jobs)
        held_frame = hold_proc_insert(psql, jobs[idx[stuck_show][0]])
        mine = plan_job(conn, jobs[idx[managed][0]].pk, 2, managed=True)
        theirs = plan_job(conn, jobs[idx[stuck_show][0]].pk, 2, managed=False)
        theirs += plan_job(conn, jobs[idx[other][0]].pk, 2, managed=False)
        assert held_frame not in {b.frame.pk for b in theirs}
        started = time.monotonic()
        thread, out = in_thread(write_batch, conn, mine + theirs, mem_used=256_000)
        thread.join(RETURNS_WITHIN)
        took = time.monotonic() - started
        if thread.is_alive():
            psql.execute("ROLLBACK")
            thread.join(30)
            pytest.fail(f"the booking transaction waited {took:.1f}s for one show's idle transaction")
        assert "error" not in out, out.get("error")
        result = out["value"]
        written = {b.layer.job.show for b in result.written}
        assert written == {managed, other}
        assert {(b.layer.job.show, table) for b, table in result.rejected} == {(stuck_show, REJECT_LOCKED)}
        # The skipped show's part was rolled back exactly: no proc, no host charge, frames WAITING.
        skipped = [b for b, _t in result.rejected]
        assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_proc = ANY(%s)", ([b.pk_proc for b in skipped],)) == 0
        assert scalar(
            conn, "SELECT count(*) FROM frame WHERE pk_frame = ANY(%s) AND str_state = 'WAITING'",
            ([b.frame.pk for b in skipped],),
        ) == len(skipped)  # fmt: skip
        # Who blocks is named: the session, its application and what it holds.
        assert any(bl["application_name"] == "psql-stuck" for bl in result.blockers.get(stuck_show, []))
        psql.execute("ROLLBACK")
        # Once the session ended, the show books again.
        again = plan_job(conn, jobs[idx[stuck_show][0]].pk, 2, managed=False)
        assert len(write_batch(conn, again, mem_used=256_000).written) == 2
        assert violations(conn) == []


def test_a_row_lock_on_a_managed_show_skips_that_show_and_settles_its_store_bookings_exactly() -> None:
    """`SELECT ... FROM show ... FOR UPDATE` left open holds off the foreign-key check of every proc
    of the show (at COMMIT, for deferred keys): the show is skipped, the other shows book, and the
    Store gives back exactly what it had booked for the skipped show."""
    farm = seed("stlm", shows=2, managed=True, jobs=4, frames_per_layer=6, **ONE_CORE)
    held, other = farm.show_ids
    with running_scheduler() as proc, autocommit() as conn, outside_session() as psql:
        psql.execute("BEGIN")
        psql.execute("SELECT 1 FROM show WHERE pk_show = %s FOR UPDATE", (held,))
        loop = make_loop(proc.service, fast_launcher(runtime_min=60.0, runtime_max=60.0))
        try:
            thread, out = in_thread(loop.run_once)
            thread.join(RETURNS_WITHIN)
            if thread.is_alive():
                psql.execute("ROLLBACK")
                thread.join(30)
                pytest.fail("the dispatch cycle waited for one show's row lock")
            assert "error" not in out, out.get("error")
            stats = out["value"]
            shows = dict(conn.execute("SELECT pk_show, count(*) FROM proc GROUP BY 1").fetchall())
            assert shows.get(other, 0) > 0 and shows.get(held, 0) == 0
            assert stats.rejected[REJECT_LOCKED] > 0
            assert store_cores(proc.service, farm) == db_cores(conn, farm)
            locked = loop.live_view()["locked_shows"]
            assert held in locked and any(b["application_name"] == "psql-stuck" for b in locked[held]["blockers"])
            # store_status reads the published view: it names the show and the session.
            proc.service.view_providers["dispatch"] = loop.live_view
            wait_for(lambda: f"LOCKED: show {held}" in _store_status(), timeout=10, what="store_status to name it")
            line = next(x for x in _store_status().splitlines() if x.startswith(f"LOCKED: show {held}"))
            assert "psql-stuck" in line and "idle in transaction" in line
            psql.execute("ROLLBACK")
            # Released: the show books again (after the skip's short back-off).
            deadline = time.monotonic() + 10
            while scalar(conn, "SELECT count(*) FROM proc WHERE pk_show = %s", (held,)) == 0:
                assert time.monotonic() < deadline, "the show did not book again after the lock was released"
                loop.run_once()
            assert store_cores(proc.service, farm) == db_cores(conn, farm)
        finally:
            loop.close()


def test_the_reconcile_skips_a_show_whose_lock_is_held_and_rebuilds_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUESCHED_RECONCILE_LOCK_WAIT", "0.2")
    farm = seed("stlr", shows=3, managed=False, jobs=6, frames_per_layer=4, **ONE_CORE)
    stuck_show = farm.show_ids[1]
    with autocommit() as conn, outside_session() as psql:
        jobs, _ = plan(conn, {}, managed=False)
        idx = _by_show(jobs)
        hold_proc_insert(psql, jobs[idx[stuck_show][0]])
        # Drift on another show for the reconcile to correct.
        drifted = farm.show_ids[2]
        with conn.transaction():
            conn.execute("SELECT set_config('cuesched.counter_rebuild', 'on', true)")
            conn.execute("UPDATE subscription SET int_cores = int_cores + 700 WHERE pk_show = %s", (drifted,))
        thread, out = in_thread(reconcile_unmanaged, conn)
        thread.join(RETURNS_WITHIN)
        if thread.is_alive():
            psql.execute("ROLLBACK")
            thread.join(30)
            pytest.fail("the reconcile waited for one show's idle transaction")
        assert "error" not in out, out.get("error")
        result = out["value"]
        assert result.shows == 2
        assert list(result.skipped) == [stuck_show]
        assert "psql-stuck" in result.skipped[stuck_show]
        assert scalar(conn, "SELECT SUM(int_cores) FROM subscription WHERE pk_show = %s", (drifted,)) == 0


# --- row 9: an operator's limit write never deadlocks with bookings --------------------------


def _waiting(conn: psycopg.Connection, application_name: str) -> bool:
    return bool(
        scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
            (application_name,),
        )
    )


def _set_limit_by_action(limit: str, max_value: int) -> None:
    from django.db import connection

    from accounting.actions import set_limit

    try:
        set_limit(limit, max_value=max_value, actor="ops")
    finally:
        connection.close()


@pytest.mark.parametrize("writer", ["psql", "action"])
def test_an_operator_limit_write_under_booking_and_completion_never_deadlocks(writer: str) -> None:
    """The lock order that deadlocked, driven step by step (PostgreSQL 15, deadlock_timeout 1 s).

    The booking transaction wrote its managed group first (frame, host, then the licence trigger's
    FOR UPDATE of limit L) and its unmanaged group next (another host's row); a completion on that
    other host takes the host row first and L at its statement's end. With the operator's UPDATE
    of L queued between them on L's tuple lock, the cycle booking -> completion -> operator ->
    booking was found first by the operator's wait: "deadlock detected ... while locking tuple
    ... in relation limit_record". Every proc writer now takes its limit rows first, in key order,
    so the operator only ever waits.
    """
    from dispatch.engine.completion import Completion, complete

    farm = seed("stl9", shows=2, managed=True, managed_shows=1, jobs=4, frames_per_layer=4, **ONE_CORE)
    managed, unmanaged = farm.show_ids
    limit = "stl9-limit"
    with autocommit() as conn:
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, 100)", (limit, limit)
        )
        jobs, _ = plan(conn, {}, managed=True)
        idx = _by_show(jobs)
        jm, jp, ju = jobs[idx[managed][0]], jobs[idx[unmanaged][0]], jobs[idx[unmanaged][1]]
        conn.execute(
            "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s), (%s, %s, %s)",
            (str(uuid.uuid4()), jm.layers[0].pk, limit, str(uuid.uuid4()), jp.layers[0].pk, limit),
        )
        # P: a running proc of the unmanaged show, under L, on host hP.
        first = plan_job(conn, jp.pk, 1, managed=False)
        assert len(write_batch(conn, first, mem_used=256_000).written) == 1
        p = first[0]
        m = plan_job(conn, jm.pk, 4, managed=True)
        m = [next(b for b in m if b.host.pk != p.host.pk)]
        u = plan_job(conn, ju.pk, 1, managed=False)
        u[0].host = p.host  # the unmanaged booking goes where the completion runs

    def op_psql() -> None:
        with outside_session("ops-operator") as op:
            op.execute("UPDATE limit_record SET int_max_value = 50 WHERE pk_limit_record = %s", (limit,))

    def op_action() -> None:
        import os

        os.environ["PGAPPNAME"] = "ops-operator"
        _set_limit_by_action(limit, 50)

    operator = op_psql if writer == "psql" else op_action
    b_conn = db.connect(autocommit=True, application_name="stl9-booking")
    c_conn = db.connect(autocommit=True, application_name="stl9-completion")
    try:
        with autocommit() as watch, outside_session("stl9-holder") as x:
            x.execute("BEGIN")
            x.execute("SELECT 1 FROM limit_record WHERE pk_limit_record = %s FOR UPDATE", (limit,))
            tb, ob = in_thread(write_batch, b_conn, m + u, mem_used=256_000)
            wait_for(lambda: not tb.is_alive() or _waiting(watch, "stl9-booking"), what="the booking to wait for L")
            to, oo = in_thread(operator)
            wait_for(lambda: _waiting(watch, "ops-operator"), what="the operator to wait for L")
            tc, oc = in_thread(complete, c_conn, [Completion(p.pk_proc, 0)])
            wait_for(lambda: _waiting(watch, "stl9-completion"), what="the completion to wait for L")
            x.execute("COMMIT")
            for t in (tb, to, tc):
                t.join(30)
                assert not t.is_alive()
        assert "error" not in oo, f"the operator's write failed: {oo.get('error')!r}"
        assert "error" not in oc, f"the completion failed: {oc.get('error')!r}"
        assert "error" not in ob, f"the booking failed: {ob.get('error')!r}"
        with autocommit() as conn:
            assert scalar(conn, "SELECT int_max_value FROM limit_record WHERE pk_limit_record = %s", (limit,)) == 50
            counted = scalar(
                conn,
                "SELECT count(*) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer"
                " WHERE ll.pk_limit_record = %s",
                (limit,),
            )
            assert scalar(conn, "SELECT int_running FROM limit_record WHERE pk_limit_record = %s", (limit,)) == counted
            assert violations(conn) == []
    finally:
        b_conn.close()
        c_conn.close()


def test_a_cap_write_behind_a_held_row_waits_bounded_and_names_the_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's, the API's and the commands' cap writes go through the actions: behind a
    session that holds the row they wait CUESCHED_CAP_WRITE_WAIT, then fail with a message that
    names it and change nothing; once it is gone the same write goes through."""
    from django.core.exceptions import ValidationError
    from django.db import connection

    from accounting.actions import set_limit

    monkeypatch.setenv("CUESCHED_CAP_WRITE_WAIT", "0.5")
    with autocommit() as conn:
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES ('stlc', 'stlc', 10)"
        )
    with outside_session() as psql:
        psql.execute("BEGIN")
        psql.execute("SELECT 1 FROM limit_record WHERE pk_limit_record = 'stlc' FOR UPDATE")

        def write() -> None:
            try:
                set_limit("stlc", max_value=20, actor="ops")
            finally:
                connection.close()

        thread, out = in_thread(write)
        thread.join(RETURNS_WITHIN)
        if thread.is_alive():
            psql.execute("ROLLBACK")
            thread.join(30)
            pytest.fail("the limit write waited without bound behind a held row")
        assert isinstance(out.get("error"), ValidationError), out
        message = " ".join(out["error"].messages)
        assert "psql-stuck" in message and "nothing was changed" in message
        psql.execute("ROLLBACK")
    assert set_limit("stlc", max_value=20, actor="ops").changed
    with autocommit() as conn:
        assert scalar(conn, "SELECT int_max_value FROM limit_record WHERE pk_limit_record = 'stlc'") == 20


def test_a_flip_behind_a_stuck_proc_writer_gives_up_bounded_and_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flip needs its own show's proc writers out of the way (its row FOR UPDATE against their
    FOR KEY SHARE): behind an idle transaction that wrote a proc of that show it cannot go on,
    and says which session to end. Another show flips meanwhile (before issue 27's row locks the
    flip of that other show failed too, behind the one accounting-keys lock)."""
    from django.db import connection

    from accounting.actions import flip_show
    from accounting.db import KeysLockTimeout

    monkeypatch.setenv("CUESCHED_FLIP_LOCK_WAIT", "1")
    farm = seed("stlf", shows=2, managed=False, jobs=4, frames_per_layer=4, **ONE_CORE)
    with autocommit() as conn, outside_session() as psql:
        jobs, _ = plan(conn, {}, managed=False)
        idx = _by_show(jobs)
        hold_proc_insert(psql, jobs[idx[farm.show_ids[0]][0]])
        started = time.monotonic()
        try:
            with pytest.raises(KeysLockTimeout) as failed:
                flip_show(farm.show_ids[0], True, actor="ops")
            assert flip_show(farm.show_ids[1], True, actor="ops").changed
        finally:
            connection.close()
        assert time.monotonic() - started < RETURNS_WITHIN
        assert "psql-stuck" in str(failed.value) and "idle in transaction" in str(failed.value)
        psql.execute("ROLLBACK")
    assert flip_show(farm.show_ids[0], True, actor="ops").changed


def test_the_display_write_skips_a_managed_counter_row_another_session_holds() -> None:
    """The recompute writes SUM(proc) into managed shows' counter rows for CueGUI and the console:
    a row another session holds (an operator's UPDATE left open) is left for the next pass, and
    every other row is written at once, so nobody waits and no cycle can form with that session."""
    farm = seed("stld", shows=2, managed=True, jobs=4, frames_per_layer=4, **ONE_CORE)
    held, other = farm.show_ids
    with running_scheduler() as proc, autocommit() as conn, outside_session() as psql:
        jobs, _ = plan(conn, {}, managed=True)
        idx = _by_show(jobs)
        bookings = plan_job(conn, jobs[idx[held][0]].pk, 2, managed=True)
        bookings += plan_job(conn, jobs[idx[other][0]].pk, 2, managed=True)
        assert len(write_batch(conn, bookings, mem_used=256_000).written) == 4
        psql.execute("BEGIN")
        psql.execute("UPDATE subscription SET int_size = int_size WHERE pk_show = %s", (held,))
        thread, out = in_thread(proc.service.recomputer.run_once, conn)
        thread.join(RETURNS_WITHIN)
        if thread.is_alive():
            psql.execute("ROLLBACK")
            thread.join(30)
            pytest.fail("the display write waited for a counter row another session holds")
        assert "error" not in out, out.get("error")
        assert out["value"].pg_error is None
        display = dict(conn.execute("SELECT pk_show, SUM(int_cores) FROM subscription GROUP BY 1").fetchall())
        assert display[other] == 200 and display[held] == 0
        psql.execute("ROLLBACK")
        proc.service.recomputer.run_once(conn)
        display = dict(conn.execute("SELECT pk_show, SUM(int_cores) FROM subscription GROUP BY 1").fetchall())
        assert display[held] == 200
