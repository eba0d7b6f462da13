"""Writes made outside the scheduler reach the accounting exactly once, whoever makes them (issue 15).

Each test changes the farm from connections of its own, committing, as a script, a DBA in psql
or a Cuebot sharing the database would, while a real SchedulerProcess runs. It then holds both
accounting paths to the truth, SUM(proc) per key:

* a scheduler-managed show (`b_scheduler_managed`): the Store, within `BOUND` seconds (the
  listener applies the trigger's signed deltas), and a booking through
  `service.apply_booking` that would now breach a cap is refused;
* an unmanaged show: the five counter tables, right after the commit (the triggers move them
  in the writing statement), and a write that would breach a cap fails with check_violation.

A counter may read high, never low: each check below fails when one reads low, which is what
the old code (before the integrity work) did on every row of the issue's table. Where the
database-enforced half already held there (proc UPDATEs, rows 3 and 4), both halves share one
test, so that it still fails on the old code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import errors as pg_errors

from accounting import db, recompute
from accounting.limits import reseed_limits
from accounting.service import AccountingService
from accounting.store import Applied, BookingDelta, CounterSnapshot, LimitExceeded, Store
from tests.integration.runtime_support import MiniFarm, autocommit_conn, make_farm, running_scheduler, uid, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {
    "CUESCHED_RECOMPUTE_INTERVAL": "3600",
    "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
    "CUESCHED_DB_RECONCILE_INTERVAL": "3600",
    "CUESCHED_MANAGED_SHOWS_TTL": "0.2",
}
# How long the listener may take to bring the Store to the truth after a commit.
BOUND = 5.0


@pytest.fixture(autouse=True)
def _slow_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recompute, limit reseed and reconcile effectively off: what heals must be the write's own event."""
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    c = autocommit_conn()
    yield c
    c.close()


# --------------------------------------------------------------------------- farm helpers


def start_proc(
    conn: psycopg.Connection, farm: MiniFarm, host: str, job_index: int = 0, centicores: int = 400, gpus: int = 0
) -> str:
    """Start one WAITING frame as a proc on a chosen host, committed (an outside INSERT)."""
    job, layer = farm.jobs[job_index], farm.layers[job_index]
    frame = farm.frames[job].pop()
    pk_proc = uid(f"oproc-{farm.show}", farm._proc_seq)
    farm._proc_seq += 1
    with conn.transaction():
        conn.execute(
            "UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1 WHERE pk_frame = %s", (frame,)
        )
        conn.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
            " int_mem_reserved, int_gpus_reserved) VALUES (%s, %s, %s, %s, %s, %s, %s, 1048576, %s)",
            (pk_proc, host, farm.show, layer, job, frame, centicores, gpus),
        )
        conn.execute(
            "UPDATE host SET int_cores_idle = int_cores_idle - %s, int_mem_idle = int_mem_idle - 1048576,"
            " int_gpus_idle = int_gpus_idle - %s WHERE pk_host = %s",
            (centicores, gpus, host),
        )
    return pk_proc


@dataclass
class World:
    """A MiniFarm plus a second allocation, folder and show to move running procs to.

    farm: subscription A burst 100, folder F1 unlimited, job0 and job1 max 10 cores each,
    procs[0..1] of job0 on hosts[0] and procs[2] of job1 on hosts[1], 4 cores each (A = 12).
    alloc_b: the show's subscription B, burst 10, with host_b. folder_b: max 10 cores.
    show_b: another show (same flag) with a subscription on A, burst 10.
    """

    farm: MiniFarm
    alloc_b: str
    host_b: str
    folder_b: str
    show_b: str
    procs: list[str]

    @property
    def shows(self) -> list[str]:
        return [self.farm.show, self.show_b]

    def delta(
        self,
        cores: int,
        *,
        show: str | None = None,
        alloc: str | None = None,
        folder: str | None = None,
        job_index: int = 0,
    ) -> BookingDelta:
        f = self.farm
        return BookingDelta(show or f.show, alloc or f.alloc, folder or f.folder, f.jobs[job_index], cores, 0)


