"""A small farm drains completely through the real runtime, and no cap is ever exceeded.

The accounting runtime (bootstrap from the database, listener applying the releases of the
completion path's proc deletes) runs as in production; the dispatch loop books with the
simulated launcher; a sampler on its own connection checks every invariant many times while
the farm drains.
"""

from __future__ import annotations

import threading

import pytest

from accounting.scheduler import SchedulerOptions, SchedulerProcess
from dispatch.engine.loop import dispatch_main
from tests.integration.dispatch_support import (
    Sampler,
    autocommit,
    drain,
    fast_launcher,
    make_loop,
    scalar,
    seed,
    store_cores,
    violations,
    wait_for,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def _assert_drained(conn, farm) -> None:
    states = dict(conn.execute("SELECT str_state, count(*) FROM frame GROUP BY 1").fetchall())
    assert states == {"SUCCEEDED": len(farm.job_ids) * farm.spec.layers * farm.spec.frames_per_layer}
    assert scalar(conn, "SELECT count(*) FROM job WHERE str_state <> 'FINISHED'") == 0
    assert scalar(conn, "SELECT count(*) FROM proc") == 0
    assert scalar(conn, "SELECT count(*) FROM host WHERE int_cores_idle <> int_cores OR int_mem_idle <> int_mem") == 0
    assert scalar(conn, "SELECT COALESCE(SUM(int_waiting_count + int_running_count), 0) FROM job_stat") == 0


def test_managed_farm_drains_within_every_cap() -> None:
    farm = seed("drm")
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        assert service.is_managed(farm.show_ids[0])
        launcher = fast_launcher()
        # Few jobs and frames per query, so the farm takes many cycles and every skip path runs.
        loop = make_loop(service, launcher, max_jobs=3, frames_per_layer=2, batch_size=7)
        sampler = Sampler().start()
        try:
            totals = drain(loop)
        finally:
            sampler.stop()
        assert sampler.breaches == []
        assert sampler.samples > 10
        assert totals.booked == totals.completed == 96
        # The caps did bind: some booking was refused by the Store or its pre-check.
        assert totals.rejected["job_precheck"] + totals.rejected["job"] + totals.rejected["subscription"] > 0
        _assert_drained(conn, farm)
        assert violations(conn) == []
        # Every release reached the Store through the listener: back to zero, nothing in flight.
        wait_for(lambda: set(store_cores(service, farm).values()) == {0}, what="store counters back to 0")
        inflight = service.store.inflight_snapshot()
        assert {v for v in inflight.job.values()} <= {(0, 0)}


def test_drain_with_failing_frames_and_failing_launches_stays_exact() -> None:
    farm = seed("drf")
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        launcher = fast_launcher(failure_rate=0.25, launch_failure_rate=0.15)
        loop = make_loop(service, launcher, max_jobs=4, frames_per_layer=2, batch_size=9)
        sampler = Sampler().start()
        try:
            totals = drain(loop)
        finally:
            sampler.stop()
        assert sampler.breaches == []
        assert totals.launch_failures > 0 and totals.compensated == totals.launch_failures
        states = dict(conn.execute("SELECT str_state, count(*) FROM frame GROUP BY 1").fetchall())
        assert set(states) <= {"SUCCEEDED", "DEAD"} and sum(states.values()) == 96
        assert scalar(conn, "SELECT count(*) FROM job WHERE str_state <> 'FINISHED'") == 0
        assert violations(conn) == []
        assert scalar(conn, "SELECT count(*) FROM host WHERE int_cores_idle <> int_cores") == 0
        wait_for(lambda: set(store_cores(service, farm).values()) == {0}, what="store counters back to 0")
        inflight = service.store.inflight_snapshot()
        assert {v for v in inflight.job.values()} <= {(0, 0)}


def test_unmanaged_farm_drains_with_database_enforced_caps() -> None:
    farm = seed("dru", managed=False)
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        assert not service.is_managed(farm.show_ids[0])
        loop = make_loop(service, fast_launcher(), max_jobs=3, frames_per_layer=2, batch_size=7)
        sampler = Sampler().start()
        try:
            totals = drain(loop)
        finally:
            sampler.stop()
        assert sampler.breaches == []
        assert totals.booked == totals.completed == 96
        _assert_drained(conn, farm)
        # The trigger-kept totals came back to zero with the last release.
        for table in ("subscription", "folder_resource", "job_resource", "layer_resource"):
            assert scalar(conn, f"SELECT COALESCE(SUM(abs(int_cores)), 0) FROM {table}") == 0, table
        # The Store never saw the show.
        assert set(store_cores(service, farm).values()) <= {0}


def test_managed_only_leaves_unmanaged_shows_alone() -> None:
    managed = seed("dmo")
    unmanaged = seed("dmu", managed=False, jobs=2)
    with running_scheduler() as proc, autocommit() as conn:
        loop = make_loop(proc.service, fast_launcher(), managed_only=True)
        drain(loop)
        rows = conn.execute(
            "SELECT s.b_scheduler_managed, f.str_state, count(*) FROM frame f JOIN job j ON j.pk_job = f.pk_job"
            " JOIN show s ON s.pk_show = j.pk_show GROUP BY 1, 2"
        ).fetchall()
        assert {(m, st): n for m, st, n in rows} == {
            (True, "SUCCEEDED"): len(managed.job_ids) * 8,
            (False, "WAITING"): len(unmanaged.job_ids) * 8,
        }


def test_dispatch_main_runs_in_the_scheduler_process_and_exits_when_idle() -> None:
    """The wiring run_scheduler uses: SchedulerProcess(...).run(dispatch_main(...))."""
    farm = seed("dmain", jobs=4)
    process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=30))
    thread = threading.Thread(
        target=process.run,
        args=(dispatch_main("simulated", exit_when_idle=True, runtime_min=0.0, runtime_max=0.01),),
        daemon=True,
    )
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "run_scheduler did not exit once the farm was drained"
    with autocommit() as conn:
        _assert_drained(conn, farm)
    # The loop's counters are part of the service's live view (published every second).
    assert process.service.view_providers["dispatch"]()["booked"] == 32


