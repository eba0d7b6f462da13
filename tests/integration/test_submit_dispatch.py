"""Submitted jobs on the real runtime: the Store caps a new job at once, dependencies run in order
on the simulated launcher, and a kill releases every proc (the Store and SUM(proc) agree)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from accounting.channels import parse_limit_change
from accounting.notify import LIMIT_CHANNEL
from accounting.service import AccountingService
from dispatch.engine.kills import KillSender
from dispatch.jobs.controls import kill_job, retry_frames
from dispatch.jobs.submit import submit_job
from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from tests.integration.dispatch_support import (
    autocommit,
    drain,
    fast_launcher,
    make_loop,
    scalar,
    violations,
    wait_for,
)
from tests.integration.notify_listener import listening
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def _farm(prefix: str, *, managed: bool = True, hosts: int = 3, cores: int = 8) -> str:
    """Show, one allocation (its tag on every host), root folder; no jobs. Returns the show name."""
    spec = FarmSpec(
        prefix=prefix,
        managed=managed,
        jobs=0,
        hosts=hosts,
        allocs=1,
        manual_tags=0,
        host_cores_choices=(cores,),
        host_mem_gb_choices=(32,),
    )
    seed_farm(spec)
    return show_name(prefix, 0)


def _job(show: str, name: str, frames: int, **overrides: Any) -> dict[str, Any]:
    layer = {"name": "main", "command": "true", "range": f"1-{frames}", "cores": 1, "memory": "1GB"}
    return {"show": show, "name": name, "user": "alice", "layers": [layer], **overrides}


def _store_agrees_with_procs(conn: psycopg.Connection, service: AccountingService, jobs: list[str]) -> bool:
    """The Store's live cores equal SUM(proc) for the subscription, folder and these jobs."""
    snap = service.store.audit_snapshot()
    rows = conn.execute(
        "SELECT j.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.int_cores_reserved FROM proc p"
        " JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job WHERE NOT p.b_local"
    ).fetchall()
    want: dict[tuple[str, Any], int] = {}
    for show, alloc, folder, job, cc in rows:
        for key in (("sub", (show, alloc)), ("folder", folder), ("job", job)):
            want[key] = want.get(key, 0) + cc // 100
    for job in jobs:
        want.setdefault(("job", job), 0)
    for (kind, key), cores in want.items():
        got = getattr(snap, kind).get(key, (0, 0))[0]
        if got != cores:
            return False
    for (show, alloc), (cores, _gpus) in snap.sub.items():
        if want.get(("sub", (show, alloc)), 0) != cores:
            return False
    return True