def build_world(conn: psycopg.Connection, tag: str, *, managed: bool) -> World:
    farm = make_farm(conn, tag, managed=managed, burst_cores=100, job_max_cores=10, jobs=2, hosts=2, frames=10)
    facility = uid(f"{tag}-facility")
    alloc_b, host_b, folder_b, show_b = (uid(f"{tag}-{k}-b") for k in ("alloc", "host", "folder", "show"))
    with conn.transaction():
        conn.execute(
            "INSERT INTO alloc (pk_alloc, pk_facility, str_name, str_tag) VALUES (%s, %s, %s, %s)",
            (alloc_b, facility, f"{tag}_alloc_b", f"{tag}_b"[:24]),
        )
        conn.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst)"
            " VALUES (%s, %s, %s, 1000, 1000)",
            (uid(f"{tag}-sub-b"), alloc_b, farm.show),
        )
        conn.execute(
            "INSERT INTO host (pk_host, pk_alloc, str_name, int_cores, int_cores_idle, int_mem, int_mem_idle,"
            " int_gpus, int_gpus_idle) VALUES (%s, %s, %s, 6400, 6400, %s, %s, 8, 8)",
            (host_b, alloc_b, f"{tag}_hb", 1 << 30, 1 << 30),
        )
        conn.execute(
            "INSERT INTO host_stat (pk_host_stat, pk_host, str_os, int_mem_total, int_mem_free)"
            " VALUES (%s, %s, 'linux', %s, %s)",
            (uid(f"{tag}-hs-b"), host_b, 1 << 30, 1 << 30),
        )
        conn.execute(
            "INSERT INTO folder (pk_folder, pk_show, pk_dept, str_name) VALUES (%s, %s, %s, %s)",
            (folder_b, farm.show, farm.dept, f"{tag}_folder_b"),
        )
        conn.execute("UPDATE folder_resource SET int_max_cores = 1000 WHERE pk_folder = %s", (folder_b,))
        conn.execute(
            "INSERT INTO show (pk_show, str_name, b_scheduler_managed) VALUES (%s, %s, %s)",
            (show_b, f"{tag}_show_b", managed),
        )
        conn.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst)"
            " VALUES (%s, %s, %s, 1000, 1000)",
            (uid(f"{tag}-sub-show-b"), farm.alloc, show_b),
        )
    procs = [
        start_proc(conn, farm, farm.hosts[0], 0),
        start_proc(conn, farm, farm.hosts[0], 0),
        start_proc(conn, farm, farm.hosts[1], 1),
    ]
    return World(farm, alloc_b, host_b, folder_b, show_b, procs)


# --------------------------------------------------------------------------- the truth and both paths

Key = tuple[str, str, str]  # (table, show or "", id)

TRUTH_SQL = """
SELECT 'sub', p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE NOT p.b_local GROUP BY p.pk_show, h.pk_alloc
UNION ALL
SELECT 'folder', '', j.pk_folder, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE NOT p.b_local GROUP BY j.pk_folder
UNION ALL
SELECT 'job', '', p.pk_job, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p WHERE NOT p.b_local GROUP BY p.pk_job
UNION ALL
SELECT 'layer', '', p.pk_layer, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p WHERE NOT p.b_local GROUP BY p.pk_layer
UNION ALL
SELECT 'point', p.pk_show, j.pk_dept, SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE NOT p.b_local GROUP BY p.pk_show, j.pk_dept
"""

# The five database counter tables of some shows, keyed like TRUTH_SQL.
COUNTERS_SQL = """
SELECT 'sub', s.pk_show, s.pk_alloc, s.int_cores::bigint, s.int_gpus::bigint
FROM subscription s WHERE s.pk_show = ANY(%(shows)s)
UNION ALL
SELECT 'folder', '', fr.pk_folder, fr.int_cores::bigint, fr.int_gpus::bigint
FROM folder_resource fr JOIN folder f ON f.pk_folder = fr.pk_folder WHERE f.pk_show = ANY(%(shows)s)
UNION ALL
SELECT 'job', '', jr.pk_job, jr.int_cores::bigint, jr.int_gpus::bigint
FROM job_resource jr JOIN job j ON j.pk_job = jr.pk_job WHERE j.pk_show = ANY(%(shows)s)
UNION ALL
SELECT 'layer', '', lr.pk_layer, lr.int_cores::bigint, lr.int_gpus::bigint
FROM layer_resource lr JOIN job j ON j.pk_job = lr.pk_job WHERE j.pk_show = ANY(%(shows)s)
UNION ALL
SELECT 'point', pt.pk_show, pt.pk_dept, pt.int_cores::bigint, pt.int_gpus::bigint
FROM point pt WHERE pt.pk_show = ANY(%(shows)s)
"""

