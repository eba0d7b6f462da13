"""A frame's life (issue 29) on real hosts: `run_agent` in a subprocess and a real RQD daemon.

A memory failure is retried with the layer's memory raised until it fits (the frame reads its
reservation from CUE_MEMORY and exits 33 below 4 GB), no retry charged; a frame that runs past its
layer's `timeout`, or whose log is silent past `timeout_llu`, is killed within one report interval
and DEAD, with the reason. The figures (seconds from the timeout to the processes being gone) are
printed: run with `-s` to read them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dispatch.engine.launcher import get_launcher
from dispatch.jobs.submit import submit_job
from tests.integration.agent_support import agent_farm, agent_process
from tests.integration.dispatch_support import autocommit, drain, make_loop, scalar, violations, wait_for
from tests.integration.rqd_support import gateway, pids_of, rqd_daemons, wait_registered
from tests.integration.runtime_support import running_scheduler
from tests.integration.test_rqd import _conninfo, _farm

pytestmark = pytest.mark.django_db(transaction=True)

GB = 1024 * 1024
# Exits 33 (Cuebot's memory failure) until its reservation is at least 4 GB.
NEEDS_4GB = 'test "$CUE_MEMORY" -ge 4194304 || exit 33; echo fits in $CUE_MEMORY KB'


def _timeout_spec(show: str, marker: str, tags: list[str] | None = None) -> dict[str, Any]:
    """Two one-frame layers: `busy` writes its log every half second and runs past its 1-minute
    timeout; `silent` writes one line and then nothing, past its 1-minute timeout_llu."""
    busy = f"python3 -c \"import time\nwhile True: print('busy', flush=True); time.sleep(0.5)\" {marker}-busy"
    silent = f"python3 -c \"import time; print('one line', flush=True); time.sleep(600)\" {marker}-silent"
    extra = {"tags": tags} if tags else {}
    return {
        "show": show,
        "name": f"{marker}-v1",
        "user": "alice",
        "max_retries": 3,
        "layers": [
            {"name": "busy", "command": busy, "range": "1", "memory": "256MB", "timeout": 1, **extra},
            {"name": "silent", "command": silent, "range": "1", "memory": "256MB", "timeout_llu": 1, **extra},
        ],
    }


def _check_timeouts(conn: Any, job: str, marker: str, gone_at: dict[str, float], what: str) -> None:
    rows = dict(
        (layer, (state, reason))
        for layer, state, reason in conn.execute(
            "SELECT l.str_name, f.str_state, f.str_reason FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer"
            " WHERE f.pk_job = %s",
            (job,),
        ).fetchall()
    )
    assert rows["busy"][0] == "DEAD" and "timeout of 1 min" in rows["busy"][1]
    assert rows["silent"][0] == "DEAD" and "timeout_llu of 1 min" in rows["silent"][1]
    assert scalar(conn, "SELECT max(int_retries) FROM frame WHERE pk_job = %s", (job,)) == 0  # not retried
    assert pids_of(marker) == []
    # Each timeout kill has its audit row, as an operator's kill does.
    assert scalar(conn, "SELECT count(*) FROM cuesched_farm_action WHERE str_action = 'timeout_kill'") == 2
    for layer, seconds in gone_at.items():
        print(f"\n[figure] {what}: layer {layer}: processes gone {seconds:.1f}s after its 60 s limit")


def _watch_gone(job: str, marker: str, timeout: float, gone: dict[str, float]) -> None:
    """Until both frames' processes are gone: seconds past each one's 60 s limit (from its start)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    with psycopg.connect(_conninfo(), autocommit=True) as c:
        while time.monotonic() < deadline and len(gone) < 2:
            ages = dict(
                c.execute(
                    "SELECT l.str_name, EXTRACT(EPOCH FROM now() - f.ts_started)::float8 FROM frame f"
                    " JOIN layer l ON l.pk_layer = f.pk_layer WHERE f.pk_job = %s AND f.ts_started IS NOT NULL",
                    (job,),
                ).fetchall()
            )
            for layer, age in ages.items():
                running = bool(pids_of(f"{marker}-{layer}"))
                if running:
                    seen.add(layer)
                elif layer in seen and layer not in gone:
                    gone[layer] = age - 60.0
            time.sleep(0.2)


def _watch(job: str, marker: str, gone: dict[str, float]) -> threading.Thread:
    thread = threading.Thread(target=_watch_gone, args=(job, marker, 110, gone), daemon=True)
    thread.start()
    return thread


def test_a_memory_failure_on_run_agent_is_retried_with_raised_memory_until_it_fits(tmp_path: Path) -> None:
    farm = agent_farm("agmem", NEEDS_4GB, frames=1, max_retries=0)
    with agent_process("agmem-host", farm, tmp_path), autocommit() as conn:
        with running_scheduler() as proc:
            launcher = get_launcher("q2")
            try:
                totals = drain(make_loop(proc.service, launcher, host_refresh_interval=0.2), 60)
            finally:
                launcher.close()
        # 1 GB: exit 33 -> 3 GB: exit 33 -> 5 GB: fits. Never DEAD, never charged a retry.
        assert conn.execute("SELECT str_state, int_retries, int_exit_status, str_reason FROM frame").fetchone() == (
            "SUCCEEDED",
            0,
            0,
            None,
        )
        assert scalar(conn, "SELECT int_mem_min FROM layer") == 5 * GB
        assert totals.booked == 3
        assert violations(conn) == []


