"""Review 2 of issue 22's upgrade path: holes in re-adoption found by running it, each a strict xfail until its fix.

Why these exist: re-adoption (`adopt_cuebot_db --apply` after a cuesched release) is the only way
a new release reaches an adopted Cuebot database, so whatever it silently misses stays wrong on
the farm for good. Each test reproduces one miss on OpenCue's real schema; each was a strict
xfail until its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.integration import cuebot_support as cb
from tests.integration.cuebot_standin import INSERT_VIRTUAL_PROC, PROC_CREATED, CuebotStandIn
from tests.integration.test_cuebot_mode import ALLOC, ROOT, SHOW, Farm, counters
from tests.integration.test_cuebot_upgrade import catalog, pgtrigger_name


@pytest.fixture
def adopted(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Cuebot database adopted by this cuesched, one per test (each test changes it)."""
    name = cb.cuebot_db_name(f"rev2_{request.node.name[-24:].lower()}")
    url = cb.build_cuebot_db(name)
    try:
        cb.manage(url, "adopt_cuebot_db", "--apply")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC)
            )
        yield url
    finally:
        cb.drop_database(name)


PROC = "00000000-0000-0000-0000-0000000000a1"
PROC_SIZES = (100, 1_048_576, 1_048_576, 0, 0, 0, 0, 0, False)  # INSERT_VIRTUAL_PROC's other values


def _said(out: str) -> str:
    """The report's action lines (its long skip/keep lists left out)."""
    return "\n".join(line for line in out.splitlines() if not line.startswith(("skip ", "keep ", "copied ")))


def _triggers_running(url: str, table: str, function: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT tgname, tgenabled::text FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal"
            " AND tgfoid = %s::regprocedure",
            (table, f"{function}()"),
        ).fetchall()


def test_readoption_rewrites_job_caps_left_at_minus_one_as_0016_does(adopted: str) -> None:
    """An adopted database from before 0016 (no cuebot_job_caps_unlimited trigger, 0016 not
    recorded) with a job cap of -1 written by that cuesched. Cuebot's DispatchQuery reads
    `job_resource.int_cores + layer.int_cores_min <= int_max_cores`, so that job is never
    dispatched by Cuebot again; 0016's RunSQL rewrites it on a migrated database, but adoption
    only records 0016 and says nothing (reproduced with main's adoption, then this release's)."""
    url = adopted
    cat = catalog(url)
    trig = pgtrigger_name(cat, "job_resource", "cuebot_job_caps_unlimited")
    with psycopg.connect(url, autocommit=True) as conn:
        farm = Farm(conn, url=url)
        conn.execute(f"DROP TRIGGER {trig} ON job_resource")
        conn.execute(f"DROP FUNCTION {trig}()")
        conn.execute("DELETE FROM django_migrations WHERE app = 'dispatch' AND name = '0016_cuebot_job_caps'")
        conn.execute("UPDATE job_resource SET int_max_cores = -1 WHERE pk_job = %s", (farm.job,))
    out = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
    assert f"add trigger job_resource.{trig}" in out, out
    with psycopg.connect(url) as conn:
        (cap,) = conn.execute("SELECT int_max_cores FROM job_resource WHERE pk_job = %s", (farm.job,)).fetchone()
        # Cuebot's own dispatch predicate (DispatchQuery.java) for this job's layer.
        (dispatchable,) = conn.execute(
            "SELECT job_resource.int_cores + layer.int_cores_min <= job_resource.int_max_cores"
            " FROM job_resource JOIN layer USING (pk_job) WHERE pk_job = %s",
            (farm.job,),
        ).fetchone()
    assert cap == 2147483647 and dispatchable, f"job cap still {cap}; apply said:\n{_said(out)}"


def test_readoption_notices_a_disabled_cuesched_trigger(adopted: str) -> None:
    """A site ran ALTER TABLE proc DISABLE TRIGGER on cuesched's proc insert trigger: an unmarked
    writer's proc is then counted by nobody (counters LOW, as reproduced), yet `--check` says
    "nothing to add ... current". Re-adoption must re-enable it, or refuse naming it."""
    url = adopted
    trig = pgtrigger_name(catalog(url), "proc", "acct_proc_insert")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE proc DISABLE TRIGGER {trig}")
    done = cb.manage(url, "adopt_cuebot_db", "--apply", check=False)
    out = done.stdout + done.stderr
    enabled = dict(_triggers_running(url, "proc", trig))[trig]
    refused = done.returncode != 0 and trig in out and "disabled" in out
    assert enabled == "O" or refused, f"{trig} left {enabled!r}; adoption said:\n{_said(out)}"


def test_a_renamed_cuesched_trigger_does_not_end_up_counting_twice(adopted: str) -> None:
    """A site renamed cuesched's proc insert trigger. Re-adoption adds pgtrigger's name again
    beside it; both run the same (cuesched's) function and Cuebot's own booking reads 200 for
    a 100-centicore proc in subscription, folder_resource and point (reproduced), high for good
    after the unbook. Re-adoption must treat a trigger running a certainly-cuesched function as
    cuesched's whatever its name (drop it as stale, or refuse naming it)."""
    url = adopted
    trig = pgtrigger_name(catalog(url), "proc", "acct_proc_insert")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TRIGGER {trig} ON proc RENAME TO site_proc_insert")
    done = cb.manage(url, "adopt_cuebot_db", "--apply", check=False)
    out = done.stdout + done.stderr
    running = _triggers_running(url, "proc", trig)
    if done.returncode != 0:
        assert "site_proc_insert" in out, out
        return
    assert len(running) == 1, f"{running} all run {trig}(); adoption said:\n{_said(out)}"
    with psycopg.connect(url, autocommit=True) as conn:
        farm = Farm(conn, url=url)
        standin = CuebotStandIn(url)
        try:
            standin.book(
                host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
            )
        finally:
            standin.close()
        seen = counters(conn, farm)
    assert seen["subscription"] == seen["sum_proc"], seen