# The keys the Store enforces for some shows: their subscriptions, folders and unfinished jobs.
STORE_KEYS_SQL = """
SELECT 'sub', pk_show, pk_alloc FROM subscription WHERE pk_show = ANY(%(shows)s)
UNION ALL SELECT 'folder', '', pk_folder FROM folder WHERE pk_show = ANY(%(shows)s)
UNION ALL SELECT 'job', '', pk_job FROM job WHERE pk_show = ANY(%(shows)s) AND str_state <> 'FINISHED'
"""


def ceil_cores(centicores: int) -> int:
    """The Store's unit: whole cores, a key's SUM rounded up (250 centicores -> 3)."""
    return -(-int(centicores) // 100)


def truth(conn: psycopg.Connection) -> dict[Key, tuple[int, int]]:
    return {(t, s, k): (int(c), int(g)) for t, s, k, c, g in conn.execute(TRUTH_SQL)}


def db_counters(conn: psycopg.Connection, shows: list[str]) -> dict[Key, tuple[int, int]]:
    return {(t, s, k): (int(c), int(g)) for t, s, k, c, g in conn.execute(COUNTERS_SQL, {"shows": shows})}


def db_drift(conn: psycopg.Connection, shows: list[str]) -> dict[Key, tuple[tuple[int, int] | None, tuple[int, int]]]:
    """Counter rows of `shows` (centicores, gpus) that differ from SUM(proc); a missing point row counts."""
    real = truth(conn)
    rows = db_counters(conn, shows)
    out: dict[Key, tuple[tuple[int, int] | None, tuple[int, int]]] = {}
    for key, value in rows.items():
        expected = real.get(key, (0, 0))
        if value != expected:
            out[key] = (value, expected)
    for key, expected in real.items():
        if key[0] == "point" and key[1] in shows and key not in rows and expected != (0, 0):
            out[key] = (None, expected)
    return out


def assert_db_matches_truth(conn: psycopg.Connection, shows: list[str]) -> None:
    drift = db_drift(conn, shows)
    assert not drift, f"database counters differ from SUM(proc) (counter, truth): {drift}"


def store_drift(store: Store, conn: psycopg.Connection, shows: list[str]) -> dict[Key, tuple]:
    """Store keys of `shows` whose (cores, gpus) differ from SUM(proc) in whole cores, rounded up."""
    real = truth(conn)
    live = store.audit_snapshot()
    out: dict[Key, tuple] = {}
    for table, show, key in conn.execute(STORE_KEYS_SQL, {"shows": shows}).fetchall():
        cc, g = real.get((table, show, key), (0, 0))
        expected = (ceil_cores(cc), g)
        if table == "sub":
            actual = live.sub.get((show, key), (0, 0))
        else:
            actual = getattr(live, table).get(key, (0, 0))
        if actual != expected:
            out[(table, show, key)] = (actual, expected)
    return out


def wait_store_matches(store: Store, conn: psycopg.Connection, shows: list[str], what: str) -> None:
    """Within BOUND the Store equals SUM(proc) on every key of `shows`; the last drift if not."""
    last: dict[Key, tuple] = {}

    def matches() -> bool:
        nonlocal last
        last = store_drift(store, conn, shows)
        return not last

    try:
        wait_for(matches, BOUND, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; Store (cores, gpus) vs SUM(proc) still differ: {last}") from None


def assert_refused(result: object, table: str, current: int, limit: int) -> None:
    assert isinstance(result, LimitExceeded), f"booking admitted over the {table} cap: {result}"
    assert (result.table, result.current, result.limit) == (table, current, limit)


def assert_fits_then_release(service: AccountingService, delta: BookingDelta) -> None:
    """The cap is enforced at its exact value, not merely closed: the largest booking that fits passes."""
    booking = service.apply_booking(delta)
    assert isinstance(booking, Applied), f"a booking that fits was refused: {booking}"
    service.rollback_booking(booking)


def fails_with_cap(conn: psycopg.Connection, sql: str, params: tuple, constraint: str, shows: list[str]) -> None:
    """A database-enforced write over a cap fails with check_violation naming it; no counter moves."""
    before = db_counters(conn, shows)
    with pytest.raises(pg_errors.CheckViolation) as err:
        conn.execute(sql, params)
    assert err.value.diag.constraint_name == constraint
    assert db_counters(conn, shows) == before


# --------------------------------------------------------------------------- row 1: host.pk_alloc


PATHS = pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])


