"""`./dev stop` (issue 21, item 6) on an embedded server of the test's own.

`CUESCHED_PGDATA` points the embedded server at a temporary directory, so the checkout's own
server (`.cuesched/pgdata`, shared by whoever works in it) is never started or stopped here.
The script is run as a newcomer runs it; no Django database is involved.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pgdata(tmp_path: Path) -> Iterator[Path]:
    # Short: the server's Unix socket lives under it, and socket paths are limited to ~100 bytes.
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"cs-stop-{os.getpid()}-{tmp_path.name[-12:]}"
    yield path / "pgdata"
    _pg_ctl_stop(path / "pgdata")
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _env(pgdata: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    env["CUESCHED_PGDATA"] = str(pgdata)
    return env


def _dev_stop(pgdata: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["./dev", "stop", *args], cwd=ROOT, env=_env(pgdata), capture_output=True, text=True, timeout=120
    )


def _start(pgdata: Path) -> tuple[str, int]:
    code = "from cuesched_project import embedded_db as e; s = e.ensure_running(); print(s.socket_dir, s.port)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(pgdata), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    socket_dir, port = out.stdout.split()
    return socket_dir, int(port)


def _running(pgdata: Path) -> bool:
    pidfile = pgdata / "postmaster.pid"
    if not pidfile.exists():
        return False
    pid = int(pidfile.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pg_ctl_stop(pgdata: Path) -> None:
    """Clean-up only, if a test failed with its server up."""
    if _running(pgdata):
        os.kill(int((pgdata / "postmaster.pid").read_text().split()[0]), 15)


def _log_size(pgdata: Path) -> int:
    log = pgdata / "log"
    return log.stat().st_size if log.exists() else 0


def test_dev_stop_says_what_it_found_and_never_starts_the_server(pgdata: Path) -> None:
    out = _dev_stop(pgdata)
    assert out.returncode == 0, out.stderr
    assert "no embedded PostgreSQL" in out.stdout and "nothing to stop" in out.stdout
    assert not (pgdata / "PG_VERSION").exists()

    _start(pgdata)
    assert _running(pgdata)
    out = _dev_stop(pgdata)
    assert out.returncode == 0, out.stderr
    assert "stopped the embedded PostgreSQL" in out.stdout
    assert not _running(pgdata)

    size = _log_size(pgdata)
    out = _dev_stop(pgdata)
    assert out.returncode == 0, out.stderr
    assert "is not running: nothing to stop" in out.stdout
    assert not _running(pgdata)
    assert _log_size(pgdata) == size  # no start-up (and shut-down) was logged: it was never started


def test_dev_stop_refuses_while_sessions_are_connected_unless_forced(pgdata: Path) -> None:
    socket_dir, port = _start(pgdata)
    client = psycopg.connect(
        host=socket_dir, port=port, user="postgres", dbname="postgres", application_name="cuesched-web-test"
    )
    try:
        out = _dev_stop(pgdata)
        assert out.returncode == 1, out.stdout
        assert "1 other session(s) connected" in out.stdout and "cuesched-web-test" in out.stdout
        assert "--force" in out.stdout
        assert _running(pgdata)
        assert client.execute("SELECT 1").fetchone() == (1,)  # the session was not cut off

        out = _dev_stop(pgdata, "--force")
        assert out.returncode == 0, out.stdout
        assert "cutting 1 session(s) off (--force)" in out.stdout
        assert not _running(pgdata)
    finally:
        client.close()