@pytest.mark.one_server
def test_run_agent_kills_a_frame_past_its_timeout_and_one_whose_log_is_silent(tmp_path: Path) -> None:
    farm = agent_farm("agtmo", "true", frames=1)
    marker = f"agtmo-{os.getpid()}"
    show = scalar_show()
    with agent_process("agtmo-host", farm, tmp_path), autocommit() as conn, running_scheduler() as proc:
        job = submit_job(_timeout_spec(show, marker, farm["tags"]), user="alice").job_id  # type: ignore[arg-type]
        launcher = get_launcher("q2")
        loop = make_loop(proc.service, launcher, host_refresh_interval=0.2)
        gone: dict[str, float] = {}
        watcher = _watch(job, marker, gone)
        try:
            drain(loop, 120)
        finally:
            launcher.close()
            watcher.join(120)
        _check_timeouts(conn, job, marker, gone, "run_agent")
        assert violations(conn) == []


@pytest.mark.one_server
def test_rqd_frames_past_their_timeout_or_silent_past_timeout_llu_are_killed_and_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqt", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    marker = f"rqt-{os.getpid()}"
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqt-a"], tags=tags):
        with running_scheduler() as proc:
            job = submit_job(_timeout_spec(show, marker), user="alice").job_id
            launcher = get_launcher("rqd")
            # The launcher's status poll every second is the host report the timeouts are read from.
            loop = make_loop(proc.service, launcher, host_refresh_interval=0.2, lost_host_sweep_interval=1.0)
            gone: dict[str, float] = {}
            watcher = _watch(job, marker, gone)
            try:
                drain(loop, 120)
            finally:
                launcher.close()
                watcher.join(120)
            _check_timeouts(conn, job, marker, gone, "RQD")
            assert scalar(conn, "SELECT count(*) FROM proc") == 0
            assert violations(conn) == []


def scalar_show() -> str:
    with autocommit() as conn:
        return scalar(conn, "SELECT str_name FROM show")


@contextlib.contextmanager
def _xvfb() -> Iterator[str]:
    """A headless X display for RQD's NIMBY (its pynput listeners need one); xdotool types on it."""
    if not (shutil.which("Xvfb") and shutil.which("xdotool")):
        pytest.skip("Xvfb and xdotool are needed for RQD's NIMBY (apt-get install xvfb xdotool; .ci/run does)")
    display = f":{100 + os.getpid() % 800}"
    xvfb = subprocess.Popen(
        ["Xvfb", display, "-screen", "0", "640x480x16", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: (
                subprocess.run(
                    ["xdotool", "getmouselocation"], env={**os.environ, "DISPLAY": display}, capture_output=True
                ).returncode
                == 0
            ),
            10,
            "Xvfb to accept clients",
        )
        yield display
    finally:
        xvfb.terminate()
        xvfb.wait(10)


def test_rqd_nimby_locks_the_host_requeues_its_frames_without_a_retry_and_reopens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqn", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    marker = f"rqn-{os.getpid()}"
    done = tmp_path / "owner-gone"
    command = f"test -e {done} && exit 0; python3 -c 'import time; time.sleep(600)' {marker}"
    spec = {
        "show": show,
        "name": "rqn-v1",
        "user": "alice",
        "max_retries": 0,  # a NIMBY kill charged as a failure would make them DEAD
        "layers": [{"name": "main", "command": command, "range": "1-2", "cores": 1, "memory": "256MB"}],
    }
    with (
        _xvfb() as display,
        autocommit() as conn,
        gateway() as gw,
        rqd_daemons(conn, gw, tmp_path, ["rqn-a"], tags=tags, cores=2, nimby_display=display, nimby_idle=3) as daemons,
        running_scheduler() as proc,
    ):
        job = submit_job(spec, user="alice").job_id
        launcher = get_launcher("rqd")
        try:
            with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                assert loop.run_once().booked == 2
                wait_for(lambda: len(pids_of(marker)) == 2, 20, "RQD to start both frames")
                # The owner sits down: input on RQD's display, which its NIMBY listens to.
                started = time.monotonic()
                env = {**os.environ, "DISPLAY": display}
                subprocess.run(["xdotool", "mousemove", "50", "50"], env=env, check=True)
                subprocess.run(["xdotool", "mousemove", "120", "90"], env=env, check=True)
                wait_for(
                    lambda: scalar(conn, "SELECT str_lock_state FROM host") == "NIMBY_LOCKED", 20, "the NIMBY lock"
                )
                unbookable = time.monotonic() - started
                print(f"\n[figure] RQD: NIMBY on -> host NIMBY_LOCKED (unbookable) in {unbookable:.2f}s")
                wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 20, "RQD's reports of its NIMBY kills")
                assert pids_of(marker) == []
                rows = conn.execute("SELECT str_state, int_exit_status, int_retries, str_reason FROM frame").fetchall()
                assert [r[:3] for r in rows] == [("WAITING", 286, 0)] * 2 and all("NIMBY" in r[3] for r in rows)
                assert loop.run_once().booked == 0  # nothing booked on a NIMBY_LOCKED host
                done.touch()
                # RQD 1.37 unlocks only when free swap is at least 1 GB (MINIMUM_SWAP, which its
                # config cannot change); a machine with no swap stays locked for ever. So the owner
                # "leaves" by RQD's other way back: the daemon restarted with its NIMBY off, whose
                # reports say unlocked.
                rqd = daemons["rqn-a"]
                rqd.stop()
                rqd.nimby_display = None
                rqd.start()
                wait_registered(conn, rqd, 30)
                wait_for(lambda: scalar(conn, "SELECT str_lock_state FROM host") == "OPEN", 30, "the NIMBY unlock")
            totals = drain(make_loop(proc.service, launcher, host_refresh_interval=0.2), 60)
        finally:
            launcher.close()
        assert totals.booked == 2
        assert conn.execute("SELECT str_state, int_retries FROM frame").fetchall() == [("SUCCEEDED", 0)] * 2
        assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (job,)) == "FINISHED"
        actions = [
            r[0]
            for r in conn.execute(
                "SELECT str_action FROM cuesched_farm_action WHERE str_target_kind = 'host' ORDER BY id"
            )
        ]
        assert actions == ["nimby_lock", "nimby_unlock"]
        assert violations(conn) == []


