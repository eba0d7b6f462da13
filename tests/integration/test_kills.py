"""A kill is not a release (issue 27, row 10): the proc stays booked until the run has ended.

The scheduler here is the real one with its dispatch (`SchedulerProcess` running
`dispatch_main`: the loops, and the kill sender beside them), on a real RQD or a real q2 agent;
the kill comes from the test's own thread and connection, as the API, the console or `manage.py
job kill` send it: a process without a launcher. A watcher samples, every few milliseconds, the
frame processes really alive on the host (from /proc) between two reads of the host's procs:
every live process must be booked in one of the two reads (its proc is inserted before its launch
and deleted after its end), and never more run than the host has cores.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import call_command

from accounting.scheduler import SchedulerOptions, SchedulerProcess
from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, complete
from dispatch.engine.loop import dispatch_main
from dispatch.engine.placement import parse_tags
from dispatch.jobs.controls import kill_frames, kill_job
from dispatch.jobs.submit import submit_job
from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from tests.integration.agent_support import agent_process
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, scalar, violations, wait_for
from tests.integration.rqd_support import gateway, pids_of, rqd_daemons
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

KILL_BOUND = 3.0  # seconds from the kill's commit to the host having it ("within a second or two", with slack)


@contextmanager
def scheduler_dispatching(launcher: str, **loop_options: Any) -> Iterator[SchedulerProcess]:
    """The whole scheduler (Store, listener, lease, dispatch loop and kill sender) in a thread."""
    process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=30))
    main = dispatch_main(launcher, loop_options={"host_refresh_interval": 0.2, **loop_options})
    thread = threading.Thread(target=process.run, args=(main,), name="test-scheduler", daemon=True)
    thread.start()
    try:
        if not process.ready.wait(30):
            raise AssertionError("scheduler did not become ready")
        yield process
    finally:
        process.stop.set()
        thread.join(30)


class HostWatcher:
    """Samples (procs booked on the host, frame processes alive, procs booked again) in a loop.

    A process is named by the `<marker> <job> <frame number>` its command line ends with."""

    def __init__(self, host: str, marker: str, cores: int) -> None:
        self.host, self.marker, self.cores = host, marker, cores
        self.pattern = re.compile(rf"{re.escape(marker)} (\S+) (\d+)")
        self.samples = 0
        self.unbooked: list[tuple[str, int]] = []  # a live process booked in neither read
        self.max_running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-watcher", daemon=True)

    def start(self) -> HostWatcher:
        self._thread.start()
        return self

    def _booked(self, conn: psycopg.Connection) -> set[tuple[str, int]]:
        rows = conn.execute(
            "SELECT j.str_name, f.int_number FROM proc p JOIN frame f ON f.pk_frame = p.pk_frame"
            " JOIN job j ON j.pk_job = p.pk_job JOIN host h ON h.pk_host = p.pk_host WHERE h.str_name = %s",
            (self.host,),
        ).fetchall()
        return {(r[0], int(r[1])) for r in rows}

    def _alive(self) -> set[tuple[str, int]]:
        alive = set()
        for pid in pids_of(self.marker):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            m = self.pattern.search(cmdline)
            if m:
                alive.add((m.group(1), int(m.group(2))))
        return alive

    def _run(self) -> None:
        with autocommit() as conn:
            while not self._stop.is_set():
                before = self._booked(conn)
                alive = self._alive()
                after = self._booked(conn)
                self.unbooked += sorted(alive - before - after)
                self.max_running = max(self.max_running, len(alive))
                self.samples += 1
                self._stop.wait(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _managed_farm(prefix: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    seed_farm(FarmSpec(prefix=prefix, managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
    with autocommit() as conn:
        alloc, tag = conn.execute("SELECT str_name, str_tag FROM alloc").fetchone()
    monkeypatch.setenv("CUESCHED_RQD_DEFAULT_ALLOC", alloc)
    return show_name(prefix, 0), [tag]


def _job(show: str, name: str, command: str, frames: str, **kw: Any) -> dict[str, Any]:
    layer = {"name": "main", "command": command, "range": frames, "cores": 1, "memory": "256MB", **kw}
    return {"show": show, "name": name, "user": "alice", "layers": [layer]}


def _frames(conn: psycopg.Connection, job: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT int_number, str_state, int_exit_status, int_retries FROM frame WHERE pk_job = %s ORDER BY 1", (job,)
    ).fetchall()


def within(predicate: Any, bound: float) -> float | None:
    """Seconds until `predicate` held, or None if it did not within `bound` (a bounded wait)."""
    start = time.monotonic()
    while time.monotonic() - start < bound:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def _rqd_kills(log: Path) -> int:
    return log.read_text(errors="replace").count("Request received: killRunningFrame")


def test_a_job_kill_over_rqd_keeps_its_procs_booked_until_rqd_reports_the_frames_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 10: the kill reaches RQD within the bound, the killed frames' cores stay counted until
    RQD's completion reports, the next job's frames start only then, never more than 2 on 2 cores."""
    show, tags = _managed_farm("rkl", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    marker = f"rkl-{os.getpid()}"

    def command(seconds: int) -> str:
        return f'python3 -c "import time; time.sleep({seconds})" {marker} #JOB# #IFRAME#'

    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rkl-a"], tags=tags, cores=2) as d:
        rqd_log = d["rkl-a"].log
        with scheduler_dispatching("rqd") as proc:
            victim = submit_job(_job(show, "rkl-victim", command(120), "1-2"), user="alice").job_id
            wait_for(lambda: len(pids_of(f"{marker} rkl-victim")) == 2, 30, "RQD to run both frames of the victim")
            after = submit_job(_job(show, "rkl-next", command(2), "1-4"), user="alice").job_id
            watcher = HostWatcher("rkl-a", marker, cores=2).start()
            try:
                wait_for(lambda: watcher.samples > 20, 10, "the watcher's first samples")
                kills_before = _rqd_kills(rqd_log)
                killed = kill_job(victim, actor="test")  # this thread holds no launcher, as the API
                t_kill = time.monotonic()
                # The kill reaches RQD within the bound (RQD logs each KillRunningFrame it serves).
                received = within(lambda: _rqd_kills(rqd_log) >= kills_before + 2, KILL_BOUND)
                # (Measured, and then waited for however long it takes, so that a kill that comes
                # late still lets the test say what the counters did meanwhile.)
                wait_for(lambda: pids_of(f"{marker} rkl-victim") == [], 60, "the killed processes to be gone")
                gone = time.monotonic() - t_kill
                # The victim's procs went only with RQD's completion reports; then the next job ran.
                wait_for(
                    lambda: scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (victim,)) == 0,
                    15,
                    "RQD's completion reports of the killed frames",
                )
                wait_for(
                    lambda: (
                        scalar(
                            conn, "SELECT count(*) FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'", (after,)
                        )
                        == 4
                    ),
                    60,
                    "the next job's four frames to run on the freed cores",
                )
            finally:
                watcher.stop()
            assert watcher.samples > 50
            assert watcher.unbooked == [], f"frames running with no proc booked: {sorted(set(watcher.unbooked))}"
            assert watcher.max_running <= 2
            assert received is not None, f"RQD received no KillRunningFrame within {KILL_BOUND}s"
            assert gone < KILL_BOUND, f"the killed processes lived {gone:.1f}s after the kill"
            assert killed.detail["killing"] == 2 and killed.detail["finished"]
            print(
                f"\nrqd kill: KillRunningFrame received {received:.3f}s, processes gone {gone:.3f}s after the kill;"
                f" {watcher.samples} samples, max {watcher.max_running} running on 2 cores, 0 unbooked"
            )
            # Recorded as killed: eaten (the job is finished), exit 301, no retry counted.
            assert _frames(conn, victim) == [(1, "EATEN", EXIT_STATUS_KILLED, 0), (2, "EATEN", EXIT_STATUS_KILLED, 0)]
            assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (victim,)) == "FINISHED"
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert violations(conn) == []
            wait_for(
                lambda: not any(c for c, _g in proc.service.store.audit_snapshot().job.values()),
                10,
                "the Store to hold no cores",
            )
            assert gw.servicer.counts["errors"] == 0


