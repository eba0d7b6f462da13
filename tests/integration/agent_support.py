"""Helpers for the host-agent tests: a farm with no host of its own, an agent in a subprocess.

The agent is the real `manage.py run_agent` on the test database (its DATABASE_URL is built
from the test connection's settings), so the frames really run through the broker: the
database for q2, RabbitMQ for celery.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from django.conf import settings
from django.db import connection

from cuesched_project.dburl import url_from_settings
from dispatch.engine.placement import parse_tags
from tests.integration.dispatch_support import scalar, seed, wait_for

ROOT = Path(settings.BASE_DIR)


def database_url_for_agents() -> str:
    return url_from_settings(connection.settings_dict)


def agent_farm(prefix: str, command: str, *, frames: int = 3, max_retries: int = 1) -> dict[str, object]:
    """One managed show, one alloc, one job of one 1-core layer running `command`, no host."""
    seed_ = seed(
        prefix,
        hosts=0,
        jobs=1,
        layers=1,
        allocs=1,
        frames_per_layer=frames,
        manual_tags=1,
        layer_cores_choices=(1,),
        layer_mem_gb_choices=(1,),
    )
    with psycopg.connect(_conninfo(), autocommit=True) as conn:
        conn.execute("UPDATE layer SET str_cmd = %s", (command,))
        conn.execute("UPDATE job SET int_max_retries = %s", (max_retries,))
        alloc = scalar(conn, "SELECT str_name FROM alloc")
        tags = sorted(parse_tags(scalar(conn, "SELECT str_tags FROM layer")))
    return {"seed": seed_, "alloc": alloc, "tags": tags}


def _conninfo() -> str:
    from accounting import db

    return db.conninfo()


@contextmanager
def agent_process(
    host: str,
    farm: dict[str, object],
    log_root: Path,
    *,
    transport: str = "q2",
    cores: int = 4,
    memory: str = "16G",
    env_extra: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`run_agent` for `host` in a subprocess; yields once its host has pinged, stops it after."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url_for_agents(),
        CUESCHED_AGENT_LOG_ROOT=str(log_root),
        CUESCHED_AGENT_KILL_POLL="0.1",
        CUESCHED_AGENT_KILL_GRACE="2",
        CUESCHED_LOG_LEVEL="WARNING",
    )
    env.update(env_extra or {})
    argv = [sys.executable, "manage.py", "run_agent", "--host", host, "--transport", transport]
    argv += ["--alloc", str(farm["alloc"]), "--tags", " ".join(farm["tags"]), "--cores", str(cores)]  # type: ignore[arg-type]
    argv += ["--memory", memory, "--heartbeat", "0.3"]
    popen = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        with psycopg.connect(_conninfo(), autocommit=True) as conn:

            def pinged() -> bool:
                assert popen.poll() is None, f"run_agent exited with {popen.returncode}"
                return bool(
                    scalar(
                        conn,
                        "SELECT count(*) FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host"
                        " WHERE h.str_name = %s AND hs.ts_ping > now() - interval '2 seconds'",
                        (host,),
                    )
                )

            wait_for(pinged, 20, f"agent {host} to register and ping")
        yield popen
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGTERM)
            try:
                popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(5)
