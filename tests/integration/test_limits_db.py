"""Licence limits in the database, for every writer (issue 19, part 1).

`limit_record.int_running` is recounted from proc under the limit row's lock by every proc
statement of a limited layer, whoever writes it; a count that rises above `int_max_value` fails
the statement with `check_violation` (`acct_limit_max`). These tests write procs as an outside
writer would (plain SQL on connections of their own), managed and unmanaged shows alike: a
limit spans shows, and the check is the same for both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pg_errors

from accounting.licences import LIMIT_MAX_CONSTRAINT, LIMIT_USE_SQL, limit_max
from dispatch.models import LayerLimit, LimitRecord
from tests.integration import farm_fixtures as ff
from tests.integration.runtime_support import autocommit_conn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    c = autocommit_conn()
    yield c
    c.close()


def _insert_proc(conn: psycopg.Connection, host: str, frame: ff.Frame, *, isolation: str = "READ COMMITTED") -> str:
    pk = ff.unique("lproc")
    with conn.cursor() as cur:
        cur.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        try:
            cur.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved) SELECT %s, %s, j.pk_show, f.pk_layer, f.pk_job, f.pk_frame, 100, 1024"
                " FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE f.pk_frame = %s",
                (pk, host, frame.pk),
            )
            cur.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return pk


def _running(conn: psycopg.Connection, limit: LimitRecord) -> tuple[int, int]:
    row = conn.execute(
        "SELECT int_running, int_frames FROM limit_record WHERE pk_limit_record = %s", (limit.pk,)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def _limited_farm(*, max_value: int, host_limit: bool = False, frames: int = 10, hosts: int = 1, managed: bool = False):
    farm = ff.tiny_farm(managed=managed, frames=frames)
    limit = LimitRecord.objects.create(str_name=ff.unique("arnold"), int_max_value=max_value, b_host_limit=host_limit)
    LayerLimit.objects.create(layer=farm.layer, limit=limit)
    extra = [ff.create_host(farm.alloc) for _ in range(hosts - 1)]
    return farm, limit, [farm.host, *extra]


def test_a_negative_max_is_unlimited_on_cuesched_schema(conn: psycopg.Connection) -> None:
    """Only beside Cuebot does a negative max run nothing; here it counts and never refuses,
    and the SQL reading every writer uses agrees with the Python one."""
    farm, limit, (host,) = _limited_farm(max_value=-1)
    for f in farm.frames[:4]:
        _insert_proc(conn, host.pk, f)
    assert _running(conn, limit) == (4, 4)
    row = conn.execute(LIMIT_USE_SQL + " WHERE r.pk_limit_record = %s", (limit.pk,)).fetchone()
    assert row is not None and row[2] == row[7] == limit_max(-1, cuebot=False) == -1


@pytest.mark.parametrize("managed", [False, True])
def test_frame_limit_refuses_the_booking_over_max_and_frees_on_release(conn: psycopg.Connection, managed: bool) -> None:
    farm, limit, (host,) = _limited_farm(max_value=3, managed=managed)
    procs = [_insert_proc(conn, host.pk, f) for f in farm.frames[:3]]
    assert _running(conn, limit) == (3, 3)
    with pytest.raises(pg_errors.CheckViolation) as err:
        _insert_proc(conn, host.pk, farm.frames[3])
    assert err.value.diag.constraint_name == LIMIT_MAX_CONSTRAINT
    assert "running=4 max=3" in (err.value.diag.message_primary or "")
    assert _running(conn, limit) == (3, 3)
    conn.execute("DELETE FROM proc WHERE pk_proc = %s", (procs[0],))
    assert _running(conn, limit) == (2, 2)
    _insert_proc(conn, host.pk, farm.frames[3])
    assert _running(conn, limit) == (3, 3)


def test_host_limit_counts_hosts_not_frames(conn: psycopg.Connection) -> None:
    farm, limit, hosts = _limited_farm(max_value=2, host_limit=True, hosts=3)
    a, b, c = hosts
    _insert_proc(conn, a.pk, farm.frames[0])
    _insert_proc(conn, a.pk, farm.frames[1])
    _insert_proc(conn, a.pk, farm.frames[2])
    assert _running(conn, limit) == (1, 3)
    last_on_b = _insert_proc(conn, b.pk, farm.frames[3])
    assert _running(conn, limit) == (2, 4)
    with pytest.raises(pg_errors.CheckViolation):
        _insert_proc(conn, c.pk, farm.frames[4])
    _insert_proc(conn, b.pk, farm.frames[4])  # a host that holds the licence already: free
    assert _running(conn, limit) == (2, 5)
    conn.execute("DELETE FROM proc WHERE pk_host = %s", (b.pk,))
    assert _running(conn, limit) == (1, 3)
    _insert_proc(conn, c.pk, farm.frames[5])
    assert _running(conn, limit) == (2, 4)
    del last_on_b


def test_max_lowered_below_use_refuses_new_frames_and_never_goes_negative(conn: psycopg.Connection) -> None:
    farm, limit, (host,) = _limited_farm(max_value=5)
    procs = [_insert_proc(conn, host.pk, f) for f in farm.frames[:4]]
    conn.execute("UPDATE limit_record SET int_max_value = 1 WHERE pk_limit_record = %s", (limit.pk,))
    assert _running(conn, limit) == (4, 4)
    with pytest.raises(pg_errors.CheckViolation):
        _insert_proc(conn, host.pk, farm.frames[5])
    for pk in procs:
        conn.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))
    assert _running(conn, limit) == (0, 0)
    conn.execute("DELETE FROM proc WHERE pk_proc = %s", (procs[0],))  # nothing left: still 0
    assert _running(conn, limit) == (0, 0)


def test_tagging_a_running_layer_counts_its_frames_and_refuses_going_over(conn: psycopg.Connection) -> None:
    farm = ff.tiny_farm(managed=False, frames=6)
    for f in farm.frames[:3]:
        _insert_proc(conn, farm.host.pk, f)
    small = LimitRecord.objects.create(str_name=ff.unique("small"), int_max_value=2)
    with pytest.raises(pg_errors.CheckViolation):
        conn.execute(
            "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
            (ff.unique("ll"), farm.layer.pk, small.pk),
        )
    big = LimitRecord.objects.create(str_name=ff.unique("big"), int_max_value=3)
    conn.execute(
        "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
        (ff.unique("ll"), farm.layer.pk, big.pk),
    )
    assert _running(conn, big) == (3, 3)
    with pytest.raises(pg_errors.CheckViolation):
        _insert_proc(conn, farm.host.pk, farm.frames[3])
    conn.execute("DELETE FROM layer_limit WHERE pk_limit_record = %s", (big.pk,))
    assert _running(conn, big) == (0, 0)


def test_truncate_proc_recounts_and_use_columns_are_written_by_triggers_only(conn: psycopg.Connection) -> None:
    farm, limit, (host,) = _limited_farm(max_value=5)
    for f in farm.frames[:2]:
        _insert_proc(conn, host.pk, f)
    with pytest.raises(pg_errors.CheckViolation):
        conn.execute("UPDATE limit_record SET int_running = 0 WHERE pk_limit_record = %s", (limit.pk,))
    conn.execute("TRUNCATE proc")
    assert _running(conn, limit) == (0, 0)
    row = conn.execute(LIMIT_USE_SQL + " WHERE r.pk_limit_record = %s", (limit.pk,)).fetchone()
    assert row is not None and row[4] == row[5] == 0


def test_switching_to_a_host_limit_recounts(conn: psycopg.Connection) -> None:
    farm, limit, (host,) = _limited_farm(max_value=10)
    for f in farm.frames[:3]:
        _insert_proc(conn, host.pk, f)
    conn.execute("UPDATE limit_record SET b_host_limit = true WHERE pk_limit_record = %s", (limit.pk,))
    assert _running(conn, limit) == (1, 3)


def test_repeatable_read_writer_cannot_count_a_stale_use(conn: psycopg.Connection) -> None:
    """A writer whose snapshot predates another writer's commit on the limit fails (40001), never counts low."""
    farm, limit, (host,) = _limited_farm(max_value=1)
    other = autocommit_conn()
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1 FROM limit_record").fetchall()  # the snapshot is taken here
        _insert_proc(other, host.pk, farm.frames[0])
        with pytest.raises((pg_errors.SerializationFailure, pg_errors.CheckViolation)):
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved) SELECT %s, %s, j.pk_show, f.pk_layer, f.pk_job, f.pk_frame, 100, 1024"
                " FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE f.pk_frame = %s",
                (ff.unique("rr"), host.pk, farm.frames[1].pk),
            )
        conn.execute("ROLLBACK")
    finally:
        other.close()
    assert _running(conn, limit) == (1, 1)


