"""A kill is not a release: the kill mark, and the scheduler's thread that sends kills to hosts.

A frame's proc is the record that its cores are taken. Deleting it when a kill is asked for
(what cuesched did before) said the cores were free while the process still ran, until its
host got round to stopping it: RQD only at its next status report, seconds later, while the
freed cores were booked again. So a kill now

1. **marks** the run's proc in the kill's own transaction (`dispatch.jobs.controls.kill_job` /
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

import psycopg

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine.kill_marks import (
    KILL_FRAME,
    KILL_JOB,
    KILL_LLU,
    KILL_MEMORY,
    KILL_NIMBY,
    KILL_REASONS,
    KILL_TIMEOUT,
)
from dispatch.engine.launcher import Launcher, RunKill
from dispatch.engine.placement import in_shard, shard_params

logger = logging.getLogger(__name__)

__all__ = [
    "KILL_FRAME",
    "KILL_JOB",
    "KILL_LLU",
    "KILL_MEMORY",
    "KILL_NIMBY",
    "KILL_REASONS",
    "KILL_TIMEOUT",
    "KillSender",
    "mark_timeouts",
    "pending_kills",
]

KILL_CHANNEL = "cuesched_kill"

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
# Timeouts (issue 29), marked by whoever hears the host: RQD's reports through the gateway (its
# log's last update, llu_time) and cuesched's agents (the log's mtime). Run time counts from the
# booking (proc.ts_dispatched), so a frame is marked once it has run past timeout x 60 s, at the
# first report after that: within one report interval, never Cuebot's integer-minute test
# (HostReportHandler.killTimedOutFrames, a minute late). A proc already marked (a job kill) keeps
# its mark. The run ends DEAD, not retried, with the reason (dispatch.engine.completion).
MARK_TIMEOUTS_SQL = f"""
WITH marked AS (
  UPDATE proc p SET ts_kill = now(),
    str_kill = CASE WHEN l.int_timeout > 0
                     AND p.ts_dispatched < now() - make_interval(secs => l.int_timeout * %(minute)s::float8)
                    THEN '{KILL_TIMEOUT}' ELSE '{KILL_LLU}' END
  FROM layer l, unnest(%(procs)s::text[], %(llu)s::float8[]) AS m(pk_proc, llu)
  WHERE p.pk_proc = m.pk_proc AND (%(host)s::text IS NULL OR p.pk_host = %(host)s) AND p.ts_kill IS NULL
    AND l.pk_layer = p.pk_layer
    AND ((l.int_timeout > 0 AND p.ts_dispatched < now() - make_interval(secs => l.int_timeout * %(minute)s::float8))
      OR (l.int_timeout_llu > 0 AND m.llu > 0
          AND to_timestamp(m.llu) < now() - make_interval(secs => l.int_timeout_llu * %(minute)s::float8)))
  RETURNING p.pk_proc, p.pk_frame, p.pk_job, p.str_kill
),
audit AS (
  -- The kill's audit row (dispatch.models.farm_actions), as an operator's frame kill writes one.
  INSERT INTO cuesched_farm_action (str_action, str_target_kind, str_target, str_target_name, int_changed,
                                    detail, str_username)
  SELECT 'timeout_kill', 'frame', m.pk_job, j.str_name, 1,
         jsonb_build_object('frame', f.str_name, 'proc', m.pk_proc, 'kill', m.str_kill), 'cuesched'
  FROM marked m JOIN job j ON j.pk_job = m.pk_job JOIN frame f ON f.pk_frame = m.pk_frame
)
SELECT pk_proc, pk_frame, str_kill FROM marked
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


def mark_timeouts(
    conn: psycopg.Connection, llu: dict[str, float], *, host: str | None = None, minute: float = 60.0
) -> list[tuple[str, str, str]]:
    """Mark the runs of `llu` ({pk_proc: the log's last update, epoch s; 0 unknown}) that are past
    their layer's timeout or timeout_llu; returns (pk_proc, pk_frame, kill) of those marked.

    `minute`: the seconds in one minute of `timeout` / `timeout_llu`. Always 60 in production: no
    setting or environment variable reaches it, and neither the RQD gateway nor the agents pass it.
    Only the stress suite's frame_life phase (dispatch.lab.stress.frame_life) passes less, so hung
    frames time out within its few seconds under load.

    One transaction with its hint on the kill channel, so the scheduler's sender sends the kill at
    once (the gateway and the agent also stop the run themselves on seeing the mark)."""
    if not llu:
        return []
    procs = sorted(llu)
    with conn.transaction():
        rows = conn.execute(
            MARK_TIMEOUTS_SQL,
            {"procs": procs, "llu": [float(llu[p]) for p in procs], "host": host, "minute": float(minute)},
        ).fetchall()
        if rows:
            conn.execute(NOTIFY_SQL, ("timeout",))
    for pk_proc, pk_frame, kill in rows:
        logger.warning("proc %s of frame %s: past its layer's %s; killing it", pk_proc, pk_frame, kill.lower())
    return [tuple(r) for r in rows]


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