def test_a_job_kill_through_a_q2_agent_keeps_the_proc_booked_until_the_process_has_exited(tmp_path: Path) -> None:
    """Row 10 for the q2 agent: a frame that takes a second to exit on SIGTERM (a renderer
    flushing) keeps its core counted until the agent reports its end, recorded killed."""
    from tests.integration.dispatch_support import seed

    seed(
        "akl",
        hosts=0,
        jobs=2,
        layers=1,
        allocs=1,
        frames_per_layer=1,
        manual_tags=1,
        layer_cores_choices=(1,),
        layer_mem_gb_choices=(1,),
    )
    marker = f"akl-{os.getpid()}"
    with autocommit() as conn:
        jobs = [r[0] for r in conn.execute("SELECT pk_job FROM job ORDER BY str_name")]
        victim, after = jobs
        names = dict(conn.execute("SELECT pk_job, str_name FROM job").fetchall())
        # The agent runs these through /bin/sh -c, whose command line holds the marker.
        slow_exit = f": {marker} #JOB# #IFRAME#; trap 'sleep 1; exit 143' TERM; sleep 60 & wait"
        conn.execute("UPDATE layer SET str_cmd = %s WHERE pk_job = %s", (slow_exit, victim))
        conn.execute("UPDATE layer SET str_cmd = %s WHERE pk_job = %s", (f": {marker} #JOB# #IFRAME#; sleep 1", after))
        conn.execute("UPDATE job SET b_paused = true WHERE pk_job = %s", (after,))
        alloc = scalar(conn, "SELECT str_name FROM alloc")
        tags = sorted({t for (raw,) in conn.execute("SELECT str_tags FROM layer") for t in parse_tags(raw)})
    farm = {"alloc": alloc, "tags": tags}
    host = "akl-host"
    with agent_process(host, farm, tmp_path, cores=1), scheduler_dispatching("q2") as proc, autocommit() as conn:
        wait_for(lambda: len(pids_of(f"{marker} {names[victim]}")) >= 1, 20, "the agent to start the victim")
        conn.execute("UPDATE job SET b_paused = false WHERE pk_job = %s", (after,))
        watcher = HostWatcher(host, marker, cores=1).start()
        try:
            wait_for(lambda: watcher.samples > 20, 10, "the watcher's first samples")
            killed = kill_job(victim, actor="test")
            t_kill = time.monotonic()
            wait_for(lambda: pids_of(f"{marker} {names[victim]}") == [], 30, "the killed frame's process to be gone")
            gone = time.monotonic() - t_kill
            wait_for(
                lambda: scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (victim,)) == 0,
                10,
                "the agent's completion of the killed frame",
            )
            wait_for(
                lambda: scalar(conn, "SELECT str_state FROM frame WHERE pk_job = %s", (after,)) == "SUCCEEDED",
                30,
                "the next job's frame to run on the freed core",
            )
        finally:
            watcher.stop()
        assert watcher.unbooked == [], f"frames running with no proc booked: {sorted(set(watcher.unbooked))}"
        assert watcher.max_running <= 1
        assert gone < KILL_BOUND + 1  # the kill poll (0.1 s here) and the frame's own 1 s exit
        assert killed.detail["killing"] == 1
        print(f"\nq2 kill: process gone {gone:.3f}s after the kill (it takes 1 s to exit on SIGTERM)")
        log = next(p for p in tmp_path.rglob("*.log") if names[victim] in str(p))
        assert "=== killed: a kill" in log.read_text()
        assert _frames(conn, victim) == [(1, "EATEN", EXIT_STATUS_KILLED, 0)]
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert violations(conn) == []
        wait_for(
            lambda: not any(c for c, _g in proc.service.store.audit_snapshot().job.values()),
            10,
            "the Store to hold no cores",
        )


