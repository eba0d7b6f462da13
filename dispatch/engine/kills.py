"""A kill is not a release: the kill mark, and the scheduler's thread that sends kills to hosts.

A frame's proc is the record that its cores are taken. Deleting it when a kill is asked for
(what cuesched did before) said the cores were free while the process still ran, until its
host got round to stopping it: RQD only at its next status report, seconds later, while the
freed cores were booked again. So a kill now

1. **marks** the run's proc in the kill's own transaction (`dispatch.jobs.actions.kill_job` /
   `kill_frames`): `proc.ts_kill` (when it was asked for) and `proc.str_kill` (what the frame
   becomes when the run has ended: `JOB`, eaten, or `FRAME`, back to WAITING), and sends a hint on
   `cuesched_kill`. The proc stays booked, counted by every counter; a job kill also finishes the
   job and eats its frames that have not started, so nothing of it is booked again. The mark is
   durable: a scheduler or web process that dies after the commit loses nothing;
2. is **sent** by the scheduler, which holds the launchers (`KillSender`, a thread of
   `run_scheduler`'s dispatch): it LISTENs on `cuesched_kill` and also reads the marked procs every
   `CUESCHED_KILL_POLL` seconds (the table is the truth, the notification only wakes it), and sends
   each marked run's kill through the launcher of its host's shard, again every
   `CUESCHED_KILL_RESEND` seconds until the proc is gone (a host that did not answer, or a
   launch that was still on its way, is retried). A web process or a command issues a kill with no
   launcher: it only writes the mark, and the scheduler's sender picks it up within the poll
   (at once, through the notification);
3. is **ended** by the run's real end: its completion report (an agent's, RQD's FrameComplete
   through the gateway) deletes the proc the usual way, and `dispatch.engine.completion` records
   a marked run that did not exit 0 as killed (exit 301, no retry counted, never a failure). A
   host that never reports is swept as lost (`CUESCHED_LOST_HOST_TIMEOUT`), recorded killed too.

Races, each decided by the proc row's lock (a kill's UPDATE and a completion's DELETE of one
proc serialise on it, whichever comes first, and the DELETE reads the mark from the row it
deletes): a completion that wins ends the frame as it ended (the kill then finds no proc and has
nothing to send); a completion that loses is recorded killed. A kill of a run whose launch is
still in flight is resent until the host has it (RQD answers NOT_FOUND, or ignores a kill that
comes before the frame's pid, until then); a launcher that sees the mark before it launches does
not launch and ends the run killed itself. A kill sent twice is harmless on every launcher.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine.placement import in_shard, shard_params

if TYPE_CHECKING:
    from dispatch.engine.launcher import Launcher

logger = logging.getLogger(__name__)

KILL_CHANNEL = "cuesched_kill"
KILL_JOB = "JOB"  # the frame is eaten when its run ends (the job is finished)
KILL_FRAME = "FRAME"  # the frame goes back to WAITING when its run ends (runs again elsewhere)

# A job kill marks every proc of the job; a frame kill never downgrades a job kill's mark.
# ts_kill keeps the first request's time (how long a kill has been waiting is measured from it).
MARK_JOB_SQL = f"""
UPDATE proc SET ts_kill = COALESCE(ts_kill, now()), str_kill = '{KILL_JOB}'
WHERE pk_job = %(job)s AND str_kill IS DISTINCT FROM '{KILL_JOB}'
RETURNING pk_proc
"""
MARK_FRAMES_SQL = f"""
UPDATE proc SET ts_kill = COALESCE(ts_kill, now()), str_kill = COALESCE(str_kill, '{KILL_FRAME}')
WHERE pk_job = %(job)s
  AND pk_frame IN (SELECT pk_frame FROM frame WHERE pk_job = %(job)s
                   AND (pk_frame = ANY(%(frames)s::text[]) OR str_name = ANY(%(frames)s::text[])))
RETURNING pk_proc
"""
KILLING_OF_JOB_SQL = "SELECT pk_proc FROM proc WHERE pk_job = %s AND ts_kill IS NOT NULL ORDER BY pk_proc"
NOTIFY_SQL = f"SELECT pg_notify('{KILL_CHANNEL}', %s)"

# The sender's read: the marked procs of one shard of hosts, oldest request first.
PENDING_SQL = f"""
SELECT p.pk_proc, p.pk_frame, p.pk_host, h.str_name, h.str_rqd_address, p.str_kill,
       EXTRACT(EPOCH FROM now() - p.ts_kill)::float8