@PATHS
def test_host_moved_to_another_allocation_moves_its_running_procs(conn, managed: bool) -> None:
    """`UPDATE host SET pk_alloc` under running procs: both subscriptions follow; the new burst holds."""
    w = build_world(conn, f"hm-{managed}", managed=managed)
    move = "UPDATE host SET pk_alloc = %s WHERE pk_host = %s"
    with running_scheduler() as proc:
        service = proc.service
        conn.execute(move, (w.alloc_b, w.farm.hosts[0]))  # job0's 8 cores leave A (burst 100) for B (burst 10)
        if not managed:
            # Moved in the writing statement, and the next move is cap-checked like a booking.
            counters = db_counters(conn, w.shows)
            assert counters[("sub", w.farm.show, w.farm.alloc)][0] == 400
            assert counters[("sub", w.farm.show, w.alloc_b)][0] == 800
            assert_db_matches_truth(conn, w.shows)
            fails_with_cap(conn, move, (w.alloc_b, w.farm.hosts[1]), "acct_subscription_burst", w.shows)  # 8+4 > 10
            host_alloc = conn.execute("SELECT pk_alloc FROM host WHERE pk_host = %s", (w.farm.hosts[1],)).fetchone()
            assert host_alloc == (w.farm.alloc,)
            return
        wait_store_matches(service.store, conn, w.shows, "Store subscriptions to follow the host move")
        assert service.store.sub_counters(w.farm.show, w.farm.alloc)[0] == 4
        assert service.store.sub_counters(w.farm.show, w.alloc_b) == (8, 10)
        assert_refused(service.apply_booking(w.delta(3, alloc=w.alloc_b)), "subscription", 8, 10)
        assert_fits_then_release(service, w.delta(2, alloc=w.alloc_b))


# --------------------------------------------------------------------------- row 2: job.pk_folder


@PATHS
def test_job_moved_to_another_folder_moves_its_running_procs(conn, managed: bool) -> None:
    """`UPDATE job SET pk_folder` under running procs: both folders follow; the new folder's max holds."""
    w = build_world(conn, f"jm-{managed}", managed=managed)
    move = "UPDATE job SET pk_folder = %s WHERE pk_job = %s"
    with running_scheduler() as proc:
        service = proc.service
        conn.execute(move, (w.folder_b, w.farm.jobs[0]))  # job0's 8 cores go to folder B (max 10)
        if not managed:
            counters = db_counters(conn, w.shows)
            assert counters[("folder", "", w.farm.folder)][0] == 400
            assert counters[("folder", "", w.folder_b)][0] == 800
            assert_db_matches_truth(conn, w.shows)
            fails_with_cap(conn, move, (w.folder_b, w.farm.jobs[1]), "acct_folder_max_cores", w.shows)  # 8+4 > 10
            return
        wait_store_matches(service.store, conn, w.shows, "Store folders to follow the job move")
        assert_refused(service.apply_booking(w.delta(3, folder=w.folder_b)), "folder", 8, 10)
        assert_fits_then_release(service, w.delta(2, folder=w.folder_b))


# --------------------------------------------------------------------------- row 3: proc keys


def test_a_proc_moved_to_another_show_than_its_jobs_is_refused(conn) -> None:
    """`UPDATE proc SET pk_show` alone: refused, with a clear error, counters unchanged on both paths.

    It used to be accepted and moved the subscription only. But a proc is accounted by its own
    show while its job's and folder's counters belong to the job's show, so the rebuild of either
    side (a reconcile, a flip) then read them LOW: the second review admitted 16 cores on a job
    capped at 10 that way. A proc changes show with its job, or not at all.
    """
    m = build_world(conn, "pk-show-m", managed=True)
    u = build_world(conn, "pk-show-u", managed=False)
    before = db_counters(conn, u.shows)
    with running_scheduler() as proc:
        for w in (m, u):
            with pytest.raises(psycopg.errors.ForeignKeyViolation, match="other than its job"):
                conn.execute("UPDATE proc SET pk_show = %s WHERE pk_proc = %s", (w.show_b, w.procs[0]))
        assert db_counters(conn, u.shows) == before
        wait_store_matches(proc.service.store, conn, m.shows, "Store unchanged by the refused move")


