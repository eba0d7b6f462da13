"""Helpers for the first-hour tests: commands in subprocesses, and who is still alive after them.

A command's children may leave its process group (the demo starts each child in its own), so
"nothing outlives the command" is checked by an environment marker every process it starts
inherits, read from /proc (no psutil), and by the descendants seen while it ran.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from django.conf import settings

ROOT = Path(settings.BASE_DIR)
MARKER = "CUESCHED_TEST_MARKER"


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def held_port() -> socket.socket:
    """A listening socket of the test's own, on a port the kernel picked: a taken port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def new_marker() -> str:
    return uuid.uuid4().hex


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat): a pid plus this names one
    process even after the pid is reused."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    state = fields[0]
    return None if state == "Z" else fields[19]


def marked_processes(marker: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose environment carries `marker`."""
    needle = f"{MARKER}={marker}".encode()
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            if needle in env.split(b"\0") and _proc_start(int(entry)) is not None:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
    return out


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every live descendant of `root`, from the ppid links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: dict[int, str] = {}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            start = _proc_start(child)
            if start is not None:
                out[child] = start
                stack.append(child)
    return out


def still_alive(seen: dict[int, str]) -> list[int]:
    """Those of `seen` (pid: start time) that are still the same live process."""
    return [pid for pid, start in seen.items() if _proc_start(pid) == start]


def command_env(marker: str, **extra: str) -> dict[str, str]:
    from tests.integration.agent_support import database_url_for_agents

    env = dict(os.environ)
    env.update(
        {MARKER: marker, "DATABASE_URL": database_url_for_agents(), "CUESCHED_LOG_LEVEL": "INFO", **extra},
    )
    return env


def manage(args: list[str], env: dict[str, str], output: Path) -> subprocess.Popen[bytes]:
    """`manage.py ARGS` in its own session, stdout and stderr to `output`."""
    with open(output, "wb") as fh:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_marked(marker: str) -> None:
    """Clean up after a failed assertion: SIGKILL whatever carries the marker."""
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