def test_the_api_and_the_cli_say_killing_until_the_run_has_ended(client: Any, django_user_model: Any) -> None:
    """No scheduler sends the kill here (the sender is not running): the mark alone is what the
    API, `job show` and `job kill` report, and the proc stays booked; the run's end then comes as
    a completion with a failing status, recorded killed."""
    from dispatch.jobs.tokens import issue_token
    from tests.integration.dispatch_support import seed

    seed("apk", hosts=1, jobs=1, layers=1, frames_per_layer=3, layer_cores_choices=(1,))
    user = django_user_model.objects.create_user("ops", is_staff=True)
    token = issue_token(user)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 3
        job = scalar(conn, "SELECT pk_job FROM job")
        name = scalar(conn, "SELECT str_name FROM job")
        # A frame kill first: that frame goes back to WAITING when its run ends.
        frame_one = scalar(conn, "SELECT str_name FROM frame WHERE int_number = 1")
        assert kill_frames(job, [frame_one], actor="test").detail["killing"] == 1
        answer = client.post(f"/api/jobs/{name}/kill", data="", content_type="application/json", **auth)
        assert answer.status_code == 200, answer.content
        assert answer.json()["killing"] == 3 and answer.json()["changed"] >= 1
        assert scalar(conn, "SELECT count(*) FROM proc") == 3  # still booked: nothing ended yet
        detail = client.get(f"/api/jobs/{name}", **auth).json()
        assert (detail["state"], detail["killing"]) == ("FINISHED", 3)
        listed = client.get("/api/jobs", **auth).json()["results"]
        assert [(j["name"], j["killing"]) for j in listed] == [(name, 3)]
        frames = client.get(f"/api/jobs/{name}/frames", **auth).json()["results"]
        assert [(f["state"], f["killing"]) for f in frames] == [("RUNNING", True)] * 3
        out = StringIO()
        call_command("job", "show", name, stdout=out)
        assert json.loads(out.getvalue())["killing"] == 3
        out = StringIO()
        call_command("job", "kill", name, stdout=out)  # a second kill: harmless, says the same
        assert "killing 3 running frame(s)" in out.getvalue()
        # The runs end: one reports success before the kill reached it, two report a signal death.
        procs = dict(conn.execute("SELECT f.int_number, p.pk_proc FROM proc p JOIN frame f USING (pk_frame)"))
        result = complete(conn, [Completion(procs[1], 137), Completion(procs[2], 1), Completion(procs[3], 0)])
        assert result.released == 3 and result.killed == 2
        launcher.close()
        # Frame 1 had a frame kill and then the job's: the job's wins (eaten); a kill is no failure.
        assert _frames(conn, job) == [
            (1, "EATEN", EXIT_STATUS_KILLED, 0),
            (2, "EATEN", EXIT_STATUS_KILLED, 0),
            (3, "SUCCEEDED", 0, 0),
        ]
        detail = client.get(f"/api/jobs/{name}", **auth).json()
        assert detail["killing"] == 0
        assert violations(conn) == []