@pytest.mark.parametrize("column", ["pk_job", "pk_host"])
def test_proc_keys_updated_in_place_move_its_accounting(conn, column: str) -> None:
    """`UPDATE proc SET pk_job / pk_host`: the old key loses it, the new one gains it.

    The Store learns of it through a -old/+new delta pair (the old code sent no message at all).
    The database-enforced half is checked alongside, with the new key's cap (the old code's
    proc UPDATE trigger already moved those counters: this test fails there on the Store half).
    """
    m = build_world(conn, f"pk-{column}-m", managed=True)
    u = build_world(conn, f"pk-{column}-u", managed=False)

    def move(w: World, procs: list[str]) -> tuple[str, tuple]:
        if column == "pk_job":  # with the layer: a proc's layer belongs to its job
            return (
                "UPDATE proc SET pk_job = %s, pk_layer = %s WHERE pk_proc = ANY(%s)",
                (w.farm.jobs[1], w.farm.layers[1], procs),
            )
        return f"UPDATE proc SET {column} = %s WHERE pk_proc = ANY(%s)", (w.host_b, procs)

    def new_key(w: World, cores: int) -> BookingDelta:
        """A booking against the key procs[0] moved to (job1, alloc B or show B), on job1."""
        if column == "pk_host":
            return w.delta(cores, alloc=w.alloc_b, job_index=1)
        return w.delta(cores, job_index=1)

    # After procs[0] (4 cores) moved, the new key holds 8 (job1) or 4 (alloc B) of its 10.
    held = 8 if column == "pk_job" else 4
    table = "job" if column == "pk_job" else "subscription"
    constraint = "acct_job_max_cores" if column == "pk_job" else "acct_subscription_burst"
    with running_scheduler() as proc:
        service = proc.service
        for w in (m, u):
            conn.execute(*move(w, [w.procs[0]]))
        assert_db_matches_truth(conn, u.shows)
        # The rest of A's procs onto the new key would breach its cap of 10.
        fails_with_cap(conn, *move(u, u.procs[1:] if column != "pk_job" else [u.procs[1]]), constraint, u.shows)
        wait_store_matches(service.store, conn, m.shows, f"Store to follow UPDATE proc SET {column}")
        assert_refused(service.apply_booking(new_key(m, 10 - held + 1)), table, held, 10)
        assert_fits_then_release(service, new_key(m, 10 - held))


# --------------------------------------------------------------------------- row 4: in-place resize


def test_reserved_cores_and_gpus_changed_in_place_are_accounted(conn) -> None:
    """`UPDATE proc SET int_cores_reserved, int_gpus_reserved`: +2.5 cores counts +3 in the Store.

    The database-enforced half already held on the old code (its proc UPDATE trigger); the
    Store half did not (no message): that is where this test fails there.
    """
    m = build_world(conn, "rs-m", managed=True)
    u = build_world(conn, "rs-u", managed=False)
    resize = "UPDATE proc SET int_cores_reserved = %s, int_gpus_reserved = %s WHERE pk_proc = %s"
    with running_scheduler() as proc:
        service = proc.service
        for w in (m, u):
            conn.execute(resize, (650, 2, w.procs[2]))  # job1: 4 -> 6.5 cores, 0 -> 2 GPUs
        counters = db_counters(conn, u.shows)
        assert counters[("job", "", u.farm.jobs[1])] == (650, 2)
        assert counters[("sub", u.farm.show, u.farm.alloc)] == (1450, 2)
        assert_db_matches_truth(conn, u.shows)
        fails_with_cap(conn, resize, (1100, 2, u.procs[2]), "acct_job_max_cores", u.shows)
        wait_store_matches(service.store, conn, m.shows, "Store to follow the in-place resize")
        live = service.store.audit_snapshot()
        assert live.job[m.farm.jobs[1]] == (7, 2)  # 650 centicores, rounded up
        assert live.sub[(m.farm.show, m.farm.alloc)] == (15, 2)
        assert_refused(service.apply_booking(m.delta(4, job_index=1)), "job", 7, 10)
        assert_fits_then_release(service, m.delta(3, job_index=1))


# --------------------------------------------------------------------------- row 5: outside INSERT


