"""The LISTEN loop: releases and cap changes from PostgreSQL into the Store, live.

Its own autocommit psycopg connection, never Django's. On every (re)connect it LISTENs
first and only then runs `on_connect` (a reseed of caps and counters): whatever was
committed while it was away is then either in the reseed's snapshot or still queued on
the new connection, and the xids in the payloads let the Store apply each one exactly
once either way. This closes the reference's unsafe gap, a cap decrease missed while
disconnected lingering until the next 5-minute reseed.

Liveness has a deadline. A path that still acknowledges but delivers nothing (a frozen
proxy, a half-open TCP connection) looks like a quiet one, and a probe query on it would
block forever. So the scheduler NOTIFYs itself on `cuesched_heartbeat` from another
connection (`HeartbeatSender`) and the listener only reads: the age of the last heartbeat it
received (counted from when it was sent) is how stale its view of the database can be, since
notifications arrive in commit order. Past `CUESCHED_HEARTBEAT_DEADLINE` the listener drops
the connection, reconnects and reseeds; meanwhile `fresh()` is false and the service books no
managed show.

Each (re)connect also reads the server's identity (`pg_control_system().system_identifier`)
and its current `xmax`, and hands them to `on_connect`: after a failover to another server
the recorded snapshots and transaction ids order nothing, and the service must forget them
before it reseeds.

The notifications are doorbells (accounting.notify, "The outbox"): PostgreSQL lets any session
NOTIFY any channel, so the payload on a channel is never applied. A batch of notifications on
the accounting channels makes the listener consume the outbox (`DRAIN_SQL`, on a connection of
its own) and apply those rows, in id order, which is commit order for every row that another
one must follow (the writers of one cap row, one limit row or one show's generation are
serialised by that row's lock, and each writes its outbox row after taking it). A heartbeat is
handled only after the doorbells received before it have been answered, so `fresh()` keeps its
meaning. Only the lease holder consumes: a stopped old holder woken after a takeover, or one
whose lock session died and who has not noticed yet, must not take the new holder's rows. The
process's own belief (`may_consume`) is not enough for that, so the database fences the
consuming statements by the lease generation (`DRAIN_FENCED_SQL`), and a doorbell that finds
the outbox fenced tells the process it lost its lease.

A payload that does not parse is logged with its raw text, counted and dropped. No
exception escapes the loop: anything unexpected is logged, the connection is dropped and
re-made with capped exponential backoff.
"""

from __future__ import annotations

import itertools
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from accounting import channels, db, metrics
from accounting.notify import (
    CLEAR_FENCED_SQL,
    CLEAR_SQL,
    DRAIN_FENCED_SQL,
    DRAIN_SQL,
    LEASE_GENERATION_SQL,
    OUTBOX_CHANNELS,
)
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
    licences_applied: int = 0
    # Accounting generations moved by a notification (Store.apply_generation).
    generations_applied: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    injected_drops: int = 0
    # Releases from Cuebot's AccountingNotifier dropped in Cuebot mode (see Listener.handle).
    cuebot_releases_ignored: int = 0
    # Notifications on the accounting channels (doorbells), outbox drains, and the rows they applied.
    doorbells: int = 0
    drains: int = 0
    outbox_rows: int = 0
    last_error: str | None = None
    last_reseed_seconds: float | None = None
    resyncs: int = 0
    heartbeats: int = 0
    wedges: int = 0
    # Monotonic time up to which everything committed is known to have arrived: the send time
    # of the newest heartbeat received, or the start of the last reseed, whichever is later.
    fresh_as_of: float | None = None
    server_id: str | None = None
    # The newest transaction id a notification carried: a server whose xmax is not past it
    # never committed that transaction (a failover that lost the tail).
    max_xid: int = 0
    # The latest applied cap changes (vertex, key, field, value, unix time), newest last: the
    # ops console shows when the scheduler applied an operator's edit.
    recent_caps: deque[tuple[str, str, str, int, float]] = field(default_factory=lambda: deque(maxlen=500))


