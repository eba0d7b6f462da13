"""Faults: a launch that fails after commit, a lost host, a database that drops the connection,
a COMMIT whose outcome was never seen. Each leaves no counter, host ledger or frame wrong."""

from __future__ import annotations

import threading

import psycopg
import pytest

from dispatch.engine import loop as loop_module
from dispatch.engine.booking import EXIT_STATUS_FRAME_CLEARED, BatchResult, write_batch
from dispatch.engine.completion import EXIT_STATUS_DOWN_HOST, release_lost_hosts
from dispatch.engine.loop import Unresolved
from tests.integration.dispatch_support import (
    ONE_CORE,
    Sampler,
    autocommit,
    db_cores,
    drain,
    fast_launcher,
    make_loop,
    plan,
    scalar,
    seed,
    store_cores,
    violations,
    wait_for,
)
from tests.integration.notify_listener import as_json, listening
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

LONG = {"runtime_min": 60.0, "runtime_max": 60.0}  # nothing completes while the test looks


def _inflight_is_zero(service) -> bool:
    snap = service.store.inflight_snapshot()
    return all(v == (0, 0) for m in (snap.sub, snap.folder, snap.job) for v in m.values())


def test_launch_failure_after_commit_compensates_exactly() -> None:
    farm = seed("cmp", jobs=2, frames_per_layer=2, **ONE_CORE)
    with running_scheduler() as proc, autocommit() as conn, listening(("acct_release",)) as releases:
        service = proc.service
        target, version = conn.execute(
            "SELECT pk_frame, int_version FROM frame ORDER BY str_name, pk_job LIMIT 1"
        ).fetchone()
        launcher = fast_launcher(fail_launch=lambda b: b.frame.pk == target, **LONG)
        with make_loop(service, launcher) as loop:
            stats = loop.run_once()

        assert (stats.booked, stats.launch_failures, stats.compensated) == (3, 1, 1)
        # The compensating delete sends one ordinary release, keyed as the proc is when it goes
        # (an outside move since the booking would have re-keyed it), and the booking is
        # confirmed: that release, not a rollback of the booked key, takes it out of the Store.
        [release] = as_json(releases.sent_before_sentinel("acct_release"))
        assert release["cores"] == -1
        wait_for(lambda: store_cores(service, farm) == db_cores(conn, farm), what="the release applied in the Store")
        row = conn.execute(
            "SELECT str_state, int_exit_status, int_version FROM frame WHERE pk_frame = %s", (target,)
        ).fetchone()
        assert row == ("WAITING", EXIT_STATUS_FRAME_CLEARED, version + 2)  # started, then cleared
        assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_frame = %s", (target,)) == 0
        # Host ledger and frame/proc pairing are exact; the Store holds exactly the 3 live procs.
        assert violations(conn) == []
        assert store_cores(service, farm) == db_cores(conn, farm)
        assert sum(v for k, v in db_cores(conn, farm).items() if k.startswith("job:")) == 3
        assert _inflight_is_zero(service)
        assert launcher.running() == 3


def test_lost_host_frames_return_to_waiting_and_procs_are_released() -> None:
    # Two hosts in one allocation with the same (allocation) tag: either can run any frame.
    farm = seed("lost", **{**ONE_CORE, "hosts": 2, "allocs": 1, "manual_tags": 0, "jobs": 2, "frames_per_layer": 3})
    with running_scheduler() as proc, autocommit() as conn, listening(("acct_release",)) as releases:
        service = proc.service
        launcher = fast_launcher(heartbeat=False, **LONG)  # no simulated agent pings for the silent host
        loop = make_loop(service, launcher, lost_host_timeout=30, lost_host_sweep_interval=0)
        with loop:
            assert loop.run_once().booked == 6
            lost_host, lost_procs = conn.execute(
                "SELECT pk_host, count(*) FROM proc GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1"
            ).fetchone()
            lost_frames = [r[0] for r in conn.execute("SELECT pk_frame FROM proc WHERE pk_host = %s", (lost_host,))]
            conn.execute("UPDATE host_stat SET ts_ping = now() - interval '1 hour' WHERE pk_host = %s", (lost_host,))

            procs, result = release_lost_hosts(conn, 30)

            assert len(procs) == result.released == lost_procs
            states = conn.execute(
                "SELECT str_state, int_exit_status, int_retries, count(*) FROM frame WHERE pk_frame = ANY(%s)"
                " GROUP BY 1, 2, 3",
                (lost_frames,),
            ).fetchall()
            assert states == [("WAITING", EXIT_STATUS_DOWN_HOST, 0, lost_procs)]
            assert scalar(conn, "SELECT int_cores - int_cores_idle FROM host WHERE pk_host = %s", (lost_host,)) == 0
            released = as_json(releases.sent_before_sentinel("acct_release"))
            assert sum(-m["cores"] for m in released) == lost_procs
            wait_for(lambda: store_cores(service, farm) == db_cores(conn, farm), what="the release in the Store")
            assert violations(conn) == []

            # The loop books them again, never on the silent host (its guard refuses the host
            # even before the view's next reload drops it).
            for _ in range(3):
                loop.run_once()
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_host = %s", (lost_host,)) == 0
            assert scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'RUNNING'") == 6


