"""The scheduler runtime against real PostgreSQL: bootstrap, listener, recompute, reseeds, flips.

Each test runs a real SchedulerProcess (advisory lock, listener thread, loops, live view
publisher) on the test database and changes the farm from other connections, as ops, a
script or Cuebot would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accounting import db, live
from accounting.recompute import Recomputer
from accounting.store import BookingDelta, LimitExceeded, Store
from tests.integration.runtime_support import autocommit_conn, make_farm, running_scheduler, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {
    "CUESCHED_RECOMPUTE_INTERVAL": "3600",
    "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
    "CUESCHED_MANAGED_SHOWS_TTL": "0.2",
}


@pytest.fixture(autouse=True)
def _slow_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backstop loops effectively off, so what a test sees comes from the listener alone."""
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def conn():
    c = autocommit_conn()
    yield c
    c.close()


def delta(farm, job_index: int = 0, cores: int = 1, gpus: int = 0) -> BookingDelta:
    return BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[job_index], cores, gpus)


def test_bootstrap_seeds_caps_and_counters_before_anything_is_enforced(conn) -> None:
    farm = make_farm(conn, "boot", burst_cores=10)
    for _ in range(4):
        farm.add_proc(conn, cores=2)
    with running_scheduler() as proc:
        service = proc.service
        # start() returned only after the bootstrap: caps and counters are both there.
        assert service.bootstrapped.is_set()
        assert service.is_managed(farm.show)
        assert service.store.sub_counters(farm.show, farm.alloc) == (8, 10)
        assert service.store.job_cores_in_use(farm.jobs[0]) == 8
        # The first booking already sees the 8 booked cores: 3 more would breach the burst.
        rejected = service.apply_booking(delta(farm, cores=3))
        assert isinstance(rejected, LimitExceeded)
        assert (rejected.table, rejected.current, rejected.limit) == ("subscription", 8, 10)


def test_service_enforces_nothing_before_bootstrap() -> None:
    from accounting.service import AccountingService, NotManaged

    service = AccountingService()
    result = service.apply_booking(BookingDelta("s", "a", "f", "j", 1, 0))
    assert isinstance(result, NotManaged)
    assert not service.bootstrapped.is_set()


def test_release_and_cap_changes_reach_the_store(conn) -> None:
    farm = make_farm(conn, "live", burst_cores=100, job_max_cores=50)
    procs = [farm.add_proc(conn, cores=2) for _ in range(3)]
    with running_scheduler() as proc:
        store = proc.service.store
        assert store.job_cores_in_use(farm.jobs[0]) == 6
        t0 = time.monotonic()
        farm.delete_procs(conn, procs[:1])
        wait_for(lambda: store.job_cores_in_use(farm.jobs[0]) == 4, what="release applied")
        release_delay = time.monotonic() - t0

        t0 = time.monotonic()
        conn.execute("UPDATE job_resource SET int_max_cores = 500 WHERE pk_job = %s", (farm.jobs[0],))
        wait_for(lambda: store.job_cap(farm.jobs[0]) == (5, 100), what="cap decrease applied")
        decrease_delay = time.monotonic() - t0
        assert isinstance(proc.service.apply_booking(delta(farm, cores=2)), LimitExceeded)

        t0 = time.monotonic()
        conn.execute("UPDATE subscription SET int_burst = 20000 WHERE pk_show = %s", (farm.show,))
        wait_for(lambda: store.sub_counters(farm.show, farm.alloc)[1] == 200, what="burst increase applied")
        increase_delay = time.monotonic() - t0
    print(
        f"\nnotification-to-Store delay: release {release_delay * 1000:.1f} ms, "
        f"cap decrease {decrease_delay * 1000:.1f} ms, cap increase {increase_delay * 1000:.1f} ms"
    )


