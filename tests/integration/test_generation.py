"""Issue 27 rows 2 and 3: no enforcement window between a change and the Store applying it.

The scheduler's listener (only the listener) reaches the database through a relay
(`dispatch.lab.netfreeze.FreezableProxy`) that the test freezes or slows down, while the
dispatch loop books through its own, direct connection. A cap lowered, a host moved to another
allocation or a job moved to another folder is committed directly; the loop then books at
once, within the listener's freshness deadline, when the Store has not heard of the change.
Before: the booking transaction checked no cap and the Store's stale view booked past the new
cap. Now: the change bumped the show's accounting generation in its own transaction, the
booking transaction compares it with the generation the Store's booking was decided under,
and fails that show's part until the listener (or a reseed) applied the change; then the show
books again, up to the new cap and never past it.

Also: the bookkeeping of generations through the real triggers (what bumps, what does not:
releases and cap raises never do) and the payload that carries them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import psycopg
import pytest

from accounting.limits import ensure_generation_rows
from accounting.service import AccountingService
from dispatch.engine.booking import write_batch
from dispatch.engine.loop import DispatchLoop
from dispatch.lab.netfreeze import FreezableProxy
from tests.integration.dispatch_support import fast_launcher, make_loop, plan, seed
from tests.integration.runtime_support import autocommit_conn, make_farm, uid, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CENTI = 100
LONG = {"runtime_min": 600.0, "runtime_max": 600.0}  # nothing completes while a test looks


@pytest.fixture(autouse=True)
def _quiet_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backstop loops effectively off: what a test sees is the booking check, not a heal by a reseed."""
    for key, value in {
        "CUESCHED_RECOMPUTE_INTERVAL": "3600",
        "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
        "CUESCHED_MANAGED_SHOWS_TTL": "3600",
        "CUESCHED_DB_RECONCILE_INTERVAL": "3600",
        # A 2.5 s relay plus the 0.5 s heartbeat interval stays inside it: the Store keeps enforcing.
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
def service_behind(proxy: FreezableProxy) -> Iterator[AccountingService]:
    """An AccountingService whose listener (only) connects through `proxy`; started and bootstrapped."""
    service = AccountingService(listener_connect=lambda: proxy.connect(application_name="cuesched-listener"))
    stop = threading.Event()
    service.start(stop, bootstrap_timeout=30)
    try:
        yield service
    finally:
        stop.set()
        service.join(10)


def cores(conn: psycopg.Connection, sql: str, params: tuple) -> int:
    row = conn.execute(sql, params).fetchone()
    return int(row[0] or 0) // CENTI


def job_cores(conn: psycopg.Connection, job: str) -> int:
    return cores(conn, "SELECT SUM(int_cores_reserved) FROM proc WHERE pk_job = %s", (job,))


def cycles_for(loop: DispatchLoop, seconds: float, check: callable | None = None) -> int:  # type: ignore[valid-type]
    """Run dispatch cycles for `seconds` (a window shorter than the listener's delay); `check` after each."""
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        loop.run_once()
        n += 1
        if check is not None:
            check()
        time.sleep(0.01)
    return n


def cycles_until(loop: DispatchLoop, done: callable, timeout: float, what: str, check: callable | None = None) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {loop.totals}")
        loop.run_once()
        if check is not None:
            check()
        time.sleep(0.01)


def generation(conn: psycopg.Connection, show: str) -> int | None:
    row = conn.execute("SELECT int_generation FROM cuesched_show_generation WHERE pk_show = %s", (show,)).fetchone()
    return None if row is None else int(row[0])


# --------------------------------------------------------------------------- row 2

# One show on one allocation, 1-core frames on two 64-core hosts: only the caps stop bookings.
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


@pytest.mark.parametrize("path", ["frozen", "slow-0.3s", "slow-2.5s"])
def test_a_job_max_lowered_behind_a_frozen_or_slow_listener_is_never_booked_past(conn, path: str) -> None:
    """Row 2: a job's max lowered 40 -> 5 while the listener is frozen or merely slow. Before:
    the Store's stale max of 40 let the loop book 40 cores within a fraction of a second. Now:
    0 bookings until the change is applied, then exactly up to 5, at any listener delay."""
    farm = seed({"frozen": "gen2f", "slow-0.3s": "gen2s", "slow-2.5s": "gen2t"}[path], jobs=1, frames_per_layer=60,
                job_max_cores=40 * CENTI, **ONE_JOB)
    job = farm.job_ids[0]
    with ExitStack() as stack, FreezableProxy().start() as proxy, service_behind(proxy) as service:
        assert (service.store.job_cap(job) or (0,))[0] == 40
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        worst = [0]

        def check() -> None:
            worst[0] = max(worst[0], job_cores(conn, job))

        if path == "frozen":
            proxy.freeze()
        else:
            proxy.delay = float(path.split("-")[1].rstrip("s"))
            # Let the delayed heartbeats arrive so the listener is fresh again behind the slow path.
            wait_for(lambda: service.can_enforce(), 10, "the listener fresh behind the slow relay")
        try:
            conn.execute("UPDATE job_resource SET int_max_cores = 500 WHERE pk_job = %s", (job,))
            lowered = time.monotonic()
            # Well inside the listener's delay (and its freshness deadline): the Store still holds 40.
            window = 0.25 if path == "slow-0.3s" else 1.5
            n = cycles_for(loop, window, check)
            assert path != "frozen" or (service.store.job_cap(job) or (0,))[0] == 40, "the frozen path delivered"
            booked_in_window = job_cores(conn, job)
            assert worst[0] <= 5, (
                f"{path}: {worst[0]} cores booked against the new max of 5 within "
                f"{time.monotonic() - lowered:.2f}s of the lowering ({n} cycles)"
            )
        finally:
            proxy.thaw()
            proxy.delay = 0.0
        # Once the change is applied (delivered late, or by the reseed after a wedge) the job books
        # again, up to the new max exactly: a mismatch stops the show only until then.
        cycles_until(
            loop,
            lambda: job_cores(conn, job) == 5,
            30,
            "the job booked up to its new max once the listener caught up",
            check,
        )
        cycles_for(loop, 0.3, check)
        assert worst[0] == 5, worst[0]
        assert job_cores(conn, job) == 5
    print(f"\nrow 2 {path}: {booked_in_window} cores booked in the {window}s window, worst {worst[0]} vs max 5")


# --------------------------------------------------------------------------- row 3


def _second_alloc(conn: psycopg.Connection, show: str, alloc: str, tag: str, burst_cores: int) -> str:
    other = uid(f"{tag}-alloc-b")
    with conn.transaction():
        facility = conn.execute("SELECT pk_facility FROM alloc WHERE pk_alloc = %s", (alloc,)).fetchone()[0]
        conn.execute(
            "INSERT INTO alloc (pk_alloc, pk_facility, str_name, str_tag) VALUES (%s, %s, %s, %s)",
            (other, facility, f"{tag}_alloc_b", f"{tag}_b"[:24]),
        )
        conn.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst)"
            " VALUES (%s, %s, %s, %s, %s)",
            (uid(f"{tag}-sub-b"), other, show, burst_cores * CENTI, burst_cores * CENTI),
        )
    return other


