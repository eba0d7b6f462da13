"""A licence limit's max on an adopted Cuebot database means what Cuebot means by it.

Cuebot starts a frame under a limit only while `sum_running < int_max_value`
(FrameDaoJdbc.UPDATE_FRAME_STARTED): a negative max and a NULL one (Cuebot's column is nullable,
with no default) start nothing. cuesched's own schema reads a negative max as unlimited. On one
shared `limit_record` the two readings would let the scheduler book without bound what Cuebot
never starts, so on a Cuebot database cuesched reads such a max as Cuebot does: nothing runs.
A NULL max, which cuesched's own schema cannot hold, once stopped the Store's licence reseed (and
with it every cap's reseed, which runs after it) at bootstrap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pg_errors

from accounting import channels
from accounting.licences import LIMIT_MAX_CONSTRAINT, limit_max, limit_max_sql
from accounting.notify import LICENCE_CHANNEL
from tests.integration.cuebot_standin import CuebotStandIn
from tests.integration.cuebot_support import build_cuebot_db, cuebot_db_name, drop_database, manage
from tests.integration.test_cuebot_mode import ALLOC, ROOT, SHOW, Farm, _view, _wait
from tests.integration.test_cuebot_mode import conn as conn

NULL_LIMIT = "4c1a0000-0000-4000-8000-00000000000a"  # limit ids are UUIDs (the listener checks)
NEG_LIMIT = "4c1a0000-0000-4000-8000-00000000000b"


@pytest.fixture(scope="module")
def adoption() -> Iterator[tuple[str, str]]:
    """A Cuebot database holding a NULL-max and a -1 limit before adoption: (url, --check output)."""
    name = cuebot_db_name("limitmax")
    url = build_cuebot_db(name)
    try:
        with psycopg.connect(url, autocommit=True) as c:
            # LimitDaoJdbc.createLimit's INSERT; the NULL is what a script (or an old import) leaves.
            c.execute(
                "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, %s), (%s, %s, %s)",
                (NULL_LIMIT, "nullmax", None, NEG_LIMIT, "negmax", -1),
            )
        check = manage(url, "adopt_cuebot_db", "--check", check=False)
        manage(url, "adopt_cuebot_db", "--apply")
        yield url, check.stdout + check.stderr
    finally:
        drop_database(name)


@pytest.fixture(scope="module")
def cuebot_url(adoption: tuple[str, str]) -> str:
    return adoption[0]


def _put_limit(conn: psycopg.Connection, layer: str, limit: str) -> None:
    # LayerDaoJdbc.addLimit
    conn.execute(
        "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
        (str(uuid.uuid4()), layer, limit),
    )


def _procs(conn: psycopg.Connection, job: str) -> int:
    return conn.execute("SELECT count(*) FROM proc WHERE pk_job = %s", (job,)).fetchone()[0]


def test_check_reports_limits_that_run_nothing(adoption: tuple[str, str]) -> None:
    _, out = adoption
    assert "nullmax" in out and "negmax" in out, out
    assert "runs nothing under cuesched as under Cuebot" in out, out


@pytest.mark.parametrize("limit", [NULL_LIMIT, NEG_LIMIT])
def test_a_raw_proc_under_a_null_or_negative_max_is_refused(conn: psycopg.Connection, limit: str) -> None:
    farm = Farm(conn, frames=1)
    _put_limit(conn, farm.layer, limit)
    standin = CuebotStandIn(_url_of(conn))
    try:
        with pytest.raises(pg_errors.CheckViolation) as caught:
            standin.book(
                host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
            )
        assert caught.value.diag.constraint_name == LIMIT_MAX_CONSTRAINT
    finally:
        standin.close()
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.job,))
    assert _procs(conn, farm.job) == 0


def test_a_null_max_is_announced_as_runs_nothing(conn: psycopg.Connection) -> None:
    """Every recount of a limit notifies its row. The message of a NULL-max row was empty (`||`
    with NULL), so the listener dropped it and the Store kept whatever max it held before; it
    now carries the max the Store must enforce: 0. (A new NULL max is refused by the audit
    trail's NOT NULL column, so such rows are the ones already there at adoption.)"""
    farm = Farm(conn, frames=1)
    try:
        with psycopg.connect(_url_of(conn), autocommit=True) as listen:
            listen.execute(f"LISTEN {LICENCE_CHANNEL}")
            _put_limit(conn, farm.layer, NULL_LIMIT)  # recounts the limit: its row is updated
            payloads = [n.payload for n in listen.notifies(timeout=10, stop_after=1)]
    finally:
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.job,))
    assert payloads, "no notification"
    notice = channels.parse_licence(payloads[0])
    assert (notice.limit, notice.max) == (NULL_LIMIT, 0)


def _url_of(conn: psycopg.Connection) -> str:
    from tests.integration.cuebot_support import server_url

    return server_url(conn.info.dbname)


def test_run_scheduler_books_nothing_under_null_or_negative_max_and_keeps_reseeding(
    cuebot_url: str,
    conn: psycopg.Connection,
) -> None:
    """run_scheduler in Cuebot mode on a managed show with three jobs: one under the NULL-max
    limit, one under the -1 limit, one free. The free one books all its frames, the other two
    none, and the caps were reseeded (the Store holds the subscription's burst) although a limit
    row has no max; the log names that row."""
    conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
    conn.execute("DELETE FROM proc")
    conn.execute("UPDATE subscription SET int_cores = 0, int_gpus = 0")
    burst = conn.execute(
        "UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s RETURNING int_burst",
        (SHOW, ALLOC),
    ).fetchone()[0]
    null_farm, neg_farm, free_farm = (Farm(conn, frames=3) for _ in range(3))
    _put_limit(conn, null_farm.layer, NULL_LIMIT)
    _put_limit(conn, neg_farm.layer, NEG_LIMIT)
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    env = {
        **os.environ,
        "DATABASE_URL": cuebot_url,
        "CUESCHED_CUEBOT_MODE": "auto",
        "CUESCHED_SIM_RUNTIME_MIN": "120",
        "CUESCHED_SIM_RUNTIME_MAX": "120",
    }
    sched = subprocess.Popen(
        [sys.executable, "manage.py", "run_scheduler", "--launcher", "simulated", "--metrics-port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = ""
    try:
        _wait("the free job's frames booked", lambda: _procs(conn, free_farm.job) == 3, timeout=90)

        key = f"{SHOW}:{ALLOC}"
        _wait(
            "the caps reseeded into the Store",
            lambda: ((_view(conn) or {}).get("sub") or {}).get(key, {}).get("burst") == burst // 100,
            timeout=30,
        )
        # Both limited jobs were read in the same cycles as the free one: nothing of theirs ran.
        assert _procs(conn, null_farm.job) == 0
        assert _procs(conn, neg_farm.job) == 0
    finally:
        sched.terminate()
        try:
            out = sched.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            sched.kill()
            out = sched.communicate()[0]
        conn.execute("DELETE FROM proc")
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        for farm in (null_farm, neg_farm, free_farm):
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.job,))
    assert "nullmax" in out and NULL_LIMIT in out, out[-4000:]


def test_the_sql_and_python_readings_of_a_max_agree_beside_cuebot(conn: psycopg.Connection) -> None:
    values = [None, -5, -1, 0, 3]
    got = [
        conn.execute(f"SELECT {limit_max_sql('x.v')} FROM (SELECT %s::int AS v) x", (v,)).fetchone()[0] for v in values
    ]
    assert got == [limit_max(v, cuebot=True) for v in values] == [0, 0, 0, 0, 3]