def test_the_simulated_launcher_pings_for_its_hosts_so_none_is_lost() -> None:
    """Seeded hosts have no agent: without the simulated pings they would all be lost."""
    seed("ping", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 2})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE host_stat SET ts_ping = now() - interval '1 hour'")
        loop = make_loop(proc.service, fast_launcher(**LONG), lost_host_timeout=30, lost_host_sweep_interval=0)
        with loop:
            stats = loop.run_once()
        assert stats.booked == 2 and stats.lost_released == 0
        assert scalar(conn, "SELECT count(*) FROM host_stat WHERE ts_ping < now() - interval '30 seconds'") == 0


def test_the_loop_survives_its_connection_being_killed_mid_drain() -> None:
    farm = seed("kill")
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        loop = make_loop(service, fast_launcher(), max_jobs=3, frames_per_layer=2, batch_size=5)
        sampler = Sampler().start()
        stop_killing = threading.Event()
        kills: list[int] = []

        def killer() -> None:
            with autocommit() as c:
                while not stop_killing.is_set() and len(kills) < 6:
                    n = scalar(
                        c,
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'cuesched-dispatch%%' AND datname = current_database()",
                    )
                    if n:
                        kills.append(n)
                    stop_killing.wait(0.15)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            totals = drain(loop, timeout=90)
        finally:
            stop_killing.set()
            thread.join(5)
            sampler.stop()
        assert kills, "the killer never found the loop's connection"
        assert totals.db_errors >= 1
        assert sampler.breaches == []
        assert scalar(conn, "SELECT count(*) FROM frame WHERE str_state <> 'SUCCEEDED'") == 0
        assert violations(conn) == []
        wait_for(lambda: set(store_cores(service, farm).values()) == {0}, what="store counters back to 0")
        assert _inflight_is_zero(service)


def test_an_unknown_commit_outcome_is_settled_from_the_transactions_fate() -> None:
    farm = seed("amb", jobs=2, frames_per_layer=2, **ONE_CORE)
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        with make_loop(service, fast_launcher(**LONG)) as loop:
            _jobs, bookings = plan(conn, {0: 2, 1: 2}, managed=True, book=service.apply_booking)
            # Two batches whose COMMIT the loop did not see: the first committed, the second's
            # transaction was rolled back (its xid is an aborted one).
            committed = write_batch(conn, bookings[:3], mem_used=256_000)
            with conn.transaction(force_rollback=True):
                aborted_xid = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
            loop._unresolved.append(Unresolved(bookings[:3], committed, committed.xid, None))
            loop._unresolved.append(Unresolved(bookings[3:], BatchResult(written=bookings[3:]), aborted_xid, None))
            assert not _inflight_is_zero(service)

            stats = loop.run_once()

        # The three were launched and confirmed, the fourth rolled back in the Store (pg_xact_status
        # said aborted); its frame, still WAITING, was booked afresh in the same cycle.
        assert stats.booked == 4
        assert {b.pk_proc for b in bookings[:3]} <= {r[0] for r in conn.execute("SELECT pk_proc FROM proc")}
        assert bookings[3].pk_proc not in {r[0] for r in conn.execute("SELECT pk_proc FROM proc")}
        assert _inflight_is_zero(service)
        assert store_cores(service, farm) == db_cores(conn, farm)
        assert violations(conn) == []
        assert scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'RUNNING'") == 4


def test_a_settlement_cut_short_by_a_database_error_settles_nothing_twice(monkeypatch) -> None:
    # Two batches with unknown outcomes; the database fails while the second is looked up. The
    # first used to be settled again at the next cycle (its entry stayed listed until every one
    # was done): confirmed twice, its in-flight amount went negative and the counter read LOW.
    farm = seed("amb2", jobs=2, frames_per_layer=2, **ONE_CORE)
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        with make_loop(service, fast_launcher(**LONG)) as loop:
            _jobs, bookings = plan(conn, {0: 2, 1: 2}, managed=True, book=service.apply_booking)
            first = write_batch(conn, bookings[:2], mem_used=256_000)
            second = write_batch(conn, bookings[2:], mem_used=256_000)
            loop._unresolved.append(Unresolved(bookings[:2], first, first.xid, None))
            loop._unresolved.append(Unresolved(bookings[2:], second, second.xid, None))
            calls = []
            real = loop_module.find_written

            def failing_once(c, written):
                calls.append(len(written))
                if len(calls) == 2:
                    raise psycopg.OperationalError("the database went away")
                return real(c, written)

            monkeypatch.setattr(loop_module, "find_written", failing_once)
            with pytest.raises(psycopg.OperationalError):
                loop.run_once()
            loop.run_once()
        assert _inflight_is_zero(service)
        assert store_cores(service, farm) == db_cores(conn, farm)
        assert violations(conn) == []
