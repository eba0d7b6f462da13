"""One licence limit shared by Cuebot's frames (an unmanaged show) and the scheduler's (a managed show).

On an adopted database one `limit_record` is used by both: Cuebot checks it in its frame start
(FrameDaoJdbc.UPDATE_FRAME_STARTED's subquery: the RUNNING frames of the limit's layers, summed
from layer_stat.int_running_count, must be below int_max_value), cuesched recounts it from proc
under the limit row's lock in every proc writer's transaction (accounting.licences), Cuebot's
included. Cuebot's check alone is a snapshot read of counters that another transaction is about
to raise: two starts that each read N-1 both pass. cuesched's count is what holds the limit; the
tests show that it does, against the stand-in's (Cuebot's own SQL) dispatch and a real
`run_scheduler` in Cuebot mode, and that each side also sees the other's frames in its own check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.integration.cuebot_standin import UPDATE_FRAME_STARTED, CuebotStandIn, Proc
from tests.integration.cuebot_support import adopted_cuebot_db

ROOT = Path(__file__).resolve().parents[2]
SHOW = "00000000-0000-0000-0000-000000000000"  # the seed's 'testing' show: Cuebot's (unmanaged)
ALLOC = "00000000-0000-0000-0000-000000000000"  # local.general
FOLDER = "A0000000-0000-0000-0000-000000000000"
DEPT = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0"
FACILITY = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA1"

# The limit's use as the product rule defines it (frames holding the licence) and as cuesched
# counts it, read in one snapshot; and each side's share.
USE_SQL = """
SELECT (SELECT count(*) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer
        WHERE ll.pk_limit_record = %(limit)s),
       (SELECT int_running FROM limit_record WHERE pk_limit_record = %(limit)s),
       (SELECT count(*) FROM proc p WHERE p.pk_layer = %(cuebot)s),
       (SELECT count(*) FROM proc p WHERE p.pk_layer = %(ours)s)
"""


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("licences") as url:
        yield url


@dataclass
class Job:
    job: str
    layer: str
    frames: list[str]


def _host(conn: psycopg.Connection) -> tuple[str, str]:
    """A 16-core host of local.general, as Cuebot registers one (host, host_stat, its alloc tag)."""
    pk = str(uuid.uuid4())
    name = f"lic-{pk[:8]}"
    conn.execute(
        "INSERT INTO host (pk_host, pk_alloc, str_name, str_lock_state, int_cores, int_cores_idle, int_mem, "
        "int_mem_idle) VALUES (%s, %s, %s, 'OPEN', 1600, 1600, 67108864, 67108864)",
        (pk, ALLOC, name),
    )
    conn.execute(
        "INSERT INTO host_stat (pk_host_stat, pk_host, int_mem_total, int_mem_free, ts_ping) "
        "VALUES (%s, %s, 67108864, 67108864, now())",
        (str(uuid.uuid4()), pk),
    )
    conn.execute(
        "INSERT INTO host_tag (pk_host_tag, pk_host, str_tag, str_tag_type, b_constant) "
        "VALUES (%s, %s, 'general', 'Alloc', true)",
        (str(uuid.uuid4()), pk),
    )
    return pk, name


def _managed_show(conn: psycopg.Connection) -> tuple[str, str]:
    """A second show as Cuebot's AdminManager creates one (ShowDaoJdbc.insertShow, its root group,
    a subscription to local.general, the department's point), then handed to the scheduler."""
    show, folder = str(uuid.uuid4()), str(uuid.uuid4())
    conn.execute("INSERT INTO show (pk_show,str_name) VALUES (%s,%s)", (show, f"lic{show[:6]}"))
    conn.execute(
        "INSERT INTO show_stats (pk_show, int_frame_insert_count, int_job_insert_count, "
        "int_frame_success_count, int_frame_fail_count) VALUES (%s, 0, 0, 0, 0)",
        (show,),
    )
    conn.execute(
        "INSERT INTO folder (pk_folder,pk_parent_folder,pk_show, pk_dept,str_name) VALUES (%s,NULL,%s,%s,%s)",
        (folder, show, DEPT, f"lic{show[:6]}"),
    )
    conn.execute(
        "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst) "
        "VALUES (%s, %s, %s, 100000, 100000)",
        (str(uuid.uuid4()), ALLOC, show),
    )
    conn.execute("INSERT INTO point (pk_point, pk_show, pk_dept) VALUES (%s,%s,%s)", (str(uuid.uuid4()), show, DEPT))
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (show,))
    return show, folder


