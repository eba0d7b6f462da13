"""Licence limits under the real runtime: dispatch workers, the Store and an outside writer (issue 19).

One limit is put on every layer of a managed and an unmanaged show and on a job no scheduler
dispatches, whose frames an outside writer starts and ends by plain SQL as fast as it can.
Three dispatch workers (`dispatch_main(workers=3)`, what `run_scheduler --workers 3` runs)
book both shows meanwhile. A sampler counts, from proc, the frames running on the limit: the
count never exceeds the max at any sample, and the limit is reached (the race is real).
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg import errors as pg_errors

from accounting.scheduler import SchedulerOptions, SchedulerProcess
from dispatch.engine.loop import dispatch_main
from tests.integration.dispatch_support import autocommit, scalar, seed, wait_for
from tests.integration.runtime_support import running_scheduler, uid

pytestmark = pytest.mark.django_db(transaction=True)

BOUND = 5.0  # seconds a limit change may take to reach the running Store

USE_SQL = (
    "SELECT count(*) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer WHERE ll.pk_limit_record = %s"
)


def _make_limit(conn: psycopg.Connection, max_value: int, *, host: bool = False) -> str:
    pk = uid("limit")
    conn.execute(
        "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value, b_host_limit) VALUES (%s, %s, %s, %s)",
        (pk, pk[:40], max_value, host),
    )
    return pk


def _tag(conn: psycopg.Connection, limit: str, layers: list[str]) -> None:
    conn.execute(
        "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record)"
        " SELECT gen_random_uuid()::text, l, %s FROM unnest(%s::text[]) AS l",
        (limit, layers),
    )


def _outside_job(conn: psycopg.Connection, like_job: str, limit: str, frames: int) -> list[str]:
    """A paused job of the unmanaged show (never dispatched) whose one layer holds the limit."""
    job, layer = uid("ojob"), uid("olayer")
    with conn.transaction():
        conn.execute(
            "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name, b_paused)"
            " SELECT %s, pk_folder, pk_show, pk_facility, pk_dept, %s, true FROM job WHERE pk_job = %s",
            (job, job, like_job),
        )
        conn.execute(
            "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range) VALUES (%s, %s, 'o', 'true', '1')",
            (layer, job),
        )
        _tag(conn, limit, [layer])
        ids = [uid("oframe", n) for n in range(frames)]
        conn.execute(
            "INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, int_number, str_state)"
            " SELECT t.pk, %s, %s, t.pk, t.n, 'SUCCEEDED' FROM unnest(%s::text[]) WITH ORDINALITY AS t(pk, n)",
            (layer, job, ids),
        )
    return ids


@pytest.mark.parametrize("host_limit", [False, True], ids=["frames", "hosts"])
def test_workers_and_an_outside_writer_never_overshoot_one_limit(host_limit: bool) -> None:
    max_value = 3 if host_limit else 5
    farm = seed(
        f"lim{int(host_limit)}",
        shows=2,
        managed_shows=1,
        jobs=8,
        layers=1,
        frames_per_layer=6,
        hosts=9,
        allocs=1,
        manual_tags=0,
        host_cores_choices=(16,),
        layer_cores_choices=(1,),
        sub_burst=100_000,
        folder_max_cores=-1,
        job_max_cores=100_000,
    )
    with autocommit() as conn:
        limit = _make_limit(conn, max_value, host=host_limit)
        _tag(conn, limit, list(farm.layer_ids))
        outside_frames = _outside_job(conn, farm.job_ids[0], limit, 200)
        outside_layer = scalar(conn, "SELECT pk_layer FROM frame WHERE pk_frame = %s", (outside_frames[0],))
        outside_job = scalar(conn, "SELECT pk_job FROM frame WHERE pk_frame = %s", (outside_frames[0],))
        outside_show = scalar(conn, "SELECT pk_show FROM job WHERE pk_job = %s", (outside_job,))
        total = scalar(conn, "SELECT count(*) FROM frame WHERE pk_job = ANY(%s::text[])", (list(farm.job_ids),))
    count_sql = (
        "SELECT count(DISTINCT p.pk_host) FROM proc p JOIN layer_limit ll ON ll.pk_layer = p.pk_layer"
        " WHERE ll.pk_limit_record = %s"
        if host_limit
        else USE_SQL
    )
    stop = threading.Event()
    seen: list[int] = []
    outside = {"booked": 0, "refused": 0}
    errors: list[BaseException] = []

    def sampler() -> None:
        with autocommit() as c:
            while not stop.is_set():
                seen.append(scalar(c, count_sql, (limit,)))

    def writer() -> None:
        try:
            with autocommit() as c:
                i = 0
                while not stop.is_set():
                    frame = outside_frames[i % len(outside_frames)]
                    host = farm.host_ids[i % len(farm.host_ids)]
                    i += 1
                    pk = uid("wproc", i)
                    try:
                        c.execute(
                            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame,"
                            " int_cores_reserved, int_mem_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1024)",
                            (pk, host, outside_show, outside_layer, outside_job, frame),
                        )
                    except (pg_errors.CheckViolation, pg_errors.SerializationFailure):
                        outside["refused"] += 1
                        continue
                    outside["booked"] += 1
                    time.sleep(0.002)  # hold the licence a moment, as a frame does
                    c.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))
        except BaseException as exc:
            errors.append(exc)

    process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=30))
    main = dispatch_main("simulated", exit_when_idle=False, workers=3, runtime_min=0.01, runtime_max=0.05)
    thread = threading.Thread(target=process.run, args=(main,), daemon=True)
    threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=writer, daemon=True)]
    try:
        for t in threads:
            t.start()
        thread.start()
        with autocommit() as conn:
            wait_for(
                lambda: scalar(
                    conn,
                    "SELECT count(*) FROM frame WHERE pk_job = ANY(%s::text[]) AND str_state = 'SUCCEEDED'",
                    (list(farm.job_ids),),
                )
                == total,
                timeout=120,
                what="both shows to drain under the limit",
            )
    finally:
        stop.set()
        process.stop.set()
        thread.join(30)
        for t in threads:
            t.join(10)
    assert not errors, errors
    assert seen, "the sampler took no sample"
    assert max(seen) <= max_value, f"limit overshot: {max(seen)} > {max_value}"
    assert max(seen) == max_value, "the limit was never reached: the test raced nothing"
    assert outside["booked"] > 0, outside
    view = process.service.view_providers["dispatch"]()
    assert view["workers"] == 3
    # The Store refused managed bookings over the limit in memory (not only the database).
    assert view["rejected"].get("limit", 0) > 0, view["rejected"]
    with autocommit() as conn:
        assert scalar(conn, "SELECT int_running FROM limit_record WHERE pk_limit_record = %s", (limit,)) == 0


def test_a_limit_change_reaches_the_running_store_and_blocks_booking() -> None:
    """A max lowered in psql is in the Store within the notification bound; the Store then refuses."""
    from accounting.store import LICENCE, Applied, BookingDelta, LimitExceeded

    with autocommit() as conn:
        limit = _make_limit(conn, 10)
    with running_scheduler() as process:
        store = process.service.store
        wait_for(lambda: limit in store.licences(), timeout=BOUND, what="the new limit in the Store")
        assert store.licences()[limit].max == 10
        with autocommit() as conn:
            started = time.monotonic()
            conn.execute("UPDATE limit_record SET int_max_value = 1 WHERE pk_limit_record = %s", (limit,))
        wait_for(lambda: store.licences()[limit].max == 1, timeout=BOUND, what="the lowered max in the Store")
        took = time.monotonic() - started
        assert took < BOUND
        store.set_caps({("s", "a"): 100}, {"f": (-1, -1)}, {"j": (-1, -1)})
        first = store.book(BookingDelta("s", "a", "f", "j", 1, 0, (limit,)))
        assert isinstance(first, Applied)
        second = store.book(BookingDelta("s", "a", "f", "j", 1, 0, (limit,)))
        assert isinstance(second, LimitExceeded) and second.table == LICENCE and second.key == limit
        assert (second.current, second.limit) == (1, 1)
        store.rollback(first.delta)
