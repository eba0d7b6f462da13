"""Trigger health, all the time: the catalog check of accounting/trigger_health.py every few seconds.

Why: the start-up check alone let a table owner's `ALTER TABLE proc DISABLE TRIGGER ...` while
the scheduler runs go unnoticed for good. Outside writes then counted nowhere: a managed show's
Store read LOW (a booking past its burst), an unmanaged show's counters did too (the database
path checks caps against them). So every `CUESCHED_TRIGGER_CHECK_INTERVAL` (2 s) this loop reads
pg_trigger (one catalog query) and, on any problem:

- the scheduler books **nothing**, managed or not (`AccountingService.apply_booking` refuses with
  `accounting_paused`, the dispatch loop skips every job with the reason). Not only managed
  shows: an unmanaged show's caps are enforced by the very triggers that stopped, so the
  scheduler's own bookings of it would be unchecked too. Which trigger stopped does not narrow
  it down safely (a cap table's trigger carries cap changes to the Store, proc's the usage), so
  any problem stops all of the scheduler's booking; running frames run on and are released;
- the metric `cuesched_trigger_problems` and the published view (`trigger_health`) say which
  and how to fix it: `store_status` exits 1 and the console shows a banner.

When the check is clean again, booking does not simply resume: while a trigger was off, events
were lost (an outside proc not counted, a cap change not sent), so first the caps are reseeded,
the Store is recomputed from SUM(proc) and the unmanaged counters reconciled (`recover`, the
service's), each of which raises the integrity alarm if it finds a counter below the truth. Only
when all of that succeeded is the state cleared; a failure keeps booking stopped and is retried
at the next tick. So booking resumes by itself (the condition is the catalog's, visible, and
gone), while a counter it left low stays as a latched alarm (accounting/integrity.py).

Out of reach: `session_replication_role = replica` is a session's own setting, invisible in
any catalog; its writes are found by their effect, the integrity alarm of the next recompute or
reconcile. Writers other than the scheduler (psql, a Cuebot) are not stopped by this loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg

from accounting import integrity, metrics
from accounting.trigger_health import TriggerProblem, describe, trigger_problems

logger = logging.getLogger(__name__)


class TriggerWatch:
    """What the last catalog check found; read by the booking path on every booking (no I/O)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.problems: tuple[TriggerProblem, ...] = ()
        self.since: float | None = None  # unix time the current problems were first seen
        self.checked_at: float | None = None
        self.recovering = False
        self.open_alarms = 0

    def blocked(self) -> bool:
        return bool(self.problems)

    def reason(self) -> str | None:
        problems = self.problems
        if not problems:
            return None
        what = describe(list(problems))
        if self.recovering:
            what += " (fixed in the catalog; reseeding before booking resumes)"
        return what

    def view(self) -> dict[str, object]:
        return {
            "ok": not self.problems,
            "problems": [p.line() for p in self.problems],
            "since": self.since,
            "checked_at": self.checked_at,
            "recovering": self.recovering,
            "open_integrity_alarms": self.open_alarms,
        }

    def tick(self, conn: psycopg.Connection, recover: Callable[[psycopg.Connection], None]) -> str:
        """One check; `recover` runs (and must succeed) before a cleared problem lets booking resume."""
        found = tuple(trigger_problems(conn))
        self.checked_at = time.time()
        if found:
            with self._lock:
                new = found != self.problems
                self.problems = found
                self.recovering = False
                if self.since is None:
                    self.since = time.time()
            metrics.TRIGGER_PROBLEMS.set(len(found))
            if new:
                logger.error("trigger check: booking stopped for every show: %s", describe(list(found)))
            self._count_alarms(conn)
            return f"trigger check: {len(found)} problem(s), booking stopped"
        if self.problems:
            self.recovering = True
            logger.warning("trigger check: cuesched's triggers are back; reseeding before booking resumes")
            recover(conn)  # raises: still stopped, retried next tick
            with self._lock:
                lasted = time.time() - (self.since or time.time())
                self.problems = ()
                self.since = None
                self.recovering = False
            metrics.TRIGGER_PROBLEMS.set(0)
            self._count_alarms(conn)
            logger.warning("trigger check: reseeded after %.1fs of trigger problems; booking resumes", lasted)
            return "trigger check: healthy again, booking resumes"
        metrics.TRIGGER_PROBLEMS.set(0)
        self._count_alarms(conn)
        return "trigger check: ok"

    def _count_alarms(self, conn: psycopg.Connection) -> None:
        self.open_alarms = integrity.count_open(conn)
        metrics.INTEGRITY_ALARMS_OPEN.set(self.open_alarms)
