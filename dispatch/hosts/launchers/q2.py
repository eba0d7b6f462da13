"""The q2 launcher: one django-q2 task per booking, on the booked host's own queue (ORM broker).

Flow of one frame: the loop commits the booking (proc row, frame RUNNING, host idle taken),
then `launch` checks that the host has a live agent (host_stat.ts_ping within
`CUESCHED_AGENT_TIMEOUT`) and inserts a signed task `dispatch.hosts.agent.run_frame(pk_proc, host)`
into django-q2's queue table under the host's queue name (`dispatch.hosts.agent.queue_name`). The
host's agent (`manage.py run_agent --host NAME`, a django-q2 cluster on that queue) runs the
frame and writes its end through `dispatch.engine.completion.complete` itself.

So nothing comes back through this launcher: `poll_completions` is always empty and
`running` is 0 (the database's RUNNING frames are the truth, which the loop's exit-when-idle
check reads). The loop sees the freed host at its next host-view reload
(`CUESCHED_HOST_REFRESH_INTERVAL`), and the Store hears the proc delete's release trigger.

A launch fails (and the loop compensates it) when the host's agent is silent - the host is
then marked DOWN so it is not booked again until its agent pings - or when the enqueue fails.
`kill` (`RemoteLauncher.kill`) ends a killed run whose task has not started; a running one is
stopped by its agent, which sees the proc's kill mark within `CUESCHED_AGENT_KILL_POLL` seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg

from dispatch.engine.launcher import register
from dispatch.hosts.agent import queue_name
from dispatch.hosts.launchers.remote import RemoteLauncher

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking

logger = logging.getLogger(__name__)

TASK_FUNC = "dispatch.hosts.agent.run_frame"
# django-q2 saves a task's result with its name in a varchar(100) (django_q_task.name): a longer
# name makes that save fail with a DataError and the result is lost, though the frame ran.
TASK_NAME_MAX = 100


def task_name(pk_proc: str, host: str) -> str:
    """What django-q2's admin lists the task as: the proc and its host, never over its column.

    No humanhash: the proc id already names the task uniquely, and the hash's four words (up to
    55 characters) are what used to push a 45-character host name over the column's 100."""
    return f"proc {pk_proc} on {host}"[:TASK_NAME_MAX]


@register("q2")
class Q2Launcher(RemoteLauncher):
    name = "q2"

    def send(self, live: Sequence[Booking]) -> list[tuple[Booking, str]]:
        try:
            enqueue(self._connection(), live)
        except Exception as exc:
            logger.exception("q2 launcher: enqueue of %d tasks failed", len(live))
            if self._conn is not None and self._conn.broken:
                self._conn = None
            return [(b, f"enqueue failed: {exc}") for b in live]
        return []


# django-q2's ORM broker table: a task is a row of its queue (key), free to take once `lock` is past.
ENQUEUE_SQL = """
INSERT INTO django_q_ormq (key, payload, lock)
SELECT * FROM unnest(%(key)s::text[], %(payload)s::text[], %(lock)s::timestamptz[])
"""


def task_package(pk_proc: str, host: str) -> str:
    """The signed package `django_q.tasks.async_task` would enqueue for `run_frame(pk_proc, host)`."""
    from django.utils import timezone
    from django_q.humanhash import uuid as q_uuid
    from django_q.signing import SignedPackage

    _, task_id = q_uuid()
    task = {
        "id": task_id,
        "name": task_name(pk_proc, host),
        "func": TASK_FUNC,
        "args": (pk_proc, host),
        "kwargs": {},
        "ack_failure": True,
        "started": timezone.now(),
    }
    return SignedPackage.dumps(task)


def enqueue(conn: psycopg.Connection, bookings: Sequence[Booking]) -> None:
    """One django-q2 task per booking on its host's queue, in one statement on our own
    connection (not through `async_task`, which would write one row per call on the loop
    thread's Django connection)."""
    from django.utils import timezone

    now = timezone.now()
    params = {
        "key": [queue_name(b.host.name) for b in bookings],
        "payload": [task_package(b.pk_proc, b.host.name) for b in bookings],
        "lock": [now] * len(bookings),
    }
    with conn.cursor() as cur:
        cur.execute(ENQUEUE_SQL, params)
