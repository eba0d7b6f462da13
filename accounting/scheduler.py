"""The scheduler process: singleton lock and lease, accounting service, live view, metrics, dispatch.

`manage.py run_scheduler` is a thin wrapper around `SchedulerProcess`; tests run the same
object in a thread. Stopping is cooperative through one Event (set by SIGINT/SIGTERM).

A standby (`standby=True`) waits for the lock instead of refusing to start; once it has the
lock it takes the lease (which waits for the previous holder's last booking batch) and only
then bootstraps, so its Store starts from a SUM(proc) that holds every booking the previous
holder committed. A scheduler whose lease is taken over stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from accounting import cuebot, db, live, metrics, singleton, writer_role
from accounting.service import AccountingService
from cuesched_project import conf

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOptions:
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    publish_interval: float = 1.0
    bootstrap_timeout: float | None = None
    lock_check_interval: float = 5.0
    standby: bool = False


class SchedulerProcess:
    """Owns the lock connection and every thread; `run()` blocks until `stop` is set.

    `main` is what runs in the foreground once accounting is up (the dispatch loop in
    production); without one the process only keeps the Store in sync and published.
    """

    def __init__(
        self,
        options: SchedulerOptions | None = None,
        *,
        service: AccountingService | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.options = options or SchedulerOptions()
        self.service = service or AccountingService()
        self.stop = stop or threading.Event()
        self._lock_conn: psycopg.Connection | None = None
        self._publisher: threading.Thread | None = None
        self._lock_guard: threading.Thread | None = None
        self._lock_checked_at = time.monotonic()
        self.lock_lost = False
        self.ready = threading.Event()
        self.lease_taken_at: float | None = None

    def start(self) -> None:
        """Lock and lease, bootstrap (blocking), then the publisher. Raises SchedulerAlreadyRunning,
        or CuebotModeError before taking anything when the mode setting contradicts the database, or
        WriterRoleError when the database would not take its connections for the scheduler's."""
        with db.connect(application_name="cuesched-start") as conn:
            writer_role.require_writer(conn)
            if self.service.cuebot is None:
                self.service.set_cuebot_mode(cuebot.resolve(conn))
        if self.options.standby:
            logger.info("standby: waiting for the scheduler lock")
            self._lock_conn = singleton.wait_for_lock(self.stop, conf.standby_poll_interval())
            if self._lock_conn is None:
                return
        else:
            self._lock_conn = singleton.acquire()
        generation = singleton.take_lease(self._lock_conn)
        self.lease_taken_at = time.time()
        self.service.lease_generation = generation
        metrics.LEASE_GENERATION.set(generation)
        logger.info("scheduler lease taken: generation %d", generation)
        metrics.serve(self.options.metrics_port, self.options.metrics_addr)
        self.service.start(self.stop, bootstrap_timeout=self.options.bootstrap_timeout)
        self._publisher = threading.Thread(
            target=live.run_publisher,
            args=(self.service, self.stop, self.options.publish_interval),
            name="cuesched-live",
            daemon=True,
        )
        self._publisher.start()
        self._lock_guard = threading.Thread(target=self._guard_lock, name="cuesched-lock", daemon=True)
        self._lock_guard.start()
        self.ready.set()

    def _guard_lock(self) -> None:
        """Keep the one-scheduler lock for the process lifetime, across a lost session.

        PostgreSQL drops a session lock with its session (a database restart, a killed
        backend). Left alone, a second scheduler could then start beside this one. So the
        lock is re-taken on a new session; if another scheduler got it first, this one stops.
        """
        while not self.stop.wait(min(self.options.lock_check_interval, 0.5)):
            if self.service.lease_lost.is_set():
                logger.error("the scheduler lease moved to another scheduler; stopping")
                self.lock_lost = True
                self.stop.set()
                return
            now = time.monotonic()
            if now - self._lock_checked_at < self.options.lock_check_interval:
                continue
            self._lock_checked_at = now
            try:
                self._lock_conn = singleton.still_held(self._lock_conn, self.service.lease_generation)
            except (singleton.SchedulerAlreadyRunning, singleton.LeaseLost) as exc:
                logger.error("lost the scheduler lock and another scheduler held it; stopping: %s", exc)
                self.lock_lost = True
                self.service.lease_lost.set()
                self.stop.set()
            except psycopg.Error as exc:
                logger.warning("scheduler lock session lost, retrying: %s", exc)
                self._lock_conn = None

    def run(self, main: Callable[[AccountingService, threading.Event], None] | None = None) -> None:
        try:
            self.start()
            if self._lock_conn is None:
                return  # a standby stopped before it got the lock
            if main is not None and not self.stop.is_set():
                main(self.service, self.stop)
            else:
                self.stop.wait()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        self.service.join()
        if self._publisher is not None:
            self._publisher.join(5)
        if self._lock_guard is not None:
            self._lock_guard.join(5)
        if self._lock_conn is not None:
            self._lock_conn.close()
            self._lock_conn = None
        logger.info("scheduler stopped")
