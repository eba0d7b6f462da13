"""Issue 28, memory that follows use: real frames on a real agent (`run_agent`) and a real RQD.

A frame books its layer's minimum memory. Before, nothing acted on what it really used: the
agents measured no memory at all, RQD's reported RSS was only recorded, so a frame that
allocated past its reservation kept the small reservation (the host's idle memory read HIGH and
was booked again), and a frame that took its host out of memory was left to the kernel's OOM
killer, which picks any process. Now the reservation grows to the RSS of the frame's process
tree (and the host's idle memory with it, one transaction), and a host running out of memory
loses the frame furthest over its reservation first, recorded as a memory failure (exit 33).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import psycopg
import pytest

from dispatch.engine.completion import EXIT_STATUS_MEMORY_FAILURE
from dispatch.engine.launcher import get_launcher
from tests.integration.agent_support import agent_farm, agent_process
from tests.integration.dispatch_support import autocommit, make_loop, scalar, violations, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

MB = 1024  # KB
MEMORY_ENV = {"CUESCHED_AGENT_MEMORY_INTERVAL": "0.2"}


def allocating(total_mb: int, *, step_mb: int, until: Path | None = None) -> str:
    """A frame command: allocate (and touch) `total_mb` in steps, then hold it until `until`
    exists (or 60 s), then exit 0."""
    wait = f"os.path.exists({str(until)!r})" if until else "False"
    code = (
        "import os, time\n"
        "held = []\n"
        f"for _ in range({total_mb // step_mb}):\n"
        f"    held.append(bytearray(b'\\x01') * ({step_mb} << 20))\n"
        "    time.sleep(0.05)\n"
        "deadline = time.time() + 60\n"
        f"while not {wait} and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def _ledger(conn: psycopg.Connection, host: str) -> tuple[int, int, int]:
    return conn.execute(
        "SELECT h.int_mem, h.int_mem_idle, COALESCE((SELECT SUM(int_mem_reserved) FROM proc p"
        " WHERE p.pk_host = h.pk_host), 0)::bigint FROM host h WHERE h.str_name = %s",
        (host,),
    ).fetchone()


def _book_one(transport: str) -> None:
    from tests.integration.runtime_support import running_scheduler

    with running_scheduler() as proc:
        launcher = get_launcher(transport)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()


def test_an_agent_frame_that_allocates_past_its_reservation_gets_it_and_the_ledger_holds(tmp_path: Path) -> None:
    """Reserved 64 MB, the frame takes 300 MB: its reservation becomes its RSS (>= 300 MB), the
    host's idle memory is its memory less that, and the frame ends SUCCEEDED."""
    release = tmp_path / "release"
    farm = agent_farm("mfugrow", allocating(300, step_mb=50, until=release), frames=1, max_retries=0)
    host = "mfugrow-host"
    with autocommit() as conn:
        conn.execute("UPDATE layer SET int_mem_min = %s", (64 * MB,))
        with agent_process(host, farm, tmp_path, memory="2G", env_extra=MEMORY_ENV):
            _book_one("q2")
            assert scalar(conn, "SELECT int_mem_reserved FROM proc") == 64 * MB
            wait_for(
                lambda: scalar(conn, "SELECT COALESCE(MAX(int_mem_reserved), 0) FROM proc") >= 300 * MB,
                30,
                "the reservation to follow the frame's RSS",
            )
            mem, idle, reserved = _ledger(conn, host)
            used = scalar(conn, "SELECT int_mem_used FROM proc")
            assert reserved >= 300 * MB and used >= 300 * MB
            assert idle == mem - reserved, (mem, idle, reserved)
            release.touch()
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 30, "the frame to end")
        assert conn.execute("SELECT str_state, int_exit_status FROM frame").fetchone() == ("SUCCEEDED", 0)
        mem, idle, reserved = _ledger(conn, host)
        assert (idle, reserved) == (mem, 0)
        assert violations(conn) == []


