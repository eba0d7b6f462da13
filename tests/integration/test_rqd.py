"""Real OpenCue RQD daemons as render hosts: the rqd launcher and the gateway, end to end.

Every daemon is a real `python -m rqd` (opencue-rqd 1.37.0) in a subprocess with its own config
file and gRPC port, reporting to the test's gateway (`dispatch.hosts.rqd_gateway`, in this
process, on the test database); the scheduler side is the real dispatch loop with the rqd
launcher and a real scheduler process (Store, listener). Frames are real commands run by RQD.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dispatch.engine.completion import EXIT_STATUS_DOWN_HOST
from dispatch.engine.kills import KillSender
from dispatch.engine.launcher import get_launcher
from dispatch.jobs.controls import kill_job
from dispatch.jobs.submit import submit_job
from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from ops.why import explain_job
from tests.integration.dispatch_support import Sampler, autocommit, drain, make_loop, scalar, violations, wait_for
from tests.integration.rqd_support import Rqd, gateway, pids_of, rqd_daemons, wait_registered
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def _farm(prefix: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """A managed show subscribed to one allocation, no host: the RQDs join it at startup.
    Returns the show name and the tags the RQDs advertise (the allocation's)."""
    seed_farm(FarmSpec(prefix=prefix, managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
    with autocommit() as conn:
        alloc, tag = conn.execute("SELECT str_name, str_tag FROM alloc").fetchone()
    monkeypatch.setenv("CUESCHED_RQD_DEFAULT_ALLOC", alloc)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", "")  # set per test below
    return show_name(prefix, 0), [tag]


def _layer(name: str, command: str, frames: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": command, "range": frames, "cores": 1, "memory": "256MB", **kw}


def _store_matches_procs(conn: psycopg.Connection, service: Any) -> bool:
    snap = service.store.audit_snapshot()
    want: dict[str, int] = {}
    for job, cc in conn.execute("SELECT pk_job, SUM(int_cores_reserved) FROM proc GROUP BY 1").fetchall():
        want[job] = int(cc) // 100
    got = {job: cores for job, (cores, _g) in snap.job.items() if cores}
    return got == want


def _host_ledger_exact(conn: psycopg.Connection) -> bool:
    """Every host's idle is its total minus exactly what its procs reserve."""
    return not conn.execute(
        "SELECT h.str_name FROM host h LEFT JOIN (SELECT pk_host, SUM(int_cores_reserved) c, SUM(int_mem_reserved) m"
        " FROM proc GROUP BY 1) p ON p.pk_host = h.pk_host"
        " WHERE h.int_cores_idle <> h.int_cores - COALESCE(p.c, 0) OR h.int_mem_idle <> h.int_mem - COALESCE(p.m, 0)"
    ).fetchall()


def test_jobs_with_ranges_a_dependency_and_a_failing_frame_run_on_two_rqd_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqe", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs" / "{show}" / "{job}"))
    good = {
        "show": show,
        "name": "rqe-shot-v1",
        "user": "alice",
        "layers": [
            _layer("sim", "echo sim #FRAMESPEC# on $CUE_SHOW; sleep 0.2", "1-4", chunk_size=2),
            _layer("render", "echo render #IFRAME#", "1-4", depends=[{"layer": "sim", "type": "frame"}]),
        ],
    }
    bad = {
        "show": show,
        "name": "rqe-broken-v1",
        "user": "alice",
        "max_retries": 1,
        "layers": [_layer("main", "echo failing; exit 3", "1")],
    }
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqe-a", "rqe-b"], tags=tags, cores=2):
        with running_scheduler() as proc:
            ok = submit_job(good, user="alice").job_id
            broken = submit_job(bad, user="alice").job_id
            launcher = get_launcher("rqd")
            loop = make_loop(proc.service, launcher, host_refresh_interval=0.2, lost_host_sweep_interval=1.0)
            sampler = Sampler().start()
            try:
                totals = drain(loop, 90)
            finally:
                sampler.stop()
                launcher.close()
            assert sampler.samples > 0 and sampler.breaches == []
            states = dict(conn.execute("SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1", (ok,)))
            assert states == {"SUCCEEDED": 6}
            # The failing frame: its try and one retry, then DEAD with RQD's exit status.
            assert conn.execute(
                "SELECT str_state, int_exit_status, int_retries FROM frame WHERE pk_job = %s", (broken,)
            ).fetchone() == (
                "DEAD",
                3,
                1,
            )
            assert dict(conn.execute("SELECT pk_job, str_state FROM job").fetchall()) == {
                ok: "FINISHED",
                broken: "FINISHED",
            }
            assert totals.booked == 8 and totals.launch_failures == 0
            # Both hosts ran frames (2 cores each: the first cycle's 3 frames need both).
            ran_on = {r[0] for r in conn.execute("SELECT DISTINCT str_host FROM frame WHERE str_host IS NOT NULL")}
            assert ran_on == {"rqe-a", "rqe-b"}
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert _host_ledger_exact(conn)
            assert violations(conn) == []
            wait_for(lambda: _store_matches_procs(conn, proc.service), 10, "Store = SUM(proc)")
            # RQD wrote its own logs where the RunFrame said; the sim chunk got its #FRAMESPEC#.
            logs = sorted(p.name for p in (tmp_path / "logs").rglob("*.rqlog"))
            assert "rqe-shot-v1.0001-sim.rqlog" in logs and len(logs) == 7
            sim = next((tmp_path / "logs").rglob("rqe-shot-v1.0001-sim.rqlog")).read_text()
            assert f"sim 1-2 on {show}" in sim
            assert gw.servicer.counts["completion"] >= 8 and gw.servicer.counts["errors"] == 0


def test_a_killed_job_stops_its_frames_on_rqd_and_its_memory_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqk", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    marker = f"rqk-{os.getpid()}"
    # Frames that hold ~40 MB resident (python, so RQD's RSS sampling, every 10 s, sees it):
    # frame 1 ends by itself after 13 s, frame 2 runs until it is killed.
    script = "import sys, time; b = bytearray(40 << 20); time.sleep(13 if sys.argv[1] == '1' else 120)"
    command = f'python3 -c "{script}" #IFRAME# {marker}'
    spec = {"show": show, "name": "rqk-v1", "user": "alice", "layers": [_layer("main", command, "1-2")]}
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqk-a"], tags=tags):
        with running_scheduler() as proc:
            job = submit_job(spec, user="alice").job_id
            launcher = get_launcher("rqd")
            try:
                with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                    assert loop.run_once().booked == 2
                wait_for(lambda: len(pids_of(marker)) == 2, 20, "RQD to start both frames")
                # RQD samples RSS every 10 s; the launcher's status poll brings it to the procs.
                wait_for(
                    lambda: (
                        (launcher.heartbeat(conn), scalar(conn, "SELECT min(int_mem_max_used) FROM proc"))[1] > 30_000
                    ),
                    30,
                    "RQD's RSS of both frames on their procs",
                )
                # The "why not booking" page and the job page show it per layer.
                (memory,) = explain_job(job, None).memory
                assert memory.layer == "main" and memory.running_max_rss > 30_000
                assert "max RSS" in memory.text and "running now" in memory.text
                # Frame 1's completion report brings its max RSS to the frame, in the release's transaction.
                wait_for(
                    lambda: (
                        scalar(conn, "SELECT str_state FROM frame WHERE pk_job = %s AND int_number = 1", (job,))
                        == "SUCCEEDED"
                    ),
                    30,
                    "frame 1 to end by itself",
                )
                assert (
                    scalar(conn, "SELECT int_mem_max_used FROM frame WHERE pk_job = %s AND int_number = 1", (job,))
                    > 30_000
                )
                wait_for(lambda: len(pids_of(marker)) == 1, 10, "frame 1's process to be gone")
                result = kill_job(job)
                assert result.detail["killing"] == 1
                assert KillSender([launcher]).send_due(conn) == 1  # the scheduler's sender, once
                wait_for(lambda: pids_of(marker) == [], 15, "the frames' processes to be gone")
                # RQD's completion report of the killed run releases its proc.
                wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 15, "the killed run's report")
            finally:
                launcher.close()
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert scalar(conn, "SELECT str_state FROM job") == "FINISHED"
            assert _host_ledger_exact(conn)
            assert violations(conn) == []
            wait_for(lambda: _store_matches_procs(conn, proc.service), 10, "Store = SUM(proc)")
            # Frame 2 was recorded killed by RQD's own completion report (its proc stayed booked until then).
            assert scalar(conn, "SELECT int_exit_status FROM frame WHERE pk_job = %s AND int_number = 2", (job,)) == 301
            wait_for(lambda: gw.servicer.counts["completion"] >= 2, 15, "RQD's completion reports (frame 1, the kill)")
            assert gw.servicer.counts["errors"] == 0


def test_an_rqd_killed_under_load_has_its_frames_requeued_by_the_lost_host_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rql", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    spec = {
        "show": show,
        "name": "rql-v1",
        "user": "alice",
        "layers": [_layer("main", "sleep 2", "1-6")],
    }
    with (
        autocommit() as conn,
        gateway() as gw,
        rqd_daemons(conn, gw, tmp_path, ["rql-a", "rql-b"], tags=tags, cores=2) as d,
    ):
        with running_scheduler() as proc:
            job = submit_job(spec, user="alice").job_id
            launcher = get_launcher("rqd")
            loop = make_loop(
                proc.service, launcher, host_refresh_interval=0.2, lost_host_timeout=3.0, lost_host_sweep_interval=0.5
            )
            with loop:
                assert loop.run_once().booked == 4  # 2 cores on each host
            victim = d["rql-a"]
            on_victim = scalar(
                conn, "SELECT count(*) FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE h.str_name = 'rql-a'"
            )
            assert on_victim == 2
            victim.kill(signal.SIGKILL)
            try:
                totals = drain(loop, 60)
            finally:
                launcher.close()  # the dead daemon's two frames end by themselves (sleep 2)
            assert totals.lost_released == 2
            assert dict(conn.execute("SELECT str_state, count(*) FROM frame GROUP BY 1")) == {"SUCCEEDED": 6}
            assert scalar(conn, "SELECT count(*) FROM frame WHERE int_retries > 0") == 0  # a lost host counts no retry
            assert (
                scalar(
                    conn, "SELECT str_state FROM host_stat hs JOIN host h USING (pk_host) WHERE h.str_name = 'rql-a'"
                )
                == "DOWN"
            )
            assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (job,)) == "FINISHED"
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert _host_ledger_exact(conn)
            assert violations(conn) == []
            wait_for(lambda: _store_matches_procs(conn, proc.service), 10, "Store = SUM(proc)")
            assert gw.servicer.counts["errors"] == 0


