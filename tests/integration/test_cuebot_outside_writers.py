"""Writers that do not count, beside Cuebot: a psql session or script on an adopted Cuebot database.

Cuebot's Java keeps the five counter tables of its (unmanaged) shows in the writing transaction,
so cuesched's proc triggers do not add to them for connections without `cuesched.writer=on`.
A writer that writes procs the way a person does in psql, without Cuebot's counter UPDATEs,
was then counted by nobody: the counters read LOW and Cuebot over-booked past the burst. These
tests write procs that way (a plain psycopg connection, no writer mark) and check that after
commit every counter is at least SUM(proc), while Cuebot's own SQL (the stand-in) is still
counted exactly once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.integration.cuebot_standin import CuebotStandIn, Proc
from tests.integration.cuebot_support import adopted_cuebot_db, zeroed_counters
from tests.integration.test_cuebot_mode import ALLOC, DEPT, FOLDER, SHOW, Farm, counters

RAW_INSERT = (
    "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, "
    "int_mem_reserved, int_mem_pre_reserved) VALUES (%s, %s, %s, %s, %s, %s, %s, 1048576, 1048576)"
)


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("outside") as url:
        yield url


@pytest.fixture
def conn(cuebot_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection for setup and reads; procs are cleared and counters zeroed between tests."""
    with zeroed_counters(cuebot_url, SHOW) as c:
        c.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        yield c
        c.execute("DELETE FROM proc")


@pytest.fixture
def raw(cuebot_url: str) -> Iterator[psycopg.Connection]:
    """A psql-style writer: a plain connection, no `cuesched.writer` mark, explicit transactions."""
    with psycopg.connect(cuebot_url, autocommit=True) as c:
        assert c.execute("SELECT current_setting('cuesched.writer', true)").fetchone()[0] in (None, "")
        yield c


def _insert(raw: psycopg.Connection, farm: Farm, frame: int, cores: int, *, job: str | None = None) -> str:
    pk = str(uuid.uuid4())
    raw.execute(
        RAW_INSERT,
        (pk, farm.host, SHOW, job or farm.job, farm.layer, farm.frames[frame], cores),
    )
    return pk


def _exact(conn: psycopg.Connection, farm: Farm, value: int) -> None:
    got = counters(conn, farm)
    assert got == {k: value for k in got}, got


def _not_low(conn: psycopg.Connection, farm: Farm) -> dict[str, int]:
    got = counters(conn, farm)
    job_sum, layer_sum = conn.execute(
        "SELECT (SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_job = %s),"
        " (SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_layer = %s)",
        (farm.job, farm.layer),
    ).fetchone()
    # Subscription, folder and point are shared by every farm of the show; job and layer are the farm's.
    truth = {"subscription": got["sum_proc"], "folder_resource": got["sum_proc"], "point": got["sum_proc"]}
    truth.update(job_resource=job_sum, layer_resource=layer_sum)
    low = {k: (got[k], v) for k, v in truth.items() if got[k] < v}
    assert not low, (low, got, job_sum, layer_sum)
    return got