def test_a_frame_kill_requeues_the_frame_once_its_run_has_ended_with_no_retry_counted() -> None:
    """The simulated launcher's kill ends the run at its next poll; the frame goes back to WAITING
    (exit 301), is booked again, and its next start counts no retry."""
    from dispatch.engine.kills import KillSender
    from tests.integration.dispatch_support import seed

    seed("fkl", hosts=1, jobs=1, layers=1, frames_per_layer=1, layer_cores_choices=(1,))
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        sender = KillSender([launcher], resend=0.2, poll=0.1)
        stop = threading.Event()
        thread = sender.start(stop)
        try:
            with make_loop(proc.service, launcher) as loop:
                assert loop.run_once().booked == 1
                job, frame = conn.execute("SELECT pk_job, str_name FROM frame").fetchone()
                assert kill_frames(job, [frame], actor="test").detail["killing"] == 1
                assert scalar(conn, "SELECT count(*) FROM proc") == 1  # booked until the run ends
                wait_for(lambda: launcher.running() == 1 and sender.sent >= 1, 5, "the sender's kill")

                def requeued_and_rebooked() -> bool:
                    loop.run_once()
                    return scalar(conn, "SELECT int_exit_status FROM frame") == EXIT_STATUS_KILLED and (
                        scalar(conn, "SELECT count(*) FROM proc WHERE ts_kill IS NULL") == 1
                    )

                wait_for(requeued_and_rebooked, 10, "the killed run to end and the frame to be booked again")
        finally:
            stop.set()
            thread.join(10)
            launcher.close()
        assert conn.execute("SELECT str_state, int_retries FROM frame").fetchone() == ("RUNNING", 0)
        assert violations(conn) == []


def test_a_killed_q2_task_that_has_not_started_is_revoked_and_a_marked_task_runs_nothing(tmp_path: Path) -> None:
    """Two queued tasks of a killed job, no agent consuming yet: the sender ends the one whose
    run lock is free (nothing runs it) and leaves the one whose run lock is held (a run in
    progress: its agent stops it); a task that starts after its kill runs nothing and ends it
    killed. Both are recorded killed, no retry counted."""
    from dispatch.engine.kills import KillSender
    from dispatch.engine.launcher import get_launcher
    from dispatch.hosts.agent import RUN_UNLOCK_SQL, TRY_RUN_LOCK_SQL, HostSpec, register_host, run_frame
    from tests.integration.agent_support import agent_farm

    farm = agent_farm("arv", "sleep 30", frames=2)
    with running_scheduler() as proc, autocommit() as conn, autocommit() as holder:
        register_host(HostSpec(name="arv-host", alloc=str(farm["alloc"]), cores=2, tags=tuple(farm["tags"])), conn)
        launcher = get_launcher("q2")
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 2
        job = scalar(conn, "SELECT pk_job FROM job")
        queued, started = [r[0] for r in conn.execute("SELECT pk_proc FROM proc ORDER BY pk_proc")]
        assert holder.execute(TRY_RUN_LOCK_SQL, (started,)).fetchone()[0]  # stands for a run in progress
        assert kill_job(job, actor="test").detail["killing"] == 2
        try:
            KillSender([launcher]).send_due(conn)
        finally:
            holder.execute(RUN_UNLOCK_SQL, (started,))
            launcher.close()
        assert [r[0] for r in conn.execute("SELECT pk_proc FROM proc")] == [started]  # the queued one: revoked
        assert run_frame(queued, "arv-host", log_root=str(tmp_path))["skipped"].startswith("proc is gone")
        out = run_frame(started, "arv-host", log_root=str(tmp_path))  # its task, delivered after the kill
        assert out["skipped"] == "killed before it started" and out["ran"] is False
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert _frames(conn, job) == [(1, "EATEN", EXIT_STATUS_KILLED, 0), (2, "EATEN", EXIT_STATUS_KILLED, 0)]
        assert scalar(conn, "SELECT int_cores = int_cores_idle FROM host") is True
        assert violations(conn) == []
