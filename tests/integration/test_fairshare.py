"""Issue 19, part 2: fair share by subscription size, and no head-of-line blocking in the feed.

Each test seeds a small farm, shapes it with plain SQL before the scheduler bootstraps (so the
Store is seeded with those caps), then runs the real dispatch loop cycle by cycle and reads
what it booked from committed proc rows.
"""

from __future__ import annotations

import pytest

from dispatch.engine.loop import DispatchLoop
from tests.integration.dispatch_support import Sampler, autocommit, fast_launcher, make_loop, seed
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

# Frames that never finish while a test looks: what a cycle booked stays booked.
LONG = {"runtime_min": 600.0, "runtime_max": 600.0}


def _farm(prefix: str, *, managed: bool, hosts: int = 4, allocs: int = 1, jobs: int = 4, **kw):
    """Two shows, `allocs` allocations, `hosts` 4-core hosts, one-core frames, no cap in the way."""
    spec = {
        "shows": 2,
        "allocs": allocs,
        "hosts": hosts,
        "jobs": jobs,
        "layers": 1,
        "frames_per_layer": 30,
        "manual_tags": 0,
        "host_cores_choices": (4,),
        "host_mem_gb_choices": (64,),
        "layer_cores_choices": (1,),
        "layer_mem_gb_choices": (1,),
        "sub_burst": 1600,
        "folder_max_cores": -1,
        "job_max_cores": 10_000,
        **kw,
    }
    return seed(prefix, managed=managed, **spec)


def _booked_by_show(conn, farm) -> dict[str, int]:
    rows = conn.execute(
        "SELECT pk_show, SUM(int_cores_reserved) / 100 FROM proc WHERE pk_show = ANY(%s) GROUP BY 1",
        (list(farm.show_ids),),
    ).fetchall()
    out = dict.fromkeys(farm.show_ids, 0)
    out.update({show: int(cores) for show, cores in rows})
    return out


def _booked_by_job(conn, farm) -> dict[str, int]:
    rows = conn.execute(
        "SELECT pk_job, SUM(int_cores_reserved) / 100 FROM proc WHERE pk_job = ANY(%s) GROUP BY 1",
        (list(farm.job_ids),),
    ).fetchall()
    out = dict.fromkeys(farm.job_ids, 0)
    out.update({job: int(cores) for job, cores in rows})
    return out


def _jobs_of(farm, show_index: int) -> list[str]:
    return [j for i, j in enumerate(farm.job_ids) if i % len(farm.show_ids) == show_index]


