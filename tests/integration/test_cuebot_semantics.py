"""Cuebot's cap semantics and ts_eligible on an adopted Cuebot database, against Cuebot's own SQL.

Where the two schedulers read one column differently, the column must hold a value both read
the same way: an unlimited job cap, a flip back to Cuebot over a lowered cap, a Cuebot booking
that read a show as its own just before the show was flipped, a frame's eligible time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from accounting.db import with_writer_option
from tests.integration import cuebot_standin as cs
from tests.integration.cuebot_standin import CuebotStandIn, Proc
from tests.integration.cuebot_support import adopted_cuebot_db, manage
from tests.integration.test_cuebot_mode import ALLOC, SHOW, Farm, _sum_proc, _view, _wait, counters

ROOT = Path(__file__).resolve().parents[2]
INT_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("semantics") as url:
        yield url


@pytest.fixture
def conn(cuebot_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(cuebot_url, autocommit=True) as c:
        c.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        c.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        yield c
        c.execute("DELETE FROM proc")
        c.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        c.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")


def _submit(url: str, tmp_path: Path, **extra: object) -> str:
    name = f"testing-sh{uuid.uuid4().hex[:6]}-sem_v1"
    spec = {
        "show": "testing",
        "name": name,
        "user": "alice",
        "layers": [{"name": "main", "command": "true", "range": "1-4", "tags": ["general"]}],
        **extra,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    manage(url, "submit_job", str(path))
    with psycopg.connect(url) as c:
        return c.execute("SELECT pk_job FROM job WHERE str_name = %s", (name,)).fetchone()[0]


def _host(conn: psycopg.Connection) -> tuple[str, str]:
    pk, name = str(uuid.uuid4()), f"sem-{uuid.uuid4().hex[:8]}"
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
    return pk, name


def _caps(conn: psycopg.Connection, job: str) -> tuple[int, int]:
    return conn.execute("SELECT int_max_cores, int_max_gpus FROM job_resource WHERE pk_job = %s", (job,)).fetchone()


def _flip(conn: psycopg.Connection, managed: bool) -> None:
    conn.execute("UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s", (managed, SHOW))


# --- 1. an unlimited job cap is one Cuebot reads as unlimited too ------------------------------


def test_an_unlimited_cuesched_job_is_booked_by_cuebot_after_a_flip_and_back(
    cuebot_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """A job submitted with -1 (unlimited) caps, its show flipped to the scheduler and back to
    Cuebot: Cuebot's verify_job_resources refused every booking of it ('job has exceeded max
    cores'), and its dispatcher's `int_cores < int_max_cores` never picked it."""
    job = _submit(cuebot_url, tmp_path, max_cores=-1, max_gpus=-1)
    assert _caps(conn, job) == (INT_MAX, INT_MAX)
    _flip(conn, True)
    _flip(conn, False)
    host, host_name = _host(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        procs = [
            standin.dispatch_one(host=host, host_name=host_name, alloc=ALLOC, job=job, cores=100) for _ in range(2)
        ]
        assert all(p is not None for p in procs)
        # Cuebot's own dispatcher filter reads the job as bookable.
        assert conn.execute(
            "SELECT 1 FROM job_resource WHERE pk_job = %s AND int_cores < int_max_cores AND int_gpus < int_max_gpus",
            (job,),
        ).fetchone()
        # cuesched reads it back as unlimited (the `job show` answer and the Store's caps).
        shown = json.loads(manage(cuebot_url, "job", "show", job).stdout)
        assert shown["max_cores"] == -1 and shown["max_gpus"] == -1, shown
        for proc in procs:
            standin.complete(proc)
    finally:
        standin.close()


def test_job_max_cores_minus_one_then_a_cuebot_booking(
    cuebot_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """`job max-cores JOB -1` on a Cuebot database: Cuebot then books past the old cap."""
    job = _submit(cuebot_url, tmp_path, max_cores=1)
    manage(cuebot_url, "job", "max-cores", job, "-1")
    assert _caps(conn, job)[0] == INT_MAX
    again = manage(cuebot_url, "job", "max-cores", job, "-1").stdout
    assert "unchanged" in again.lower() or "no change" in again.lower(), again
    host, host_name = _host(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        procs = [
            standin.dispatch_one(host=host, host_name=host_name, alloc=ALLOC, job=job, cores=100) for _ in range(2)
        ]
        assert all(p is not None for p in procs)
        for proc in procs:
            standin.complete(proc)
    finally:
        standin.close()


def test_every_writer_of_a_negative_job_cap_stores_cuebots_unlimited(conn: psycopg.Connection) -> None:
    """A psql UPDATE or INSERT of -1 (or any negative) is stored as INT_MAX, cores and GPUs; a
    row left at -1 from before (written with the trigger off) is normalized by the migration's SQL,
    and a Cuebot booking against it passes even before that."""
    farm = Farm(conn)
    conn.execute("UPDATE job_resource SET int_max_cores = -1, int_max_gpus = -5 WHERE pk_job = %s", (farm.job,))
    assert _caps(conn, farm.job) == (INT_MAX, INT_MAX)
    conn.execute("UPDATE job_resource SET int_max_cores = 300, int_max_gpus = 2 WHERE pk_job = %s", (farm.job,))
    assert _caps(conn, farm.job) == (300, 2)
    (trigger,) = conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'job_resource'::regclass AND tgname LIKE %s",
        ("%cuebot_job_caps_unlimited%",),
    ).fetchone()
    conn.execute(f'ALTER TABLE job_resource DISABLE TRIGGER "{trigger}"')
    try:
        conn.execute("UPDATE job_resource SET int_max_cores = -1, int_max_gpus = -1 WHERE pk_job = %s", (farm.job,))
    finally:
        conn.execute(f'ALTER TABLE job_resource ENABLE TRIGGER "{trigger}"')
    assert _caps(conn, farm.job) == (-1, -1)
    standin = CuebotStandIn(_url(conn))
    try:
        proc = standin.dispatch_one(host=farm.host, host_name=farm.host_name, alloc=ALLOC, job=farm.job, cores=100)
        assert proc is not None  # the booking's own UPDATE normalized the row before Cuebot's verify read it
        assert _caps(conn, farm.job) == (INT_MAX, INT_MAX)
        standin.complete(proc)
    finally:
        standin.close()
    conn.execute(f'ALTER TABLE job_resource DISABLE TRIGGER "{trigger}"')
    try:
        conn.execute("UPDATE job_resource SET int_max_cores = -1, int_max_gpus = -1 WHERE pk_job = %s", (farm.job,))
    finally:
        conn.execute(f'ALTER TABLE job_resource ENABLE TRIGGER "{trigger}"')
    from accounting.triggers import NORMALIZE_CUEBOT_JOB_CAPS_SQL

    conn.execute(NORMALIZE_CUEBOT_JOB_CAPS_SQL)
    assert _caps(conn, farm.job) == (INT_MAX, INT_MAX)


def _url(conn: psycopg.Connection) -> str:
    from tests.integration.cuebot_support import server_url

    return server_url(conn.info.dbname)


# --- 2. a flip back to Cuebot over a lowered cap ---------------------------------------------


def test_a_flip_back_to_cuebot_over_a_lowered_burst_and_job_cap_writes_the_truth(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """The scheduler's frames run 300 centicores; the burst (and the job's max) were lowered to
    200 while the show was managed. The flip to Cuebot rebuilds the five tables from SUM(proc):
    Cuebot's verify_subscription refused that write, so the flip failed; now it writes 300 over
    the cap, as Cuebot's recalculate_subs() does, and the caps are back as they were."""
    farm = Farm(conn)
    _flip(conn, True)
    ours = _writer_url(cuebot_url)
    with psycopg.connect(ours, autocommit=True) as w:
        for frame in farm.frames[:3]:
            w.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, "
                "int_mem_reserved, int_mem_pre_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1048576, 1048576)",
                (str(uuid.uuid4()), farm.host, SHOW, farm.job, farm.layer, frame),
            )
    conn.execute("UPDATE frame SET str_state = 'RUNNING' WHERE pk_frame = ANY(%s)", (farm.frames[:3],))
    conn.execute("UPDATE subscription SET int_burst = 200 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    conn.execute("UPDATE job_resource SET int_max_cores = 200 WHERE pk_job = %s", (farm.job,))
    _flip(conn, False)
    got = counters(conn, farm)
    assert got == {k: 300 for k in got}, got
    burst = conn.execute(
        "SELECT int_burst FROM subscription WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC)
    ).fetchone()[0]
    assert burst == 200 and _caps(conn, farm.job)[0] == 200
    # Cuebot enforces its caps from here: over the burst, its next booking is refused.
    standin = CuebotStandIn(cuebot_url)
    try:
        with pytest.raises(psycopg.errors.RaiseException, match="exceeded"):
            standin.dispatch_one(host=farm.host, host_name=farm.host_name, alloc=ALLOC, job=farm.job, cores=100)
    finally:
        standin.close()
    assert counters(conn, farm) == got


def _writer_url(url: str) -> str:
    return f"{url}?options={with_writer_option(None).replace(' ', '%20').replace('=', '%3D')}"


# --- 3. a Cuebot booking racing a flip to managed --------------------------------------------


def test_a_cuebot_booking_that_read_the_show_before_a_flip_to_managed(cuebot_url: str) -> None:
    """Cuebot's DispatchQuery reads the show as its own; the flip to the scheduler commits; the
    scheduler books the show up to its burst; then Cuebot inserts its proc. The proc trigger's
    shared lock does not wait (the flip is over), and it reads the show as managed: the proc was
    sent to the Store (counted once) but nobody checked it against the burst the scheduler had
    just filled, so SUM(proc) passed the burst. Cuebot's booking must be refused whole."""
    burst = 200
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
        conn.execute("DELETE FROM proc")
        conn.execute(
            "UPDATE subscription SET int_burst = %s, int_cores = 0 WHERE pk_show = %s AND pk_alloc = %s",
            (burst, SHOW, ALLOC),
        )
        farm = Farm(conn, frames=4)  # the scheduler's
        late = Farm(conn, frames=1)  # the frame Cuebot reads before the flip
        env = {
            **os.environ,
            "DATABASE_URL": cuebot_url,
            "CUESCHED_CUEBOT_MODE": "auto",
            "CUESCHED_MANAGED_SHOWS_TTL": "0.3",
            "CUESCHED_SIM_RUNTIME_MIN": "600",
            "CUESCHED_SIM_RUNTIME_MAX": "600",
        }
        standin = CuebotStandIn(cuebot_url)
        sched = None
        try:
            tx = standin.conn.transaction()
            tx.__enter__()
            row = standin.conn.execute(cs.DISPATCHABLE_FRAME, (late.job,)).fetchone()
            assert row is not None  # Cuebot read the show as its own
            # The scheduler must not take that frame itself: its job is paused (Cuebot's
            # UPDATE_FRAME_STARTED does not read the pause again).
            conn.execute("UPDATE job SET b_paused = true WHERE pk_job = %s", (late.job,))
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
            sched = subprocess.Popen(
                [sys.executable, "manage.py", "run_scheduler", "--launcher", "simulated", "--metrics-port", "0"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _wait("the scheduler to book the burst", lambda: _sum_proc(conn) == burst, timeout=90)
            frame, layer, job, version, show = row
            refused = None
            try:
                standin.conn.execute(
                    cs.UPDATE_FRAME_STARTED,
                    ("RUNNING", late.host_name, 100, 1_048_576, 0, 0, frame, "WAITING", version),
                )
                standin._book(Proc(str(uuid.uuid4()), late.host, ALLOC, show, job, layer, frame, 100))
                tx.__exit__(None, None, None)
            except psycopg.Error as exc:
                refused = exc
                tx.__exit__(type(exc), exc, exc.__traceback__)
            assert _sum_proc(conn) <= burst, f"SUM(proc) {_sum_proc(conn)} passed the burst {burst}"
            assert isinstance(refused, psycopg.errors.CheckViolation), refused
            assert refused.diag.constraint_name == "acct_managed_show_booked_outside"
            state = conn.execute("SELECT str_state FROM frame WHERE pk_frame = %s", (frame,)).fetchone()[0]
            assert state == "WAITING"  # refused whole: Cuebot's frame update went with it

            def store_cores() -> int | None:
                return ((_view(conn) or {}).get("sub") or {}).get(f"{SHOW}:{ALLOC}", {}).get("cores")

            _wait("the Store to count what runs", lambda: store_cores() == burst // 100)
        finally:
            standin.close()
            if sched is not None:
                sched.terminate()
                sched.wait(60)
            conn.execute("DELETE FROM proc")
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job IN (%s, %s)", (farm.job, late.job))
            conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))


# --- 4. ts_eligible --------------------------------------------------------------------------


def test_a_cuesched_submit_stamps_ts_eligible_as_cuebot_does(
    cuebot_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """Cuebot (V41-V42) stamps a frame's ts_eligible when it becomes WAITING and leaves DEPEND
    frames NULL until its update_frame_dep_to_wait trigger stamps them; layers and jobs get
    their creation time. pycue's eligibleTime() and the V44 scheduler queries read these."""
    name = f"testing-sh{uuid.uuid4().hex[:6]}-elig_v1"
    spec = {
        "show": "testing",
        "name": name,
        "user": "alice",
        "layers": [
            {"name": "sim", "command": "sim", "range": "1-2"},
            {"name": "render", "command": "render", "range": "1-2", "depends": [{"layer": "sim", "type": "frame"}]},
        ],
    }
    path = tmp_path / "elig.json"
    path.write_text(json.dumps(spec))
    manage(cuebot_url, "submit_job", str(path))
    job, job_elig = conn.execute("SELECT pk_job, ts_eligible FROM job WHERE str_name = %s", (name,)).fetchone()
    assert job_elig is not None
    assert (
        conn.execute("SELECT count(*) FROM layer WHERE pk_job = %s AND ts_eligible IS NULL", (job,)).fetchone()[0] == 0
    )
    frames = conn.execute(
        "SELECT f.str_state, f.ts_eligible IS NOT NULL FROM frame f WHERE f.pk_job = %s ORDER BY f.str_name", (job,)
    ).fetchall()
    assert sorted(frames) == [("DEPEND", False), ("DEPEND", False), ("WAITING", True), ("WAITING", True)], frames
    # Cuebot's own trigger stamps a DEPEND frame when its dependency count reaches 0.
    conn.execute("UPDATE frame SET int_depend_count = 0 WHERE pk_job = %s AND str_state = 'DEPEND'", (job,))
    assert (
        conn.execute(
            "SELECT count(*) FROM frame WHERE pk_job = %s AND (str_state <> 'WAITING' OR ts_eligible IS NULL)", (job,)
        ).fetchone()[0]
        == 0
    )


def test_an_unmarked_writer_cannot_grow_or_move_a_managed_proc_either(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """The sibling of the refused INSERT: beside Cuebot, an UPDATE by an unmarked writer (Cuebot,
    psql) that grows a managed show's proc, or moves it onto another job of the show, books
    capacity the Store never checked, exactly as that INSERT did. It is refused the same way;
    shrinking or releasing stays allowed (the Store applies the release)."""
    farm, other = Farm(conn), Farm(conn)
    _flip(conn, True)
    pk = str(uuid.uuid4())
    with psycopg.connect(_writer_url(cuebot_url), autocommit=True) as w:
        w.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, "
            "int_mem_reserved, int_mem_pre_reserved) VALUES (%s, %s, %s, %s, %s, %s, 200, 1048576, 1048576)",
            (pk, farm.host, SHOW, farm.job, farm.layer, farm.frames[0]),
        )
    for stmt, params in (
        ("UPDATE proc SET int_cores_reserved = 300 WHERE pk_proc = %s", (pk,)),
        (
            "UPDATE proc SET pk_job = %s, pk_layer = %s, pk_frame = %s WHERE pk_proc = %s",
            (other.job, other.layer, other.frames[0], pk),
        ),
    ):
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(stmt, params)
        assert refused.value.diag.constraint_name == "acct_managed_show_booked_outside", stmt
    assert conn.execute("SELECT int_cores_reserved, pk_job FROM proc WHERE pk_proc = %s", (pk,)).fetchone() == (
        200,
        farm.job,
    )
    conn.execute("UPDATE proc SET int_cores_reserved = 100 WHERE pk_proc = %s", (pk,))
    conn.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))


def test_readoption_rewrites_the_negative_job_caps_its_migration_would_have(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """dispatch 0016's RunSQL rewrites job caps left at -1 before its trigger existed. Adoption
    records migrations instead of running them, so on a database adopted before 0016 that step
    was skipped: such a job stayed at -1, never picked by Cuebot's dispatcher (a SELECT, which
    the trigger never sees). Re-adoption now runs the migration's data step and says so first."""
    farm = Farm(conn)
    (trigger,) = conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'job_resource'::regclass "
        "AND tgname LIKE 'pgtrigger_cuebot_job_caps_unlimited_%'"
    ).fetchone()
    conn.execute(f"ALTER TABLE job_resource DISABLE TRIGGER {trigger}")
    try:
        conn.execute("UPDATE job_resource SET int_max_cores = -1 WHERE pk_job = %s", (farm.job,))
    finally:
        conn.execute(f"ALTER TABLE job_resource ENABLE TRIGGER {trigger}")
    conn.execute("DELETE FROM django_migrations WHERE app = 'dispatch' AND name = '0016_cuebot_job_caps'")
    check = manage(cuebot_url, "adopt_cuebot_db", "--check").stdout
    assert "add data dispatch.0016_cuebot_job_caps" in check, check
    assert "negative max cores or GPUs, which Cuebot books nothing of" in check, check
    assert _caps(conn, farm.job)[0] == -1  # --check wrote nothing
    manage(cuebot_url, "adopt_cuebot_db", "--apply")
    assert _caps(conn, farm.job)[0] == INT_MAX
    assert "nothing to add" in manage(cuebot_url, "adopt_cuebot_db", "--check").stdout