def test_a_memory_failure_on_rqd_is_retried_with_raised_memory_until_it_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    show, tags = _farm("rqm", monkeypatch)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    spec = {
        "show": show,
        "name": "rqm-v1",
        "user": "alice",
        "max_retries": 0,  # a memory failure charged as a failure would make it DEAD
        "layers": [{"name": "main", "command": NEEDS_4GB, "range": "1", "memory": "1GB"}],
    }
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rqm-a"], tags=tags):
        with running_scheduler() as proc:
            submit_job(spec, user="alice")
            launcher = get_launcher("rqd")
            try:
                totals = drain(make_loop(proc.service, launcher, host_refresh_interval=0.2), 60)
            finally:
                launcher.close()
        # RQD reports exit 33 twice (1 GB, then 3 GB), then the frame fits in 5 GB.
        assert conn.execute("SELECT str_state, int_retries, int_exit_status FROM frame").fetchone() == (
            "SUCCEEDED",
            0,
            0,
        )
        assert scalar(conn, "SELECT int_mem_min FROM layer") == 5 * GB
        assert totals.booked == 3
        assert violations(conn) == []


def test_an_unknown_rqd_host_waits_retrying_until_an_operator_admits_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQD 1.37 retries its startup report every 15 s only on UNAVAILABLE and exits on any other
    answer: on main the unknown host was refused (INVALID_ARGUMENT) and the daemon was gone."""
    from django.core.management import call_command

    from dispatch.lab.rqdfarm import start_daemons

    _show, tags = _farm("rqw", monkeypatch)
    monkeypatch.delenv("CUESCHED_RQD_DEFAULT_ALLOC")
    with autocommit() as conn, gateway() as gw:
        alloc = scalar(conn, "SELECT str_name FROM alloc")
        daemons = start_daemons(["rqw-a"], gw.port, tmp_path, tags=tags, cores=2, memory_kb=4 * GB)
        rqd = daemons["rqw-a"]
        try:
            # Its startup report, then its retry 15 s later: the daemon is still there, and waiting.
            wait_for(
                lambda: (scalar(conn, "SELECT max(int_reports) FROM cuesched_waiting_host") or 0) >= 2,
                40,
                "RQD's second startup report",
            )
            assert rqd.alive()
            assert scalar(conn, "SELECT count(*) FROM host") == 0
            row = conn.execute(
                "SELECT str_name, str_address, int_cores, int_mem > 0 FROM cuesched_waiting_host"
            ).fetchone()
            assert row == ("rqw-a", f"127.0.0.1:{rqd.port}", 2, True)  # as its startup report described it
            assert gw.servicer.counts["waiting"] >= 2
            call_command("rqd_hosts", "admit", "rqw-a", "--alloc", alloc, "--user", "ops")
            assert scalar(conn, "SELECT count(*) FROM cuesched_waiting_host") == 0
            wait_registered(conn, rqd, 30)  # its next startup report (or status report) finds it known
            assert conn.execute(
                "SELECT a.str_name, h.int_cores FROM host h JOIN alloc a ON a.pk_alloc = h.pk_alloc"
            ).fetchone() == (alloc, 200)
            assert conn.execute(
                "SELECT str_action, str_target_name, str_username FROM cuesched_farm_action"
            ).fetchall() == [("admit_host", "rqw-a", "ops")]
        finally:
            rqd.stop()
