"""Issue 21, what a new user hits in the first hour: the demo's ports and processes, a stopped
agent or scheduler, the admin password, frame logs per database, `store_status`'s exit code.

The demo, the scheduler and the agent run as real subprocesses on the test database; "nothing
outlives the command" is read from /proc (see first_hour_support).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from dispatch import conf
from dispatch.hosts.agent import LOG_HEADER, previous_runs
from tests.integration.agent_support import agent_farm, database_url_for_agents
from tests.integration.dispatch_support import autocommit, scalar, seed, violations, wait_for
from tests.integration.first_hour_support import (
    ROOT,
    command_env,
    descendants,
    free_port,
    held_port,
    kill_marked,
    manage,
    marked_processes,
    new_marker,
    still_alive,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def _wait_exit(popen: subprocess.Popen[bytes], timeout: float, output: Path) -> int:
    try:
        return popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
        raise AssertionError(f"{popen.args} did not exit within {timeout}s:\n{output.read_text()}") from None


# --- item 1: the demo's ports; nothing it starts outlives it --------------------------------
@pytest.mark.parametrize("which", ["web", "metrics"])
def test_a_taken_port_stops_the_demo_before_it_starts_anything(which: str, tmp_path: Path) -> None:
    holder = held_port()
    taken = holder.getsockname()[1]
    web, metrics = (taken, free_port()) if which == "web" else (free_port(), taken)
    marker = new_marker()
    password_file = tmp_path / "admin-password"
    env = command_env(
        marker,
        CUESCHED_DEMO_PASSWORD_FILE=str(password_file),
        CUESCHED_AGENT_LOG_ROOT=str(tmp_path),
        CUESCHED_METRICS_PORT=str(metrics),
    )
    out = tmp_path / "demo.out"
    demo = manage(["demo", "--addr", f"127.0.0.1:{web}"], env, out)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while demo.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(demo.pid))
            time.sleep(0.05)
        code = _wait_exit(demo, 5, out)
        text = out.read_text()
        assert code != 0, text
        assert f"127.0.0.1:{taken} cannot be listened on" in text and "Nothing was started" in text, text
        assert "Traceback" not in text, text
        assert "starting scheduler" not in text and not password_file.exists(), text
        assert marked_processes(marker) == {}
        assert still_alive(seen) == []
    finally:
        holder.close()
        kill_marked(marker)


def test_run_scheduler_on_a_taken_metrics_port_says_so_without_a_traceback(tmp_path: Path) -> None:
    holder = held_port()
    marker = new_marker()
    out = tmp_path / "scheduler.out"
    try:
        scheduler = manage(
            ["run_scheduler", "--no-dispatch", "--metrics-port", str(holder.getsockname()[1])], command_env(marker), out
        )
        code = _wait_exit(scheduler, 60, out)
        text = out.read_text()
        assert code == 1, text
        assert f"cannot serve /metrics on 127.0.0.1:{holder.getsockname()[1]}" in text, text
        assert "Traceback" not in text, text
    finally:
        holder.close()
        kill_marked(marker)


def test_ctrl_c_stops_the_whole_demo_and_leaves_no_frame_running(tmp_path: Path) -> None:
    """The done-when of item 1 and 3 together: the demo really runs frames, then a Ctrl-C (SIGINT
    to its process group, as a terminal sends it) leaves no process and no booked frame."""
    marker = new_marker()
    web = free_port()
    env = command_env(
        marker,
        CUESCHED_DEMO_PASSWORD_FILE=str(tmp_path / "admin-password"),
        CUESCHED_AGENT_LOG_ROOT=str(tmp_path / "logs"),
        CUESCHED_METRICS_PORT=str(free_port()),
    )
    out = tmp_path / "demo.out"
    demo = manage(["demo", "--addr", f"127.0.0.1:{web}"], env, out)
    seen: dict[int, str] = {}
    try:
        with autocommit() as conn:

            def frames_running() -> bool:
                assert demo.poll() is None, out.read_text()
                seen.update(descendants(demo.pid))
                return bool(scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'SUCCEEDED'")) and bool(
                    scalar(conn, "SELECT count(*) FROM proc")
                )

            wait_for(frames_running, 120, "the demo to run frames (some done, some booked)")
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{web}/admin/login/", timeout=10) as resp:
                assert resp.status == 200
            seen.update(descendants(demo.pid))
            assert {"run_scheduler", "run_agent"} <= {
                word for cmd in marked_processes(marker).values() for word in cmd.split()
            }
            import os

            os.killpg(demo.pid, signal.SIGINT)
            code = _wait_exit(demo, 60, out)
            text = out.read_text()
            assert code == 0, text
            assert marked_processes(marker) == {}, text
            assert still_alive(seen) == [], text
            stopped = r"agent for host demo_agent stopped: \d+ running frame\(s\) ended and requeued"
            assert re.search(stopped, text), text
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'RUNNING'") == 0
            assert violations(conn) == []
    finally:
        kill_marked(marker)


@pytest.mark.one_server
def test_ctrl_c_with_the_output_pipe_gone_still_leaves_nothing_running(tmp_path: Path) -> None:
    """`./dev run | tee log` and a Ctrl-C: the terminal's SIGINT kills tee too, so every later
    write of the demo and its children meets a broken pipe. The stop must not depend on being
    able to say what it does: a failed write used to skip the kill of the agent's process
    group, and its q2 cluster processes outlived the command."""
    import os

    marker = new_marker()
    web = free_port()
    env = command_env(
        marker,
        CUESCHED_DEMO_PASSWORD_FILE=str(tmp_path / "admin-password"),
        CUESCHED_AGENT_LOG_ROOT=str(tmp_path / "logs"),
        CUESCHED_METRICS_PORT=str(free_port()),
    )
    read_end, write_end = os.pipe()
    demo = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--addr", f"127.0.0.1:{web}"],
        cwd=ROOT,
        env=env,
        stdout=write_end,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.close(write_end)
    seen: dict[int, str] = {}
    try:
        with autocommit() as conn:

            os.set_blocking(read_end, False)

            def drain_and_check() -> bool:
                try:
                    os.read(read_end, 1 << 20)
                except BlockingIOError:
                    pass
                assert demo.poll() is None
                seen.update(descendants(demo.pid))
                return bool(scalar(conn, "SELECT count(*) FROM proc"))

            wait_for(drain_and_check, 120, "the demo to run frames")
            seen.update(descendants(demo.pid))
            os.close(read_end)  # tee is gone: every write from now on is EPIPE
            os.killpg(demo.pid, signal.SIGINT)
            demo.wait(90)
            assert marked_processes(marker) == {}
            assert still_alive(seen) == []
    finally:
        kill_marked(marker)


# --- item 3: SIGTERM to run_agent and run_scheduler ----------------------------------------
def test_sigterm_to_scheduler_and_agent_ends_or_requeues_every_frame_and_says_so(tmp_path: Path) -> None:
    farm = agent_farm("asigterm", "sleep 30", frames=3)
    host = "asigterm-host"
    marker = new_marker()
    env = command_env(
        marker,
        CUESCHED_AGENT_LOG_ROOT=str(tmp_path / "logs"),
        CUESCHED_AGENT_KILL_POLL="0.2",
        CUESCHED_AGENT_KILL_GRACE="2",
        CUESCHED_HOST_REFRESH_INTERVAL="0.2",
    )
    agent_out, scheduler_out = tmp_path / "agent.out", tmp_path / "scheduler.out"
    agent_argv = ["run_agent", "--host", host, "--transport", "q2", "--alloc", str(farm["alloc"])]
    agent_argv += ["--tags", " ".join(farm["tags"]), "--cores", "2", "--memory", "16G", "--heartbeat", "0.3"]  # type: ignore[arg-type]
    agent = manage(agent_argv, env, agent_out)
    scheduler = manage(["run_scheduler", "--launcher", "q2", "--metrics-port", "0"], env, scheduler_out)
    try:
        with autocommit() as conn:

            def two_running() -> bool:
                assert agent.poll() is None, agent_out.read_text()
                assert scheduler.poll() is None, scheduler_out.read_text()
                logs = list((tmp_path / "logs").rglob("*.log"))
                return len([p for p in logs if "=== command: sleep 30" in p.read_text()]) == 2

            # 2 cores, 1-core frames: two run, the third stays WAITING.
            wait_for(two_running, 60, "the agent to run two frames")
            assert scalar(conn, "SELECT count(*) FROM proc") == 2

            scheduler.send_signal(signal.SIGTERM)
            assert _wait_exit(scheduler, 30, scheduler_out) == 0, scheduler_out.read_text()
            assert "received SIGTERM, stopping" in scheduler_out.read_text()
            assert "scheduler stopped" in scheduler_out.read_text()
            # The scheduler's stop is not the frames' end: the agent still runs them.
            assert scalar(conn, "SELECT count(*) FROM proc") == 2

            started = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            assert _wait_exit(agent, 30, agent_out) == 0, agent_out.read_text()
            text = agent_out.read_text()
            assert time.monotonic() - started < 30 - 1  # not the frames' own 30 s
            assert "received SIGTERM, stopping the agent" in text, text
            assert (
                f"agent for host {host} stopped: 2 running frame(s) ended and requeued, 0 queued frame(s) requeued, "
                "host marked DOWN until its agent starts again" in text
            ), text
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert conn.execute("SELECT str_state, count(*) FROM frame GROUP BY 1").fetchall() == [("WAITING", 3)]
            assert conn.execute(
                "SELECT hs.str_state, h.int_cores = h.int_cores_idle FROM host h JOIN host_stat hs USING (pk_host)"
            ).fetchall() == [("DOWN", True)]
            for log in (tmp_path / "logs").rglob("*.log"):
                if "sleep 30" in log.read_text():
                    assert "=== killed" in log.read_text()
            assert violations(conn) == []
        assert marked_processes(marker) == {}
    finally:
        kill_marked(marker)


def test_sigterm_to_a_scheduler_running_frames_in_process_requeues_them_and_says_so(tmp_path: Path) -> None:
    """The simulated launcher's frames live in the scheduler process: when it stops, nobody else
    will ever complete them, so it must requeue them itself (the lost-host way: no retry charged)
    rather than leave them RUNNING with their procs booked."""
    seed("ssigterm", hosts=2, jobs=1, layers=1, frames_per_layer=3, layer_cores_choices=(1,))
    marker = new_marker()
    env = command_env(marker, CUESCHED_SIM_RUNTIME_MIN="300", CUESCHED_SIM_RUNTIME_MAX="300")
    out = tmp_path / "scheduler.out"
    scheduler = manage(["run_scheduler", "--launcher", "simulated", "--metrics-port", "0"], env, out)
    try:
        with autocommit() as conn:

            def all_running() -> bool:
                assert scheduler.poll() is None, out.read_text()
                return scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'RUNNING'") == 3

            wait_for(all_running, 60, "the scheduler to start the three frames")
            scheduler.send_signal(signal.SIGTERM)
            assert _wait_exit(scheduler, 30, out) == 0, out.read_text()
            text = out.read_text()
            assert "received SIGTERM, stopping" in text, text
            assert "3 in-process frame(s) requeued" in text, text
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert conn.execute("SELECT str_state, int_retries FROM frame GROUP BY 1, 2").fetchall() == [("WAITING", 0)]
            assert violations(conn) == []
        assert marked_processes(marker) == {}
    finally:
        kill_marked(marker)


# --- item 7: the admin password is kept --------------------------------------------------
def test_the_demo_keeps_the_admin_password_of_its_first_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "admin-password"
    monkeypatch.setenv("CUESCHED_DEMO_PASSWORD_FILE", str(path))

    def login() -> str:
        from io import StringIO

        buf = StringIO()
        call_command("demo", "--no-serve", stdout=buf)
        line = next(x for x in buf.getvalue().splitlines() if x.startswith("admin login:"))
        return line

    first = login()
    password = path.read_text().strip()
    assert f"admin / {password}" in first and "new; stored in" in first and str(path) in first
    assert path.stat().st_mode & 0o777 == 0o600
    second = login()
    assert f"admin / {password}" in second and "kept from the first run" in second
    admin = get_user_model().objects.get(username="admin")
    assert admin.check_password(password)

    admin.set_password("mine-now")
    admin.save()
    third = login()
    assert "unchanged" in third and "--reset-admin" in third and password not in third
    assert get_user_model().objects.get(username="admin").check_password("mine-now")

    from io import StringIO

    buf = StringIO()
    call_command("demo", "--no-serve", "--reset-admin", stdout=buf)
    new = path.read_text().strip()
    assert new != password and "PASSWORD CHANGED" in buf.getvalue() and new in buf.getvalue()
    assert get_user_model().objects.get(username="admin").check_password(new)


# --- item 9: frame logs per database, and a header that counts the runs -------------------
def test_the_default_frame_log_root_is_one_per_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUESCHED_AGENT_LOG_ROOT", raising=False)
    here = settings.DATABASES["default"]
    embedded = conf.database_slug({"NAME": "cuesched", "HOST": "/tmp/sock", "PORT": "5432"}, True)
    external = conf.database_slug({"NAME": "cuesched", "HOST": "127.0.0.1", "PORT": "5432"}, False)
    other_port = conf.database_slug({"NAME": "cuesched", "HOST": "127.0.0.1", "PORT": "5433"}, False)
    assert len({embedded, external, other_port}) == 3
    assert all("/" not in s and s for s in (embedded, external, other_port))
    root = Path(conf.agent_log_root())
    assert root.parent == Path(settings.BASE_DIR) / ".cuesched" / "logs"
    assert root.name == conf.database_slug(here, settings.EMBEDDED_DATABASE) and here["NAME"] in root.name


def test_previous_runs_counts_the_headers_across_read_blocks(tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    assert previous_runs(log) == 0
    body = b"x" * ((1 << 20) - 5)  # puts the second header across the first 1 MiB block boundary
    log.write_bytes(LOG_HEADER.encode() + b"h1\n" + body + b"\n" + LOG_HEADER.encode() + b"h2\nout\n")
    assert previous_runs(log) == 2
    log.write_bytes(b"a line that quotes " + LOG_HEADER.encode() + b"mid-line\n")
    assert previous_runs(log) == 0


# --- item 10: store_status's exit code -----------------------------------------------------
def test_store_status_exits_1_on_a_stale_view_and_0_on_a_live_one() -> None:
    env = {"DATABASE_URL": database_url_for_agents(), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "manage.py", "store_status"]
    with running_scheduler(publish_interval=0.2):
        with autocommit() as conn:
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM cuesched_scheduler_state") == 1, 10, "a published view")
        live = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert live.returncode == 0, live.stderr
        assert "(live)" in live.stdout
    with autocommit() as conn:
        conn.execute("UPDATE cuesched_scheduler_state SET heartbeat = now() - interval '1 minute'")
    for extra in ([], ["--json"]):
        stale = subprocess.run([*argv, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert stale.returncode == 1, (stale.stdout, stale.stderr)
        assert "STALE" in stale.stderr and "Traceback" not in stale.stderr
        assert stale.stdout.strip()  # the view is still printed


def test_a_demo_killed_outright_takes_its_children_with_it(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup at all: the children hear of it from the kernel (PR_SET_PDEATHSIG)
    and stop as for a SIGTERM, the agent requeueing its frames."""
    marker = new_marker()
    env = command_env(
        marker,
        CUESCHED_DEMO_PASSWORD_FILE=str(tmp_path / "admin-password"),
        CUESCHED_AGENT_LOG_ROOT=str(tmp_path / "logs"),
        CUESCHED_METRICS_PORT=str(free_port()),
    )
    out = tmp_path / "demo.out"
    demo = manage(["demo", "--addr", f"127.0.0.1:{free_port()}"], env, out)
    try:
        with autocommit() as conn:

            def booked() -> bool:
                assert demo.poll() is None, out.read_text()
                return bool(scalar(conn, "SELECT count(*) FROM frame WHERE str_state <> 'WAITING'"))

            wait_for(booked, 120, "the demo to book frames")
            children = marked_processes(marker)
            assert {"run_scheduler", "run_agent", "runserver"} <= {w for c in children.values() for w in c.split()}
            demo.kill()
            demo.wait(10)
            wait_for(lambda: marked_processes(marker) == {}, 60, "every child of the killed demo to stop")
            assert "agent for host demo_agent stopped:" in out.read_text()
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert violations(conn) == []
    finally:
        kill_marked(marker)