@pytest.mark.parametrize("managed", [True, False], ids=["store", "database"])
def test_two_workers_share_the_caps_and_split_the_farm(managed: bool) -> None:
    """Two dispatch workers book one show under one folder cap: the Store (or the triggers) is
    the only thing they share, and no cap is exceeded while both book at once."""
    farm = seed(f"dwk{int(managed)}", managed=managed, jobs=8, folder_max_cores=1000, hosts=12)
    process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=30))
    main = dispatch_main("simulated", exit_when_idle=True, workers=2, runtime_min=0.0, runtime_max=0.02)
    thread = threading.Thread(target=process.run, args=(main,), daemon=True)
    sampler = Sampler().start()
    try:
        thread.start()
        thread.join(120)
    finally:
        sampler.stop()
    assert not thread.is_alive(), "the workers did not exit once the farm was drained"
    assert sampler.breaches == []
    view = process.service.view_providers["dispatch"]()
    assert view["workers"] == 2
    assert view["booked"] == view["completed"] == 64
    with autocommit() as conn:
        _assert_drained(conn, farm)
        # Each worker books only on its own hosts (the shard of the host id's hash), so the two
        # never race for a host's idle cores: every frame ran on a host of its worker's shard.
        mixed = scalar(
            conn,
            "SELECT count(*) FROM frame f JOIN host h ON h.str_name = f.str_host"
            " WHERE mod(hashtext(h.pk_host) & 2147483647, 2) <> mod(hashtext(f.pk_job) & 2147483647, 2)",
        )
    assert mixed == 0


def test_the_invariant_check_sees_a_breach() -> None:
    """The sampler's query is the test oracle: it must report a proc over a job's cap."""
    farm = seed("orcl", **{"jobs": 1, "job_max_cores": 100, "layer_cores_choices": (2,)})
    with autocommit() as conn:
        conn.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
            " int_mem_reserved) SELECT gen_random_uuid()::text, %s, j.pk_show, j.pk_job, f.pk_layer, f.pk_frame,"
            " 200, 1 FROM frame f JOIN job j ON j.pk_job = f.pk_job LIMIT 1",
            (farm.host_ids[0],),
        )
        found = {what for what, *_rest in violations(conn)}
    assert {"job", "host_ledger", "running_vs_procs", "proc_frame_not_running"} <= found
