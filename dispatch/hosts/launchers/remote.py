"""What the q2 and celery launchers share: frames run on remote host agents.

The agents write each frame's end through `dispatch.engine.completion.complete` themselves, so a
remote launcher reports nothing back: `poll_completions` is empty and `running` is 0 (the
database's RUNNING frames are the truth). Before sending, it checks in one query that each
booked host's agent pinged recently; a silent host's bookings fail (the loop compensates
them). `kill` does nothing: every kill releases the proc first, and the agent stops a frame
whose proc is gone. Subclasses only say how a batch of live bookings is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg

from accounting import db as acct_db
from dispatch import conf
from dispatch.hosts.agent import silent_hosts

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking
    from dispatch.engine.completion import Completion


class RemoteLauncher:
    name = "remote"

    def __init__(self, *, agent_timeout: float | None = None) -> None:
        self.agent_timeout = conf.agent_timeout() if agent_timeout is None else agent_timeout
        self._conn: psycopg.Connection | None = None
        self.launched = 0
        self.launch_failures = 0

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = acct_db.connect(autocommit=True, application_name=f"cuesched-launcher-{self.name}")
        return self._conn

    def _silent(self, bookings: Sequence[Booking]) -> dict[str, str]:
        hosts = sorted({b.host.pk for b in bookings})
        try:
            return silent_hosts(self._connection(), hosts, self.agent_timeout)
        except psycopg.Error as exc:
            self.close()
            return dict.fromkeys(hosts, f"cannot check the agents ({exc})")

    def send(self, live: Sequence[Booking]) -> list[tuple[Booking, str]]:
        """Hand bookings whose agents are alive to the transport; returns those that failed."""
        raise NotImplementedError

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        silent = self._silent(bookings)
        failures = [(b, silent[b.host.pk]) for b in bookings if b.host.pk in silent]
        live = [b for b in bookings if b.host.pk not in silent]
        if live:
            failures += self.send(live)
        self.launched += len(bookings) - len(failures)
        self.launch_failures += len(failures)
        return failures

    def poll_completions(self) -> list[Completion]:
        return []  # the agents write completions themselves

    def next_due(self) -> float | None:
        return None

    def running(self) -> int:
        return 0  # the database's RUNNING frames are the truth

    def kill(self, pk_proc: str) -> None:
        """Nothing to do: the proc is already released, and its agent stops the frame when it sees that."""

    def heartbeat(self, conn: psycopg.Connection) -> None:
        """Agents ping for themselves."""

    def abandon(self) -> list[str]:
        return []  # the agents run the frames: they end or requeue them when they stop

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
