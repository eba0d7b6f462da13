"""Real frames through a q2 host agent (django-q2, ORM broker: the test database is the queue).

The agent is `manage.py run_agent --transport q2` in a subprocess; the scheduler side is the
real dispatch loop with the q2 launcher. Frames run real commands, write their logs, and end
through the release path from the agent's side.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatch.engine.completion import EXIT_STATUS_DOWN_HOST, EXIT_STATUS_KILLED, kill_frames
from dispatch.engine.launcher import get_launcher
from dispatch.hosts.agent import EXIT_COMMAND_NOT_FOUND, HostSpec, register_host, release_previous_runs, run_frame
from dispatch.hosts.launchers.q2 import TASK_FUNC
from tests.integration.agent_support import agent_farm, agent_process
from tests.integration.dispatch_support import autocommit, drain, make_loop, scalar, violations, wait_for
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

# Frame 2 fails (`false`) every try; the others echo and sleep. The shell syntax runs it via /bin/sh.
COMMAND = "if [ #IFRAME# = 2 ]; then false; else echo rendering #FRAME# of #JOB#; sleep 0.2; fi"


def check_real_frames(transport: str, tmp_path: Path) -> None:
    farm = agent_farm(f"ag{transport}", COMMAND, frames=3, max_retries=1)
    host = f"ag{transport}-host"
    with agent_process(host, farm, tmp_path, transport=transport), running_scheduler() as proc, autocommit() as conn:
        launcher = get_launcher(transport)
        loop = make_loop(proc.service, launcher, host_refresh_interval=0.2)
        try:
            totals = drain(loop, 30)
        finally:
            launcher.close()

        rows = conn.execute(
            "SELECT int_number, str_state, int_exit_status, int_retries, ts_started IS NOT NULL,"
            " ts_stopped >= ts_started FROM frame ORDER BY int_number"
        ).fetchall()
        # 1 and 3 succeed; 2 fails, is retried once (max retries 1), then is DEAD with its status.
        assert rows == [
            (1, "SUCCEEDED", 0, 0, True, True),
            (2, "DEAD", 1, 1, True, True),
            (3, "SUCCEEDED", 0, 0, True, True),
        ]
        assert totals.booked == 4 and totals.launch_failures == 0
        assert scalar(conn, "SELECT str_state FROM job") == "FINISHED"
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert conn.execute(
            "SELECT int_cores = int_cores_idle AND int_mem = int_mem_idle FROM host WHERE str_name = %s", (host,)
        ).fetchone() == (True,)
        assert violations(conn) == []

        logs = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.log"))
        show, job, layer = conn.execute(
            "SELECT s.str_name, j.str_name, l.str_name FROM layer l"
            " JOIN job j ON j.pk_job = l.pk_job JOIN show s ON s.pk_show = j.pk_show"
        ).fetchone()
        assert logs == [Path(show, job, f"{layer}.{n:04d}.log") for n in (1, 2, 3)]
        first = (tmp_path / logs[0]).read_text()
        assert f"rendering 0001-{layer} of {job}" in first and "exit status 0" in first
        second = (tmp_path / logs[1]).read_text()
        assert second.count("=== cuesched agent") == 2  # the try and its retry, appended
        # Each header numbers its run in this log, beside the retries the job's limit counts.
        assert ", run 1, retries 0, " in second and ", run 2, retries 1, " in second
        assert second.count("exit status 1") == 2


def test_real_frames_run_through_a_q2_agent_with_exit_status_retries_and_logs(tmp_path: Path) -> None:
    check_real_frames("q2", tmp_path)


def check_kill(transport: str, tmp_path: Path) -> None:
    farm = agent_farm(f"ak{transport}", "sleep 30", frames=1)
    host = f"ak{transport}-host"
    with agent_process(host, farm, tmp_path, transport=transport), running_scheduler() as proc, autocommit() as conn:
        launcher = get_launcher(transport)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()
        frame = scalar(conn, "SELECT pk_frame FROM frame")
        log: Path | None = None

        def started() -> bool:
            nonlocal log
            found = list(tmp_path.rglob("*.log"))
            log = found[0] if found else None
            return log is not None and "=== command: sleep 30" in log.read_text()

        wait_for(started, 15, "the agent to start the frame")
        assert kill_frames(conn, [frame]).released == 1
        wait_for(lambda: log is not None and "=== killed" in log.read_text(), 10, "the agent to kill the frame")
        # The kill's completion stands (the agent writes none after it): WAITING, exit 301, no retry.
        assert conn.execute("SELECT str_state, int_exit_status, int_retries FROM frame").fetchone() == (
            "WAITING",
            EXIT_STATUS_KILLED,
            0,
        )
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert conn.execute("SELECT int_cores = int_cores_idle FROM host WHERE str_name = %s", (host,)).fetchone() == (
            True,
        )
        assert violations(conn) == []


def test_a_running_frame_is_killed_through_its_q2_agent(tmp_path: Path) -> None:
    check_kill("q2", tmp_path)


def test_a_launch_to_a_host_without_an_agent_fails_and_is_compensated(tmp_path: Path) -> None:
    farm = agent_farm("anoagent", "echo never", frames=1)
    with agent_process("anoagent-host", farm, tmp_path):
        pass  # registered, then stopped: the host stays UP with its last ping
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE host_stat SET ts_ping = now() - interval '60 seconds'")  # silent past the agent timeout
        launcher = get_launcher("q2")
        with make_loop(proc.service, launcher) as loop:
            first = loop.run_once()
            assert (first.booked, first.launch_failures, first.compensated) == (0, 1, 1)
            assert conn.execute("SELECT str_state, int_exit_status FROM frame").fetchone() == ("WAITING", 299)
            assert scalar(conn, "SELECT str_state FROM host_stat") == "DOWN"
            second = loop.run_once()  # the DOWN host is not booked again
            assert second.launch_failures == 0 and second.booked == 0
        launcher.close()
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert scalar(conn, "SELECT int_cores = int_cores_idle FROM host") is True
        assert scalar(conn, "SELECT count(*) FROM django_q_ormq") == 0
        assert violations(conn) == []


def test_a_missing_command_ends_the_frame_with_127_and_a_second_delivery_runs_nothing(tmp_path: Path) -> None:
    """The agent's task run in this process (the broker's delivery stood in for by a direct call)."""
    farm = agent_farm("amissing", "no-such-command-cuesched --frame #IFRAME#", frames=1, max_retries=0)
    with running_scheduler() as proc, autocommit() as conn:
        pk_host = register_host(
            HostSpec(name="amissing-host", alloc=str(farm["alloc"]), cores=2, tags=tuple(farm["tags"])), conn
        )
        launcher = get_launcher("q2")
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()
        pk_proc = scalar(conn, "SELECT pk_proc FROM proc")
        assert scalar(conn, "SELECT count(*) FROM django_q_ormq WHERE key = 'cuesched.host.amissing-host'") == 1

        first = run_frame(pk_proc, "amissing-host", log_root=str(tmp_path))
        assert first["command"] == ["no-such-command-cuesched", "--frame", "1"]  # plain argv: no shell
        assert first["exit_status"] == EXIT_COMMAND_NOT_FOUND and first["states"] == {"DEAD": 1}
        assert "cannot start the command" in Path(first["log_path"]).read_text()
        assert conn.execute("SELECT str_state, int_exit_status FROM frame").fetchone() == ("DEAD", 127)
        assert scalar(conn, "SELECT int_cores = int_cores_idle FROM host WHERE pk_host = %s", (pk_host,)) is True

        again = run_frame(pk_proc, "amissing-host", log_root=str(tmp_path))  # a re-delivered task
        assert again == {"pk_proc": pk_proc, "ran": False, "killed": False, "skipped": again["skipped"]}
        assert "gone" in again["skipped"]
        assert violations(conn) == []


def test_a_restarted_agent_requeues_the_frames_its_previous_life_left_running() -> None:
    farm = agent_farm("arestart", "sleep 30", frames=2)
    with running_scheduler() as proc, autocommit() as conn:
        spec = HostSpec(name="arestart-host", alloc=str(farm["alloc"]), cores=4, tags=tuple(farm["tags"]))
        pk_host = register_host(spec, conn)
        launcher = get_launcher("q2")
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 2  # queued for an agent that then "died"
        launcher.close()
        assert register_host(spec, conn) == pk_host  # the agent starts again: same host, booked idle kept
        assert scalar(conn, "SELECT int_cores - int_cores_idle FROM host") == 200
        assert release_previous_runs(pk_host, conn) == 2
        assert conn.execute("SELECT DISTINCT str_state, int_exit_status, int_retries FROM frame").fetchall() == [
            ("WAITING", EXIT_STATUS_DOWN_HOST, 0)
        ]
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert scalar(conn, "SELECT int_cores = int_cores_idle FROM host") is True
        assert release_previous_runs(pk_host, conn) == 0
        assert violations(conn) == []


def test_a_frame_sees_the_cue_environment_and_not_the_agents_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DJANGO_SECRET_KEY_PROBE", "must-not-leak")
    farm = agent_farm("aenv", "env", frames=1)
    with running_scheduler() as proc, autocommit() as conn:
        register_host(HostSpec(name="aenv-host", alloc=str(farm["alloc"]), cores=2, tags=tuple(farm["tags"])), conn)
        launcher = get_launcher("q2")
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()
        out = run_frame(scalar(conn, "SELECT pk_proc FROM proc"), "aenv-host", log_root=str(tmp_path))
        assert out["command"] == ["env"] and out["exit_status"] == 0 and out["states"] == {"SUCCEEDED": 1}
        env = dict(line.split("=", 1) for line in Path(out["log_path"]).read_text().splitlines() if "=" in line[:40])
        layer, job = conn.execute("SELECT l.str_name, j.str_name FROM layer l JOIN job j USING (pk_job)").fetchone()
        assert env["CUE_FRAME"] == f"0001-{layer}" and env["CUE_JOB"] == job and env["CUE_IFRAME"] == "1"
        assert env["CUE_THREADS"] == "1" and env["CUE_RESOURCE_ID"] == out["pk_proc"] and "PATH" in env
        assert "DATABASE_URL" not in env and "DJANGO_SECRET_KEY_PROBE" not in env


def test_a_task_on_a_host_with_the_longest_name_is_saved_by_django_q2(tmp_path: Path) -> None:
    """django-q2's task name column is varchar(100); a 45-character host name (the longest
    `host.str_name` allows) used to push the launcher's task name over it, and the cluster then
    failed to save the frame's task result (DataError) although the frame itself succeeded."""
    farm = agent_farm("along", "echo long host name", frames=1, max_retries=0)
    host = "along-render-node-0123456789-abcdefghijklmnop"
    assert len(host) == 45
    with agent_process(host, farm, tmp_path), running_scheduler() as proc, autocommit() as conn:
        launcher = get_launcher("q2")
        loop = make_loop(proc.service, launcher, host_refresh_interval=0.2)
        try:
            totals = drain(loop, 30)
        finally:
            launcher.close()
        assert totals.booked == 1 and totals.launch_failures == 0
        assert scalar(conn, "SELECT str_state FROM frame") == "SUCCEEDED"

        # The cluster's monitor saves the result after the frame's end: wait for its row.
        def saved() -> bool:
            return bool(scalar(conn, "SELECT count(*) FROM django_q_task WHERE func = %s", (TASK_FUNC,)))

        wait_for(saved, 15, "django-q2 to save the task result")
        name, success = conn.execute("SELECT name, success FROM django_q_task").fetchone()
        assert success is True and len(name) <= 100
        assert host in name  # the task still names its host
        assert violations(conn) == []
