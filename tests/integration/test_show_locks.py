"""A stuck proc writer holds off the moves of its own keys only, never another show's (issue 27, row 7).

A flip, a host's allocation move and a job's folder move must wait for every proc writer whose
accounting they change, and only for those: an idle psql transaction that wrote a proc of show B
keeps B's flip, and the moves of B's host and job, waiting (bounded, named), while show A flips
and A's host and job move at once. The waits are on rows of the keys moved (the show, host or
job row), so a host move also waits for an in-flight insert onto that host of a show that had
no proc there yet, and counts it. And a flip and a move of its show's running procs wait for
each other: the show's flag decides which side books the move, so it cannot change between the
move's read of it and the move's commit.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from accounting import db
from tests.integration.dispatch_support import autocommit, scalar, seed

pytestmark = pytest.mark.django_db(transaction=True)

# Far below the 10 s the old accounting-keys lock made every flip and move wait behind any
# proc writer of the farm, far above what an uncontended flip or move takes.
PROMPT = 3.0
TWO_SHOWS = {
    "shows": 2,
    "allocs": 2,
    "hosts": 4,
    "jobs": 2,
    "folders_per_show": 2,
    "layers": 1,
    "frames_per_layer": 4,
    "manual_tags": 0,
    "host_cores_choices": (16,),
    "host_mem_gb_choices": (64,),
    "layer_cores_choices": (1,),
    "layer_mem_gb_choices": (1,),
}


@contextmanager
def outside_session(application_name: str = "psql-stuck") -> Iterator[psycopg.Connection]:
    """A plain session, as psql opens it: no cuesched writer mark, no timeouts of ours."""
    conn = psycopg.connect(db.conninfo(), autocommit=True, application_name=application_name)
    try:
        yield conn
    finally:
        if not conn.closed:
            conn.execute("ROLLBACK")
            conn.close()


def job_of(conn: psycopg.Connection, show: str) -> tuple[str, str, str]:
    """(job, layer, a waiting frame) of `show`."""
    return conn.execute(
        "SELECT j.pk_job, l.pk_layer, f.pk_frame FROM job j JOIN layer l ON l.pk_job = j.pk_job "
        "JOIN frame f ON f.pk_layer = l.pk_layer WHERE j.pk_show = %s AND f.str_state = 'WAITING' "
        "AND NOT EXISTS (SELECT 1 FROM proc p WHERE p.pk_frame = f.pk_frame) ORDER BY f.pk_frame LIMIT 1",
        (show,),
    ).fetchone()


def insert_proc(conn: psycopg.Connection, show: str, host: str) -> str:
    """INSERT INTO proc ... of one frame of `show` on `host`, in the caller's transaction."""
    job, layer, frame = job_of(conn, show)
    pk = str(uuid.uuid4())
    conn.execute(
        "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
        " int_mem_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1)",
        (pk, host, show, job, layer, frame),
    )
    return pk


def other_alloc(conn: psycopg.Connection, host: str) -> str:
    return scalar(
        conn,
        "SELECT pk_alloc FROM alloc WHERE pk_alloc <> (SELECT pk_alloc FROM host WHERE pk_host = %s) "
        "ORDER BY pk_alloc LIMIT 1",
        (host,),
    )


def other_folder(conn: psycopg.Connection, job: str) -> str:
    """Another folder of `job`'s show."""
    return scalar(
        conn,
        "SELECT f.pk_folder FROM folder f JOIN job j ON j.pk_show = f.pk_show AND j.pk_folder <> f.pk_folder "
        "WHERE j.pk_job = %s ORDER BY f.pk_folder LIMIT 1",
        (job,),
    )


# Every subscription and folder counter of an unmanaged show against SUM(proc) by its keys now.
DRIFT_SQL = """
SELECT 'subscription', s.pk_show || '/' || s.pk_alloc, s.int_cores,
       (SELECT COALESCE(SUM(p.int_cores_reserved), 0) FROM proc p JOIN host h ON h.pk_host = p.pk_host
        WHERE p.pk_show = s.pk_show AND h.pk_alloc = s.pk_alloc AND NOT p.b_local)
FROM subscription s JOIN show sh ON sh.pk_show = s.pk_show AND NOT sh.b_scheduler_managed
UNION ALL
SELECT 'folder', f.pk_folder, f.int_cores,
       (SELECT COALESCE(SUM(p.int_cores_reserved), 0) FROM proc p JOIN job j ON j.pk_job = p.pk_job
        WHERE j.pk_folder = f.pk_folder AND NOT p.b_local)
FROM folder_resource f JOIN folder fo ON fo.pk_folder = f.pk_folder
JOIN show sh ON sh.pk_show = fo.pk_show AND NOT sh.b_scheduler_managed
"""