def test_listener_backend_killed_while_caps_drop_and_procs_go(conn) -> None:
    farm = make_farm(conn, "kill", burst_cores=100, job_max_cores=40)
    procs = [farm.add_proc(conn, cores=4) for _ in range(5)]
    with running_scheduler() as proc:
        service = proc.service
        listener = service.listener
        old_pid = listener.backend_pid
        reconnects = listener.stats.reconnects
        # Kill the listener's backend, and while it is gone lower a cap and delete procs.
        conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        farm.delete_procs(conn, procs[:3])
        conn.execute("UPDATE job_resource SET int_max_cores = 1000 WHERE pk_job = %s", (farm.jobs[0],))
        conn.execute("UPDATE subscription SET int_burst = 3000 WHERE pk_show = %s", (farm.show,))
        t0 = time.monotonic()
        wait_for(lambda: listener.stats.reconnects > reconnects and listener.connected.is_set(), 20, "reconnect")
        wait_for(
            lambda: (
                service.store.job_cores_in_use(farm.jobs[0]) == 8
                and service.store.job_cap(farm.jobs[0]) == (10, 100)
                and service.store.sub_counters(farm.show, farm.alloc) == (8, 30)
            ),
            10,
            "Store equal to the database after reconnect",
        )
        healed = time.monotonic() - t0
        assert listener.backend_pid != old_pid
    print(f"\nreconnect-to-healed: {healed * 1000:.0f} ms")


def test_release_already_in_a_recompute_snapshot_is_not_subtracted_twice(conn) -> None:
    farm = make_farm(conn, "twice", burst_cores=100)
    procs = [farm.add_proc(conn, cores=2) for _ in range(3)]
    listen = autocommit_conn()
    listen.execute("LISTEN acct_release")
    from accounting.listener import Listener

    store = Store()
    recomputer = Recomputer(store)
    with db.connect() as rc:
        from accounting.limits import reseed_limits

        reseed_limits(store, rc)
        recomputer.store_pass(rc)
        assert store.job_cores_in_use(farm.jobs[0]) == 6
        # The delete commits, then a recompute reads a snapshot that already excludes it...
        farm.delete_procs(conn, procs[:1])
        note = next(listen.notifies(timeout=10, stop_after=1))
        recomputer.store_pass(rc)
    assert store.job_cores_in_use(farm.jobs[0]) == 4
    # ... and only then does the listener get to the release: it must be skipped.
    listener = Listener(store)
    assert listener.handle(note.channel, note.payload) == "skipped"
    assert store.job_cores_in_use(farm.jobs[0]) == 4
    assert store.sub_counters(farm.show, farm.alloc)[0] == 4
    listen.close()


def test_cap_notified_after_a_reseed_read_its_rows_is_not_reverted(conn) -> None:
    farm = make_farm(conn, "revert", job_max_cores=50)
    listen = autocommit_conn()
    listen.execute("LISTEN acct_limit_change")
    from accounting.limits import read_limits
    from accounting.listener import Listener

    store = Store()
    with db.connect() as rc:
        rows = read_limits(rc)  # the reseed reads its rows ...
    assert rows.jobs[farm.jobs[0]] == (50, 100)
    conn.execute("UPDATE job_resource SET int_max_cores = 700 WHERE pk_job = %s", (farm.jobs[0],))
    note = next(listen.notifies(timeout=10, stop_after=1))
    assert Listener(store).handle(note.channel, note.payload) == "applied"  # ... the decrease lands ...
    store.set_caps(rows.subs, rows.folders, rows.jobs, pg_snapshot=rows.pg_snapshot)  # ... then the reseed
    assert store.job_cap(farm.jobs[0])[0] == 7
    listen.close()


def test_show_flipped_to_managed_with_live_procs_is_enforced_from_its_first_booking(conn) -> None:
    farm = make_farm(conn, "flip", managed=False, burst_cores=20)
    for _ in range(3):
        farm.add_proc(conn, cores=5)  # 15 of 20 cores booked under database-enforced accounting
    with running_scheduler() as proc:
        service = proc.service
        assert not service.is_managed(farm.show)
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (farm.show,))
        wait_for(lambda: service.is_managed(farm.show), 10, "show published as managed")
        # Published only after its seed: the very first booking sees the 15 live cores.
        assert service.store.sub_counters(farm.show, farm.alloc) == (15, 20)
        rejected = service.apply_booking(delta(farm, cores=6))
        assert isinstance(rejected, LimitExceeded) and rejected.current == 15
        assert not isinstance(service.apply_booking(delta(farm, cores=5)), LimitExceeded)