def test_a_job_with_dependencies_runs_in_dependency_order_and_finishes() -> None:
    show = _farm("sdo")
    spec = {
        "show": show,
        "name": "sdo-shot-v1",
        "user": "alice",
        "max_cores": 6,
        "max_gpus": 2,
        "layers": [
            {"name": "sim", "command": "sim #FRAMESPEC#", "range": "1-6", "chunk_size": 3, "memory": "1GB"},
            {"name": "render", "command": "render #IFRAME#", "range": "1-6", "memory": "1GB",
             "depends": [{"layer": "sim", "type": "frame"}]},
            {"name": "movie", "command": "movie", "range": "1", "memory": "1GB",
             "depends": [{"layer": "render", "type": "layer"}]},
        ],
    }  # fmt: skip
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        result = submit_job(spec, user="alice")
        job = result.job_id
        # The job_resource insert and cap update notifications cap the job in the Store at once.
        wait_for(lambda: service.store.job_cap(job) == (6, 2), what="the job's caps in the Store")

        seen: list[tuple[str, int, bool]] = []

        def launched(booking: Any) -> int:
            """At each launch, are the frames this one depends on done? (read from the database)."""
            layer, number = booking.layer.name, booking.frame.number
            if layer == "sim":
                ready = True
            elif layer == "render":
                sim = "0001-sim" if number <= 3 else "0004-sim"
                ready = scalar(conn, "SELECT str_state FROM frame WHERE pk_job = %s AND str_name = %s", (job, sim)) == (
                    "SUCCEEDED"
                )
            else:
                ready = (
                    scalar(
                        conn,
                        "SELECT count(*) FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer"
                        " WHERE f.pk_job = %s AND l.str_name = 'render' AND f.str_state <> 'SUCCEEDED'",
                        (job,),
                    )
                    == 0
                )
            seen.append((layer, number, ready))
            return 0

        loop = make_loop(service, fast_launcher(exit_status=launched), max_jobs=5, frames_per_layer=4)
        totals = drain(loop)

        assert sorted((layer, n) for layer, n, _ready in seen) == sorted(
            [("sim", 1), ("sim", 4)] + [("render", n) for n in range(1, 7)] + [("movie", 1)]
        )
        assert [s for s in seen if not s[2]] == []  # nothing started before what it waits for
        assert seen[-1][0] == "movie"
        assert totals.booked == totals.completed == 9
        states = dict(conn.execute("SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1", (job,)))
        assert states == {"SUCCEEDED": 9}
        assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (job,)) == "FINISHED"
        assert scalar(conn, "SELECT count(*) FROM depend WHERE b_active OR ts_satisfied IS NULL") == 0
        assert violations(conn) == []
        wait_for(lambda: _store_agrees_with_procs(conn, service, [job]), what="Store = SUM(proc)")


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "database-enforced"])
def test_kill_of_a_running_job_kills_every_run_and_their_ends_release_the_procs(managed: bool) -> None:
    show = _farm("skl" if managed else "sku", managed=managed)
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        victim = submit_job(_job(show, "victim", 6), user="alice").job_id
        other = submit_job(_job(show, "bystander", 3), user="bob").job_id
        launcher = fast_launcher(runtime_min=60.0, runtime_max=60.0)
        with make_loop(service, launcher) as loop:
            assert loop.run_once().booked == 9
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (victim,)) == 6

            result = kill_job(victim)

            assert result.detail["killing"] == 6 and result.detail["finished"]
            # A kill is not a release: the six stay booked until their runs have ended.
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s AND ts_kill IS NOT NULL", (victim,)) == 6
            assert loop.run_once().booked == 0  # nothing of the killed job starts
            assert KillSender([launcher]).send_due(conn) == 6  # the scheduler's sender: the runs end
            loop.run_once()  # their completions, recorded killed
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (victim,)) == 0
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (other,)) == 3  # untouched
            rows = conn.execute("SELECT str_state, int_exit_status FROM frame WHERE pk_job = %s", (victim,)).fetchall()
            assert set(rows) == {("EATEN", 301)}
            assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (victim,)) == "FINISHED"
            assert violations(conn) == []  # host ledger, RUNNING = procs, caps
            if managed:
                wait_for(lambda: _store_agrees_with_procs(conn, service, [victim, other]), what="Store = SUM(proc)")
                assert service.store.audit_snapshot().job[other][0] == 3
            else:
                # The database-enforced totals moved with the proc deletes.
                assert scalar(conn, "SELECT int_cores FROM job_resource WHERE pk_job = %s", (victim,)) == 0
                assert scalar(conn, "SELECT int_cores FROM job_resource WHERE pk_job = %s", (other,)) == 300
                assert scalar(conn, "SELECT SUM(int_cores) FROM subscription") == scalar(
                    conn, "SELECT SUM(int_cores_reserved) FROM proc"
                )
            assert launcher.running() == 3  # the launcher stopped the six
            assert loop.run_once().booked == 0  # nothing of the killed job starts again


