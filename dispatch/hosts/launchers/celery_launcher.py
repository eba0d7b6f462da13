"""The celery launcher: one message per booking on the booked host's own RabbitMQ queue.

The same agent role as q2 (`dispatch.hosts.agent.run_frame`), consumed by a Celery worker per host
(`manage.py run_agent --host NAME --transport celery`) with late acks and prefetch 1; for
farms with many machines, where thousands of agents polling one table would load the database.
Launch failures (a silent agent - the host is marked DOWN -, or the broker refusing the
publish) are returned for the loop to compensate. Completions, `running` and `kill` work as
in the q2 launcher (`RemoteLauncher`): the agent writes the completion, and stops a frame whose
proc is marked for a kill or gone; a killed task that has not started is ended by `kill`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dispatch.engine.launcher import register
from dispatch.hosts.agent import queue_name
from dispatch.hosts.launchers.remote import RemoteLauncher

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking

logger = logging.getLogger(__name__)


@register("celery")
class CeleryLauncher(RemoteLauncher):
    name = "celery"

    def send(self, live: Sequence[Booking]) -> list[tuple[Booking, str]]:
        from dispatch.hosts.celery_app import RUN_FRAME, app

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
            return [(b, f"publish failed: {exc}") for b in live[published:]]
        return []