def test_a_raw_proc_insert_is_counted_at_commit_and_refused_over_the_burst(
    conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    """An INSERT of a proc with no counter UPDATE: the five counters read SUM(proc) after commit
    (they read 0, LOW, before); one that takes the subscription past its burst is refused whole."""
    farm = Farm(conn)
    with raw.transaction():
        _insert(raw, farm, 0, 100)
    _exact(conn, farm, 100)

    conn.execute("UPDATE subscription SET int_burst = 150 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    with pytest.raises(psycopg.errors.RaiseException, match="exceeded burst"), raw.transaction():
        _insert(raw, farm, 1, 100)
    _exact(conn, farm, 100)
    assert conn.execute("SELECT count(*) FROM proc").fetchone()[0] == 1


def test_cuesched_caps_apply_to_the_top_up(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """A folder capped at 0 books nothing (cuesched's semantics; Cuebot's tier trigger checks no cap)."""
    farm = Farm(conn)
    conn.execute("UPDATE folder_resource SET int_max_cores = 0 WHERE pk_folder = %s", (FOLDER,))
    try:
        with pytest.raises(psycopg.errors.CheckViolation) as info, raw.transaction():
            _insert(raw, farm, 0, 100)
        assert info.value.diag.constraint_name == "acct_folder_max_cores"
        _exact(conn, farm, 0)
    finally:
        conn.execute("UPDATE folder_resource SET int_max_cores = -1 WHERE pk_folder = %s", (FOLDER,))


def test_a_raw_resize_and_move_never_leave_a_counter_low(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """UPDATE of int_cores_reserved upward, then of the proc's job and layer: no counter reads low."""
    farm = Farm(conn)
    other = Farm(conn)
    with raw.transaction():
        pk = _insert(raw, farm, 0, 100)
    with raw.transaction():
        raw.execute("UPDATE proc SET int_cores_reserved = 300 WHERE pk_proc = %s", (pk,))
    _exact(conn, farm, 300)
    with raw.transaction():
        raw.execute(
            "UPDATE proc SET pk_job = %s, pk_layer = %s, pk_frame = %s WHERE pk_proc = %s",
            (other.job, other.layer, other.frames[0], pk),
        )
    got = _not_low(conn, other)
    # Cuebot's update_proc_update_layer moved the layer counter; the job counter was topped up.
    assert got == {k: 300 for k in got}, got
    # The old keys are not topped down (high is allowed), and still not low.
    _not_low(conn, farm)


def test_cuebot_sql_mixed_with_a_raw_insert_in_one_transaction_is_counted_once(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """procCreated's SQL and a raw INSERT in the same transaction: 100 from Cuebot, 100 topped up."""
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        with standin.conn.transaction():
            proc = standin._book(
                Proc(str(uuid.uuid4()), farm.host, ALLOC, SHOW, farm.job, farm.layer, farm.frames[0], 100)
            )
            _insert(standin.conn, farm, 1, 100)
        _exact(conn, farm, 200)
        standin.unbook(proc)
        _exact(conn, farm, 100)
    finally:
        standin.close()


def test_a_raw_writer_that_updates_the_counters_before_its_insert_is_counted_once(
    conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    """The writer keeps the counters itself, as Cuebot does, but in the other order: exactly once."""
    from tests.integration.cuebot_standin import PROC_CREATED

    farm = Farm(conn)
    params = {"c": 100, "m": 0, "g": 0, "gm": 0, "host": farm.host, "show": SHOW, "alloc": ALLOC}
    params.update(job=farm.job, layer=farm.layer)
    with raw.transaction():
        for stmt in PROC_CREATED[1:]:
            raw.execute(stmt, params)
        _insert(raw, farm, 0, 100)
    _exact(conn, farm, 100)


def test_a_savepoint_rolled_back_leaves_everything_exact(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """ROLLBACK TO SAVEPOINT undoes a raw insert and its part of the top-up together, and a
    Cuebot-style counter UPDATE rolled back with its insert leaves nothing behind."""
    from tests.integration.cuebot_standin import PROC_CREATED

    farm = Farm(conn)
    params = {"c": 100, "m": 0, "g": 0, "gm": 0, "host": farm.host, "show": SHOW, "alloc": ALLOC}
    params.update(job=farm.job, layer=farm.layer)
    with raw.transaction():
        _insert(raw, farm, 0, 100)
        raw.execute("SAVEPOINT a")
        _insert(raw, farm, 1, 100)
        raw.execute("ROLLBACK TO SAVEPOINT a")
        raw.execute("SAVEPOINT b")
        _insert(raw, farm, 2, 100)
        for stmt in PROC_CREATED[1:]:
            raw.execute(stmt, params)
        raw.execute("ROLLBACK TO SAVEPOINT b")
        raw.execute("SAVEPOINT c")
        _insert(raw, farm, 3, 100)
        raw.execute("RELEASE SAVEPOINT c")
    _exact(conn, farm, 200)


def test_a_repeatable_read_writer_is_counted(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """At REPEATABLE READ the top-up adds what the transaction owes (it cannot trust a SUM(proc)
    read from its snapshot), relative to the row it locks."""
    farm = Farm(conn)
    raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    with raw.transaction():
        _insert(raw, farm, 0, 100)
    _exact(conn, farm, 100)


def test_a_raw_decrement_without_a_proc_is_undone_but_recalculate_subs_still_lowers(
    cuebot_url: str, conn: psycopg.Connection, raw: psycopg.Connection
) -> None:
    """Lowering a counter under running procs is a LOW write: it is topped back to SUM(proc). A
    counter that reads high (a raw DELETE of a proc) is still brought down by Cuebot's own
    recalculate_subs(), whose rewrite to SUM(proc) owes nothing."""
    farm = Farm(conn)
    with raw.transaction():
        _insert(raw, farm, 0, 100)
        pk = _insert(raw, farm, 1, 100)
    with raw.transaction():
        raw.execute("UPDATE subscription SET int_cores = 0 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    _exact(conn, farm, 200)
    with raw.transaction():
        raw.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))
    assert counters(conn, farm)["subscription"] == 200  # high, allowed
    standin = CuebotStandIn(cuebot_url)
    try:
        standin.recalculate_subs()
    finally:
        standin.close()
    assert counters(conn, farm)["subscription"] == 100


def test_the_ledger_is_empty_after_commit(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """Every row is the committing transaction's own and is taken by its top-up."""
    farm = Farm(conn)
    with raw.transaction():
        _insert(raw, farm, 0, 100)
    assert conn.execute("SELECT count(*) FROM cuesched_outside_ledger").fetchone()[0] == 0
    # Adoption made it as the migration does: UNLOGGED, its top-up a deferred constraint trigger.
    persistence, deferred = conn.execute(
        "SELECT c.relpersistence, t.tgdeferrable AND t.tginitdeferred FROM pg_class c "
        "JOIN pg_trigger t ON t.tgrelid = c.oid WHERE c.relname = 'cuesched_outside_ledger' "
        "AND t.tgname LIKE 'pgtrigger_acct_outside_topup_%'"
    ).fetchone()
    assert (persistence, deferred) == ("u", True)


def test_raw_writers_beside_cuebot_under_load_never_read_low_nor_breach(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    """Cuebot's bookings and releases, raw READ COMMITTED and REPEATABLE READ inserters, all on one
    subscription with a 5-core burst: every committed state has each counter >= SUM(proc) (read in
    one statement, one snapshot) and SUM(proc) <= burst; once every proc is released by Cuebot's
    SQL, the counters are exactly 0 (nothing counted twice, nothing lost)."""
    import random
    import threading
    import time

    burst = 500
    farm = Farm(conn, frames=40)
    conn.execute("UPDATE subscription SET int_burst = %s WHERE pk_show = %s AND pk_alloc = %s", (burst, SHOW, ALLOC))
    free = list(range(len(farm.frames)))
    running: list[str] = []
    guard = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    low: list[tuple] = []
    stats = {"cuebot": 0, "raw": 0, "raw_rr": 0, "refused": 0, "retried": 0, "released": 0, "samples": 0}
    refusals = (psycopg.errors.RaiseException, psycopg.errors.CheckViolation)
    retries = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)

    def take() -> int | None:
        with guard:
            return free.pop(random.randrange(len(free))) if free else None

    def give(frame: int) -> None:
        with guard:
            free.append(frame)

    def proc_of(pk: str, frame: int) -> Proc:
        return Proc(pk, farm.host, ALLOC, SHOW, farm.job, farm.layer, farm.frames[frame], 100)

    frame_of: dict[str, int] = {}

    def cuebot() -> None:
        standin = CuebotStandIn(cuebot_url)
        try:
            while not stop.is_set():
                frame = take()
                if frame is not None:
                    try:
                        p = standin.book(
                            host=farm.host,
                            alloc=ALLOC,
                            show=SHOW,
                            job=farm.job,
                            layer=farm.layer,
                            frame=farm.frames[frame],
                            cores=100,
                        )
                        with guard:
                            running.append(p.pk_proc)
                            frame_of[p.pk_proc] = frame
                        stats["cuebot"] += 1
                    except refusals:
                        stats["refused"] += 1
                        give(frame)
                    except retries:
                        stats["retried"] += 1
                        give(frame)
                with guard:
                    victim = running.pop(random.randrange(len(running))) if len(running) > 2 else None
                if victim is not None:
                    try:
                        standin.unbook(proc_of(victim, frame_of[victim]))
                        stats["released"] += 1
                        give(frame_of[victim])
                    except retries:
                        stats["retried"] += 1
                        with guard:
                            running.append(victim)
        except BaseException as exc:
            errors.append(exc)
        finally:
            standin.close()

    def raw_writer(isolation: psycopg.IsolationLevel, key: str) -> None:
        with psycopg.connect(cuebot_url, autocommit=True) as c:
            c.isolation_level = isolation
            try:
                while not stop.is_set():
                    frames = [f for f in (take(), take()) if f is not None]
                    pks = [str(uuid.uuid4()) for _ in frames]
                    try:
                        with c.transaction():
                            for pk, frame in zip(pks, frames, strict=True):
                                c.execute(
                                    RAW_INSERT, (pk, farm.host, SHOW, farm.job, farm.layer, farm.frames[frame], 100)
                                )
                        with guard:
                            running.extend(pks)
                            frame_of.update(zip(pks, frames, strict=True))
                        stats[key] += len(pks)
                    except refusals:
                        stats["refused"] += 1
                        for frame in frames:
                            give(frame)
                    except retries:
                        stats["retried"] += 1
                        for frame in frames:
                            give(frame)
                    stop.wait(0.005)
            except BaseException as exc:
                errors.append(exc)

    def sampler() -> None:
        with psycopg.connect(cuebot_url, autocommit=True) as c:
            while not stop.is_set():
                got = counters(c, farm)
                stats["samples"] += 1
                if min(v for k, v in got.items() if k != "sum_proc") < got["sum_proc"] or got["sum_proc"] > burst:
                    low.append(tuple(got.values()))
                stop.wait(0.01)

    threads = [
        threading.Thread(target=cuebot),
        threading.Thread(target=cuebot),
        threading.Thread(target=raw_writer, args=(psycopg.IsolationLevel.READ_COMMITTED, "raw")),
        threading.Thread(target=raw_writer, args=(psycopg.IsolationLevel.REPEATABLE_READ, "raw_rr")),
        threading.Thread(target=sampler),
    ]
    for t in threads:
        t.start()
    # Load for at least 4 s, and on until Cuebot and the READ COMMITTED writer have committed. A
    # REPEATABLE READ writer fails with 40001 whenever Cuebot booked on the subscription since its
    # snapshot, which under this load can be every time: during the load it may only retry, and
    # its commit is proved once the load is over (below).
    deadline = time.monotonic() + 60
    stop.wait(4.0)
    while time.monotonic() < deadline and min(stats["cuebot"], stats["raw"]) == 0:
        stop.wait(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    standin = CuebotStandIn(cuebot_url)
    try:
        for pk in running:
            assert standin.unbook(proc_of(pk, frame_of[pk]))
            give(frame_of[pk])
    finally:
        standin.close()
    print(stats)
    assert stats["samples"] > 20 and stats["cuebot"] > 0 and stats["raw"] > 0, stats
    assert stats["raw_rr"] > 0 or stats["retried"] > 0, stats  # the REPEATABLE READ writer took part
    assert not low, f"a counter read below SUM(proc), or SUM(proc) passed the burst: {low[:5]}"
    _exact(conn, farm, 0)
    # Quiet now: a REPEATABLE READ writer's insert commits and is counted exactly, then Cuebot's
    # SQL releases it to 0 again.
    stop.clear()
    running.clear()
    raw_writer_once = threading.Thread(target=raw_writer, args=(psycopg.IsolationLevel.REPEATABLE_READ, "raw_rr"))
    before = stats["raw_rr"]
    raw_writer_once.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and stats["raw_rr"] == before and not errors:
        time.sleep(0.05)
    stop.set()
    raw_writer_once.join(30)
    assert not errors, errors
    assert stats["raw_rr"] > before, stats
    _exact(conn, farm, 100 * len(running))
    standin = CuebotStandIn(cuebot_url)
    try:
        for pk in running:
            assert standin.unbook(proc_of(pk, frame_of[pk]))
    finally:
        standin.close()
    _exact(conn, farm, 0)


def test_a_raw_gpu_proc_is_counted_in_every_gpu_counter(conn: psycopg.Connection, raw: psycopg.Connection) -> None:
    """GPUs are owed and topped up as cores are (a proc given GPUs after its insert, same transaction)."""
    farm = Farm(conn)
    with raw.transaction():
        pk = _insert(raw, farm, 0, 100)
        raw.execute("UPDATE proc SET int_gpus_reserved = 2 WHERE pk_proc = %s", (pk,))
    gpus = conn.execute(
        """
        SELECT (SELECT int_gpus FROM subscription WHERE pk_show = %(show)s AND pk_alloc = %(alloc)s),
               (SELECT int_gpus FROM folder_resource WHERE pk_folder = %(folder)s),
               (SELECT int_gpus FROM job_resource WHERE pk_job = %(job)s),
               (SELECT int_gpus FROM layer_resource WHERE pk_layer = %(layer)s),
               (SELECT int_gpus FROM point WHERE pk_show = %(show)s AND pk_dept = %(dept)s)
        """,
        {"show": SHOW, "alloc": ALLOC, "folder": FOLDER, "job": farm.job, "layer": farm.layer, "dept": DEPT},
    ).fetchone()
    assert gpus == (2, 2, 2, 2, 2)
    _exact(conn, farm, 100)