def test_a_kill_racing_the_loop_leaves_nothing_of_the_job_running() -> None:
    show = _farm("skr", hosts=4, cores=4)
    with running_scheduler() as proc, autocommit() as conn:
        service = proc.service
        victim = submit_job(_job(show, "victim", 150), user="alice").job_id
        other = submit_job(_job(show, "bystander", 30, priority=0), user="bob").job_id
        # Short frames, small batches: the loop keeps booking the victim while the kill runs.
        launcher = fast_launcher(runtime_min=0.005, runtime_max=0.03)
        loop = make_loop(service, launcher, batch_size=3, frames_per_layer=6)
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.setdefault("totals", drain(loop)), daemon=True)
        thread.start()
        wait_for(
            lambda: (
                scalar(conn, "SELECT count(*) FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'", (victim,))
                >= 10
            ),
            timeout=30,
            what="the victim to be half-way",
        )
        killed = kill_job(victim)  # from this thread and connection, as the API or the admin would
        assert killed.detail["eaten"] > 0  # it was killed half-way (usually with frames running too)
        # A booking either committed before the kill's statements (then its proc was marked for
        # the kill) or failed its WAITING guard after: once the kill returns, nothing of the
        # victim can start, and every run of it still booked is being killed.
        assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s AND ts_kill IS NULL", (victim,)) == 0
        startable = "SELECT count(*) FROM frame WHERE pk_job = %s AND str_state IN ('WAITING', 'DEPEND')"
        assert scalar(conn, startable, (victim,)) == 0
        thread.join(60)
        assert "totals" in out, "the loop did not drain"
        states = dict(conn.execute("SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1", (victim,)))
        assert set(states) == {"SUCCEEDED", "EATEN"} and sum(states.values()) == 150
        assert dict(conn.execute("SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1", (other,))) == {
            "SUCCEEDED": 30
        }
        assert violations(conn) == []
        wait_for(lambda: _store_agrees_with_procs(conn, service, [victim, other]), what="Store = SUM(proc)")


def test_the_last_two_frames_of_a_layer_finishing_at_once_release_the_layer_that_waits() -> None:
    """Two transactions end the last two frames of a layer concurrently: exactly the one that
    commits second sees the layer complete (their layer_stat updates serialise)."""
    show = _farm("slr", hosts=0)
    spec = {
        "show": show,
        "name": "race",
        "user": "alice",
        "layers": [
            {"name": "a", "command": "true", "range": "1-3"},
            {"name": "b", "command": "true", "range": "1", "depends": [{"layer": "a", "type": "layer"}]},
        ],
    }
    job = submit_job(spec, user="alice").job_id
    finish = "UPDATE frame SET str_state = 'SUCCEEDED' WHERE pk_job = %s AND str_name = %s"
    with autocommit() as setup:
        setup.execute(finish, (job, "0001-a"))
    with autocommit() as first, autocommit() as second, autocommit() as watch:
        first.execute("BEGIN")
        first.execute(finish, (job, "0002-a"))
        pid = scalar(second, "SELECT pg_backend_pid()")
        errors: list[BaseException] = []

        def other() -> None:
            try:
                with second.transaction():
                    second.execute(finish, (job, "0003-a"))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        wait_for(
            lambda: scalar(watch, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)) == "Lock",
            what="the second transaction to wait for the first",
        )
        first.execute("COMMIT")
        thread.join(10)
        assert not thread.is_alive() and errors == []
        assert scalar(watch, "SELECT str_state FROM frame WHERE pk_job = %s AND str_name = '0001-b'", (job,)) == (
            "WAITING"
        )
        assert scalar(watch, "SELECT count(*) FROM depend WHERE b_active") == 0


def test_retrying_a_finished_job_announces_its_caps_again() -> None:
    """The Store drops the caps of finished jobs; a reopened job's caps go out on the channel."""
    show = _farm("srt", hosts=0)
    job = submit_job(_job(show, "again", 2, max_cores=3, max_gpus=1), user="alice").job_id
    with autocommit() as conn:
        conn.execute("UPDATE frame SET str_state = 'DEAD' WHERE pk_job = %s", (job,))
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (job,))
    with listening((LIMIT_CHANNEL,)) as listener:
        assert retry_frames(job).detail == {"reopened": True}
        [payload] = listener.sent_before_sentinel(LIMIT_CHANNEL)
    notice = parse_limit_change(payload)
    assert [(c.key, c.value) for c in notice.changes] == [(job, (3, 1))]
    with listening((LIMIT_CHANNEL,)) as listener:
        assert retry_frames(job).changed == 0  # nothing dead, nothing reopened: nothing sent
        assert listener.sent_before_sentinel(LIMIT_CHANNEL) == []
