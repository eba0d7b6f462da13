"""The one owner of the Store: serves the dispatcher and wires the loops around it.

Only `run_scheduler` builds an AccountingService; web processes never hold a Store
(gunicorn runs several workers, and two Stores would jointly over-book).

Start-up order (each step blocking on the one before):
1. the listener connects and LISTENs, then reseeds: managed set, caps, counters. That
   first reseed IS the bootstrap, so no cap change can fall between the bootstrap and
   the LISTEN (a gap the reference leaves open);
2. only then the recompute, limit reseed and managed-shows loops start, and the caller
   may start dispatching.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from accounting import db, metrics
from accounting.limits import reseed_limits
from accounting.listener import Listener
from accounting.managed_shows import read_managed, refresh_managed
from accounting.recompute import Recomputer, RecomputeResult
from accounting.store import Applied, BookingDelta, LimitExceeded, Store
from cuesched_project import conf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NotManaged:
    """The show is not scheduler-managed: the database-enforced accounting decides."""

    delta: BookingDelta


BookingResult = Applied | LimitExceeded | NotManaged


@dataclass
class LoopState:
    """What ops see of a background loop: when it last ran, how long, and its last error."""

    interval: float
    last_run: float | None = None
    last_seconds: float | None = None
    runs: int = 0
    errors: int = 0
    last_error: str | None = None


@dataclass
class ServiceState:
    started_at: float = field(default_factory=time.time)
    bootstrapped_at: float | None = None
    last_recompute: RecomputeResult | None = None
    loops: dict[str, LoopState] = field(default_factory=dict)
    managed_published_at: dict[str, float] = field(default_factory=dict)


class AccountingService:
    """Facade over the Store for the hot path; the managed decision is taken once per booking."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self._managed: frozenset[str] = frozenset()
        self._managed_lock = threading.Lock()
        self.recomputer = Recomputer(self.store)
        self.state = ServiceState()
        self.bootstrapped = threading.Event()
        self.listener = Listener(self.store, on_connect=self._reseed_on_connect, on_event=self._count_event)
        self._threads: list[threading.Thread] = []
        # Other parts of the scheduler (the dispatch loop) add sections to the live view here.
        self.view_providers: dict[str, Callable[[], object]] = {}
        # Bumped whenever the Store may have gained room (a release or cap change applied, a
        # recompute): a dispatch loop held back by a Store cap waits on it instead of polling.
        self._room = threading.Condition()
        self._room_generation = 0

    # -- managed shows ---------------------------------------------------------------
    def managed_shows(self) -> frozenset[str]:
        return self._managed

    def publish_managed(self, shows: frozenset[str]) -> None:
        """Replace the managed set atomically; callers seed a show before publishing it."""
        with self._managed_lock:
            now = time.time()
            for show in shows - self._managed:
                self.state.managed_published_at[show] = now
            for show in self._managed - shows:
                self.state.managed_published_at.pop(show, None)
            self._managed = frozenset(shows)
        metrics.MANAGED_SHOWS.set(len(shows))

    def is_managed(self, show: str) -> bool:
        return show in self._managed

    # -- hot path ----------------------------------------------------------------------
    def apply_booking(self, delta: BookingDelta) -> BookingResult:
        if delta.show not in self._managed:
            return NotManaged(delta)
        result = self.store.book(delta)
        if isinstance(result, LimitExceeded):
            metrics.REJECTIONS.labels(result.table).inc()
        return result

    def confirm_booking(self, booking: BookingResult) -> None:
        """Settle a booking whose proc committed and launched (counted as a booking made)."""
        # Deliberately no managed re-check: an applied booking is settled even if the show flipped.
        if isinstance(booking, Applied):
            self.store.confirm(booking.delta)
            metrics.BOOKINGS.labels("store").inc()
        elif isinstance(booking, NotManaged):
            metrics.BOOKINGS.labels("database").inc()

    def rollback_booking(self, booking: BookingResult) -> None:
        if isinstance(booking, Applied):
            self.store.rollback(booking.delta)

    # -- seeds -------------------------------------------------------------------------
    def reseed_all(self, conn: psycopg.Connection) -> RecomputeResult:
        """Managed set, caps, then counters, then publish: the bootstrap and the reconnect heal."""
        managed = read_managed(conn)
        started = time.monotonic()
        reseed_limits(self.store, conn)
        metrics.LIMIT_RESEED_SECONDS.observe(time.monotonic() - started)
        # The store pass counts every show the database flags as managed, so shows that
        # joined the set while we were away are fully seeded before being published.
        result, _ = self.recomputer.store_pass(conn)
        self.publish_managed(managed)
        return result

    def _reseed_on_connect(self) -> None:
        with db.connect(application_name="cuesched-reseed") as conn:
            result = self.reseed_all(conn)
        self._observe_recompute(result)
        if not self.bootstrapped.is_set():
            self.state.bootstrapped_at = time.time()
            self.bootstrapped.set()
            logger.info(
                "bootstrap: %d managed show(s), %d keys seeded from %d usage rows in %.3fs",
                len(self._managed),
                result.keys,
                result.rows,
                result.store_seconds,
            )

    # -- waiting for room --------------------------------------------------------------------
    def room_generation(self) -> int:
        return self._room_generation

    def wait_for_room(self, seen: int, timeout: float) -> bool:
        """Block until the Store may have room again since generation `seen`, or `timeout` passes.

        The dispatch loop's own completions free room only once their releases come back
        through the listener (a few milliseconds); a fixed retry delay would idle the loop
        for most of it.
        """
        with self._room:
            return self._room.wait_for(lambda: self._room_generation != seen, timeout)

    def _room_changed(self) -> None:
        with self._room:
            self._room_generation += 1
            self._room.notify_all()

    def _count_event(self, channel: str, outcome: str) -> None:
        if outcome == "applied":
            self._room_changed()
        if outcome.startswith("dropped:"):
            metrics.DROPPED.labels(channel, outcome.split(":", 1)[1]).inc()
        elif channel == "acct_release":
            metrics.RELEASES.labels(outcome).inc()
        else:
            metrics.LIMIT_CHANGES.labels(outcome).inc()

    def _observe_recompute(self, result: RecomputeResult) -> None:
        self._room_changed()
        self.state.last_recompute = result
        metrics.RECOMPUTE_SECONDS.observe(result.store_seconds + result.pg_seconds)
        for vertex, cores in result.drift_cores.items():
            metrics.RECOMPUTE_DRIFT.labels(vertex).set(cores)

    # -- loops -------------------------------------------------------------------------
    def _recompute_tick(self, conn: psycopg.Connection) -> str:
        result = self.recomputer.run_once(conn)
        self._observe_recompute(result)
        return (
            f"recompute: {result.keys} keys from {result.rows} usage rows, store {result.store_seconds:.3f}s, "
            f"pg {result.pg_seconds:.3f}s ({sum(result.pg_rows_updated.values())} rows), "
            f"drift {result.drift_cores}, evicted {result.evicted}"
        )

    def _limits_tick(self, conn: psycopg.Connection) -> str:
        started = time.monotonic()
        rows = reseed_limits(self.store, conn)
        metrics.LIMIT_RESEED_SECONDS.observe(time.monotonic() - started)
        return f"limit reseed: {len(rows.subs)} subs, {len(rows.folders)} folders, {len(rows.jobs)} jobs"

    def _managed_tick(self, conn: psycopg.Connection) -> str:
        result = refresh_managed(self._managed, self.recomputer, conn)
        if result.published != self._managed:
            self.publish_managed(result.published)
        return (
            f"managed shows: {len(result.published)} published, +{len(result.added)} -{len(result.removed)}, "
            f"{len(result.deferred)} deferred"
        )

    def _run_loop(
        self, name: str, interval: float, tick: Callable[[psycopg.Connection], str], stop: threading.Event
    ) -> None:
        """Fixed interval, first tick skipped (start-up did the work), errors logged, never ends."""
        loop = self.state.loops.setdefault(name, LoopState(interval=interval))
        conn: psycopg.Connection | None = None
        while not stop.wait(interval):
            started = time.monotonic()
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = db.connect(application_name=f"cuesched-{name}")
                line = tick(conn)
                logger.info("%s (%.3fs)", line, time.monotonic() - started)
            except Exception as exc:
                loop.errors += 1
                loop.last_error = f"{type(exc).__name__}: {exc}"
                metrics.LOOP_ERRORS.labels(name).inc()
                logger.warning("%s loop failed (retrying next tick): %s", name, loop.last_error)
                if conn is not None:
                    conn.close()
                conn = None
            loop.runs += 1
            loop.last_run = time.time()
            loop.last_seconds = time.monotonic() - started
        if conn is not None:
            conn.close()

    def _spawn(self, name: str, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"cuesched-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self, stop: threading.Event, *, bootstrap_timeout: float | None = None) -> None:
        """Start the listener, block until the bootstrap reseed succeeded, then the loops."""
        self._spawn("listener", self.listener.run, stop)
        deadline = None if bootstrap_timeout is None else time.monotonic() + bootstrap_timeout
        while not self.bootstrapped.wait(0.2):
            if stop.is_set():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"bootstrap did not complete: {self.listener.stats.last_error}")
        self._spawn("recompute", self._run_loop, "recompute", conf.recompute_interval(), self._recompute_tick, stop)
        self._spawn("limits", self._run_loop, "limits", conf.limit_reseed_interval(), self._limits_tick, stop)
        self._spawn("managed", self._run_loop, "managed", conf.managed_shows_ttl(), self._managed_tick, stop)

    def join(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