def _loop(service, **kw) -> DispatchLoop:
    kw.setdefault("host_refresh_interval", 0.0)  # every cycle sees the hosts the test opened
    return make_loop(service, fast_launcher(**LONG), **kw)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_every_free_core_goes_to_the_show_below_its_size(managed: bool) -> None:
    """Show A (size 8, priority 1) is below its size; show B (size 2, priority 100) already runs
    8 cores, far above its size. The 8 cores that free up all go to A, in one cycle."""
    farm = _farm(f"fsd{int(managed)}", managed=managed)
    a, b = farm.show_ids
    with autocommit() as conn:
        conn.execute("UPDATE subscription SET int_size = 800 WHERE pk_show = %s", (a,))
        conn.execute("UPDATE subscription SET int_size = 200 WHERE pk_show = %s", (b,))
        conn.execute("UPDATE job_resource SET int_priority = 1 WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
        conn.execute("UPDATE job_resource SET int_priority = 100 WHERE pk_job = ANY(%s)", (_jobs_of(farm, 1),))
        # Phase 1: only B's jobs and two of the four hosts: B books 8 cores.
        conn.execute("UPDATE job SET b_paused = true WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
        conn.execute("UPDATE host SET str_lock_state = 'LOCKED' WHERE pk_host = ANY(%s)", (list(farm.host_ids[2:]),))
        with running_scheduler() as proc:
            loop = _loop(proc.service)
            try:
                loop.run_once()
                assert _booked_by_show(conn, farm) == {a: 0, b: 8}
                # Phase 2: A's work arrives and two hosts (8 cores) open.
                conn.execute("UPDATE job SET b_paused = false WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
                conn.execute("UPDATE host SET str_lock_state = 'OPEN' WHERE pk_host = ANY(%s)", (list(farm.host_ids),))
                stats = loop.run_once()
                assert stats.booked == 8
                assert _booked_by_show(conn, farm) == {a: 8, b: 8}
            finally:
                loop.close()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_in_one_cycle_each_show_below_its_size_reaches_it_before_any_borrows(managed: bool) -> None:
    """A (size 4) runs nothing, C (size 8) runs 2: A comes first in the feed (tier 0 against
    0.25). 14 cores free up at once: A books up to its size, then C up to its own, and only then
    does A borrow the rest. Ordering alone would have let A take all 14 in that cycle."""
    farm = _farm(f"fsc{int(managed)}", managed=managed, hosts=8, host_cores_choices=(2,))
    a, c = farm.show_ids
    with autocommit() as conn:
        conn.execute("UPDATE subscription SET int_size = 400 WHERE pk_show = %s", (a,))
        conn.execute("UPDATE subscription SET int_size = 800 WHERE pk_show = %s", (c,))
        conn.execute("UPDATE job SET b_paused = true WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
        conn.execute("UPDATE host SET str_lock_state = 'LOCKED' WHERE pk_host = ANY(%s)", (list(farm.host_ids[1:]),))
        with running_scheduler() as proc:
            loop = _loop(proc.service)
            try:
                loop.run_once()
                assert _booked_by_show(conn, farm) == {a: 0, c: 2}
                conn.execute("UPDATE job SET b_paused = false WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
                conn.execute("UPDATE host SET str_lock_state = 'OPEN' WHERE pk_host = ANY(%s)", (list(farm.host_ids),))
                loop.run_once()
                assert _booked_by_show(conn, farm) == {a: 8, c: 8}
            finally:
                loop.close()


def test_fair_share_off_orders_by_priority_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same farm with CUESCHED_FAIR_SHARE off: the higher-priority show B takes the cores."""
    monkeypatch.setenv("CUESCHED_FAIR_SHARE", "0")
    farm = _farm("fsoff", managed=True)
    a, b = farm.show_ids
    with autocommit() as conn:
        conn.execute("UPDATE subscription SET int_size = 800 WHERE pk_show = %s", (a,))
        conn.execute("UPDATE subscription SET int_size = 200 WHERE pk_show = %s", (b,))
        conn.execute("UPDATE job_resource SET int_priority = 1 WHERE pk_job = ANY(%s)", (_jobs_of(farm, 0),))
        conn.execute("UPDATE job_resource SET int_priority = 100 WHERE pk_job = ANY(%s)", (_jobs_of(farm, 1),))
        with running_scheduler() as proc:
            loop = _loop(proc.service)
            try:
                loop.run_once()
                assert _booked_by_show(conn, farm) == {a: 0, b: 16}
            finally:
                loop.close()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_within_a_show_jobs_below_min_cores_come_first(managed: bool) -> None:
    """One show: job H (priority 100) already runs 4 cores, its min is 1; job L (priority 1) runs
    nothing and its min is 8. The 4 cores that free up go to L, below its min, not to H."""
    farm = _farm(f"fsmin{int(managed)}", managed=managed, hosts=2, jobs=2, shows=1)
    high, low = farm.job_ids
    with autocommit() as conn:
        conn.execute("UPDATE job_resource SET int_priority = 100, int_min_cores = 100 WHERE pk_job = %s", (high,))
        conn.execute("UPDATE job_resource SET int_priority = 1, int_min_cores = 800 WHERE pk_job = %s", (low,))
        conn.execute("UPDATE job SET b_paused = true WHERE pk_job = %s", (low,))
        conn.execute("UPDATE host SET str_lock_state = 'LOCKED' WHERE pk_host = %s", (farm.host_ids[1],))
        with running_scheduler() as proc:
            loop = _loop(proc.service)
            try:
                loop.run_once()
                assert _booked_by_job(conn, farm) == {high: 4, low: 0}
                conn.execute("UPDATE job SET b_paused = false WHERE pk_job = %s", (low,))
                conn.execute("UPDATE host SET str_lock_state = 'OPEN' WHERE pk_host = %s", (farm.host_ids[1],))
                loop.run_once()
                assert _booked_by_job(conn, farm) == {high: 4, low: 4}
            finally:
                loop.close()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_jobs_that_fit_no_free_host_do_not_block_the_read(managed: bool) -> None:
    """Three high-priority jobs whose frames fit no free host (memory, cores, tag) fill the
    feed's read of three jobs; the low-priority job below them books in the same cycle."""
    farm = _farm(f"hol{int(managed)}", managed=managed, hosts=2, jobs=4, shows=1)
    blocked, bookable = list(farm.job_ids[:3]), farm.job_ids[3]
    with autocommit() as conn:
        conn.execute("UPDATE job_resource SET int_priority = 100 WHERE pk_job = ANY(%s)", (blocked,))
        conn.execute("UPDATE job_resource SET int_priority = 1 WHERE pk_job = %s", (bookable,))
        conn.execute("UPDATE layer SET int_mem_min = 512 * 1048576 WHERE pk_job = %s", (blocked[0],))  # 512 GB
        conn.execute("UPDATE layer SET int_cores_min = 1600 WHERE pk_job = %s", (blocked[1],))  # 16 cores
        conn.execute("UPDATE layer SET str_tags = 'nosuchtag' WHERE pk_job = %s", (blocked[2],))
        with running_scheduler() as proc:
            loop = _loop(proc.service, max_jobs=3)
            try:
                stats = loop.run_once()
                booked = _booked_by_job(conn, farm)
                assert booked[bookable] == 8, (booked, stats)
                assert all(booked[j] == 0 for j in blocked)
            finally:
                loop.close()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_a_show_at_burst_where_the_hosts_are_free_does_not_block_the_read(managed: bool) -> None:
    """Show S (three jobs at priority 100) has no room on allocation X, the only one with free
    hosts, and room on Y, whose hosts are all locked: S is not skipped as full everywhere, and
    before issue 19 its jobs held every place of the read. Show T's low-priority job books on X."""
    farm = _farm(f"hsub{int(managed)}", managed=managed, hosts=4, allocs=2, jobs=8)
    s, t = farm.show_ids
    x, y = farm.alloc_ids
    s_jobs, t_jobs = _jobs_of(farm, 0), _jobs_of(farm, 1)
    with autocommit() as conn:
        tags = [r[0] for r in conn.execute("SELECT str_tag FROM alloc WHERE pk_alloc = ANY(%s)", ([x, y],))]
        conn.execute("UPDATE layer SET str_tags = %s WHERE pk_job = ANY(%s)", (" | ".join(tags), list(farm.job_ids)))
        conn.execute("UPDATE subscription SET int_burst = 0 WHERE pk_show = %s AND pk_alloc = %s", (s, x))
        conn.execute("UPDATE host SET str_lock_state = 'LOCKED' WHERE pk_alloc = %s", (y,))
        conn.execute("UPDATE job_resource SET int_priority = 100 WHERE pk_job = ANY(%s)", (s_jobs,))
        conn.execute("UPDATE job_resource SET int_priority = 1 WHERE pk_job = ANY(%s)", (t_jobs,))
        conn.execute("UPDATE job SET b_paused = true WHERE pk_job = ANY(%s)", (t_jobs[1:],))
        with running_scheduler() as proc:
            loop = _loop(proc.service, max_jobs=3)
            sampler = Sampler().start()
            try:
                stats = loop.run_once()
                booked = _booked_by_show(conn, farm)
            finally:
                sampler.stop()
                loop.close()
            x_cores = conn.execute(
                "SELECT SUM(int_cores) / 100 FROM host WHERE pk_alloc = %s AND str_lock_state = 'OPEN'", (x,)
            ).fetchone()[0]
            assert booked == {s: 0, t: int(x_cores)}, (booked, stats)
            assert sampler.breaches == []