def _job(conn: psycopg.Connection, url: str, *, show: str, folder: str, frames: int) -> Job:
    """A job of one 1-core layer, launched as Cuebot's JobLauncher does (frames SETUP -> WAITING)."""
    job, layer = str(uuid.uuid4()), str(uuid.uuid4())
    name = f"lic-shot-{job[:8]}"
    conn.execute(
        "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name, str_visible_name, "
        "str_shot, str_user, str_state) VALUES (%s, %s, %s, %s, %s, %s, %s, 'shot', 'lic', 'PENDING')",
        (job, folder, show, FACILITY, DEPT, name, name),
    )
    conn.execute(
        "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range, str_type, str_tags, int_cores_min) "
        "VALUES (%s, %s, 'render', 'true', '1-4', 'Render', 'general', 100)",
        (layer, job),
    )
    ids = [str(uuid.uuid4()) for _ in range(frames)]
    standin = CuebotStandIn(url)
    try:
        standin.activate(job=job, layer=layer, layer_name="render", frames=[(f, i) for i, f in enumerate(ids, 1)])
    finally:
        standin.close()
    conn.execute(
        "INSERT INTO point (pk_point, pk_show, pk_dept) SELECT %s, %s, %s "
        "WHERE NOT EXISTS (SELECT 1 FROM point WHERE pk_show = %s AND pk_dept = %s)",
        (str(uuid.uuid4()), show, DEPT, show, DEPT),
    )
    return Job(job, layer, ids)


@dataclass
class Setup:
    limit: str
    max_value: int
    cuebot: Job  # the unmanaged show's job (the stand-in dispatches it)
    ours: Job  # the managed show's job (run_scheduler books it)
    host: str
    host_name: str

    def use(self, conn: psycopg.Connection) -> tuple[int, int, int, int]:
        """(frames holding the limit, limit_record.int_running, Cuebot's share, the scheduler's share)."""
        params = {"limit": self.limit, "cuebot": self.cuebot.layer, "ours": self.ours.layer}
        return conn.execute(USE_SQL, params).fetchone()


def _setup(url: str, max_value: int, *, frames: int) -> Setup:
    """The limit (LimitDaoJdbc.createLimit, LayerDaoJdbc.addLimit) on one layer of each show."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")  # earlier tests' jobs
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        show, folder = _managed_show(conn)
        host, host_name = _host(conn)
        _host(conn)  # a second host for the scheduler: neither side is held back by cores
        cuebot = _job(conn, url, show=SHOW, folder=FOLDER, frames=frames)
        ours = _job(conn, url, show=show, folder=folder, frames=frames)
    standin = CuebotStandIn(url)
    try:
        limit = standin.create_limit(f"lic{uuid.uuid4().hex[:8]}", max_value)
        standin.add_limit(cuebot.layer, limit)
        standin.add_limit(ours.layer, limit)
    finally:
        standin.close()
    return Setup(limit, max_value, cuebot, ours, host, host_name)


def _wait(what: str, cond, timeout: float = 60.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)  # polling a condition with a deadline, not standing in for an event
    raise AssertionError(f"timed out waiting for {what}")


def _scheduler(url: str, **env: str) -> subprocess.Popen[str]:
    full = {
        **os.environ,
        "DATABASE_URL": url,
        "CUESCHED_CUEBOT_MODE": "auto",
        "CUESCHED_MANAGED_SHOWS_TTL": "0.3",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "manage.py", "run_scheduler", "--launcher", "simulated", "--metrics-port", "0"],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(sched: subprocess.Popen[str]) -> str:
    sched.terminate()
    out, _ = sched.communicate(timeout=60)
    return out[-3000:]


def _cycles(conn: psycopg.Connection) -> int:
    from accounting import live

    with conn.cursor() as cur:
        view = live.read_view(cur) or {}
    return int(((view.get("extra") or {}).get("dispatch") or {}).get("cycles", 0))


def _cuebot_start_rows(standin: CuebotStandIn, setup: Setup, frame: str) -> int:
    """UPDATE_FRAME_STARTED for one WAITING frame of Cuebot's layer: the rows it would update (rolled back)."""
    conn = standin.conn
    with conn.transaction(force_rollback=True):
        (version,) = conn.execute("SELECT int_version FROM frame WHERE pk_frame = %s", (frame,)).fetchone()
        return conn.execute(
            UPDATE_FRAME_STARTED, ("RUNNING", setup.host_name, 100, 1_048_576, 0, 0, frame, "WAITING", version)
        ).rowcount