def test_proc_inserted_from_outside_for_a_managed_show_is_counted(conn) -> None:
    """An INSERT INTO proc for a managed show (not the scheduler's booking) reaches the Store."""
    farm = make_farm(conn, "ins", burst_cores=10, job_max_cores=100, jobs=1)
    with running_scheduler() as proc:
        service = proc.service
        assert service.store.sub_counters(farm.show, farm.alloc) == (0, 10)
        for _ in range(2):
            start_proc(conn, farm, farm.hosts[0], 0, 400)
        wait_store_matches(service.store, conn, [farm.show], "Store to count the outside INSERTs")
        assert service.store.sub_counters(farm.show, farm.alloc) == (8, 10)
        delta = BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], 3, 0)
        assert_refused(service.apply_booking(delta), "subscription", 8, 10)


# --------------------------------------------------------------------------- row 6: subscription removed


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_removed_subscription_stops_managed_bookings(conn, how: str) -> None:
    """DELETE FROM / TRUNCATE subscription: the Store drops the burst and refuses the allocation.

    Nothing references subscription, so a plain TRUNCATE works (no CASCADE needed).
    """
    farm = make_farm(conn, f"sub-{how}", burst_cores=50, jobs=1)
    farm.add_proc(conn, cores=2)
    delta = BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], 1, 0)
    with running_scheduler() as proc:
        service = proc.service
        assert_fits_then_release(service, delta)
        if how == "delete":
            conn.execute("DELETE FROM subscription WHERE pk_show = %s AND pk_alloc = %s", (farm.show, farm.alloc))
        else:
            conn.execute("TRUNCATE subscription")
        wait_for(
            lambda: (farm.show, farm.alloc) not in service.store.caps().sub,
            BOUND,
            f"the Store to drop the burst of the subscription removed by {how.upper()}",
        )
        result = service.apply_booking(delta)
        assert isinstance(result, LimitExceeded) and result.table == "subscription", result
        assert result.limit == 0


# --------------------------------------------------------------------------- row 7: TRUNCATE proc


@PATHS
def test_truncate_proc_leaves_no_counter_booked(conn, managed: bool) -> None:
    """TRUNCATE proc (nothing references proc: no CASCADE needed) fires no row trigger.

    Database-enforced: the five counter tables read 0 right after the commit. Store: the
    `acct_resync` reseed brings every key to 0, and the whole job max books again.
    """
    w = build_world(conn, f"tr-{managed}", managed=managed)
    with running_scheduler() as proc:
        service = proc.service
        assert not managed or service.store.sub_counters(w.farm.show, w.farm.alloc) == (12, 100)
        conn.execute("TRUNCATE proc")
        if not managed:
            counters = db_counters(conn, w.shows)
            assert len(counters) >= 5, "the world has rows in the five counter tables"
            nonzero = {k: v for k, v in counters.items() if v != (0, 0)}
            assert not nonzero, f"database counters still booked after TRUNCATE proc: {nonzero}"
            return
        wait_store_matches(service.store, conn, w.shows, "Store to drop to 0 after TRUNCATE proc (acct_resync)")
        assert service.store.sub_counters(w.farm.show, w.farm.alloc) == (0, 100)
        assert_fits_then_release(service, w.delta(10))


# --------------------------------------------------------------------------- row 8: reopened job


def test_job_reopened_after_eviction_books_within_its_max(conn) -> None:
    """A FINISHED job evicted by a recompute (and dropped by a limit reseed), reopened by
    `UPDATE job SET str_state = 'PENDING'`: it never books past its max cores.

    Either the Store refuses it as job_unseeded until the dispatch loop's `fill_caps` loads its
    caps, or it knows them: what it must never do is book without them.
    """
    farm = make_farm(conn, "reopen", burst_cores=100, job_max_cores=5, jobs=2)
    farm.add_proc(conn, job_index=1, cores=1)  # the show keeps a live job
    job = farm.jobs[0]
    with running_scheduler() as proc:
        service = proc.service
        store = service.store
        assert store.job_cap(job) == (5, 100)
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (job,))
        with db.connect(application_name="cuesched-test-recompute") as rc:
            service.recomputer.run_once(rc)
            reseed_limits(store, rc)
            assert job not in store.audit_snapshot().job, "the recompute evicted the finished job"
            assert store.job_cap(job) is None, "the limit reseed dropped the finished job's caps"
            conn.execute("UPDATE job SET str_state = 'PENDING' WHERE pk_job = %s", (job,))
            booked: list[Applied] = []
            refusals: list[tuple[str, int, int]] = []
            try:
                for _ in range(4):
                    result = service.apply_booking(BookingDelta(farm.show, farm.alloc, farm.folder, job, 2, 0))
                    if isinstance(result, Applied):
                        booked.append(result)
                    else:
                        assert isinstance(result, LimitExceeded)
                        refusals.append((result.table, result.current, result.limit))
                        if result.table == "job_unseeded":
                            service.fill_caps(rc, [farm.folder], [job])  # what the dispatch loop does
                    assert 2 * len(booked) <= 5, f"the reopened job booked {2 * len(booked)} cores over its max of 5"
            finally:
                for booking in booked:
                    service.rollback_booking(booking)
        assert len(booked) == 2, f"the reopened job must book up to its max: {refusals}"
        assert refusals[-1] == ("job", 4, 5)
        assert {r[0] for r in refusals} <= {"job_unseeded", "job"}


