"""The one owner of the Store: serves the dispatcher and wires the loops around it.

Only `run_scheduler` builds an AccountingService; web processes never hold a Store
(gunicorn runs several workers, and two Stores would jointly over-book).

Start-up order (each step blocking on the one before):
1. the listener connects and LISTENs, then reseeds: managed set, caps, counters. That
   first reseed IS the bootstrap, so no cap change can fall between the bootstrap and
   the LISTEN (a gap the reference leaves open);
2. only then the recompute, limit reseed, managed-shows and reconcile loops start, and the
   caller may start dispatching.

The Store enforces only while it can trust what it holds (`can_enforce`): the listener's
heartbeat is fresh (everything committed up to a bounded time ago has arrived), the
process holds the scheduler lease, and the last reseed ran against the server the dispatch
loops talk to. Otherwise `apply_booking` refuses managed bookings with the table
`accounting_paused`; database-enforced shows are unaffected.

One condition stops every booking, managed or not: a cuesched trigger that is not installed and
firing once (the `triggers` loop, accounting/trigger_watch.py), since the database-enforced path
is those triggers. And a pass that finds a counter below SUM(proc) raises the latched integrity
alarm (accounting/integrity.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from accounting import db, integrity, metrics
from accounting.cuebot import CuebotMode
from accounting.history import HistorySampler
from accounting.limits import fill_caps, reseed_licences, reseed_limits
from accounting.listener import HeartbeatSender, Listener, ServerIdentity
from accounting.managed_shows import Managed, read_managed, refresh_managed
from accounting.recompute import Recomputer, RecomputeResult
from accounting.reconcile import reconcile_unmanaged
from accounting.store import Applied, BookingDelta, LimitExceeded, Store
from accounting.trigger_watch import TriggerWatch
from cuesched_project import conf

PAUSED = "accounting_paused"
RECENT_DRIFT_KEPT = 2000

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
    last_reconcile_drift: dict[str, int] = field(default_factory=dict)
    # Unmanaged shows the last reconcile left out: another session held their lock (show -> who).
    last_reconcile_skipped: dict[str, str] = field(default_factory=dict)
    server_changes: int = 0
    # vertex -> key -> (signed drift a recompute corrected, unix time), kept for
    # `conf.drift_memory_seconds()`: the next pass measures 0 once corrected, and ops must still
    # see that a key had drifted (and by how much) for a while after.
    recent_drift: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)

    def measured_drift(self) -> tuple[int, dict[str, int]]:
        """Farm drift (whole cores the last recompute and reconcile corrected) and the Store's per show.

        A show's figure is the signed sum over its subscriptions of what recompute passes corrected
        within CUESCHED_DRIFT_MEMORY_SECONDS (Store minus SUM(proc)). Database-enforced shows'
        per-table corrections are not per show, so they count in the farm figure only. The history
        sampler writes it with each sample (it is the only consistent measurement of drift).
        """
        rc = self.last_recompute
        farm = sum(abs(v) for v in (rc.drift_cores.values() if rc else ()))
        farm += sum(abs(v) for v in self.last_reconcile_drift.values())
        per_show: dict[str, int] = {}
        for key, (cores, at) in (self.recent_drift.get("sub") or {}).items():
            show = key.split(":", 1)[0]
            # A pass before the show's seed measured an unseeded Store (a flip just committed):
            # minus the whole booking, no counter's fault. Only passes after the seed count, and
            # only for shows published as managed (the seed time is set when it is published).
            seeded = self.managed_published_at.get(show)
            if seeded is None or at < seeded:
                continue
            per_show[show] = per_show.get(show, 0) + cores
        return farm, per_show


class AccountingService:
    """Facade over the Store for the hot path; the managed decision is taken once per booking."""

    def __init__(
        self, store: Store | None = None, *, listener_connect: Callable[[], psycopg.Connection] | None = None
    ) -> None:
        self.store = store or Store()
        self._managed: Managed = {}
        self._managed_lock = threading.Lock()
        self.recomputer = Recomputer(self.store)
        self.recomputer.on_managed = self._unpublish_stale
        self.recomputer.settle = self._notifications_caught_up
        # The continuous trigger check (accounting/trigger_watch.py): any problem stops booking.
        self.triggers = TriggerWatch()
        self.state = ServiceState()
        self.bootstrapped = threading.Event()
        self.heartbeat = HeartbeatSender(conf.heartbeat_interval())
        self.listener = Listener(
            self.store,
            on_connect=self._reseed_on_connect,
            on_event=self._count_event,
            on_resync=self._resync,
            heartbeat=self.heartbeat,
            deadline=conf.heartbeat_deadline(),
            connect=listener_connect,
            # A process that may have lost its lease leaves the outbox to the one that holds it.
            may_consume=lambda: not self.lease_lost.is_set() and not self.lease_expired(),
            lease_generation=lambda: self.lease_generation,
            on_lease_lost=lambda: self.lease_lost.set(),
        )
        # The scheduler lease this process books under (set by SchedulerProcess; None = no fence,
        # for tests that drive the service alone), and the server the Store was seeded against.
        self.lease_generation: int | None = None
        self.lease_lost = threading.Event()
        # Until when (time.monotonic()) this process surely still holds its lease: its last
        # renewal's send time + the TTL - a margin (SchedulerProcess keeps it; inf = no lease
        # clock, for tests that drive the service alone). Past it the dispatch loop neither
        # books nor launches: a standby may have taken over while this process was stopped.
        self.lease_valid_until = math.inf
        self.server_id: str | None = None
        self._max_xmax = 0
        self._managed_wakeup = threading.Event()
        # Shows whose bookings met a generation the Store had not reached: show -> (its, since).
        self._behind: dict[str, tuple[int, float]] = {}
        self._threads: list[threading.Thread] = []
        # Other parts of the scheduler (the dispatch loop) add sections to the live view here.
        self.view_providers: dict[str, Callable[[], object]] = {}
        self.history = HistorySampler()
        # Bumped whenever the Store may have gained room (a release or cap change applied, a
        # recompute): a dispatch loop held back by a Store cap waits on it instead of polling.
        self._room = threading.Condition()
        self._room_generation = 0
        # Set by set_cuebot_mode before start (run_scheduler resolves it from the database).
        self.cuebot: CuebotMode | None = None

    # -- managed shows ---------------------------------------------------------------
    def managed_shows(self) -> frozenset[str]:
        return frozenset(self._managed)

    def managed_generation(self, show: str) -> int | None:
        """The flip generation the show was seeded at, or None if it is not published."""
        return self._managed.get(show)

    def publish_managed(self, shows: Managed) -> None:
        """Replace the managed set (show -> seed generation) atomically; callers seed a show first."""
        new = dict(shows)
        with self._managed_lock:
            now = time.time()
            for show in new.keys() - self._managed.keys():
                self.state.managed_published_at[show] = now
            for show in self._managed.keys() - new.keys():
                self.state.managed_published_at.pop(show, None)
            self._managed = new
        metrics.MANAGED_SHOWS.set(len(new))

    def is_managed(self, show: str) -> bool:
        return show in self._managed

    def _unpublish_stale(self, snapshot_managed: dict[str, int]) -> None:
        """Before a recompute's overwrite: drop shows its snapshot saw unmanaged or re-flipped."""
        with self._managed_lock:
            stale = [s for s, g in self._managed.items() if snapshot_managed.get(s) != g]
            if not stale:
                return
            self._managed = {s: g for s, g in self._managed.items() if s not in stale}
            for show in stale:
                self.state.managed_published_at.pop(show, None)
        logger.info("recompute: %d show(s) flipped since their seed; unpublished until re-seeded", len(stale))
        metrics.MANAGED_SHOWS.set(len(self._managed))
        self._managed_wakeup.set()

    def request_managed_refresh(self) -> None:
        """Run the managed-shows tick now (a booking met a flip the Store has not seen)."""
        self._managed_wakeup.set()

    def report_behind(self, show: str, generation: int) -> None:
        """A booking of `show` met a newer accounting generation than the Store's `generation`.

        Normally the listener applies the change within its delay and the show books again. If
        the Store is still at `generation` a heartbeat deadline later (the message that carried
        the bump was lost, or a flip sent none), the managed-shows tick re-seeds the show, whose
        reads then cover the database's generation.
        """
        with self._managed_lock:
            if show in self._behind:
                return
            self._behind[show] = (generation, time.monotonic())
        timer = threading.Timer(self.listener.deadline, self._managed_wakeup.set)
        timer.daemon = True
        timer.start()

    def _stuck_behind(self) -> set[str]:
        """Shows reported behind more than a heartbeat deadline ago whose generation has not moved since."""
        now = time.monotonic()
        stuck = set()
        with self._managed_lock:
            for show, (generation, since) in list(self._behind.items()):
                if self.store.generation(show) != generation:
                    del self._behind[show]
                elif now - since >= self.listener.deadline:
                    stuck.add(show)
                    del self._behind[show]
        return stuck

    # -- whether the Store may enforce ---------------------------------------------------
    def lease_expired(self) -> bool:
        """This process cannot be sure it still holds the lease (no renewal for too long)."""
        return time.monotonic() >= self.lease_valid_until

    def can_enforce(self) -> bool:
        return (
            self.listener.fresh()
            and not self.lease_lost.is_set()
            and not self.lease_expired()
            and self.bootstrapped.is_set()
            and not self.triggers.blocked()
        )

    def booking_stopped(self) -> str | None:
        """Why the scheduler books no show at all right now (managed or not), or None."""
        return self.triggers.reason()

    def pause_reason(self) -> str | None:
        stopped = self.booking_stopped()
        if stopped:
            return stopped
        if self.lease_lost.is_set():
            return "this scheduler lost its lease to another one"
        if self.lease_expired():
            return "this scheduler's lease was not renewed in time (it may have been taken over)"
        if not self.listener.fresh():
            age = self.listener.heartbeat_age()
            state = self.listener.stats.state
            return (
                f"the listener is {state}" if age is None else f"the listener's last heartbeat is {age:.1f}s old"
            ) + f" (deadline {self.listener.deadline:.1f}s): caps may have changed unseen"
        return None

    def accepts_server(self, system_id: str | None) -> bool:
        """Whether a dispatch connection reached the server the Store was last seeded against."""
        return system_id is None or self.server_id is None or system_id == self.server_id

    # -- hot path ----------------------------------------------------------------------
    def apply_booking(self, delta: BookingDelta) -> BookingResult:
        if self.triggers.blocked():
            # The triggers that enforce unmanaged shows' caps (and feed the Store) are not all
            # firing: no booking of any show until they are and the counters were rebuilt.
            metrics.REJECTIONS.labels(PAUSED).inc()
            return LimitExceeded(PAUSED, 0, 0)
        if delta.show not in self._managed:
            return NotManaged(delta)
        if not self.can_enforce():
            age = self.listener.heartbeat_age()
            metrics.REJECTIONS.labels(PAUSED).inc()
            return LimitExceeded(PAUSED, int((age or 0) * 1000), int(self.listener.deadline * 1000))
        result = self.store.book(delta)
        if isinstance(result, LimitExceeded):
            metrics.REJECTIONS.labels(result.table).inc()
        return result

    def confirm_booking(self, booking: BookingResult, xid: int | None = None) -> None:
        """Settle a booking whose proc committed and launched (counted as a booking made).

        `xid` is the booking transaction: its licences stay counted until their count arrives.
        """
        # Deliberately no managed re-check: an applied booking is settled even if the show flipped.
        if isinstance(booking, Applied):
            self.store.confirm(booking.delta, xid)
            metrics.BOOKINGS.labels("store").inc()
        elif isinstance(booking, NotManaged):
            metrics.BOOKINGS.labels("database").inc()

    def rollback_booking(self, booking: BookingResult) -> None:
        if isinstance(booking, Applied):
            self.store.rollback(booking.delta)

    def fill_caps(self, conn: psycopg.Connection, folders: list[str], jobs: list[str]) -> None:
        """Load caps the Store lacks for folders and jobs about to be booked (it refuses them meanwhile)."""
        if folders or jobs:
            fill_caps(self.store, conn, folders, jobs)

    def fill_licences(self, conn: psycopg.Connection) -> None:
        """Read every licence limit into the Store (a layer names one it does not hold yet)."""
        reseed_licences(self.store, conn)

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

    def _check_server(self, identity: ServerIdentity) -> None:
        """Forget every recorded snapshot and xid when the server (or its xid counter) changed."""
        changed = (
            (identity.system_id is not None and self.server_id is not None and identity.system_id != self.server_id)
            or identity.xmax < self._max_xmax
            or identity.xmax <= self.listener.stats.max_xid
        )
        if changed:
            self.state.server_changes += 1
            metrics.FORGOTTEN.inc()
            logger.warning(
                "listener: the database is another server now (system id %s -> %s, xmax %d after %d seen): "
                "forgetting every recorded snapshot and transaction id before the reseed",
                self.server_id,
                identity.system_id,
                identity.xmax,
                self._max_xmax,
            )
            self.store.forget_sources()
            self._max_xmax = 0
            self.listener.stats.max_xid = 0
        self._max_xmax = max(self._max_xmax, identity.xmax)

    def _reseed_on_connect(self, identity: ServerIdentity | None = None) -> None:
        if identity is not None:
            self._check_server(identity)
        with db.connect(application_name="cuesched-reseed") as conn:
            result = self.reseed_all(conn)
        if identity is not None:
            self.server_id = identity.system_id
        if not self.bootstrapped.is_set():
            # The bootstrap seeds an empty Store: every key "moves", which is not drift.
            result.drift_cores = dict.fromkeys(result.drift_cores, 0)
            result.drift_keys = {}
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

    def _resync(self, table: str) -> None:
        """A TRUNCATE: no row-level message was possible, so everything is read again."""
        metrics.RESYNCS.inc()
        with db.connect(application_name="cuesched-resync") as conn:
            result = self.reseed_all(conn)
        self._observe_recompute(result)

    def _count_event(self, channel: str, outcome: str) -> None:
        if outcome == "heartbeat" or outcome == "dropped:foreign":
            return
        if outcome == "applied":
            self._room_changed()
        if outcome.startswith("dropped:"):
            metrics.DROPPED.labels(channel, outcome.split(":", 1)[1]).inc()
        elif channel == "acct_release":
            metrics.RELEASES.labels(outcome).inc()
        else:
            metrics.LIMIT_CHANGES.labels(outcome).inc()

    def _observe_recompute(self, result: RecomputeResult) -> None:
        self._max_xmax = max(self._max_xmax, result.pg_xmax)
        self._room_changed()
        self.state.last_recompute = result
        self._remember_drift(result.drift_keys)
        metrics.RECOMPUTE_SECONDS.observe(result.store_seconds + result.pg_seconds)
        for vertex, cores in result.drift_cores.items():
            metrics.RECOMPUTE_DRIFT.labels(vertex).set(cores)

    def _remember_drift(self, drift_keys: dict[str, dict[str, int]], now: float | None = None) -> None:
        now = time.time() if now is None else now
        horizon = now - conf.drift_memory_seconds()
        for vertex in ("sub", "folder", "job"):
            kept = {k: v for k, v in self.state.recent_drift.get(vertex, {}).items() if v[1] >= horizon}
            for key, cores in (drift_keys.get(vertex) or {}).items():
                kept[key] = (cores, now)
            if len(kept) > RECENT_DRIFT_KEPT:
                kept = dict(sorted(kept.items(), key=lambda kv: -kv[1][1])[:RECENT_DRIFT_KEPT])
            self.state.recent_drift[vertex] = kept

    # -- loops -------------------------------------------------------------------------
    def _notifications_caught_up(self, since: float) -> bool:
        """Block until a heartbeat sent after `since` (monotonic) came back through the listener.

        Notifications arrive in commit order, so every one committed before `since` has then
        been applied. Bounded by the heartbeat deadline: past it the listener is wedged anyway.
        """
        deadline = time.monotonic() + self.listener.deadline + self.heartbeat.interval
        while time.monotonic() < deadline:
            if self.listener.stats.state != "listening":
                return False  # reconnecting: its reseed waits for this pass, so do not hold it up
            fresh_as_of = self.listener.stats.fresh_as_of
            if fresh_as_of is not None and fresh_as_of >= since:
                return True
            time.sleep(0.01)
        return False

    def _recompute_tick(self, conn: psycopg.Connection) -> str:
        # Licence counts are the database's own (recounted by every writer): one small read
        # bounds how long a lost acct_licence message or an unknown-xid confirm can read high.
        reseed_licences(self.store, conn)
        published = dict(self._managed)
        result = self.recomputer.run_once(conn)
        self._observe_recompute(result)
        # Judged only for shows published, at one generation, through the whole pass.
        stable = {s for s, g in published.items() if self._managed.get(s) == g}
        findings = integrity.managed_findings(conn, result.low, stable)
        if findings:
            integrity.raise_alarm(conn, integrity.STORE_LOW, findings)
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
        self._managed_wakeup.clear()
        # A show whose generation moved is re-seeded: stop enforcing it now, not after the seed.
        current = dict(self._managed)
        # And one the Store stayed behind on: seeded again (still published meanwhile: its
        # bookings keep failing the generation check until the seed covers it).
        stuck = self._stuck_behind()
        for show in stuck:
            current.pop(show, None)
        if stuck:
            logger.warning("managed shows: %d show(s) behind their accounting generation; re-seeding", len(stuck))
        result = refresh_managed(current, self.recomputer, conn)
        if result.published != self._managed:
            self.publish_managed(result.published)
        return (
            f"managed shows: {len(result.published)} published, +{len(result.added)} -{len(result.removed)}, "
            f"{len(result.deferred)} deferred"
        )

    def _reconcile_tick(self, conn: psycopg.Connection) -> str:
        result = reconcile_unmanaged(conn)
        self.state.last_reconcile_drift = result.drift_cores
        self.state.last_reconcile_skipped = result.skipped
        if result.low:
            integrity.raise_alarm(conn, integrity.DB_LOW, result.low)
        for table, cores in result.drift_cores.items():
            metrics.DB_RECONCILE_DRIFT.labels(table).set(cores)
        if any(result.drift_cores.values()):
            logger.warning("reconcile: unmanaged shows' counters had drifted from SUM(proc): %s", result.drift_cores)
        skipped = f", {len(result.skipped)} skipped (lock held)" if result.skipped else ""
        return f"reconcile: {result.shows} unmanaged show(s), drift {result.drift_cores}{skipped}"

    def _triggers_tick(self, conn: psycopg.Connection) -> str:
        return self.triggers.tick(conn, self._rebuild_after_trigger_problems)

    def _rebuild_after_trigger_problems(self, conn: psycopg.Connection) -> None:
        """Everything a trigger that did not fire could have left wrong, rebuilt before booking resumes:
        caps (a cap change not sent), the Store from SUM(proc) and the unmanaged counters (procs
        not counted); the last two raise the integrity alarm on a counter they find low."""
        self._limits_tick(conn)
        self._recompute_tick(conn)
        if self.cuebot is None or not self.cuebot.enabled:
            self._reconcile_tick(conn)

    def _history_tick(self, conn: psycopg.Connection) -> str:
        return self.history.sample(conn, self.state.measured_drift())

    def _run_loop(
        self,
        name: str,
        interval: float,
        tick: Callable[[psycopg.Connection], str],
        stop: threading.Event,
        wakeup: threading.Event | None = None,
    ) -> None:
        """Fixed interval (or sooner when `wakeup` is set), first tick skipped, errors logged, never ends."""
        loop = self.state.loops.setdefault(name, LoopState(interval=interval))
        conn: psycopg.Connection | None = None

        def wait() -> bool:
            if wakeup is None:
                return stop.wait(interval)
            deadline = time.monotonic() + interval
            while not stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or wakeup.wait(min(remaining, 0.1)):
                    return stop.is_set()
            return True

        while not wait():
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

    def set_cuebot_mode(self, mode: CuebotMode) -> None:
        """Beside Cuebot: drop its notifier's duplicate releases, leave unmanaged counters to it."""
        self.cuebot = mode
        self.listener.ignore_xidless_releases = mode.enabled
        self.recomputer.cuebot = mode.enabled
        metrics.CUEBOT_MODE.set(1 if mode.enabled else 0)
        logger.log(logging.WARNING if mode.enabled else logging.INFO, "Cuebot mode %s", mode.describe())

    def start(self, stop: threading.Event, *, bootstrap_timeout: float | None = None) -> None:
        """Start the heartbeat and the listener, block until the bootstrap reseed succeeded, then the loops."""
        self._spawn("heartbeat", self.heartbeat.run, stop)
        self._spawn("listener", self.listener.run, stop)
        deadline = None if bootstrap_timeout is None else time.monotonic() + bootstrap_timeout
        # The bootstrap reseed runs inside the listener's connect, which only afterwards marks
        # itself listening (fresh): wait for both, or the first bookings after start are paused.
        while not (self.bootstrapped.wait(0.2) and self.listener.connected.wait(0.2)):
            if stop.is_set():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"bootstrap did not complete: {self.listener.stats.last_error}")
        # The trigger check's first tick now, not one interval later: a standby that checked at its
        # start may take over long after, and must not book a moment on a trigger gone since.
        try:
            with db.connect(application_name="cuesched-triggers") as conn:
                self._triggers_tick(conn)
        except Exception as exc:
            logger.warning("trigger check at start failed (the loop retries): %s", exc)
        self._spawn("recompute", self._run_loop, "recompute", conf.recompute_interval(), self._recompute_tick, stop)
        self._spawn("limits", self._run_loop, "limits", conf.limit_reseed_interval(), self._limits_tick, stop)
        self._spawn(
            "managed",
            self._run_loop,
            "managed",
            conf.managed_shows_ttl(),
            self._managed_tick,
            stop,
            self._managed_wakeup,
        )
        if self.cuebot is None or not self.cuebot.enabled:
            # Beside Cuebot the unmanaged counters are Cuebot's: a rewrite from a SUM(proc) read
            # before Cuebot's next relative update committed would leave them LOW. Cuebot's own
            # recalculate_subs() is their backstop there.
            self._spawn(
                "reconcile", self._run_loop, "reconcile", conf.db_reconcile_interval(), self._reconcile_tick, stop
            )
        self._spawn("history", self._run_loop, "history", conf.history_interval(), self._history_tick, stop)
        self._spawn(
            "triggers", self._run_loop, "triggers", conf.trigger_check_interval(), self._triggers_tick, stop
        )

    def join(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