def test_apply_does_not_deadlock_with_a_cuebot_booking_in_flight(adopted: str) -> None:
    """Under a stand-in book/unbook loop (3 threads), an upgrading `--apply` failed with a
    deadlock on both tries, with a traceback: it locks folder_resource (name order), then waits
    for host, which Cuebot's procCreated has updated and will next want folder_resource.
    Here deterministically: Cuebot's transaction holds proc and host, adoption starts, and once
    it waits for host Cuebot goes on with procCreated. Locking in Cuebot's own order (proc,
    host, subscription, layer_resource, job_resource, folder_resource, point, then the rest)
    made --apply succeed under the loop, counters exact (tried by hand)."""
    url = adopted
    cat = catalog(url)
    with psycopg.connect(url, autocommit=True) as conn:
        farm = Farm(conn, url=url)
        # What an older release left: two bodies to replace, so re-adoption locks host and folder_resource.
        for table, base in (("host", "acct_host_move"), ("folder_resource", "acct_limit_folder_update")):
            name = pgtrigger_name(cat, table, base)
            body = cat.functions[f"{name}()"]
            conn.execute(body.replace("BEGIN", "BEGIN\n    -- an older release's body", 1))
    standin = CuebotStandIn(url)
    watch = psycopg.connect(url, autocommit=True)
    params = {"c": 100, "m": 1_048_576, "g": 0, "gm": 0, "host": farm.host, "show": SHOW, "alloc": ALLOC}
    params.update(job=farm.job, layer=farm.layer)
    adoption = None
    cuebot_error: Exception | None = None
    try:
        try:
            with standin.conn.transaction():
                standin.conn.execute(
                    INSERT_VIRTUAL_PROC,
                    (PROC, farm.host, SHOW, farm.layer, farm.job, farm.frames[0], *PROC_SIZES),
                )
                standin.conn.execute(PROC_CREATED[0], params)  # host
                adoption = subprocess.Popen(
                    [sys.executable, "manage.py", "adopt_cuebot_db", "--apply"],
                    cwd=ROOT,
                    env={**os.environ, "DATABASE_URL": url},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                deadline = time.monotonic() + 240
                while adoption.poll() is None and time.monotonic() < deadline:
                    waiting = watch.execute(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'host'::regclass"
                    ).fetchone()[0]
                    if waiting:
                        break
                    time.sleep(0.1)  # polling pg_locks: the wait has no notification to await
                for stmt in PROC_CREATED[1:]:
                    standin.conn.execute(stmt, params)
        except psycopg.errors.DeadlockDetected as exc:
            cuebot_error = exc
        out, _ = adoption.communicate(timeout=300)
    finally:
        if adoption is not None and adoption.poll() is None:
            adoption.kill()
        standin.close()
        watch.close()
    assert cuebot_error is None, f"Cuebot's booking was rolled back: {cuebot_error}"
    assert adoption.returncode == 0, out[-1500:]


def test_a_deadlock_with_another_writer_fails_adoption_whole_with_a_retry_message(adopted: str) -> None:
    """A writer taking Cuebot's tables against Cuebot's order (folder_resource, then host: a
    script) can still deadlock with adoption, which locks host first. PostgreSQL rolls back the
    side that waited first, adoption: it must say to retry, without a traceback, and write nothing."""
    url = adopted
    cat = catalog(url)
    with psycopg.connect(url, autocommit=True) as conn:
        farm = Farm(conn, url=url)
        old = {}
        for table, base in (("host", "acct_host_move"), ("folder_resource", "acct_limit_folder_update")):
            name = pgtrigger_name(cat, table, base)
            old[name] = cat.functions[f"{name}()"].replace("BEGIN", "BEGIN\n    -- an older release's body", 1)
            conn.execute(old[name])
    script = psycopg.connect(url)
    watch = psycopg.connect(url, autocommit=True)
    adoption = None
    try:
        script.execute(
            "UPDATE folder_resource SET int_max_cores = int_max_cores"
            " WHERE pk_folder = (SELECT pk_folder FROM folder_resource ORDER BY pk_folder LIMIT 1)"
        )
        adoption = subprocess.Popen(
            [sys.executable, "manage.py", "adopt_cuebot_db", "--apply"],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": url},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 240
        while adoption.poll() is None and time.monotonic() < deadline:
            waiting = watch.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'folder_resource'::regclass"
            ).fetchone()[0]
            if waiting:
                break
            time.sleep(0.1)  # polling pg_locks: the wait has no notification to await
        script.execute("UPDATE host SET int_cores = int_cores WHERE pk_host = %s", (farm.host,))
        script.commit()
        out, _ = adoption.communicate(timeout=300)
    finally:
        if adoption is not None and adoption.poll() is None:
            adoption.kill()
        script.close()
        watch.close()
    assert adoption.returncode != 0, out[-1500:]
    assert "deadlocked with another transaction" in out and "retry at a quieter moment" in out, out[-1500:]
    assert "nothing was written" in out and "Traceback" not in out, out[-1500:]
    after = catalog(url)
    assert all("an older release's body" in after.functions[f"{name}()"] for name in old)