# --------------------------------------------------------------------------- row 9: REPEATABLE READ writers


def _rr_insert(rr: psycopg.Connection, farm: MiniFarm) -> str:
    job, layer = farm.jobs[0], farm.layers[0]
    frame = farm.frames[job].pop()
    pk_proc = uid(f"rrproc-{farm.show}")
    rr.execute(
        "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
        " int_mem_reserved, int_gpus_reserved) VALUES (%s, %s, %s, %s, %s, %s, 300, 1048576, 0)",
        (pk_proc, farm.hosts[0], farm.show, layer, job, frame),
    )
    return pk_proc


@pytest.mark.parametrize("to_managed", [True, False], ids=["to_managed", "to_unmanaged"])
def test_repeatable_read_writer_across_a_flip_is_counted_once_or_fails(conn, to_managed: bool) -> None:
    """A REPEATABLE READ writer whose snapshot predates a flip inserts a proc after it.

    Its trigger would read the show's flag from that snapshot; it must fail with a
    serialization failure (40001) or, if it commits, be counted by the path that owns the
    show now, exactly once.
    """
    farm = make_farm(conn, f"rr-{to_managed}", managed=not to_managed, burst_cores=100, jobs=1)
    for _ in range(2):
        farm.add_proc(conn, cores=2)
    rr = autocommit_conn()
    try:
        with running_scheduler() as proc:
            service = proc.service
            assert service.is_managed(farm.show) is not to_managed
            rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            rr.execute("SELECT 1")  # the snapshot is taken here, before the flip
            conn.execute("UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s", (to_managed, farm.show))
            wait_for(lambda: service.is_managed(farm.show) is to_managed, BOUND, "the flip to be published")
            try:
                _rr_insert(rr, farm)
                rr.execute("COMMIT")
                committed = True
            except pg_errors.SerializationFailure:
                rr.execute("ROLLBACK")
                committed = False
            if to_managed:
                wait_store_matches(service.store, conn, [farm.show], "the Store to count exactly SUM(proc)")
            else:
                assert_db_matches_truth(conn, [farm.show])
            n_procs = conn.execute("SELECT count(*) FROM proc WHERE pk_show = %s", (farm.show,)).fetchone()[0]
            assert n_procs == (3 if committed else 2)
    finally:
        rr.close()