def drift(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """The unmanaged counters that differ from SUM(proc)."""
    return [tuple(r) for r in conn.execute(DRIFT_SQL).fetchall() if r[2] != r[3]]


def timed(fn: Any) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def test_a_flip_of_one_show_goes_through_while_a_proc_write_of_another_is_left_open(monkeypatch) -> None:
    """Old code: the flip of show A failed after CUESCHED_FLIP_LOCK_WAIT behind show B's writer."""
    from django.db import connection

    from accounting.actions import flip_show

    monkeypatch.setenv("CUESCHED_FLIP_LOCK_WAIT", "5")
    farm = seed("slkf", managed=False, **TWO_SHOWS)
    show_a, show_b = farm.show_ids
    with autocommit() as conn, outside_session() as psql:
        psql.execute("BEGIN")
        insert_proc(psql, show_b, farm.host_ids[0])
        try:
            took = timed(lambda: flip_show(show_a, True, actor="ops"))
            assert took < PROMPT, f"the console flip of {show_a} waited {took:.1f}s behind show {show_b}'s writer"
            # And as psql writes it: the trigger's own wait.
            conn.execute("SET lock_timeout = '5s'")
            took = timed(
                lambda: conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (show_a,))
            )
            assert took < PROMPT, f"a psql flip of {show_a} waited {took:.1f}s behind show {show_b}'s writer"
        finally:
            connection.close()
        psql.execute("COMMIT")
        assert drift(conn) == []


def test_a_flip_of_the_stuck_show_gives_up_bounded_and_names_the_session(monkeypatch) -> None:
    from django.db import connection

    from accounting.actions import flip_show
    from accounting.db import KeysLockTimeout

    monkeypatch.setenv("CUESCHED_FLIP_LOCK_WAIT", "1")
    farm = seed("slks", managed=False, **TWO_SHOWS)
    show_b = farm.show_ids[1]
    with outside_session() as psql:
        psql.execute("BEGIN")
        insert_proc(psql, show_b, farm.host_ids[0])
        try:
            with pytest.raises(KeysLockTimeout) as failed:
                flip_show(show_b, True, actor="ops")
        finally:
            connection.close()
        assert "psql-stuck" in str(failed.value) and "idle in transaction" in str(failed.value), failed.value
        with autocommit() as conn:
            conn.execute("SET lock_timeout = '1s'")
            with pytest.raises(psycopg.errors.LockNotAvailable) as raw:
                conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (show_b,))
            assert raw.value.diag.message_hint and "proc" in raw.value.diag.message_hint
        psql.execute("ROLLBACK")
    assert flip_show(show_b, True, actor="ops").changed


def test_moves_of_another_shows_host_and_job_go_through_while_a_proc_write_is_left_open() -> None:
    farm = seed("slkm", managed=False, **TWO_SHOWS)
    show_a, show_b = farm.show_ids
    stuck_host, free_host = farm.host_ids[0], farm.host_ids[1]
    with autocommit() as conn, outside_session() as psql:
        # A running proc of show A on the host that moves: the move has accounting to do.
        insert_proc(conn, show_a, free_host)
        psql.execute("BEGIN")
        insert_proc(psql, show_b, stuck_host)
        conn.execute("SET lock_timeout = '5s'")
        alloc = other_alloc(conn, free_host)
        took = timed(lambda: conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, free_host)))
        assert took < PROMPT, f"a host move waited {took:.1f}s behind a proc writer on another host"
        job_a = job_of(conn, show_a)[0]
        folder = other_folder(conn, job_a)
        took = timed(lambda: conn.execute("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder, job_a)))
        assert took < PROMPT, f"a job move waited {took:.1f}s behind a proc writer of another show"
        psql.execute("COMMIT")
        assert drift(conn) == []


class _Racer:
    """One statement on a connection of its own, in a thread; tells whether it waits on a lock."""

    def __init__(self, sql: str, params: tuple[Any, ...], *, claim_writer: bool) -> None:
        self.conn = db.connect(autocommit=True, application_name="cuesched-test-racer", claim_writer=claim_writer)
        self.conn.execute("SET lock_timeout = '20s'")
        self.pid = self.conn.info.backend_pid
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sql, params), daemon=True)
        self.thread.start()

    def _run(self, sql: str, params: tuple[Any, ...]) -> None:
        try:
            self.conn.execute(sql, params)
        except BaseException as exc:  # reported by finish()
            self.error = exc
        finally:
            self.done.set()

    def waits_on_lock(self, watcher: psycopg.Connection) -> bool:
        """True once its backend waits on a lock; False if the statement ended without one."""
        deadline = time.monotonic() + 10
        while not self.done.is_set() and time.monotonic() < deadline:
            if scalar(watcher, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (self.pid,)) == "Lock":
                return True
            self.done.wait(0.02)
        return False

    def finish(self) -> BaseException | None:
        assert self.done.wait(20), "the statement never ended"
        self.thread.join()
        self.conn.close()
        return self.error