MALFORMED = [
    "not json",
    "[]",
    '{"show": "x"}',
    json.dumps({"show": "nope", "alloc": "a", "folder": "f", "job": "j", "cores": -1, "gpus": 0}),
    json.dumps({"vertex": "planet", "id": "00000000-0000-0000-0000-000000000001", "max_cores": 1}),
    json.dumps({"vertex": "job", "id": "00000000-0000-0000-0000-000000000001", "max_cores": "ten"}),
    json.dumps({"vertex": "sub", "show": "00000000-0000-0000-0000-000000000001", "burst": 2**80}),
]


def test_malformed_payloads_are_dropped_and_the_listener_carries_on(conn) -> None:
    farm = make_farm(conn, "junk", burst_cores=100)
    procs = [farm.add_proc(conn, cores=3) for _ in range(2)]
    with running_scheduler() as proc:
        listener = proc.service.listener
        # Written as the trigger functions write (the outbox), by a writer that wrote junk: on a
        # channel alone the listener applies nothing, junk or not (test_review_27's forged tests).
        for payload in MALFORMED:
            for channel in ("acct_release", "acct_limit_change"):
                conn.execute("SELECT cuesched_acct_emit(%s, %s)", (channel, payload))
        farm.delete_procs(conn, procs[:1])
        wait_for(lambda: proc.service.store.job_cores_in_use(farm.jobs[0]) == 3, what="valid release after junk")
        assert sum(listener.stats.dropped.values()) == 2 * len(MALFORMED)
        assert listener.stats.reconnects == 0
        assert listener.connected.is_set()


def test_live_view_is_published_and_readable(conn) -> None:
    farm = make_farm(conn, "view", burst_cores=30, job_max_cores=12)
    farm.add_proc(conn, cores=2)
    with running_scheduler(publish_interval=0.05):

        def published() -> dict | None:
            with conn.cursor() as cur:
                view = live.read_view(cur)
            if view and f"{farm.show}:{farm.alloc}" in view["sub"]:
                return view
            return None

        wait_for(lambda: published() is not None, what="live view")
        view = published()
        assert view["age_seconds"] < live.STALE_AFTER_SECONDS
        assert view["sub"][f"{farm.show}:{farm.alloc}"]["cores"] == 2
        assert view["sub"][f"{farm.show}:{farm.alloc}"]["burst"] == 30
        assert view["job"][farm.jobs[0]]["max_cores"] == 12
        assert view["listener"]["state"] == "listening"


def test_a_second_scheduler_refuses_to_start() -> None:
    from django.db import connection

    from cuesched_project.dburl import url_from_settings

    url = url_from_settings(connection.settings_dict)
    with running_scheduler():
        env = {**os.environ, "DATABASE_URL": url}
        out = subprocess.run(
            [sys.executable, "manage.py", "run_scheduler", "--metrics-port", "0"],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode != 0
    assert "another run_scheduler already owns this database" in out.stderr


def test_metrics_count_bookings_rejections_and_releases(conn) -> None:
    from accounting import metrics

    def value(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    farm = make_farm(conn, "metrics", burst_cores=4)
    procs = [farm.add_proc(conn, cores=1)]
    with running_scheduler() as proc:
        service = proc.service
        before = (
            value("cuesched_bookings_total", accounting="store"),
            value("cuesched_rejections_total", table="subscription"),
            value("cuesched_releases_total", outcome="applied"),
        )
        booking = service.apply_booking(delta(farm, cores=3))
        service.confirm_booking(booking)
        assert isinstance(service.apply_booking(delta(farm, cores=1)), LimitExceeded)
        farm.delete_procs(conn, procs)
        wait_for(lambda: value("cuesched_releases_total", outcome="applied") > before[2], what="release counted")
        assert value("cuesched_bookings_total", accounting="store") == before[0] + 1
        assert value("cuesched_rejections_total", table="subscription") == before[1] + 1


def test_scheduler_retakes_its_lock_after_losing_the_session(conn) -> None:
    """A killed lock session (as after a database restart) must not leave the database open
    to a second scheduler: the running one takes the lock again on a new session."""
    from accounting import singleton

    with running_scheduler(lock_check_interval=0.05) as proc:
        old_pid = proc._lock_conn.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        wait_for(
            lambda: (
                proc._lock_conn is not None
                and not proc._lock_conn.closed
                and proc._lock_conn.info.backend_pid != old_pid
            ),
            what="lock re-taken on a new session",
        )
        with pytest.raises(singleton.SchedulerAlreadyRunning):
            singleton.acquire()
        assert not proc.stop.is_set()