_CAP_FIELDS = {
    LimitKind.SUB_BURST: ("sub", ("burst",)),
    LimitKind.FOLDER_MAX_CORES: ("folder", ("max_cores",)),
    LimitKind.FOLDER_MAX_GPUS: ("folder", ("max_gpus",)),
    LimitKind.JOB_MAX_CORES: ("job", ("max_cores",)),
    LimitKind.JOB_MAX_GPUS: ("job", ("max_gpus",)),
    LimitKind.FOLDER_CAPS: ("folder", ("max_cores", "max_gpus")),
    LimitKind.JOB_CAPS: ("job", ("max_cores", "max_gpus")),
}


def _cap_records(change: LimitChange) -> list[tuple[str, str, str, int, float]]:
    """One (vertex, key, field, value, time) per field the change set; removals set none."""
    if change.kind not in _CAP_FIELDS:
        return []
    vertex, names = _CAP_FIELDS[change.kind]
    key = ":".join(change.key) if isinstance(change.key, tuple) else change.key
    values = change.value if isinstance(change.value, tuple) else (change.value,)
    now = time.time()
    return [(vertex, key, name, value, now) for name, value in zip(names, values, strict=True)]


IDENTITY_SQL = """
SELECT (SELECT system_identifier::text FROM pg_control_system()), pg_snapshot_xmax(pg_current_snapshot())::text
"""


@dataclass(frozen=True)
class ServerIdentity:
    """Which server a connection reached, and how far its transaction ids had got."""

    system_id: str | None
    xmax: int


def read_identity(conn: psycopg.Connection) -> ServerIdentity:
    try:
        row = conn.execute(IDENTITY_SQL).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        # pg_control_system() is restricted on some installations: fall back to the xmax check.
        row = (None, conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()[0])  # type: ignore[index]
    assert row is not None
    return ServerIdentity(system_id=row[0], xmax=int(row[1]))


class HeartbeatSender:
    """NOTIFYs `cuesched_heartbeat` every `interval` from a connection of its own.

    Its own connection and thread: a send blocked on a dead path must not stop the listener
    from noticing that nothing comes back. `sent_at(seq)` tells the listener when a heartbeat
    it received left.
    """

    def __init__(self, interval: float, connect: Callable[[], psycopg.Connection] | None = None) -> None:
        self.interval = interval
        self.token = secrets.token_hex(8)
        self._connect = connect or (lambda: db.connect(autocommit=True, application_name="cuesched-heartbeat"))
        self._seq = itertools.count(1)
        self._sent: dict[int, float] = {}
        self._lock = threading.Lock()
        self.errors = 0

    def sent_at(self, payload: str) -> float | None:
        token, _, seq = payload.partition(":")
        if token != self.token or not seq.isdigit():
            return None
        with self._lock:
            return self._sent.pop(int(seq), None)

    def run(self, stop: threading.Event) -> None:
        conn: psycopg.Connection | None = None
        while not stop.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = self._connect()
                seq = next(self._seq)
                with self._lock:
                    self._sent[seq] = time.monotonic()
                    for old in [k for k in self._sent if k < seq - 1000]:
                        del self._sent[old]
                conn.execute("SELECT pg_notify(%s, %s)", (channels.HEARTBEAT_CHANNEL, f"{self.token}:{seq}"))
            except Exception as exc:
                self.errors += 1
                logger.debug("heartbeat send failed: %s", exc)
                if conn is not None:
                    conn.close()
                conn = None
            stop.wait(self.interval)
        if conn is not None:
            conn.close()


class ListenerWedgedError(RuntimeError):
    """No heartbeat came back within the deadline: the path is treated as dead."""