def test_a_host_moved_into_a_full_allocation_behind_a_frozen_listener_books_nothing_past_its_burst(conn) -> None:
    """Row 3: a host running 8 cores of a managed show moves to an allocation whose burst is 10
    while the listener is frozen. Before: the Store's B counter (0) let the loop book 10 more on
    B at once (18 > 10). Now: nothing until the move is applied, then exactly up to 10."""
    farm = seed("gen3h", jobs=1, frames_per_layer=40, job_max_cores=8 * CENTI, **{**ONE_JOB, "hosts": 1})
    show, job, host, alloc = farm.show_ids[0], farm.job_ids[0], farm.host_ids[0], farm.alloc_ids[0]
    alloc_b = _second_alloc(conn, show, alloc, "gen3h", burst_cores=10)

    def on_b() -> int:
        return cores(
            conn,
            "SELECT SUM(p.int_cores_reserved) FROM proc p JOIN host h ON h.pk_host = p.pk_host"
            " WHERE p.pk_show = %s AND h.pk_alloc = %s",
            (show, alloc_b),
        )

    with ExitStack() as stack, FreezableProxy().start() as proxy, service_behind(proxy) as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        cycles_until(loop, lambda: job_cores(conn, job) == 8, 20, "8 cores booked on allocation A")
        conn.execute("UPDATE job_resource SET int_max_cores = 10000 WHERE pk_job = %s", (job,))  # a raise
        wait_for(lambda: (service.store.job_cap(job) or (0,))[0] == 100, 10, "the raise applied")
        worst = [0]

        def check() -> None:
            worst[0] = max(worst[0], on_b())

        proxy.freeze()
        try:
            conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc_b, host))
            check()
            assert worst[0] == 8
            cycles_for(loop, 1.5, check)
            assert worst[0] <= 10, f"{worst[0]} cores on allocation B against its burst of 10"
        finally:
            proxy.thaw()
        cycles_until(loop, lambda: on_b() == 10, 30, "allocation B booked up to its burst once the move applied", check)
        cycles_for(loop, 0.3, check)
        assert worst[0] == 10, worst[0]