def test_a_restarted_rqd_has_its_stale_procs_released_at_its_startup_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqr", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    # A startup releases the procs booked more than the grace ago (a younger one may be a launch
    # that landed on the new daemon): the test's proc is made older than a 1 s grace below.
    monkeypatch.setenv("CUESCHED_RQD_ORPHAN_GRACE", "1")
    marker = f"rqr-{os.getpid()}"
    spec = {
        "show": show,
        "name": "rqr-v1",
        "user": "alice",
        "layers": [_layer("main", f'python3 -c "import time; time.sleep(60)" {marker}', "1")],
    }
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqr-a"], tags=tags) as d:
        with running_scheduler() as proc:
            submit_job(spec, user="alice")
            launcher = get_launcher("rqd")
            try:
                with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                    assert loop.run_once().booked == 1
                wait_for(lambda: len(pids_of(marker)) >= 1, 20, "RQD to start the frame")
                rqd: Rqd = d["rqr-a"]
                rqd.kill(signal.SIGKILL)
                for pid in pids_of(marker):
                    # The frame may go with its daemon between the listing and the kill: gone is
                    # what this wants.
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                assert scalar(conn, "SELECT count(*) FROM proc") == 1  # nothing noticed yet (timeout 300 s)
                wait_for(
                    lambda: scalar(conn, "SELECT bool_and(ts_dispatched < now() - interval '1 second') FROM proc"),
                    10,
                    "the proc to be older than the grace",
                )
                rqd.start()
                wait_registered(conn, rqd, 30)
                wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 10, "the startup report's release")
            finally:
                launcher.close()
            assert conn.execute("SELECT str_state, int_exit_status, int_retries FROM frame").fetchone() == (
                "WAITING",
                EXIT_STATUS_DOWN_HOST,
                0,
            )
            assert _host_ledger_exact(conn)
            assert violations(conn) == []
            wait_for(lambda: _store_matches_procs(conn, proc.service), 10, "Store = SUM(proc)")
            assert gw.servicer.counts["startup"] == 2