FROM proc p JOIN host h ON h.pk_host = p.pk_host
WHERE p.ts_kill IS NOT NULL AND {in_shard("p.pk_host")}
ORDER BY p.ts_kill, p.pk_proc
LIMIT %(limit)s
"""
PENDING_LIMIT = 5000


@dataclass(frozen=True, slots=True)
class RunKill:
    """One run to stop on its host: what every launcher needs to reach it."""

    pk_proc: str
    pk_frame: str
    pk_host: str
    host: str
    rqd_address: str | None
    kind: str
    age: float  # seconds since the kill was asked for


def pending_kills(conn: psycopg.Connection, shard: tuple[int, int] = (0, 1)) -> list[RunKill]:
    """The runs whose kill was asked for and whose proc is still booked, in one shard of hosts."""
    rows = conn.execute(PENDING_SQL, {"limit": PENDING_LIMIT, **shard_params(shard)}).fetchall()
    return [RunKill(*row) for row in rows]


class KillSender:
    """Sends the kills of marked procs through the launchers, until their runs have ended.

    One per scheduler process, beside the dispatch loops: `launchers[i]` is the launcher of
    dispatch shard i, so each run's kill goes to the launcher that launched it (the simulated one
    knows only its own runs). Resends are kept in memory only: a restarted scheduler sends every
    pending kill again at once, which is what a kill that may have been lost needs.
    """

    def __init__(
        self,
        launchers: Sequence[Launcher],
        *,
        connect: Callable[[], psycopg.Connection] | None = None,
        resend: float | None = None,
        poll: float | None = None,
    ) -> None:
        self.launchers = list(launchers)
        self.resend = conf.kill_resend() if resend is None else resend
        self.poll = conf.kill_poll() if poll is None else poll
        self._connect = connect or (lambda: acct_db.connect(autocommit=True, application_name="cuesched-kill"))
        self._sent: dict[str, float] = {}  # pk_proc -> monotonic time of the last send
        self.sent = 0  # kills handed to a launcher (resends included)
        self.errors = 0

    def send_due(self, conn: psycopg.Connection) -> int:
        """Send the kills that were never sent, or not within `resend` seconds; returns how many."""
        now = time.monotonic()
        count = len(self.launchers)
        pending: set[str] = set()
        sent = 0
        for index, launcher in enumerate(self.launchers):
            runs = pending_kills(conn, (index, count))
            pending.update(r.pk_proc for r in runs)
            due = [r for r in runs if now - self._sent.get(r.pk_proc, float("-inf")) >= self.resend]
            if not due:
                continue
            for run in due:
                if run.pk_proc in self._sent:
                    logger.info(
                        "kill of proc %s on %s: not ended %.1fs after the request; sent again",
                        run.pk_proc,
                        run.host,
                        run.age,
                    )
                self._sent[run.pk_proc] = now
            try:
                launcher.kill(due)
            except Exception:  # one launcher's bug must not stop the kills of the others
                self.errors += 1
                logger.exception("kill sender: launcher %s failed to send %d kill(s)", launcher.name, len(due))
            sent += len(due)
        for pk in [pk for pk in self._sent if pk not in pending]:
            del self._sent[pk]  # its run ended (its proc is gone)
        self.sent += sent
        return sent

    def run(self, stop: threading.Event) -> None:
        """Until `stop`: LISTEN, send what is due, wait for a notification or the poll interval."""
        conn: psycopg.Connection | None = None
        backoff = 0.0
        while not stop.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = self._connect()
                    conn.execute(f"LISTEN {KILL_CHANNEL}")
                    self._sent.clear()  # a kill may have been asked for while disconnected: all again
                self.send_due(conn)
                backoff = 0.0
                wait = self.poll
                if self._sent:
                    wait = min(wait, self.resend)
                for _note in conn.notifies(timeout=wait, stop_after=1):
                    pass
            except psycopg.Error as exc:
                self.errors += 1
                backoff = min(5.0, max(0.2, backoff * 2))
                logger.warning("kill sender: database error (%s); reconnecting in %.1fs", exc, backoff)
                if conn is not None:
                    conn.close()
                conn = None
                stop.wait(backoff)
        if conn is not None:
            conn.close()

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="cuesched-kill", daemon=True)
        thread.start()
        return thread