def test_a_job_moved_into_a_full_folder_behind_a_frozen_listener_books_nothing_past_its_max(conn) -> None:
    """Row 3: a job running 8 cores moves into a folder whose max is 10 while the listener is
    frozen; another job of that folder waits. Before: the Store's folder counter (0) let it book
    10 at once (18 > 10). Now: nothing until the move is applied, then exactly up to 10."""
    farm = seed("gen3f", jobs=2, frames_per_layer=40, job_max_cores=8 * CENTI, folders_per_show=2, **ONE_JOB)
    moved, waiting = farm.job_ids
    folder_a, folder_b = farm.folder_ids[:2]
    with conn.transaction():
        conn.execute("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder_a, moved))
        conn.execute("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder_b, waiting))
        conn.execute("UPDATE folder_resource SET int_max_cores = 1000 WHERE pk_folder = %s", (folder_b,))
        conn.execute("UPDATE job_resource SET int_max_cores = 10000 WHERE pk_job = %s", (waiting,))
        # The waiting job cannot book before the move: its layer starts when the test says so.
        conn.execute("UPDATE layer SET ts_start_after = now() + interval '1 hour' WHERE pk_job = %s", (waiting,))

    def in_b() -> int:
        return cores(
            conn,
            "SELECT SUM(p.int_cores_reserved) FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE j.pk_folder = %s",
            (folder_b,),
        )

    with ExitStack() as stack, FreezableProxy().start() as proxy, service_behind(proxy) as service:
        loop = stack.enter_context(make_loop(service, fast_launcher(**LONG)))
        cycles_until(loop, lambda: job_cores(conn, moved) == 8, 20, "8 cores booked for the job in folder A")
        worst = [0]

        def check() -> None:
            worst[0] = max(worst[0], in_b())

        proxy.freeze()
        try:
            conn.execute("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder_b, moved))
            conn.execute("UPDATE layer SET ts_start_after = NULL WHERE pk_job = %s", (waiting,))
            check()
            assert worst[0] == 8
            cycles_for(loop, 1.5, check)
            assert worst[0] <= 10, f"{worst[0]} cores in folder B against its max of 10"
        finally:
            proxy.thaw()
        cycles_until(loop, lambda: in_b() == 10, 30, "folder B booked up to its max once the move applied", check)
        cycles_for(loop, 0.3, check)
        assert worst[0] == 10, worst[0]


# --------------------------------------------------------------------------- what bumps


def test_releases_and_cap_raises_never_bump_the_generation_and_lowerings_and_moves_do(conn) -> None:
    """CAS starvation must not come back: the releases of a busy show and an operator raising a
    cap leave its generation alone; a cap lowered, a key moved into a cap and a flip bump it,
    and the notification of a bump carries the show's new generation."""
    farm = make_farm(conn, "genbump", managed=False, burst_cores=100, job_max_cores=40, jobs=2, frames=10, hosts=2)
    job = farm.jobs[0]
    procs = [farm.add_proc(conn, cores=1) for _ in range(3)]
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (farm.show,))
    g0 = generation(conn, farm.show)
    assert g0 is not None, "a flip writes the show's generation row"

    def unchanged(what: str) -> None:
        assert generation(conn, farm.show) == g0, f"{what} bumped the generation"

    farm.delete_procs(conn, procs[:1])
    unchanged("a release")
    conn.execute("UPDATE proc SET int_cores_reserved = 50 WHERE pk_proc = %s", (procs[1],))
    unchanged("a proc shrunk in place")
    conn.execute("UPDATE job_resource SET int_max_cores = 8000, int_max_gpus = 200 WHERE pk_job = %s", (job,))
    unchanged("a job max raised")
    conn.execute("UPDATE job_resource SET int_max_cores = -1 WHERE pk_job = %s", (job,))
    unchanged("a job max made unlimited")
    conn.execute("UPDATE subscription SET int_burst = 20000 WHERE pk_show = %s", (farm.show,))
    unchanged("a burst raised")
    conn.execute("UPDATE folder_resource SET int_max_cores = -5 WHERE pk_folder = %s", (farm.folder,))
    unchanged("a folder max rewritten, still unlimited")
    conn.execute("UPDATE proc SET int_mem_used = 5 WHERE pk_proc = %s", (procs[2],))
    unchanged("a memory report")

    conn.execute("LISTEN acct_limit_change")
    conn.execute("UPDATE job_resource SET int_max_cores = 500 WHERE pk_job = %s", (job,))
    g1 = generation(conn, farm.show)
    assert g1 is not None and g1 > g0, "a job max lowered must bump"
    notes = [json.loads(n.payload) for n in conn.notifies(timeout=2, stop_after=1)]
    assert notes and notes[-1].get("show") == farm.show and notes[-1].get("gen") == g1, notes
    assert notes[-1].get("gen_from") == g0, notes
    conn.execute("UNLISTEN acct_limit_change")

    conn.execute("UPDATE subscription SET int_burst = 10000 WHERE pk_show = %s", (farm.show,))
    g2 = generation(conn, farm.show)
    assert g2 > g1, "a burst lowered must bump"
    conn.execute("UPDATE folder_resource SET int_max_gpus = 3 WHERE pk_folder = %s", (farm.folder,))
    g3 = generation(conn, farm.show)
    assert g3 > g2, "a folder max GPUs lowered (from unlimited) must bump"
    other = _second_alloc(conn, farm.show, farm.alloc, "genbump", burst_cores=50)
    host = conn.execute("SELECT pk_host FROM proc WHERE pk_proc = %s", (procs[1],)).fetchone()[0]
    conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (other, host))
    g4 = generation(conn, farm.show)
    assert g4 > g3, "a host with running procs moved into another allocation must bump"
    idle = next(h for h in farm.hosts if h != host)
    if not conn.execute("SELECT 1 FROM proc WHERE pk_host = %s", (idle,)).fetchone():
        conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (other, idle))
        assert generation(conn, farm.show) == g4, "a host with nothing running moved: nothing to apply"
    conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (farm.show,))
    assert generation(conn, farm.show) > g4, "a flip must bump"


