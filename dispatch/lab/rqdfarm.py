"""Real OpenCue RQD daemons on this machine: `python -m rqd -c <conf>` in subprocesses.

For the RQD tests, `bench_rqd` and the stress drain's `--launcher rqd` variant. Each daemon gets
its own config file, its own gRPC port (advertised to the gateway with an `rqdport-N` tag),
OVERRIDE_CUEBOT/CUEBOT_GRPC_PORT pointing at a gateway, a host name of its own
(OVERRIDE_HOSTNAME: several daemons on one machine stand for several hosts), NIMBY off
(`--nimbyoff` and OVERRIDE_NIMBY), and RQD_BECOME_JOB_USER off, so it runs frames as the
current user - root in CI - without trying to switch to the job's user or drop to `daemon`.

A daemon started with `nimby_display` (an X display, such as a headless Xvfb's) runs RQD's own
NIMBY instead (OVERRIDE_NIMBY on, no `--nimbyoff`): its pynput listeners watch that display, so
any input there (`xdotool mousemove`) locks the host as a user sitting down at it would. RQD 1.37
unlocks after `nimby_idle` seconds without input (MINIMUM_IDLE, checked every second) only where
at least 1 GB of swap is free (its MINIMUM_SWAP, not configurable): on a machine without swap the
lock holds until the daemon restarts with its NIMBY off.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rqd:
    name: str
    port: int
    config: Path
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    nimby_display: str | None = None

    def start(self) -> Rqd:
        out = open(self.log, "ab")  # the daemon keeps its own copy of the descriptor
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
        argv = [sys.executable, "-m", "rqd", "-c", str(self.config)]
        if self.nimby_display:
            env["DISPLAY"] = self.nimby_display
        else:
            argv.append("--nimbyoff")
        self.popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        out.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the daemon alone (SIGKILL: its frames' process groups are left to themselves)."""
        if self.alive():
            assert self.popen is not None
            os.kill(self.popen.pid, sig)
            self.popen.wait(15)

    def stop(self) -> None:
        if self.alive():
            assert self.popen is not None
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)


def write_config(
    path: Path,
    *,
    name: str,
    port: int,
    gateway_port: int,
    cores: int,
    memory_kb: int,
    tags: list[str],
    nimby_idle: int | None = None,
) -> None:
    path.write_text(
        "[Override]\n"
        f"OVERRIDE_HOSTNAME = {name}\n"
        "OVERRIDE_CUEBOT = 127.0.0.1\n"
        f"CUEBOT_GRPC_PORT = {gateway_port}\n"
        f"RQD_GRPC_PORT = {port}\n"
        f"OVERRIDE_CORES = {cores}\n"
        "OVERRIDE_PROCS = 1\n"
        f"OVERRIDE_MEMORY = {memory_kb}\n"
        + (
            f"OVERRIDE_NIMBY = True\nMINIMUM_IDLE = {nimby_idle}\nCHECK_INTERVAL_LOCKED = 1\n"
            if nimby_idle is not None
            else "OVERRIDE_NIMBY = False\n"
        )
        + "OVERRIDE_IS_DESKTOP = False\n"
        "RQD_BECOME_JOB_USER = False\n"
        "RQD_USE_PATH_ENV_VAR = True\n"
        f"RQD_TAGS = {' '.join([*tags, f'rqdport-{port}'])}\n"
        "CONSOLE_LOG_LEVEL = INFO\n"
    )


REGISTERED_SQL = (
    "SELECT count(*) FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host"
    " WHERE h.str_name = %s AND h.str_rqd_address = %s AND hs.ts_ping > now() - interval '5 seconds'"
)


def wait_registered(conn: psycopg.Connection, rqd: Rqd, timeout: float) -> None:
    """Until the daemon's startup report registered its host with its address (or it died)."""
    deadline = time.monotonic() + timeout
    while True:
        if not rqd.alive():
            raise RuntimeError(f"rqd {rqd.name} exited: {rqd.log.read_text()[-3000:]}")
        row = conn.execute(REGISTERED_SQL, (rqd.name, f"127.0.0.1:{rqd.port}")).fetchone()
        if row and row[0]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rqd {rqd.name} did not report its startup within {timeout}s")
        time.sleep(0.05)


def start_daemons(
    names: list[str],
    gateway_port: int,
    tmp: Path,
    *,
    tags: list[str],
    cores: int,
    memory_kb: int,
    nimby_display: str | None = None,
    nimby_idle: int = 5,
) -> dict[str, Rqd]:
    daemons: dict[str, Rqd] = {}
    for name in names:
        port = free_port()
        config = tmp / f"{name}.conf"
        write_config(
            config,
            name=name,
            port=port,
            gateway_port=gateway_port,
            cores=cores,
            memory_kb=memory_kb,
            tags=tags,
            nimby_idle=nimby_idle if nimby_display else None,
        )
        daemons[name] = Rqd(name, port, config, tmp / f"{name}.out", nimby_display=nimby_display).start()
    return daemons


def pids_of(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a frame's own command)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and "pytest" not in cmdline:
            out.append(int(entry.name))
    return out
