"""The LISTEN loop: releases and cap changes from PostgreSQL into the Store, live.

Its own autocommit psycopg connection, never Django's. On every (re)connect it LISTENs
first and only then runs `on_connect` (a reseed of caps and counters): whatever was
committed while it was away is then either in the reseed's snapshot or still queued on
the new connection, and the xids in the payloads let the Store apply each one exactly
once either way. This closes the reference's unsafe gap, a cap decrease missed while
disconnected lingering until the next 5-minute reseed.

A payload that does not parse is logged with its raw text, counted and dropped. No
exception escapes the loop: anything unexpected is logged, the connection is dropped and
re-made with capped exponential backoff.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from accounting import channels, db, metrics
from accounting.store import LimitChange, LimitKind, Store

logger = logging.getLogger(__name__)


@dataclass
class ListenerStats:
    """Counters the live view and the metrics read; plain ints, written by one thread."""

    state: str = "starting"
    connected_since: float | None = None
    reconnects: int = 0
    releases_applied: int = 0
    releases_skipped: int = 0
    limits_applied: int = 0
    limits_skipped: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    injected_drops: int = 0
    last_error: str | None = None
    last_reseed_seconds: float | None = None
    # The latest applied cap changes (vertex, key, field, value, unix time), newest last: the
    # ops console shows when the scheduler applied an operator's edit.
    recent_caps: deque[tuple[str, str, str, int, float]] = field(default_factory=lambda: deque(maxlen=500))


_CAP_FIELDS = {
    LimitKind.SUB_BURST: ("sub", "burst"),
    LimitKind.FOLDER_MAX_CORES: ("folder", "max_cores"),
    LimitKind.FOLDER_MAX_GPUS: ("folder", "max_gpus"),
    LimitKind.JOB_MAX_CORES: ("job", "max_cores"),
    LimitKind.JOB_MAX_GPUS: ("job", "max_gpus"),
}


def _cap_record(change: LimitChange) -> tuple[str, str, str, int, float]:
    vertex, name = _CAP_FIELDS[change.kind]
    key = ":".join(change.key) if isinstance(change.key, tuple) else change.key
    return (vertex, key, name, change.value, time.time())


class Listener:
    """Consumes `acct_release` and `acct_limit_change` into the Store.

    `on_connect(conn_factory)` runs after LISTEN on every connect; it must reseed caps
    and counters and raise on failure (the listener then reconnects and retries).
    `on_event` is called after each handled notification (metrics, tests).
    """

    def __init__(
        self,
        store: Store,
        *,
        on_connect: Callable[[], None] | None = None,
        on_event: Callable[[str, str], None] | None = None,
        backoff_initial: float = 0.1,
        backoff_max: float = 10.0,
        poll_timeout: float = 0.5,
        probe_interval: float = 5.0,
    ) -> None:
        self.store = store
        self.on_connect = on_connect
        self.on_event = on_event
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.poll_timeout = poll_timeout
        self.probe_interval = probe_interval
        self.stats = ListenerStats()
        self.connected = threading.Event()
        # Fault injection for the stress suite: drop this share of acct_release messages.
        self.drop_release_ratio = 0.0
        self._rng = random.Random(0x0C0FFEE)
        self._conn: psycopg.Connection | None = None
        self.backend_pid: int | None = None

    # -- handling one notification (public so tests can feed raw payloads) --
    def handle(self, channel: str, payload: str) -> str:
        """Apply one notification; returns its outcome: applied, skipped or dropped:<reason>."""
        try:
            if channel == channels.RELEASE_CHANNEL:
                if self.drop_release_ratio and self._rng.random() < self.drop_release_ratio:
                    self.stats.injected_drops += 1
                    return "dropped:injected"
                release = channels.parse_release(payload)
                if self.store.apply_release(release.delta, release.xid):
                    self.stats.releases_applied += 1
                    return "applied"
                self.stats.releases_skipped += 1
                return "skipped"
            if channel == channels.LIMIT_CHANNEL:
                notice = channels.parse_limit_change(payload)
                outcome = "skipped"
                for change in notice.changes:
                    if self.store.apply_limit_change(change, notice.xid):
                        self.stats.limits_applied += 1
                        self.stats.recent_caps.append(_cap_record(change))
                        outcome = "applied"
                    else:
                        self.stats.limits_skipped += 1
                return outcome
            logger.debug("ignoring notification on unexpected channel %r", channel)
            return "dropped:channel"
        except channels.PayloadError as exc:
            self.stats.dropped[channel] = self.stats.dropped.get(channel, 0) + 1
            logger.warning("dropped malformed %s payload (%s): %r", channel, exc, payload[:2000])
            return "dropped:malformed"

    # -- the loop --
    def run(self, stop: threading.Event) -> None:
        delay = self.backoff_initial
        while not stop.is_set():
            try:
                self._session(stop)
            except Exception as exc:
                if self.connected.is_set():
                    # The session had been healthy: a fresh outage, not a failing retry.
                    delay = self.backoff_initial
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                self.stats.state = "disconnected"
                self.connected.clear()
                metrics.LISTENER_CONNECTED.set(0)
                logger.warning(
                    "listener: %s; reconnecting in %.1fs (the reseed on reconnect heals the gap)",
                    self.stats.last_error,
                    delay,
                )
            finally:
                self._close()
            if stop.wait(delay):
                break
            delay = min(delay * 2, self.backoff_max)
            self.stats.reconnects += 1
            metrics.LISTENER_RECONNECTS.inc()
        self.stats.state = "stopped"

    def _session(self, stop: threading.Event) -> None:
        conn = db.connect(autocommit=True, application_name="cuesched-listener")
        self._conn = conn
        self.backend_pid = conn.info.backend_pid
        for channel in channels.CHANNELS:
            conn.execute(f"LISTEN {channel}")
        self.stats.state = "reseeding"
        started = time.monotonic()
        if self.on_connect is not None:
            self.on_connect()
        self.stats.last_reseed_seconds = time.monotonic() - started
        self.stats.state = "listening"
        self.stats.connected_since = time.time()
        self.connected.set()
        metrics.LISTENER_CONNECTED.set(1)
        logger.info(
            "listener: listening on %s (backend pid %s), reseeded in %.3fs",
            ", ".join(channels.CHANNELS),
            self.backend_pid,
            self.stats.last_reseed_seconds,
        )
        last_probe = time.monotonic()
        while not stop.is_set():
            for note in conn.notifies(timeout=self.poll_timeout):
                outcome = self.handle(note.channel, note.payload)
                if self.on_event is not None:
                    self.on_event(note.channel, outcome)
                if stop.is_set():
                    return
            # A terminated backend surfaces as an error inside notifies(); a quiet but dead
            # path only on traffic, hence a cheap probe every few seconds of silence.
            if time.monotonic() - last_probe >= self.probe_interval:
                conn.execute("SELECT 1")
                last_probe = time.monotonic()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except Exception:
                pass
