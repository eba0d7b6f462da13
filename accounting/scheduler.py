"""The scheduler process: singleton lock, accounting service, live view, metrics, dispatch.

`manage.py run_scheduler` is a thin wrapper around `SchedulerProcess`; tests run the same
object in a thread. Stopping is cooperative through one Event (set by SIGINT/SIGTERM).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from accounting import live, metrics, singleton
from accounting.service import AccountingService

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOptions:
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    publish_interval: float = 1.0
    bootstrap_timeout: float | None = None
    lock_check_interval: float = 5.0


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
        self.lock_lost = False
        self.ready = threading.Event()

    def start(self) -> None:
        """Lock, bootstrap (blocking), then the publisher. Raises SchedulerAlreadyRunning."""
        self._lock_conn = singleton.acquire()
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
        while not self.stop.wait(self.options.lock_check_interval):
            try:
                self._lock_conn = singleton.still_held(self._lock_conn)
            except singleton.SchedulerAlreadyRunning as exc:
                logger.error("lost the scheduler lock and another scheduler holds it now; stopping: %s", exc)
                self.lock_lost = True
                self.stop.set()
            except psycopg.Error as exc:
                logger.warning("scheduler lock session lost, retrying: %s", exc)
                self._lock_conn = None

    def run(self, main: Callable[[AccountingService, threading.Event], None] | None = None) -> None:
        try:
            self.start()
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