def test_each_side_sees_the_others_frames_in_its_own_check(cuebot_url: str) -> None:
    """Max 3. Cuebot holds 2: the scheduler books 1 and no more (cycles go by). Cuebot's
    UPDATE_FRAME_STARTED then updates 0 rows: the scheduler's bookings move frames to RUNNING, which
    Cuebot's update_frame_status_counts trigger counts in layer_stat. Cuebot's 2 end: the
    scheduler holds all 3, and Cuebot's start still updates 0 rows."""
    setup = _setup(cuebot_url, 3, frames=8)
    standin = CuebotStandIn(cuebot_url)
    sched = None
    try:
        held = [
            standin.dispatch_one(
                host=setup.host, host_name=setup.host_name, alloc=ALLOC, job=setup.cuebot.job, cores=100
            )
            for _ in range(2)
        ]
        assert all(isinstance(p, Proc) for p in held), held
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            assert setup.use(conn) == (2, 2, 2, 0)
            sched = _scheduler(cuebot_url, CUESCHED_SIM_RUNTIME_MIN="300", CUESCHED_SIM_RUNTIME_MAX="300")
            _wait("the scheduler to book one frame", lambda: setup.use(conn)[3] >= 1)
            seen = _cycles(conn)
            _wait("three more dispatch cycles", lambda: _cycles(conn) >= seen + 3)
            assert setup.use(conn) == (3, 3, 2, 1)
            waiting = setup.cuebot.frames[2]
            assert _cuebot_start_rows(standin, setup, waiting) == 0
            assert (
                standin.dispatch_one(
                    host=setup.host, host_name=setup.host_name, alloc=ALLOC, job=setup.cuebot.job, cores=100
                )
                is None
            )
            running = conn.execute(
                "SELECT int_running_count FROM layer_stat WHERE pk_layer = %s", (setup.ours.layer,)
            ).fetchone()[0]
            assert running == 1  # the scheduler's frame, as Cuebot's subquery sums it

            for proc in held:
                assert standin.complete(proc)
            _wait("the scheduler to hold the whole limit", lambda: setup.use(conn)[3] == 3)
            seen = _cycles(conn)
            _wait("three more dispatch cycles", lambda: _cycles(conn) >= seen + 3)
            assert setup.use(conn) == (3, 3, 0, 3)
            assert _cuebot_start_rows(standin, setup, waiting) == 0
            assert (
                standin.dispatch_one(
                    host=setup.host, host_name=setup.host_name, alloc=ALLOC, job=setup.cuebot.job, cores=100
                )
                is None
            )
            assert setup.use(conn) == (3, 3, 0, 3)
    finally:
        standin.close()
        if sched is not None:
            print(_stop(sched))
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
            conn.execute("DELETE FROM proc")


def test_two_cuebot_starts_that_both_read_room_take_one_place(cuebot_url: str) -> None:
    """Max 1, on two unmanaged layers. Cuebot's start reads the limit's room from layer_stat, which
    a start of the other layer raises only when it commits: two dispatchers both read 0 and both
    pass the subquery (Cuebot alone would run 2). The later proc INSERT meets cuesched's recount
    under the limit row's lock and is refused (check_violation: startFrameAndProc rolls back whole)."""
    setup = _setup(cuebot_url, 1, frames=2)
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        other = _job(conn, cuebot_url, show=SHOW, folder=FOLDER, frames=1)
    first, second = CuebotStandIn(cuebot_url), CuebotStandIn(cuebot_url)
    try:
        second.add_limit(other.layer, setup.limit)
        proc = Proc(str(uuid.uuid4()), setup.host, ALLOC, SHOW, setup.cuebot.job, setup.cuebot.layer,
                    setup.cuebot.frames[0], 100)  # fmt: skip
        with pytest.raises(psycopg.errors.CheckViolation, match="is full"):
            with first.conn.transaction():
                assert _start(first, setup, setup.cuebot.frames[0]) == 1  # room: nothing runs yet
                # Another Cuebot dispatcher, meanwhile: its subquery cannot see the start above.
                got = second.dispatch_one(
                    host=setup.host, host_name=setup.host_name, alloc=ALLOC, job=other.job, cores=100
                )
                assert got is not None
                first._book(proc)
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            assert setup.use(conn)[:2] == (1, 1)
            state = conn.execute("SELECT str_state FROM frame WHERE pk_frame = %s", (proc.frame,)).fetchone()[0]
            assert state == "WAITING"  # the refused start rolled back with its proc
            assert second.complete(got)
    finally:
        first.close()
        second.close()
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
            conn.execute("DELETE FROM proc")


