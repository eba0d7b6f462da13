"""What the q2 and celery launchers share: frames run on remote host agents.

The agents write each frame's end through `dispatch.engine.completion.complete` themselves, so a
remote launcher reports nothing back: `poll_completions` is empty and `running` is 0 (the
database's RUNNING frames are the truth). Before sending, it checks in one query that each
booked host's agent pinged recently; a silent host's bookings fail (the loop compensates
them). Subclasses only say how a batch of live bookings is sent.

`kill` (from the kill sender, `dispatch.engine.kills`): the database is the agents' transport,
so the kill mark on the proc is what a running frame's agent sees at its next kill poll
(`CUESCHED_AGENT_KILL_POLL`, default 1 s): it ends the process group and reports the end, which
the completion path records as killed. What `kill` itself does is the revoke of a task that has
not started: it tries the run's lock (`pg_try_advisory_lock`, which every run holds for its
whole life on its own connection). Free, no run of the proc is in progress, so this ends the
proc killed now, while holding the lock (a task delivered later finds its proc gone and runs
nothing); held, the run is in progress and its agent stops it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, complete
from dispatch.hosts.agent import RUN_UNLOCK_SQL, TRY_RUN_LOCK_SQL, silent_hosts

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking
    from dispatch.engine.kills import RunKill


class RemoteLauncher:
    name = "remote"

    def __init__(self, *, agent_timeout: float | None = None) -> None:
        self.agent_timeout = conf.agent_timeout() if agent_timeout is None else agent_timeout
        self._conn: psycopg.Connection | None = None
        self._kill_conn: psycopg.Connection | None = None  # the kill sender's thread only
        self.revoked = 0  # kills that ended a run that had not started
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
            if self._conn is not None:
                self._conn.close()
            self._conn = None
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

    def kill(self, runs: Sequence[RunKill]) -> None:
        """End now the runs that have not started (their run lock is free); see the module doc."""
        if not runs:
            return
        try:
            if self._kill_conn is None or self._kill_conn.closed or self._kill_conn.broken:
                self._kill_conn = acct_db.connect(autocommit=True, application_name=f"cuesched-kill-{self.name}")
            conn = self._kill_conn
            free = [r.pk_proc for r in runs if conn.execute(TRY_RUN_LOCK_SQL, (r.pk_proc,)).fetchone()[0]]
            try:
                if free:
                    result = complete(conn, [Completion(pk, EXIT_STATUS_KILLED) for pk in free])
                    self.revoked += result.released
            finally:
                for pk in free:
                    conn.execute(RUN_UNLOCK_SQL, (pk,))
        except psycopg.Error as exc:
            # The kill mark stays: the agent still sees it, and the sender tries again.
            logger.warning("%s launcher: kill of %d run(s) failed (%s); sent again later", self.name, len(runs), exc)
            if self._kill_conn is not None:
                self._kill_conn.close()
            self._kill_conn = None

    def heartbeat(self, conn: psycopg.Connection) -> None:
        """Agents ping for themselves."""

    def abandon(self) -> list[str]:
        return []  # the agents run the frames: they end or requeue them when they stop

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._kill_conn is not None:
            self._kill_conn.close()
            self._kill_conn = None