def test_concurrent_outside_writers_never_overshoot(conn: psycopg.Connection) -> None:
    """Eight writers (READ COMMITTED and REPEATABLE READ) race for 4 licences; a sampler reads SUM(proc)."""
    max_value = 4
    farm, limit, hosts = _limited_farm(max_value=max_value, frames=400, hosts=4)
    frames = list(farm.frames)
    lock = threading.Lock()
    stop = threading.Event()
    seen: list[int] = []
    refused = [0]
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        c = autocommit_conn()
        mine: list[str] = []
        try:
            while not stop.is_set():
                with lock:
                    if not frames:
                        return
                    frame = frames.pop()
                try:
                    mine.append(
                        _insert_proc(
                            c, hosts[i % 4].pk, frame, isolation="REPEATABLE READ" if i % 2 else "READ COMMITTED"
                        )
                    )
                except (pg_errors.CheckViolation, pg_errors.SerializationFailure):
                    refused[0] += 1
                if len(mine) >= 2:
                    c.execute("DELETE FROM proc WHERE pk_proc = %s", (mine.pop(0),))
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    def sampler() -> None:
        c = autocommit_conn()
        try:
            while not stop.is_set():
                row = c.execute(
                    "SELECT count(*) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer"
                    " WHERE ll.pk_limit_record = %s",
                    (limit.pk,),
                ).fetchone()
                seen.append(row[0] if row else 0)
        finally:
            c.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    s = threading.Thread(target=sampler)
    s.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    s.join(timeout=10)
    assert not errors, errors
    assert seen and max(seen) <= max_value, max(seen)
    assert max(seen) == max_value  # the limit was reached: the race was real
    assert refused[0] > 0
    running, frames_count = _running(conn, limit)
    truth = conn.execute(
        "SELECT count(*) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer WHERE ll.pk_limit_record = %s",
        (limit.pk,),
    ).fetchone()
    assert truth is not None and running == frames_count == truth[0]