class Listener:
    """Consumes `acct_release`, `acct_limit_change` and `acct_resync` into the Store.

    `on_connect(identity)` runs after LISTEN on every connect; it must reseed caps and
    counters (forgetting recorded snapshots first if the server changed) and raise on failure
    (the listener then reconnects and retries). `on_resync(table)` runs for a TRUNCATE.
    `on_event` is called after each handled notification (metrics, tests). With a
    `heartbeat`, a session that receives none of its heartbeats for `deadline` seconds is
    dropped and re-made.
    """

    def __init__(
        self,
        store: Store,
        *,
        on_connect: Callable[[ServerIdentity], None] | None = None,
        on_event: Callable[[str, str], None] | None = None,
        on_resync: Callable[[str], None] | None = None,
        heartbeat: HeartbeatSender | None = None,
        deadline: float = 3.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 10.0,
        poll_timeout: float = 0.2,
        connect: Callable[[], psycopg.Connection] | None = None,
        outbox_connect: Callable[[], psycopg.Connection] | None = None,
        may_consume: Callable[[], bool] | None = None,
        lease_generation: Callable[[], int | None] | None = None,
        on_lease_lost: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.on_connect = on_connect
        self.on_event = on_event
        self.on_resync = on_resync
        self.heartbeat = heartbeat
        self.deadline = deadline
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.poll_timeout = poll_timeout
        self._connect = connect or (lambda: db.connect(autocommit=True, application_name="cuesched-listener"))
        # The outbox is read on a connection of its own: the LISTEN session only ever reads (a
        # query on a frozen path would block the loop that must notice the freeze).
        self._outbox_connect = outbox_connect or (
            lambda: db.connect(autocommit=True, application_name="cuesched-outbox")
        )
        self._outbox: psycopg.Connection | None = None
        self.may_consume = may_consume or (lambda: True)
        # The lease this process consumes under (None: no lease, the outbox is this process's).
        self.lease_generation = lease_generation or (lambda: None)
        self.on_lease_lost = on_lease_lost or (lambda: None)
        # Doorbells received and not answered yet (the lease holder could not be sure it holds it).
        self._rang = False
        self.stats = ListenerStats()
        self.connected = threading.Event()
        # Fault injection for the stress suite: drop this share of acct_release messages.
        self.drop_release_ratio = 0.0
        self._rng = random.Random(0x0C0FFEE)
        self._conn: psycopg.Connection | None = None
        self.backend_pid: int | None = None
        # Cuebot mode: our proc trigger sends a release for every proc delete, whoever the
        # writer, so a release without a transaction id (Cuebot's AccountingNotifier, which
        # runs when Cuebot's accounting.notify.enabled is true) is the same release a second
        # time. Applying it would read the Store LOW; it is counted, warned about and dropped.
        self.ignore_xidless_releases = False
        self._cuebot_warned_at: float | None = None

    # -- handling one message (public so tests can feed raw payloads) --
    def handle(self, channel: str, payload: str) -> str:
        """Apply one message as trusted; returns its outcome: applied, skipped or dropped:<reason>.

        The loop calls it for outbox rows (what the triggers wrote) and heartbeats only, never
        for a payload that came on a channel: that one any session could have sent.
        """
        try:
            if channel == channels.RELEASE_CHANNEL:
                if self.drop_release_ratio and self._rng.random() < self.drop_release_ratio:
                    self.stats.injected_drops += 1
                    return "dropped:injected"
                release = channels.parse_release(payload)
                if release.xid is None and self.ignore_xidless_releases:
                    return self._ignore_cuebot_release(payload)
                if release.xid is not None and release.xid > self.stats.max_xid:
                    self.stats.max_xid = release.xid
                applied = self.store.apply_delta(release.delta, release.xid)
                # After the delta (applied, or skipped as already read): the bump it closes.
                if release.generation is not None and self.store.apply_generation(
                    release.delta.show, *release.generation
                ):
                    self.stats.generations_applied += 1
                if applied:
                    self.stats.releases_applied += 1
                    return "applied"
                self.stats.releases_skipped += 1
                return "skipped"
            if channel == channels.LIMIT_CHANNEL:
                notice = channels.parse_limit_change(payload)
                if notice.xid is not None and notice.xid > self.stats.max_xid:
                    self.stats.max_xid = notice.xid
                outcome = "skipped"
                for change in notice.changes:
                    if self.store.apply_limit_change(change, notice.xid):
                        self.stats.limits_applied += 1
                        self.stats.recent_caps.extend(_cap_records(change))
                        outcome = "applied"
                    else:
                        self.stats.limits_skipped += 1
                if notice.generation is not None and self.store.apply_generation(*notice.generation):
                    self.stats.generations_applied += 1
                    outcome = "applied"
                return outcome
            if channel == channels.LICENCE_CHANNEL:
                lic = channels.parse_licence(payload)
                if lic.removed:
                    applied = self.store.remove_licence(lic.limit, lic.xid)
                else:
                    applied = self.store.apply_licence(lic.limit, lic.max, lic.host, lic.running, lic.xid)
                if applied:
                    self.stats.licences_applied += 1
                    return "applied"
                return "skipped"
            if channel == channels.HEARTBEAT_CHANNEL:
                sent = self.heartbeat.sent_at(payload) if self.heartbeat is not None else None
                if sent is None:
                    return "dropped:foreign"  # another scheduler's, or one sent before a reconnect
                self.stats.heartbeats += 1
                self.stats.fresh_as_of = max(self.stats.fresh_as_of or sent, sent)
                return "heartbeat"
            if channel == channels.RESYNC_CHANNEL:
                resync = channels.parse_resync(payload)
                self.stats.resyncs += 1
                logger.warning("listener: %s was truncated; reseeding the Store", resync.table)
                if self.on_resync is not None:
                    self.on_resync(resync.table)
                return "applied"
            logger.debug("ignoring notification on unexpected channel %r", channel)
            return "dropped:channel"
        except channels.PayloadError as exc:
            self.stats.dropped[channel] = self.stats.dropped.get(channel, 0) + 1
            logger.warning("dropped malformed %s payload (%s): %r", channel, exc, payload[:2000])
            return "dropped:malformed"

    # -- the outbox --
    def _outbox_conn(self) -> psycopg.Connection:
        if self._outbox is None or self._outbox.closed or self._outbox.broken:
            self._outbox = self._outbox_connect()
        return self._outbox

    def _outbox_execute(self, unfenced: str, fenced: str) -> psycopg.Cursor[Any]:
        """Consume under the lease, in the database: whatever this process believes of its lease."""
        generation = self.lease_generation()
        if generation is None:
            return self._outbox_conn().execute(unfenced)
        return self._outbox_conn().execute(fenced, {"generation": generation})

    def _check_fence(self) -> None:
        """A doorbell that found nothing: tell the process if the lease has moved on.

        The old holder learns it lost the lease here at the first write after the takeover, not
        at its next renewal, which a killed lock session can put off for good.
        """
        generation = self.lease_generation()
        if generation is None:
            return
        row = self._outbox_conn().execute(LEASE_GENERATION_SQL).fetchone()
        if row is not None and int(row[0]) != generation:
            logger.error(
                "listener: the outbox is fenced: the lease is at generation %d, this process holds %d",
                int(row[0]),
                generation,
            )
            self.on_lease_lost()

    def clear_outbox(self) -> int:
        """Drop what is in the outbox; only right before a reseed, which reads all of it anyway."""
        if not self.may_consume():
            return 0
        cur = self._outbox_execute(CLEAR_SQL, CLEAR_FENCED_SQL)
        return cur.rowcount

    def drain(self) -> int:
        """Consume the outbox and apply its rows in id order; returns how many rows were applied.

        Raises when the outbox cannot be read (the session is then re-made, and its reseed heals
        whatever the failed read had consumed); returns -1 when this process may not consume now.
        """
        if not self.may_consume():
            return -1
        rows = self._outbox_execute(DRAIN_SQL, DRAIN_FENCED_SQL).fetchall()
        if not rows:
            self._check_fence()
        self._rang = False
        self.stats.drains += 1
        rows.sort()
        for _id, channel, payload in rows:
            outcome = self.handle(channel, payload)
            self.stats.outbox_rows += 1
            if self.on_event is not None:
                self.on_event(channel, outcome)
        return len(rows)

    def handle_batch(self, notes: list[psycopg.Notify]) -> None:
        """Answer a batch of notifications: doorbells by one drain, heartbeats after the drain."""
        for note in notes:
            if note.channel in OUTBOX_CHANNELS:
                self.stats.doorbells += 1
                self._rang = True
                cuebot = self.ignore_xidless_releases and note.channel == channels.RELEASE_CHANNEL
                if cuebot and '"xid"' not in note.payload and self.on_event is not None:
                    self.on_event(note.channel, self._ignore_cuebot_release(note.payload))
                elif cuebot and '"xid"' not in note.payload:
                    self._ignore_cuebot_release(note.payload)
                continue
            if note.channel == channels.HEARTBEAT_CHANNEL and self._rang and self.drain() < 0:
                # Not answered: this heartbeat cannot vouch for what came before it.
                continue
            outcome = self.handle(note.channel, note.payload)
            if self.on_event is not None:
                self.on_event(note.channel, outcome)
        if self._rang:
            self.drain()

    def _ignore_cuebot_release(self, payload: str) -> str:
        """Drop a Cuebot notifier release; warn loudly, at most once a minute (it comes per proc)."""
        self.stats.cuebot_releases_ignored += 1
        now = time.monotonic()
        if self._cuebot_warned_at is None or now - self._cuebot_warned_at >= 60.0:
            self._cuebot_warned_at = now
            logger.warning(
                "Cuebot's AccountingNotifier is on (accounting.notify.enabled=true): cuesched's proc trigger "
                "already sent this release, so it is dropped, never counted twice (%d so far). Set "
                "accounting.notify.enabled=false in Cuebot, the configuration Cuebot mode expects. Payload: %r",
                self.stats.cuebot_releases_ignored,
                payload[:500],
            )
        return "dropped:cuebot_notifier"

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

    def fresh(self, max_age: float | None = None) -> bool:
        """Whether everything committed more than `max_age` seconds ago has surely arrived."""
        if self.stats.state != "listening" or self.stats.fresh_as_of is None:
            return False
        return time.monotonic() - self.stats.fresh_as_of <= (self.deadline if max_age is None else max_age)

    def heartbeat_age(self) -> float | None:
        fresh_as_of = self.stats.fresh_as_of
        return None if fresh_as_of is None else time.monotonic() - fresh_as_of

    def _session(self, stop: threading.Event) -> None:
        self.stats.fresh_as_of = None
        conn = self._connect()
        self._conn = conn
        self.backend_pid = conn.info.backend_pid
        for channel in channels.CHANNELS:
            conn.execute(f"LISTEN {channel}")
        identity = read_identity(conn)
        self.stats.server_id = identity.system_id
        self.stats.state = "reseeding"
        started = time.monotonic()
        # Every row committed before this point is in the reseed below; later ones ring again.
        self._rang = False
        self.clear_outbox()
        if self.on_connect is not None:
            self.on_connect(identity)
        self.stats.last_reseed_seconds = time.monotonic() - started
        # The reseed read everything committed before it started; later commits are queued here.
        self.stats.fresh_as_of = started
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
        while not stop.is_set():
            # Only reads on this connection: a query on a frozen path would block for good. One
            # batch is everything received so far (at least one, or none after the poll timeout).
            notes = list(conn.notifies(timeout=self.poll_timeout, stop_after=1))
            if notes or self._rang:
                self.handle_batch(notes)
            age = self.heartbeat_age()
            if self.heartbeat is not None and age is not None and age > self.deadline:
                self.stats.wedges += 1
                metrics.LISTENER_WEDGES.inc()
                raise ListenerWedgedError(f"no heartbeat came back for {age:.1f}s (deadline {self.deadline:.1f}s)")

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        outbox, self._outbox = self._outbox, None
        self.stats.fresh_as_of = None
        if outbox is not None and not outbox.closed:
            try:
                outbox.close()
            except Exception:
                pass
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except Exception:
                pass