@pytest.mark.parametrize("mover", ["flip", "host_alloc", "job_folder"])
def test_key_movers_inside_repeatable_read_are_refused(conn, mover: str) -> None:
    """A flip or key move at REPEATABLE READ would miss procs committed after its snapshot: refused (0A000)."""
    w = build_world(conn, f"rrm-{mover}", managed=True)
    sql, params = {
        "flip": ("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (w.farm.show,)),
        "host_alloc": ("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (w.alloc_b, w.farm.hosts[0])),
        "job_folder": ("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (w.folder_b, w.farm.jobs[0])),
    }[mover]
    rr = autocommit_conn()
    try:
        with running_scheduler() as proc:
            rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            rr.execute("SELECT 1")
            with pytest.raises(pg_errors.FeatureNotSupported):
                rr.execute(sql, params)
            rr.execute("ROLLBACK")
            assert proc.service.is_managed(w.farm.show)
            wait_store_matches(proc.service.store, conn, w.shows, "nothing moved")
    finally:
        rr.close()


# --------------------------------------------------------------------------- Store defect: eviction


def test_recompute_keeps_the_caps_of_a_job_created_after_its_snapshot(conn, monkeypatch) -> None:
    """A job created after a recompute's snapshot, cap by notification, first booking rolled back
    during the pass: the pass evicts its empty counter, but its max cores must stay."""
    farm = make_farm(conn, "evict", burst_cores=100, jobs=1)
    new_job, new_layer = uid("evict-new-job"), uid("evict-new-layer")
    delta = BookingDelta(farm.show, farm.alloc, farm.folder, new_job, 2, 0)
    test_thread = threading.current_thread()
    armed = threading.Event()
    build_snapshot = recompute.build_snapshot

    with running_scheduler() as proc:
        service = proc.service
        store = service.store

        def after_the_snapshot(*args: object, **kwargs: object) -> CounterSnapshot:
            # Runs inside the pass, after its snapshot committed and before its overwrite and eviction.
            if armed.is_set() and threading.current_thread() is test_thread:
                armed.clear()
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name)"
                        " VALUES (%s, %s, %s, %s, %s, 'evict_new_job')",
                        (new_job, farm.folder, farm.show, uid("evict-facility"), farm.dept),
                    )
                    conn.execute("UPDATE job_resource SET int_max_cores = 500 WHERE pk_job = %s", (new_job,))
                    conn.execute(
                        "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range)"
                        " VALUES (%s, %s, 'evict_new_layer', 'true', '1-1')",
                        (new_layer, new_job),
                    )
                wait_for(lambda: store.job_cap(new_job) == (5, 100), BOUND, "the new job's cap by notification")
                booking = service.apply_booking(delta)
                assert isinstance(booking, Applied), booking
                service.rollback_booking(booking)  # its dispatch failed: the counter holds nothing
            return build_snapshot(*args, **kwargs)

        monkeypatch.setattr(recompute, "build_snapshot", after_the_snapshot)
        armed.set()
        with db.connect(application_name="cuesched-test-recompute") as rc:
            result = service.recomputer.run_once(rc)
        assert not armed.is_set(), "the hook ran inside the pass"
        assert result.evicted >= 1, "the pass evicted the job it could not see (its counter held nothing)"
        assert store.job_cap(new_job) == (5, 100), "the recompute dropped the caps of a job it could not see"
        assert_refused(
            service.apply_booking(BookingDelta(farm.show, farm.alloc, farm.folder, new_job, 6, 0)), "job", 0, 5
        )
        assert_fits_then_release(service, BookingDelta(farm.show, farm.alloc, farm.folder, new_job, 5, 0))


# --------------------------------------------------------------------------- Store defect: flip seed


def test_managed_flip_seed_keeps_bookings_in_flight(conn) -> None:
    """A flip round trip re-seeds the show while a booking is in flight: the seed must carry it,
    and rolling the booking back afterwards must leave SUM(proc), never less."""
    farm = make_farm(conn, "seedfl", burst_cores=20, jobs=1)
    for _ in range(2):
        farm.add_proc(conn, cores=4)  # 8 of 20 booked
    inflight = BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], 5, 0)
    with running_scheduler() as proc:
        service = proc.service
        store = service.store
        booking = service.apply_booking(inflight)  # booked, never confirmed: its dispatch is still running
        assert isinstance(booking, Applied)
        assert store.sub_counters(farm.show, farm.alloc) == (13, 20)
        flip = "UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s"
        conn.execute(flip, (False, farm.show))
        wait_for(lambda: not service.is_managed(farm.show), BOUND, "the show to be unpublished")
        conn.execute(flip, (True, farm.show))
        wait_for(lambda: service.is_managed(farm.show), BOUND, "the show re-seeded and published again")
        live = store.audit_snapshot()
        for name, value in (
            ("subscription", live.sub[(farm.show, farm.alloc)][0]),
            ("folder", live.folder[farm.folder][0]),
            ("job", live.job[farm.jobs[0]][0]),
        ):
            assert value >= 8 + 5, f"the flip seed dropped the in-flight booking from the {name}: {value} < 13"
        # With the 5 in flight counted, 8 more would breach the burst of 20 once both commit.
        assert_refused(
            service.apply_booking(BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], 8, 0)),
            "subscription",
            13,
            20,
        )
        service.rollback_booking(booking)
        live = store.audit_snapshot()
        assert live.sub[(farm.show, farm.alloc)][0] == 8
        assert live.folder[farm.folder][0] == 8
        assert live.job[farm.jobs[0]][0] == 8
        wait_store_matches(store, conn, [farm.show], "Store equal to SUM(proc) after the rollback")