def _start(standin: CuebotStandIn, setup: Setup, frame: str) -> int:
    """UPDATE_FRAME_STARTED for one frame of the stand-in's open transaction: the rows updated."""
    (version,) = standin.conn.execute("SELECT int_version FROM frame WHERE pk_frame = %s", (frame,)).fetchone()
    return standin.conn.execute(
        UPDATE_FRAME_STARTED, ("RUNNING", setup.host_name, 100, 1_048_576, 0, 0, frame, "WAITING", version)
    ).rowcount


def test_cuebot_and_run_scheduler_share_one_limit_under_load(cuebot_url: str) -> None:
    """Max 3 on a layer of each show: the stand-in dispatching Cuebot's in a loop (frames ending
    after 0.3 s), run_scheduler in Cuebot mode booking the managed one (0.2-0.6 s frames). Sampled
    throughout, in one snapshot each: the frames holding the limit never exceed 3, int_running
    never reads below them, and both sides run frames."""
    max_value = 3
    setup = _setup(cuebot_url, max_value, frames=400)
    stop = threading.Event()
    samples: list[tuple[int, int, int, int]] = []
    stats = {"cuebot_booked": 0, "cuebot_zero_rows": 0, "cuebot_refused_by_count": 0, "cuebot_aborted": 0}
    errors: list[BaseException] = []

    def cuebot_side() -> None:
        standin = CuebotStandIn(cuebot_url)
        running: list[tuple[float, Proc]] = []
        try:
            while not stop.is_set():
                try:
                    proc = standin.dispatch_one(
                        host=setup.host, host_name=setup.host_name, alloc=ALLOC, job=setup.cuebot.job, cores=100
                    )
                    if proc is None:
                        stats["cuebot_zero_rows"] += 1
                    else:
                        stats["cuebot_booked"] += 1
                        running.append((time.monotonic(), proc))
                except psycopg.errors.CheckViolation as exc:
                    # Cuebot's subquery read room that a booking committing meanwhile took:
                    # cuesched's recount refused the proc, Cuebot's transaction rolled back.
                    assert "is full" in str(exc), exc
                    stats["cuebot_refused_by_count"] += 1
                except psycopg.errors.DeadlockDetected:
                    stats["cuebot_aborted"] += 1  # PostgreSQL aborts one whole; Cuebot moves on
                now = time.monotonic()
                for started, proc in [r for r in running if now - r[0] > 0.3]:
                    try:
                        standin.complete(proc)
                    except psycopg.errors.DeadlockDetected:
                        stats["cuebot_aborted"] += 1
                        continue
                    running.remove((started, proc))
                stop.wait(0.01)
            for _started, proc in running:
                standin.complete(proc)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            standin.close()

    def sampler() -> None:
        with psycopg.connect(cuebot_url, autocommit=True) as c:
            while not stop.is_set():
                samples.append(setup.use(c))
                stop.wait(0.01)

    sched = _scheduler(
        cuebot_url,
        CUESCHED_RECOMPUTE_INTERVAL="1",
        CUESCHED_SIM_RUNTIME_MIN="0.2",
        CUESCHED_SIM_RUNTIME_MAX="0.6",
    )
    threads = [threading.Thread(target=cuebot_side), threading.Thread(target=sampler)]
    out = ""
    try:
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            _wait("the scheduler's first cycles", lambda: _cycles(conn) > 0)
            for t in threads:
                t.start()

            def ours_succeeded() -> int:
                return conn.execute(
                    "SELECT count(*) FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'", (setup.ours.job,)
                ).fetchone()[0]

            # The load runs for at least 12 s, and on until the scheduler has finished a frame of
            # its own (bounded): Cuebot's loop retries every 10 ms and takes most free places, so on
            # a busy machine the scheduler's first one can come late.
            deadline = time.monotonic() + 90
            time.sleep(12.0)
            while time.monotonic() < deadline and ours_succeeded() == 0:
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(30)
            assert not errors, errors
            ours_done = ours_succeeded()
    finally:
        stop.set()
        out = _stop(sched)
        with psycopg.connect(cuebot_url, autocommit=True) as conn:
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
            conn.execute("DELETE FROM proc")
    print(out)
    over = [s for s in samples if s[0] > max_value]
    low = [s for s in samples if s[1] < s[0]]
    full = sum(1 for s in samples if s[0] == max_value)
    both = sum(1 for s in samples if s[2] > 0 and s[3] > 0)
    print({**stats, "samples": len(samples), "at_max": full, "both_running": both, "ours_succeeded": ours_done})
    assert len(samples) > 100
    assert not over, f"more frames than the limit's max {max_value}: {over[:10]}"
    assert not low, f"int_running read below the frames holding the limit: {low[:10]}"
    assert full > 0, "the limit was never reached: the test did not race"
    assert stats["cuebot_booked"] > 0 and ours_done > 0, (stats, ours_done)
