"""The scheduler process: singleton lock and lease, accounting service, live view, metrics, dispatch.

`manage.py run_scheduler` is a thin wrapper around `SchedulerProcess`; tests run the same
object in a thread. Stopping is cooperative through one Event (set by SIGINT/SIGTERM).

A standby (`standby=True`) waits for the lock instead of refusing to start; once it has the
lock it takes the lease (which waits for the previous holder's last booking batch) and only
then bootstraps, so its Store starts from a SUM(proc) that holds every booking the previous
holder committed. A scheduler whose lease is taken over stops.

The lock-guard thread renews the lease's deadline every CUESCHED_LEASE_RENEW_INTERVAL on the
lock session: the heartbeat a standby judges the holder by (accounting/singleton.py). Each
renewal also moves `service.lease_valid_until`, this process's own reading of how long the
lease surely is still its own (the renewal's send time + TTL - a margin): past it the dispatch
loop neither books nor launches, so a holder woken from a stop acts on nothing it decided
before, even before it has heard that a standby took over.
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
    lease_ttl: float | None = None  # None: CUESCHED_LEASE_TTL
    lease_renew_interval: float | None = None  # None: CUESCHED_LEASE_RENEW_INTERVAL


# How much sooner than the database's deadline this process stops trusting its own lease: room
# for a renewal's round trip and for clocks that run at slightly different rates.
LEASE_MARGIN = 1.0


class LeaseSettingsError(ValueError):
    """CUESCHED_LEASE_TTL and CUESCHED_LEASE_RENEW_INTERVAL that would let a live holder lose its lease."""


def check_lease_settings(ttl: float, renew: float) -> None:
    """A live holder renews at least twice per TTL, and its own lease clock outlasts a renewal."""
    if not (renew > 0 and ttl >= 2 * renew and ttl - LEASE_MARGIN > renew):
        raise LeaseSettingsError(
            f"CUESCHED_LEASE_TTL={ttl:g} and CUESCHED_LEASE_RENEW_INTERVAL={renew:g} would let a running "
            "scheduler lose its lease between two renewals; the scheduler did not start. Hint: keep the renew "
            f"interval positive, at most half the TTL and under TTL - {LEASE_MARGIN:g} s (defaults 6 and 1.5)"
        )


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
        self._renewed_at = time.monotonic()
        self.lease_ttl = conf.lease_ttl() if self.options.lease_ttl is None else self.options.lease_ttl
        self.renew_interval = (
            conf.lease_renew_interval()
            if self.options.lease_renew_interval is None
            else self.options.lease_renew_interval
        )
        check_lease_settings(self.lease_ttl, self.renew_interval)
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
        sent = time.monotonic()
        generation = singleton.take_lease(self._lock_conn, ttl=self.lease_ttl)
        self._renewed(sent)
        self.lease_taken_at = time.time()
        self.service.lease_generation = generation
        metrics.LEASE_GENERATION.set(generation)
        logger.info("scheduler lease taken: generation %d", generation)
        # Renewing from now on, not after the bootstrap: a bootstrap longer than the TTL would
        # otherwise let a standby take the lease from a healthy new holder.
        self._lock_guard = threading.Thread(target=self._guard_lock, name="cuesched-lock", daemon=True)
        self._lock_guard.start()
        metrics.serve(self.options.metrics_port, self.options.metrics_addr)
        self.service.start(self.stop, bootstrap_timeout=self.options.bootstrap_timeout)
        self._publisher = threading.Thread(
            target=live.run_publisher,
            args=(self.service, self.stop, self.options.publish_interval),
            name="cuesched-live",
            daemon=True,
        )
        self._publisher.start()
        self.ready.set()

    def _guard_lock(self) -> None:
        """Keep the one-scheduler lock for the process lifetime, across a lost session.

        PostgreSQL drops a session lock with its session (a database restart, a killed
        backend). Left alone, a second scheduler could then start beside this one. So the
        lock is re-taken on a new session; if another scheduler got it first, this one stops.
        """
        while not self.stop.wait(min(self.options.lock_check_interval, self.renew_interval, 0.5)):
            if self.service.lease_lost.is_set():
                logger.error("the scheduler lease moved to another scheduler; stopping")
                self.lock_lost = True
                self.stop.set()
                return
            now = time.monotonic()
            if now - self._renewed_at >= self.renew_interval:
                self._renew()
                if self.stop.is_set():
                    return
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
            else:
                self._renew()

    def _renewed(self, sent: float) -> None:
        self._renewed_at = sent
        self.service.lease_valid_until = sent + self.lease_ttl - LEASE_MARGIN

    def _renew(self) -> None:
        """One heartbeat on the lock session. A failed one is retried at the next tick; the lock
        check (every lock_check_interval) takes the lock again on a new session if it is gone."""
        generation = self.service.lease_generation
        conn = self._lock_conn
        if generation is None or conn is None or conn.closed or conn.broken:
            return
        sent = time.monotonic()
        try:
            held = singleton.renew(conn, generation, self.lease_ttl)
        except psycopg.Error as exc:
            logger.warning("scheduler lease renewal failed (%s); the lock check takes the lock again", exc)
            return
        if not held:
            logger.error(
                "lost the scheduler lease: its generation moved past %d (another scheduler took over); stopping",
                generation,
            )
            self.lock_lost = True
            self.service.lease_lost.set()
            self.stop.set()
            return
        self._renewed(sent)

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
        db.clear_lease_tag(self.service.lease_generation)
        logger.info("scheduler stopped")
