"""Real frames through a Celery host agent (RabbitMQ on 127.0.0.1:5672, one queue per host).

The same checks as the q2 agent's: `run_agent --transport celery` in a subprocess, the real
dispatch loop with the celery launcher. Skipped, saying why, when no RabbitMQ answers.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dispatch import conf
from tests.integration.test_agents_q2 import check_kill, check_real_frames

pytestmark = pytest.mark.django_db(transaction=True)


def _rabbitmq_reachable() -> str | None:
    url = urlsplit(conf.celery_broker_url())
    host, port = url.hostname or "127.0.0.1", url.port or 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"RabbitMQ at {host}:{port} is unreachable ({exc}); set CUESCHED_CELERY_BROKER"
    return None


@pytest.fixture(autouse=True)
def _needs_rabbitmq() -> None:
    reason = _rabbitmq_reachable()
    if reason:
        pytest.skip(reason)


def test_real_frames_run_through_a_celery_agent_with_exit_status_retries_and_logs(tmp_path: Path) -> None:
    check_real_frames("celery", tmp_path)


def test_a_running_frame_is_killed_through_its_celery_agent(tmp_path: Path) -> None:
    check_kill("celery", tmp_path)
