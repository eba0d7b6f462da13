"""The celery launcher: one message per booking on the booked host's own RabbitMQ queue.

The same agent role as q2 (`dispatch.agent.run_frame`), consumed by a Celery worker per host
(`manage.py run_agent --host NAME --transport celery`) with late acks and prefetch 1; for
farms with many machines, where thousands of agents polling one table would load the database.
Launch failures (a silent agent - the host is marked DOWN -, or the broker refusing the
publish) are returned for the loop to compensate. Completions, `running` and `kill` work as
in the q2 launcher: the agent writes the completion, and stops a frame whose proc is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg

from accounting import db as acct_db
from dispatch import conf
from dispatch.agent import queue_name, silent_hosts
from dispatch.launchers import register

if TYPE_CHECKING:
    from dispatch.completion import Completion
    from dispatch.dispatcher import Booking

logger = logging.getLogger(__name__)


@register("celery")
class CeleryLauncher:
    name = "celery"

    def __init__(self, *, agent_timeout: float | None = None) -> None:
        self.agent_timeout = conf.agent_timeout() if agent_timeout is None else agent_timeout
        self._conn: psycopg.Connection | None = None
        self.launched = 0
        self.launch_failures = 0

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = acct_db.connect(autocommit=True, application_name="cuesched-launcher-celery")
        return self._conn

    def _silent(self, bookings: Sequence[Booking]) -> dict[str, str]:
        hosts = sorted({b.host.pk for b in bookings})
        try:
            return silent_hosts(self._connection(), hosts, self.agent_timeout)
        except psycopg.Error as exc:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return dict.fromkeys(hosts, f"cannot check the agents ({exc})")

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        from dispatch.celery_app import RUN_FRAME, app

        silent = self._silent(bookings)
        failures = [(b, silent[b.host.pk]) for b in bookings if b.host.pk in silent]
        live = [b for b in bookings if b.host.pk not in silent]
        published = 0
        try:
            with app.producer_or_acquire() as producer:
                for b in live:
                    app.send_task(
                        RUN_FRAME,
                        args=[b.pk_proc, b.host.name],
                        queue=queue_name(b.host.name),
                        producer=producer,
                        retry=False,
                    )
                    published += 1
        except Exception as exc:  # the broker refused or is unreachable: the rest did not go out
            logger.warning("celery launcher: publish failed after %d of %d: %s", published, len(live), exc)
            failures += [(b, f"publish failed: {exc}") for b in live[published:]]
        self.launched += len(bookings) - len(failures)
        self.launch_failures += len(failures)
        return failures

    def poll_completions(self) -> list[Completion]:
        return []

    def next_due(self) -> float | None:
        return None

    def running(self) -> int:
        return 0

    def kill(self, pk_proc: str) -> None:
        logger.debug("celery launcher: proc %s released; its agent stops the frame when it sees the proc gone", pk_proc)

    def heartbeat(self, conn: psycopg.Connection) -> None:
        """Agents ping for themselves."""

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