def test_a_launch_to_an_rqd_that_does_not_answer_fails_is_compensated_and_marks_the_host_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqu", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    spec = {"show": show, "name": "rqu-v1", "user": "alice", "layers": [_layer("main", "true", "1")]}
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqu-a"], tags=tags) as d:
        d["rqu-a"].stop()  # registered and freshly pinged, but nothing answers at its address now
        with running_scheduler() as proc:
            submit_job(spec, user="alice")
            # No status poll: it would find the daemon gone and mark the host DOWN before the launch.
            launcher = get_launcher("rqd", timeout=2.0, poll_hosts=False)
            try:
                with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                    first = loop.run_once()
                    assert (first.booked, first.launch_failures, first.compensated) == (0, 1, 1)
                    assert scalar(conn, "SELECT str_state FROM host_stat") == "DOWN"
                    assert loop.run_once().launch_failures == 0  # the DOWN host is not booked again
            finally:
                launcher.close()
            assert conn.execute("SELECT str_state, int_retries FROM frame").fetchone() == ("WAITING", 0)
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert _host_ledger_exact(conn)
            assert violations(conn) == []
            wait_for(lambda: _store_matches_procs(conn, proc.service), 10, "Store = SUM(proc)")


def test_a_status_report_racing_a_completion_never_leaves_a_running_frame_without_its_proc() -> None:
    """The completion path updates the frame row by the version it read (ctid): a status report
    that wrote the RUNNING frame row between that read and the update made the completion delete
    the proc and skip the frame, RUNNING with no proc (seen once in the stress drain on RQD). The
    interleaving is forced with a lock on the frame row: the report writes procs only now, so it
    does not wait on it, and the completion ends the frame."""
    import threading

    from opencue_proto import report_pb2

    from dispatch.engine.completion import Completion, complete
    from dispatch.hosts.rqd_gateway import report_status
    from tests.integration.dispatch_support import fast_launcher, seed

    seed("rqrace", hosts=1, jobs=1, layers=1, frames_per_layer=1)
    with running_scheduler() as proc, autocommit() as conn, autocommit() as holder:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        pk_proc, pk_frame, host = conn.execute(
            "SELECT p.pk_proc, p.pk_frame, h.str_name FROM proc p JOIN host h ON h.pk_host = p.pk_host"
        ).fetchone()
        report = report_pb2.HostReport(
            host=report_pb2.RenderHost(name=host, total_mem=1 << 24, free_mem=1 << 23),
            frames=[report_pb2.RunningFrameInfo(resource_id=pk_proc, frame_id=pk_frame, rss=50_000, max_rss=60_000)],
        )

        def blocked_or_done(thread: threading.Thread, app: str) -> bool:
            waiting = scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                (app,),
            )
            return not thread.is_alive() or waiting > 0

        errors: list[BaseException] = []

        def run(app: str, fn: Any) -> threading.Thread:
            def target() -> None:
                try:
                    with psycopg.connect(_conninfo(), autocommit=True, application_name=app) as c:
                        fn(c)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            wait_for(lambda: blocked_or_done(thread, app), 10, f"{app} to block or finish")
            return thread

        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM frame WHERE pk_frame = %s FOR NO KEY UPDATE", (pk_frame,))
        status = run("rqrace-status", lambda c: report_status(c, report, None, grace=3600))
        completion = run("rqrace-complete", lambda c: complete(c, [Completion(pk_proc, 0)]))
        holder.execute("ROLLBACK")
        status.join(10)
        completion.join(10)
        launcher.close()
        assert errors == []
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert conn.execute("SELECT str_state, int_exit_status FROM frame").fetchone() == ("SUCCEEDED", 0)
        assert violations(conn) == []


def _conninfo() -> str:
    from accounting import db

    return db.conninfo()