def _move_of(conn: psycopg.Connection, kind: str, proc: str) -> tuple[str, tuple[str, str]]:
    """The statement that moves `proc`'s host to another allocation, or its job to another folder."""
    host, job = conn.execute("SELECT pk_host, pk_job FROM proc WHERE pk_proc = %s", (proc,)).fetchone()
    if kind == "host":
        return "UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (other_alloc(conn, host), host)
    folder = other_folder(conn, job)
    return "UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder, job)


def _move_behind(conn: psycopg.Connection, sql: str, params: tuple[Any, ...]) -> _Racer:
    """An outside session's move, started behind the caller's writer: it must wait on a lock."""
    move = _Racer(sql, params, claim_writer=False)
    assert move.waits_on_lock(conn), f"the move did not wait for the writer: {move.finish()}"
    return move


def test_a_host_move_waits_for_an_in_flight_insert_onto_that_host_and_counts_it() -> None:
    """The host has no proc of the writer's show yet: only the host's own row can order the two.

    The insert reserves memory, so at COMMIT the host memory ledger writes the host's idle
    memory: a mover that held the host row (NO KEY UPDATE) while it waited for the writer's
    KEY SHARE deadlocked with that write (CI, on the merged main).
    """
    farm = seed("slkh", managed=False, **TWO_SHOWS)
    show_b = farm.show_ids[1]
    host = farm.host_ids[0]
    with autocommit() as conn, outside_session() as psql:
        alloc = other_alloc(conn, host)
        psql.execute("BEGIN")
        insert_proc(psql, show_b, host)
        conn.execute("SET lock_timeout = '1s'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, host))
        # Started behind the writer, it goes on once the writer commits, and moves its proc too.
        move = _move_behind(conn, "UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, host))
        psql.execute("COMMIT")
        assert move.finish() is None
        assert scalar(conn, "SELECT pk_alloc FROM host WHERE pk_host = %s", (host,)) == alloc
        assert drift(conn) == [], "the insert committed behind the move was counted on the old allocation"


def test_a_host_move_behind_a_writer_that_then_updates_the_host_row_is_no_deadlock() -> None:
    """Cuebot's own booking: INSERT INTO proc, then UPDATE host SET int_cores_idle, one transaction.

    Old code: the mover took the host row NO KEY UPDATE, then waited (its BEFORE ROW trigger's FOR
    UPDATE) for the writer's KEY SHARE; the writer's UPDATE host then waited for the mover.
    """
    farm = seed("slkc", managed=False, **TWO_SHOWS)
    show_b = farm.show_ids[1]
    host = farm.host_ids[0]
    with autocommit() as conn, outside_session() as psql:
        alloc = other_alloc(conn, host)
        psql.execute("BEGIN")
        pk = insert_proc(psql, show_b, host)
        psql.execute("UPDATE proc SET int_mem_reserved = 0 WHERE pk_proc = %s", (pk,))  # cores only
        move = _move_behind(conn, "UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, host))
        psql.execute("UPDATE host SET int_cores_idle = int_cores_idle - 100 WHERE pk_host = %s", (host,))
        psql.execute("COMMIT")
        assert move.finish() is None
        assert scalar(conn, "SELECT pk_alloc FROM host WHERE pk_host = %s", (host,)) == alloc
        assert drift(conn) == []


def test_a_job_move_behind_a_writer_that_then_updates_the_job_row_is_no_deadlock() -> None:
    """The scheduler's completion finishes a job (UPDATE job) in the transaction that releases its
    procs, and Cuebot's does the same: the sibling of the host case on the job row."""
    farm = seed("slkj", managed=False, **TWO_SHOWS)
    show_b = farm.show_ids[1]
    with autocommit() as conn, outside_session() as psql:
        job = job_of(conn, show_b)[0]
        folder = other_folder(conn, job)
        psql.execute("BEGIN")
        insert_proc(psql, show_b, farm.host_ids[0])
        move = _move_behind(conn, "UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder, job))
        psql.execute("UPDATE job SET ts_updated = now() WHERE pk_job = %s", (job,))
        psql.execute("COMMIT")
        assert move.finish() is None
        assert scalar(conn, "SELECT pk_folder FROM job WHERE pk_job = %s", (job,)) == folder
        assert drift(conn) == [], "the proc committed behind the move was counted in the old folder"


def test_a_psql_host_or_job_move_behind_a_stuck_writer_gives_up_bounded() -> None:
    """The moves wait in their own row lock (accounting.move_locks): bounded there as well.

    Without the statement triggers' bound a psql move with no lock_timeout waited as long as the
    stuck writer stayed open (here: until the statement_timeout that keeps the test finite).
    """
    from accounting.keylocks import MOVE_LOCK_SECONDS

    farm = seed("slkb", managed=False, **TWO_SHOWS)
    show_b = farm.show_ids[1]
    host = farm.host_ids[0]
    with autocommit() as conn, outside_session() as psql:
        alloc = other_alloc(conn, host)
        job = job_of(conn, show_b)[0]
        folder = other_folder(conn, job)
        psql.execute("BEGIN")
        insert_proc(psql, show_b, host)
        conn.execute("SET lock_timeout = 0")
        conn.execute(f"SET statement_timeout = '{MOVE_LOCK_SECONDS * 3}s'")
        for sql, params in (
            ("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, host)),
            ("UPDATE job SET pk_folder = %s WHERE pk_job = %s", (folder, job)),
        ):
            with pytest.raises(psycopg.errors.LockNotAvailable):
                conn.execute(sql, params)
        assert scalar(conn, "SHOW lock_timeout") == "0"
        psql.execute("ROLLBACK")
        # A move that goes through puts the session's own lock_timeout back for the rest of it.
        with conn.transaction():
            conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (alloc, host))
            assert scalar(conn, "SHOW lock_timeout") == "0"
        conn.execute("SET statement_timeout = 0")


# --- a flip and a move of its show's running procs wait for each other -----------------------

FLIP_SQL = "UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s"


@pytest.mark.parametrize("kind", ["host", "job"])
def test_a_flip_to_unmanaged_waits_for_a_move_of_the_shows_running_procs(kind: str) -> None:
    """The move (the console's, with the writer mark) books a managed show's procs on their new
    key in the Store; a flip to unmanaged committed before the move's commit rebuilt the counters
    from SUM(proc) with the procs still on their old key: the new key read LOW once the move
    committed. The old code held this order already, by another row: the move's Store booking (a
    positive outside delta) bumps the show's generation row, which the flip bumps too. Pinned
    beside the two orders it did not hold."""
    farm = seed(f"slm{kind[0]}", managed=True, **TWO_SHOWS)
    show = farm.show_ids[0]
    with autocommit() as conn, autocommit() as mover:
        sql, params = _move_of(conn, kind, insert_proc(conn, show, farm.host_ids[0]))
        mover.execute("BEGIN")
        mover.execute(sql, params)
        flip = _Racer(FLIP_SQL, (False, show), claim_writer=True)
        waited = flip.waits_on_lock(conn)
        mover.execute("COMMIT")
        assert flip.finish() is None
        assert drift(conn) == [], "the flip rebuilt the counters with the moved procs on their old key"
        assert waited, "the flip did not wait for the move of its show's procs"


@pytest.mark.parametrize("kind", ["host", "job"])
def test_a_move_of_a_shows_running_procs_waits_for_its_flip_to_unmanaged_and_books_after_it(kind: str) -> None:
    """The other order: the flip's rebuild is written (procs on the old key), not committed. A
    move that read the show as still managed booked it in the Store only, and the counters the
    flip handed to the database missed it. Old code: the move went through at once."""
    farm = seed(f"sln{kind[0]}", managed=True, **TWO_SHOWS)
    show = farm.show_ids[0]
    with autocommit() as conn, autocommit() as flipper:
        sql, params = _move_of(conn, kind, insert_proc(conn, show, farm.host_ids[0]))
        flipper.execute("BEGIN")
        flipper.execute(FLIP_SQL, (False, show))
        move = _Racer(sql, params, claim_writer=True)
        waited = move.waits_on_lock(conn)
        flipper.execute("COMMIT")
        assert move.finish() is None
        assert drift(conn) == [], "the move was booked by the Store's side of a show the flip gave the database"
        assert waited, "the move did not wait for the flip of its procs' show"


@pytest.mark.parametrize("kind", ["host", "job"])
def test_a_flip_to_managed_waits_for_an_outside_move_of_the_shows_running_procs(kind: str) -> None:
    """The stress phase outside_writers' case: a psql move of an unmanaged show's procs, booked on
    the database side, and a flip to managed that committed before the move did. The Store
    seeds the show from SUM(proc) once the flip commits, without the uncommitted move, and the
    move sends it nothing (it was the database's to book): the new key reads LOW in the Store,
    and the committed move booked a show that was managed at its commit. Old code: the flip went
    through at once."""
    farm = seed(f"slo{kind[0]}", managed=False, **TWO_SHOWS)
    show = farm.show_ids[0]
    with autocommit() as conn, outside_session() as psql:
        sql, params = _move_of(conn, kind, insert_proc(conn, show, farm.host_ids[0]))
        psql.execute("BEGIN")
        psql.execute(sql, params)
        flip = _Racer(FLIP_SQL, (True, show), claim_writer=True)
        waited = flip.waits_on_lock(conn)
        psql.execute("COMMIT")
        assert flip.finish() is None
        assert waited, "the flip to managed committed inside an outside move of its show's procs"