# --------------------------------------------------------------------------- a bump in progress


def test_a_bump_in_progress_fails_its_shows_bookings_at_once_and_the_other_shows_book(conn) -> None:
    """A writer has lowered a job's max (its bump holds the show's generation row) and not
    committed. The booking transaction must neither wait for it (a writer left open would stall
    the farm, and a wait could close a deadlock) nor commit that show's bookings past a bump it
    cannot see yet: they are refused (`generation`), the other show's go through."""
    seed("genheld", shows=2, jobs=4, managed=True, **{**ONE_JOB, "allocs": 1})
    assert ensure_generation_rows(conn) == 2  # what every reseed does before a show is published
    jobs, bookings = plan(conn, dict.fromkeys(range(4), 1), managed=True)
    shows = sorted({j.show for j in jobs})
    assert len(shows) == 2
    held = shows[0]
    held_job = next(j.pk for j in jobs if j.show == held)
    writer = autocommit_conn()
    try:
        writer.execute("BEGIN")
        writer.execute("UPDATE job_resource SET int_max_cores = 100 WHERE pk_job = %s", (held_job,))
        started = time.monotonic()
        result = write_batch(conn, bookings, mem_used=256_000)
        took = time.monotonic() - started
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    rejected = {b.pk_proc: table for b, table in result.rejected}
    for b in bookings:
        if b.layer.job.show == held:
            assert rejected.get(b.pk_proc) == "generation", (b.layer.job.show, rejected)
        else:
            assert b.pk_proc not in rejected, rejected
    assert {b.layer.job.show for b in result.written} == {shows[1]}
    assert took < 5.0, f"the booking waited {took:.1f}s for the writer"
    procs = {r[0] for r in conn.execute("SELECT pk_proc FROM proc").fetchall()}
    assert procs == {b.pk_proc for b in result.written}