def test_an_agent_frame_that_would_take_its_host_out_of_memory_is_killed_as_exit_33(tmp_path: Path) -> None:
    """A 512 MB host; the frame climbs towards 800 MB. Before the host runs out, it is killed for
    memory: its end is a failure with exit 33 (no retry left: DEAD), its log says why, and the
    ledger never passed the host's memory."""
    farm = agent_farm("mfukill", allocating(800, step_mb=20), frames=1, max_retries=0)
    host = "mfukill-host"
    with autocommit() as conn:
        conn.execute("UPDATE layer SET int_mem_min = %s", (64 * MB,))
        with agent_process(host, farm, tmp_path, memory="512M", env_extra=MEMORY_ENV):
            _book_one("q2")
            peak = 0

            def ended() -> bool:
                nonlocal peak
                mem, idle, reserved = _ledger(conn, host)
                assert reserved <= mem and idle == max(0, mem - reserved), (mem, idle, reserved)
                peak = max(peak, reserved)
                return scalar(conn, "SELECT count(*) FROM proc") == 0

            wait_for(ended, 60, "the frame to be killed for memory")
            assert peak > 64 * MB  # it grew first, from the host's idle memory
        assert conn.execute("SELECT str_state, int_exit_status FROM frame").fetchone() == (
            "DEAD",
            EXIT_STATUS_MEMORY_FAILURE,
        )
        log = next(tmp_path.rglob("*.log")).read_text()
        assert "killed: a kill of proc" in log and "for memory" in log
        mem, idle, reserved = _ledger(conn, host)
        assert (idle, reserved) == (mem, 0)
        assert violations(conn) == []


def test_an_rqd_frame_grows_its_reservation_then_is_killed_as_exit_33_before_its_host_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real RQD (512 MB host): the frame takes 200 MB (reserved 64 MB): its reservation follows
    RQD's RSS; then it climbs to 600 MB, more than the host has: it is killed for memory, and RQD's
    completion report of the kill ends it as exit 33."""
    from dispatch.jobs.submit import submit_job
    from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
    from tests.integration.rqd_support import gateway, rqd_daemons
    from tests.integration.runtime_support import running_scheduler

    seed_farm(FarmSpec(prefix="mfr", managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
    with autocommit() as conn:
        alloc, tag = conn.execute("SELECT str_name, str_tag FROM alloc").fetchone()
    monkeypatch.setenv("CUESCHED_RQD_DEFAULT_ALLOC", alloc)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    go = tmp_path / "grow-more"
    code = (
        "import os, time\n"
        "held = [bytearray(b'\\x01') * (200 << 20)]\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.05)\n"
        "held.append(bytearray(b'\\x01') * (400 << 20))\n"
        "time.sleep(120)\n"
    )
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    # Not threadable: a threadable frame on this 512 MB host books every idle core (its memory
    # strands them), and RQD, told CUE_THREADABLE=1 as Cuebot tells it, pins a threadable frame to
    # that many physical cores, which a lab RQD claiming 4 cores on a smaller machine lacks.
    layer = {"name": "main", "command": command, "range": "1", "cores": 1, "memory": "64MB", "threadable": False}
    spec = {"show": show_name("mfr", 0), "name": "mfr-v1", "user": "alice", "layers": [layer]}
    with (
        autocommit() as conn,
        gateway() as gw,
        rqd_daemons(conn, gw, tmp_path, ["mfr-a"], tags=[tag], memory_kb=512 * MB),
    ):
        # RQD's boot report gives the machine's real memory (its OVERRIDE_MEMORY does not reach
        # it): the host is made a 512 MB one, as an operator's smaller host would report.
        conn.execute("UPDATE host SET int_mem = %s WHERE str_name = 'mfr-a'", (512 * MB,))
        job = submit_job(spec, user="alice").job_id
        conn.execute("UPDATE job SET int_max_retries = 0 WHERE pk_job = %s", (job,))
        with running_scheduler() as proc:
            launcher = get_launcher("rqd")
            try:
                with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                    assert loop.run_once().booked == 1
                # RQD samples RSS every few seconds; the launcher's status poll brings it here.
                wait_for(
                    lambda: (
                        (launcher.heartbeat(conn), scalar(conn, "SELECT COALESCE(MAX(int_mem_reserved), 0) FROM proc"))[
                            1
                        ]
                        >= 200 * MB
                    ),
                    45,
                    "the reservation to follow RQD's RSS",
                )
                mem, idle, reserved = _ledger(conn, "mfr-a")
                assert idle == mem - reserved and reserved >= 200 * MB
                go.touch()
                wait_for(
                    lambda: (launcher.heartbeat(conn), scalar(conn, "SELECT count(*) FROM proc"))[1] == 0,
                    60,
                    "the frame to be killed for memory and RQD to report its end",
                )
            finally:
                launcher.close()
        assert conn.execute("SELECT str_state, int_exit_status FROM frame WHERE pk_job = %s", (job,)).fetchone() == (
            "DEAD",
            EXIT_STATUS_MEMORY_FAILURE,
        )
        mem, idle, reserved = _ledger(conn, "mfr-a")
        assert (idle, reserved) == (mem, 0)
        assert violations(conn) == []