def test_why_not_booking_names_the_full_limit_with_its_numbers(conn: psycopg.Connection) -> None:
    from ops.why import explain_job

    farm, limit, (host,) = _limited_farm(max_value=1)
    _insert_proc(conn, host.pk, farm.frames[0])
    why = explain_job(farm.job.pk, None)
    assert why.primary is not None and why.primary.code == "limit_full", why.reasons
    assert f"{limit.str_name} 1/1 frames" in why.primary.message


def test_a_proc_written_before_its_layer_is_refused(conn: psycopg.Connection) -> None:
    """Foreign keys are deferred: a proc naming a layer that does not exist yet would escape every limit."""
    farm = ff.tiny_farm(managed=False, frames=2)
    with pytest.raises(pg_errors.ForeignKeyViolation) as err:
        with conn.transaction():
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1024)",
                (ff.unique("early"), farm.host.pk, farm.show.pk, ff.unique("nolayer"), farm.job.pk, farm.frames[0].pk),
            )
    assert "before its layer" in (err.value.diag.message_primary or "")


def test_a_limit_on_a_layer_created_in_the_same_transaction_needs_no_keys_lock(conn: psycopg.Connection) -> None:
    """A submission tags its new layers while another session holds an existing layer's key row
    (FOR KEY SHARE, as a proc writer of that layer does: accounting.keylocks)."""
    farm = ff.tiny_farm(managed=False, frames=2)
    limit = LimitRecord.objects.create(str_name=ff.unique("sub"), int_max_value=1)
    holder = autocommit_conn()
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM layer WHERE pk_layer = %s FOR KEY SHARE", (farm.layer.pk,))
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            layer = ff.unique("newlayer")
            conn.execute(
                "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range) VALUES (%s, %s, %s, 'true', '1')",
                (layer, farm.job.pk, layer),
            )
            conn.execute(
                "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
                (ff.unique("ll"), layer, limit.pk),
            )
        # An existing layer needs its row FOR UPDATE: it waits for the holder (the session's own
        # lock_timeout of 2 s, shorter than the trigger's 10 s, is kept), then gives up.
        started = time.monotonic()
        with pytest.raises(pg_errors.LockNotAvailable) as failed, conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            conn.execute(
                "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
                (ff.unique("ll"), farm.layer.pk, limit.pk),
            )
        assert time.monotonic() - started >= 1.5
        assert "idle in transaction" in (failed.value.diag.message_hint or "")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_an_updated_layer_is_not_taken_for_a_new_one_and_takes_the_keys_lock(conn: psycopg.Connection) -> None:
    """The lock skip for layers a submission creates tested the layer row's xmin, which any
    UPDATE of the row in the transaction also sets: tagging an existing layer after touching it
    skipped the exclusive lock, and a proc writer racing it was counted by no limit."""
    farm = ff.tiny_farm(managed=False, frames=2)
    limit = LimitRecord.objects.create(str_name=ff.unique("upd"), int_max_value=1)
    holder = autocommit_conn()
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM layer WHERE pk_layer = %s FOR KEY SHARE", (farm.layer.pk,))
        with pytest.raises(pg_errors.LockNotAvailable), conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            conn.execute("UPDATE layer SET str_tags = str_tags WHERE pk_layer = %s", (farm.layer.pk,))
            conn.execute(
                "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
                (ff.unique("ll"), farm.layer.pk, limit.pk),
            )
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_limit_row_written_after_its_layer_limit_counts_the_running_frames(conn: psycopg.Connection) -> None:
    """Deferred foreign keys let layer_limit name a limit that is inserted later in the same
    transaction (or deleted and inserted again with its id): the new row was seeded at 0 while
    the layer ran frames, and nothing refused a count over its max."""
    farm = ff.tiny_farm(managed=False, frames=4)
    for f in farm.frames[:3]:
        _insert_proc(conn, farm.host.pk, f)
    pk = ff.unique("late")
    with pytest.raises(pg_errors.CheckViolation), conn.transaction():
        conn.execute("SET CONSTRAINTS ALL DEFERRED")
        conn.execute(
            "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
            (ff.unique("ll"), farm.layer.pk, pk),
        )
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, 1)",
            (pk, ff.unique("late")),
        )
    limit = LimitRecord.objects.create(str_name=ff.unique("again"), int_max_value=5)
    LayerLimit.objects.create(layer=farm.layer, limit=limit)
    assert _running(conn, limit) == (3, 3)
    with pytest.raises(pg_errors.CheckViolation), conn.transaction():
        conn.execute("SET CONSTRAINTS ALL DEFERRED")
        conn.execute("DELETE FROM limit_record WHERE pk_limit_record = %s", (limit.pk,))
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, 1)",
            (limit.pk, ff.unique("again")),
        )
    with conn.transaction():
        conn.execute("SET CONSTRAINTS ALL DEFERRED")
        conn.execute("DELETE FROM limit_record WHERE pk_limit_record = %s", (limit.pk,))
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, 5)",
            (limit.pk, ff.unique("again")),
        )
    assert _running(conn, limit) == (3, 3)


def test_a_proc_keeps_its_id(conn: psycopg.Connection) -> None:
    """The proc triggers pair old and new rows by pk_proc: an UPDATE that also changed pk_proc
    was seen by none of them, so a proc could grow its cores or move to a limited layer
    uncounted (and a later DELETE took the counters below zero)."""
    farm = ff.tiny_farm(managed=False, frames=2)
    _insert_proc(conn, farm.host.pk, farm.frames[0])
    with pytest.raises(pg_errors.CheckViolation, match="keeps its id"):
        conn.execute("UPDATE proc SET int_cores_reserved = 5000, pk_proc = gen_random_uuid()::text")
    assert conn.execute("SELECT int_cores_reserved FROM proc").fetchone()[0] == 100
