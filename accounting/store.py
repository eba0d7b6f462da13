"""The accounting Store: the live, enforced counters and caps of scheduler-managed shows.

Pure Python: no I/O, no Django. One `threading.Lock` guards all state; every critical section
is arithmetic on dicts and small lists, entered with `with self._lock:` so that an exception
can never leave the lock held. Exactly one process may own a Store (see accounting-design.md
§0: two Stores would jointly over-book).

Safety asymmetry (the rule behind every choice below): a counter that reads HIGH only
under-books and heals at the next recompute; a counter that reads LOW can breach a hard cap.
Whenever the Store cannot tell, it keeps the booking.

Counter layout. Each key (subscription, folder, job) maps to one list, indexed by literal
integers on the hot path (a list subscript is the cheapest mutable cell CPython has):

    0 cores        1 gpus          live totals, the only values the cap check reads
    2 inflight_c   3 inflight_g    booked, not yet confirmed or rolled back
    4 settled0_c   5 settled0_g    confirmed while epoch % 2 == 0
    6 settled1_c   7 settled1_g    confirmed while epoch % 2 == 1
    8 snapshot                     PgSnapshot the absolute value was last read under, or None

Where it departs from the reference design (accounting-design.md §6.2), always toward HIGH
counters and closed caps:

* Signed deltas, exactly once (`apply_delta`): a usage delta from any writer (a release, a proc
  written or resized outside the scheduler, a move of its keys) is skipped on a key whose last
  absolute value was read under a snapshot that already saw the delta's transaction. A key the
  Store does not hold gets only the positive part of a delta: what it never counted cannot be
  taken back.
* Caps fail closed (`book`): a folder or job whose caps the Store does not hold is refused
  (`folder_unseeded`, `job_unseeded`), like a missing burst always was. The reference failed
  open, so a new job, a reopened one or one whose cap row was deleted booked without its max
  until the next reseed. The runtime loads a missing cap before it books (`fill_caps`).
* Caps vs reseed (`set_caps`, `apply_limit_change`): a reseed or fill that read its rows before
  a cap change committed can never overwrite the newer value a notification delivered, nor
  resurrect a cap a notification or a later reseed removed (the removal leaves its source
  behind as a tombstone).
* Eviction (`evict_jobs`) drops only counters that hold nothing, never caps; a complete limit
  reseed removes caps it no longer finds, fenced like every other cap write.
* `forget_sources` drops every recorded snapshot and transaction id: after a failover to a
  server whose transaction ids are not this server's, none of them orders anything.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "Applied",
    "BookingDelta",
    "Caps",
    "CounterSnapshot",
    "LicenceUse",
    "LimitChange",
    "LimitExceeded",
    "LimitKind",
    "PgSnapshot",
    "Store",
]

SUBSCRIPTION = "subscription"
FOLDER = "folder"
JOB = "job"
FOLDER_GPUS = "folder_gpus"
JOB_GPUS = "job_gpus"
FOLDER_UNSEEDED = "folder_unseeded"
JOB_UNSEEDED = "job_unseeded"
LICENCE = "limit"
LICENCE_UNSEEDED = "limit_unseeded"
# How many applied notification xids each licence remembers (a confirm that comes after its
# own notification must not wait for it): far more than the bookings of one batch in flight.
_LICENCE_SEEN = 256


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class BookingDelta:
    """One booking (or, negated, one release) against the three enforced vertices.

    `cores` are whole cores and `gpus` whole units, both signed: conversion from centicores
    happens only at the database boundary (`accounting.units`).
    """

    show: str
    alloc: str
    folder: str
    job: str
    cores: int
    gpus: int
    # Licence limits (limit_record ids) the frame holds while it runs: one each (see book).
    limits: tuple[str, ...] = ()


# The generation a booking carries when the Store holds none for its show: never a database value.
UNKNOWN_GENERATION = -3


@dataclass(frozen=True, slots=True)
class Applied:
    """A booking that passed every cap; exactly one of confirm or rollback must follow.

    `generation` is the show's accounting generation the Store had applied when it decided
    (UNKNOWN_GENERATION if none): the booking transaction refuses the booking if the
    database's differs, since a change the Store has not applied may have come in between.
    """

    delta: BookingDelta
    generation: int = UNKNOWN_GENERATION


@dataclass(frozen=True, slots=True)
class LimitExceeded:
    """The first cap a booking would break; nothing was mutated.

    `current` is the live counter before the delta and `limit` the cap as the Store saw it.
    """

    table: str
    current: int
    limit: int
    key: str = ""  # the licence limit's id, for the `limit` and `limit_unseeded` refusals

    def __str__(self) -> str:
        return f"limit exceeded on {self.table}: current={self.current} limit={self.limit}"


@dataclass(frozen=True)
class CounterSnapshot:
    """(cores, gpus) per key of each vertex: `sub[(show, alloc)]`, `folder[id]`, `job[id]`."""

    sub: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    folder: dict[str, tuple[int, int]] = field(default_factory=dict)
    job: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PgSnapshot:
    """A PostgreSQL MVCC snapshot (`pg_current_snapshot()`), used to order Store writes.

    Transaction ids are `xid8` (64-bit, never wrap), as `pg_current_xact_id()` returns them.
    """

    xmin: int
    xmax: int
    xip: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PgSnapshot:
        """Parse PostgreSQL's text form `xmin:xmax:xip1,xip2,...` (the xip list may be empty)."""
        parts = text.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"not a pg_snapshot: {text!r}")
        try:
            xmin = int(parts[0])
            xmax = int(parts[1])
            xip = frozenset(int(x) for x in parts[2].split(",") if x.strip())
        except ValueError:
            raise ValueError(f"not a pg_snapshot: {text!r}") from None
        if xmin < 0 or xmin > xmax or any(x < xmin or x >= xmax for x in xip):
            raise ValueError(f"inconsistent pg_snapshot: {text!r}")
        return cls(xmin, xmax, xip)

    def visible(self, xid: int) -> bool:
        """Whether transaction `xid` had finished when the snapshot was taken.

        Strictly this means committed *or aborted*; the Store only asks about transactions
        that sent a notification, and PostgreSQL delivers those only on commit.
        """
        if xid < self.xmin:
            return True
        if xid >= self.xmax:
            return False
        return xid not in self.xip

    def older_than(self, other: PgSnapshot) -> bool:
        """Whether this snapshot provably sees strictly less than `other`.

        On one primary the set of finished transactions only grows and `xmax` never goes
        back, so a smaller `xmax` (or the same `xmax` with strictly more transactions still
        in progress) means this snapshot was taken earlier and sees a subset.
        """
        if self.xmax != other.xmax:
            return self.xmax < other.xmax
        return self.xip > other.xip


class LimitKind(enum.Enum):
    """The five enforced caps a notification can change, both of a row at once, or its removal."""

    SUB_BURST = "sub_burst"
    FOLDER_MAX_CORES = "folder_max_cores"
    FOLDER_MAX_GPUS = "folder_max_gpus"
    JOB_MAX_CORES = "job_max_cores"
    JOB_MAX_GPUS = "job_max_gpus"
    FOLDER_CAPS = "folder_caps"  # value: (max_cores, max_gpus)
    JOB_CAPS = "job_caps"
    SUB_REMOVED = "sub_removed"  # value ignored
    FOLDER_REMOVED = "folder_removed"
    JOB_REMOVED = "job_removed"


@dataclass(frozen=True, slots=True)
class LimitChange:
    """One cap change: `key` is (show, alloc) for SUB_*, else the folder or job id.

    `value` is in whole cores or GPUs; -1 (any negative value for folder/job) means unlimited and 0 means nothing. The
    *_CAPS kinds carry (max_cores, max_gpus); the *_REMOVED kinds carry nothing (0).
    """

    kind: LimitKind
    key: tuple[str, str] | str
    value: int | tuple[int, int]


@dataclass(frozen=True)
class Caps:
    """Copies of every cap: burst per (show, alloc); (max_cores, max_gpus) per folder and job."""

    sub: dict[tuple[str, str], int] = field(default_factory=dict)
    folder: dict[str, tuple[int, int]] = field(default_factory=dict)
    job: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LicenceUse:
    """One licence limit as the Store sees it: `max` < 0 is unlimited; `used` is what book compares.

    `base` is the database's count (frames, or hosts for a host limit) as last notified or read,
    `inflight` the Store's bookings not yet committed, `pending` its committed bookings whose
    count has not arrived yet; `used = base + inflight + pending` (high until it arrives, never low).
    """

    max: int
    host: bool
    base: int
    inflight: int
    pending: int

    @property
    def used(self) -> int:
        return self.base + self.inflight + self.pending

    @property
    def full(self) -> bool:
        return self.max >= 0 and self.used >= self.max


# What last wrote a cap field: a notification's transaction id (int), the snapshot of the
# reseed that wrote it (PgSnapshot), or None (unknown: reference behaviour).
_CapSource = int | PgSnapshot | None

# kind -> (vertex, field): 0 max cores, 1 max GPUs, 2 both, 3 removed.
_PAIR_KINDS = {
    LimitKind.FOLDER_MAX_CORES: ("folder", 0),
    LimitKind.FOLDER_MAX_GPUS: ("folder", 1),
    LimitKind.FOLDER_CAPS: ("folder", 2),
    LimitKind.FOLDER_REMOVED: ("folder", 3),
    LimitKind.JOB_MAX_CORES: ("job", 0),
    LimitKind.JOB_MAX_GPUS: ("job", 1),
    LimitKind.JOB_CAPS: ("job", 2),
    LimitKind.JOB_REMOVED: ("job", 3),
}


def _new_counter() -> list:
    return [0, 0, 0, 0, 0, 0, 0, 0, None]


def _notification_is_stale(source: _CapSource, xid: int | None) -> bool:
    # The field was last written by a reseed whose snapshot already saw this transaction:
    # the reseed's value is this change or a later one, so applying it could only go back.
    return xid is not None and isinstance(source, PgSnapshot) and source.visible(xid)


def _reseed_is_stale(source: _CapSource, snapshot: PgSnapshot | None) -> bool:
    if snapshot is None:
        return False
    if isinstance(source, PgSnapshot):
        # Two reseeds can overlap (the limit loop and the managed-flip seed): an older read
        # landing second must not undo the newer one.
        return snapshot.older_than(source)
    if source is not None:
        # A notification committed after the reseed read its rows: its value is newer.
        return not snapshot.visible(source)
    return False


# --------------------------------------------------------------------------- the Store


class Store:
    """Atomic check-and-book over subscription, folder and job, plus the recompute protocol.

    See accounting-design.md §1 for the reference semantics; deviations and additions are
    documented on each method.
    """

    __slots__ = (
        "_burst",
        "_burst_src",
        "_epoch",
        "_folder",
        "_folder_cap_src",
        "_folder_caps",
        "_gen",
        "_gen_gaps",
        "_incarnation",
        "_job",
        "_job_cap_src",
        "_job_caps",
        "_lic",
        "_lic_pending",
        "_lic_reads",
        "_lic_seen",
        "_lock",
        "_rolled",
        "_sub",
        "_window",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sub: dict[tuple[str, str], list] = {}
        self._folder: dict[str, list] = {}
        self._job: dict[str, list] = {}
        self._burst: dict[tuple[str, str], int] = {}
        self._folder_caps: dict[str, tuple[int, int]] = {}
        self._job_caps: dict[str, tuple[int, int]] = {}
        self._burst_src: dict[tuple[str, str], _CapSource] = {}
        self._folder_cap_src: dict[str, tuple[_CapSource, _CapSource]] = {}
        self._job_cap_src: dict[str, tuple[_CapSource, _CapSource]] = {}
        self._epoch = 0
        # Bumped by forget_sources: a read that started before (on the old server) is dropped.
        self._incarnation = 0
        # Releases applied while a snapshot read is open (see open_release_window).
        self._window: list[tuple[BookingDelta, int]] | None = None
        # Bookings rolled back while a pass is open (since its begin_recompute): a compensated
        # booking's proc may still be in that pass's snapshot, so `below` counts them back in
        # (judging high, never low).
        self._rolled: list[BookingDelta] = []
        # Licence limits, by limit_record id: [max, host limit, base (the database's count as
        # last notified or read), in flight, source of base (xid, PgSnapshot or None),
        # confirmed-but-not-yet-seen]. See book and apply_licence.
        self._lic: dict[str, list] = {}
        # Confirmed bookings whose commit's notification has not arrived: limit -> {xid: n}
        # (an unknown xid is keyed ("read", n): dropped by the first licence read begun later).
        self._lic_pending: dict[str, dict[object, int]] = {}
        self._lic_seen: dict[str, deque[int]] = {}
        self._lic_reads = 0
        # Accounting generations, per show: [applied (int, or None: unknown), what the last
        # cap read covered, what the last counter read covered] (see apply_generation).
        self._gen: dict[str, list] = {}
        self._gen_gaps = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def incarnation(self) -> int:
        """Which server's snapshots the Store trusts; capture it before a read, pass it to the write."""
        return self._incarnation

    # ----------------------------------------------------------------------- hot path

    def book(self, delta: BookingDelta) -> Applied | LimitExceeded:
        """Check every cap in the reference order, then add the delta live and in-flight.

        Order: cores (only if > 0) against burst; a folder, then a job, whose caps the Store does
        not hold (fails closed); then cores against folder, job; then GPUs (only if > 0) against
        folder, job. A missing, zero or negative burst rejects every positive core booking; a
        folder/job cap of 0 books nothing (as a burst of 0), a negative one (-1) is unlimited.
        Reaching a cap exactly is allowed. On rejection
        nothing is mutated.
        """
        dc = delta.cores
        dg = delta.gpus
        skey = (delta.show, delta.alloc)
        fkey = delta.folder
        jkey = delta.job
        with self._lock:
            gen = self._gen.get(delta.show)
            generation = UNKNOWN_GENERATION if gen is None or gen[0] is None else gen[0]
            sc = self._sub.get(skey)
            fc = self._folder.get(fkey)
            jc = self._job.get(jkey)
            if dc > 0 or dg > 0:
                fcap = self._folder_caps.get(fkey)
                jcap = self._job_caps.get(jkey)
                if dc > 0:
                    cur = 0 if sc is None else sc[0]
                    limit = self._burst.get(skey, 0)
                    if limit <= 0 or cur + dc > limit:
                        return LimitExceeded(SUBSCRIPTION, cur, limit)
                if fcap is None:
                    return LimitExceeded(FOLDER_UNSEEDED, 0 if fc is None else fc[0], 0)
                if jcap is None:
                    return LimitExceeded(JOB_UNSEEDED, 0 if jc is None else jc[0], 0)
                if dc > 0:
                    limit = fcap[0]
                    if limit >= 0:
                        cur = 0 if fc is None else fc[0]
                        if cur + dc > limit:
                            return LimitExceeded(FOLDER, cur, limit)
                    limit = jcap[0]
                    if limit >= 0:
                        cur = 0 if jc is None else jc[0]
                        if cur + dc > limit:
                            return LimitExceeded(JOB, cur, limit)
                if dg > 0:
                    limit = fcap[1]
                    if limit >= 0:
                        cur = 0 if fc is None else fc[1]
                        if cur + dg > limit:
                            return LimitExceeded(FOLDER_GPUS, cur, limit)
                    limit = jcap[1]
                    if limit >= 0:
                        cur = 0 if jc is None else jc[1]
                        if cur + dg > limit:
                            return LimitExceeded(JOB_GPUS, cur, limit)
            lims = delta.limits
            if lims:
                lic = self._lic
                for lkey in lims:
                    entry = lic.get(lkey)
                    if entry is None:
                        return LimitExceeded(LICENCE_UNSEEDED, 0, 0, lkey)
                    limit = entry[0]
                    if limit >= 0:
                        cur = entry[2] + entry[3] + entry[5]
                        if cur + 1 > limit:
                            return LimitExceeded(LICENCE, cur, limit, lkey)
                for lkey in lims:
                    lic[lkey][3] += 1
            if sc is None:
                sc = self._sub[skey] = _new_counter()
            if fc is None:
                fc = self._folder[fkey] = _new_counter()
            if jc is None:
                jc = self._job[jkey] = _new_counter()
            if dc:
                sc[0] += dc
                sc[2] += dc
                fc[0] += dc
                fc[2] += dc
                jc[0] += dc
                jc[2] += dc
            if dg:
                sc[1] += dg
                sc[3] += dg
                fc[1] += dg
                fc[3] += dg
                jc[1] += dg
                jc[3] += dg
        return Applied(delta, generation)

    def confirm(self, delta: BookingDelta, xid: int | None = None) -> None:
        """Move an applied booking from in-flight to the settled bucket of the current epoch.

        Called after the proc committed (and RQD launched). The live total does not change;
        the bucket tells the next recompute whether its snapshot can be trusted to hold it.
        `xid` is the booking transaction: a licence it holds stays counted until the
        database's own count for that transaction has arrived (see apply_licence).
        """
        if delta.limits:
            self._confirm_licences(delta.limits, xid)
        dc = delta.cores
        dg = delta.gpus
        skey = (delta.show, delta.alloc)
        fkey = delta.folder
        jkey = delta.job
        with self._lock:
            b = 4 + ((self._epoch & 1) << 1)
            c = self._sub.get(skey)
            if c is None:
                c = self._sub[skey] = _new_counter()
            f = self._folder.get(fkey)
            if f is None:
                f = self._folder[fkey] = _new_counter()
            j = self._job.get(jkey)
            if j is None:
                j = self._job[jkey] = _new_counter()
            if dc:
                c[2] -= dc
                c[b] += dc
                f[2] -= dc
                f[b] += dc
                j[2] -= dc
                j[b] += dc
            if dg:
                b += 1
                c[3] -= dg
                c[b] += dg
                f[3] -= dg
                f[b] += dg
                j[3] -= dg
                j[b] += dg

    def rollback(self, delta: BookingDelta) -> None:
        """Undo an applied booking whose dispatch failed: subtract it live and in-flight."""
        if delta.limits:
            with self._lock:
                for lkey in delta.limits:
                    entry = self._lic.get(lkey)
                    if entry is not None and entry[3] > 0:
                        entry[3] -= 1
        dc = delta.cores
        dg = delta.gpus
        skey = (delta.show, delta.alloc)
        fkey = delta.folder
        jkey = delta.job
        with self._lock:
            if self._window is not None:
                self._rolled.append(delta)
            c = self._sub.get(skey)
            if c is None:
                c = self._sub[skey] = _new_counter()
            f = self._folder.get(fkey)
            if f is None:
                f = self._folder[fkey] = _new_counter()
            j = self._job.get(jkey)
            if j is None:
                j = self._job[jkey] = _new_counter()
            c[0] -= dc
            c[2] -= dc
            f[0] -= dc
            f[2] -= dc
            j[0] -= dc
            j[2] -= dc
            c[1] -= dg
            c[3] -= dg
            f[1] -= dg
            f[3] -= dg
            j[1] -= dg
            j[3] -= dg

    # ----------------------------------------------------------------------- releases

    def apply_delta(self, delta: BookingDelta, xid: int | None = None) -> bool:
        """Add a signed usage delta (a release, an outside booking, one side of a move) live.

        No cap check, no floor; in-flight and settled amounts are untouched (the delta
        concerns a proc that has committed). A key the Store holds gets the whole delta; a key
        it does not hold is created with only the positive part (a proc it never counted cannot
        be taken back, and one it did not know about must now count).

        Exactly-once: `xid` is the writing transaction (`pg_current_xact_id()`). Each key
        remembers the snapshot its absolute value was last read under (`overwrite_counters`,
        `seed_show_booked`). If that snapshot already shows `xid` as finished, the snapshot's
        SUM already reflects the write, so applying it again would double it (a release
        would read LOW): the key is skipped. Anything the snapshot cannot vouch for (no
        recorded snapshot, or `xid` not yet visible in it) gets the delta. Each key is decided
        on its own, since the three keys may have been written by different passes.

        While a snapshot read is open (`open_release_window`, `begin_recompute`) the delta
        is also logged, so the absolute write that ends the read can apply it again if the
        snapshot did not see it.

        Returns whether at least one key was changed.
        """
        dc = delta.cores
        dg = delta.gpus
        applied = False
        with self._lock:
            if self._window is not None and xid is not None:
                self._window.append((delta, xid))
            for table, key in (
                (self._sub, (delta.show, delta.alloc)),
                (self._folder, delta.folder),
                (self._job, delta.job),
            ):
                counter = table.get(key)
                if counter is None:
                    if dc <= 0 and dg <= 0:
                        continue
                    counter = table[key] = _new_counter()
                    counter[0] = max(dc, 0)
                    counter[1] = max(dg, 0)
                    applied = True
                    continue
                if xid is not None:
                    seen = counter[8]
                    if seen is not None and seen.visible(xid):
                        continue
                counter[0] += dc
                counter[1] += dg
                applied = True
        return applied

    # ----------------------------------------------------------------------- recompute

    def begin_recompute(self) -> int:
        """Open a recompute pass; must run BEFORE the snapshot SQL is issued.

        Bumping the epoch sends every later confirm to the other settled bucket, which is
        what lets `overwrite_counters` tell confirms its snapshot surely holds (before begin)
        from those it may have missed (after begin).
        """
        with self._lock:
            epoch = self._epoch
            self._epoch = epoch + 1
            self._window = []
            self._rolled = []
        return epoch

    def open_release_window(self) -> None:
        """Start logging releases; call BEFORE reading a snapshot that an absolute write will follow.

        A release applied between the snapshot read and the write (`overwrite_counters`,
        `seed_show_booked`) is erased by that write. If its transaction is not visible in the
        snapshot, the snapshot still counted the proc, and the counter would read high (safe,
        but the release would be lost until the next pass). The write replays exactly those
        logged releases on the keys it wrote. `begin_recompute` opens the window itself.
        """
        with self._lock:
            self._window = []

    def _replay_window(self, snapshot: CounterSnapshot, pg_snapshot: PgSnapshot | None) -> None:
        """Under the lock: re-apply logged releases the snapshot could not see, then close the window."""
        window, self._window = self._window, None
        if not window or pg_snapshot is None:
            return  # no snapshot to judge by: leave the counter high (safe) until the next pass
        for delta, xid in window:
            if pg_snapshot.visible(xid):
                continue  # the snapshot's SUM already excludes the proc
            for table, values, key in (
                (self._sub, snapshot.sub, (delta.show, delta.alloc)),
                (self._folder, snapshot.folder, delta.folder),
                (self._job, snapshot.job, delta.job),
            ):
                if key in values:
                    counter = table[key]
                    counter[0] += delta.cores
                    counter[1] += delta.gpus

    def overwrite_counters(
        self,
        snapshot: CounterSnapshot,
        epoch: int,
        pg_snapshot: PgSnapshot | None = None,
        incarnation: int | None = None,
    ) -> None:
        """Replace live totals with `SUM(proc)` plus what the snapshot cannot have seen.

        For each key in `snapshot`: `cores = snap + inflight + settled[keep]` (same for GPUs),
        where `keep` is the bucket of confirms made since `begin_recompute` (their procs may
        have committed after the read: carried, at worst counted twice for one pass) and
        `clear` the bucket of confirms made before it (surely in the snapshot: dropped). Then
        `settled[clear]` is zeroed on every key, and keys absent from the snapshot keep their
        live value.

        `pg_snapshot` (the `pg_current_snapshot()` of the read) is recorded on each key
        written, for `apply_delta`'s exactly-once rule; None records "unknown".

        Deviation: `epoch` must be the value the latest `begin_recompute` returned. A stale
        epoch could have the parity of the current one, and clearing that bucket would erase
        confirms the snapshot never saw (a LOW counter), so it raises ValueError instead.
        """
        with self._lock:
            if epoch != self._epoch - 1:
                raise ValueError(f"overwrite_counters for epoch {epoch}, but the open pass is {self._epoch - 1}")
            if incarnation is not None and incarnation != self._incarnation:
                # Read on the server we no longer trust: carried like a failed pass (high, safe).
                self._window = None
                return
            clear = epoch & 1
            kc = 4 + 2 * (1 - clear)
            cc = 4 + 2 * clear
            for table, values in (
                (self._sub, snapshot.sub),
                (self._folder, snapshot.folder),
                (self._job, snapshot.job),
            ):
                for key, (cores, gpus) in values.items():
                    counter = table.get(key)
                    if counter is None:
                        counter = table[key] = _new_counter()
                    counter[0] = cores + counter[2] + counter[kc]
                    counter[1] = gpus + counter[3] + counter[kc + 1]
                    counter[8] = pg_snapshot
                for counter in table.values():
                    counter[cc] = 0
                    counter[cc + 1] = 0
            self._replay_window(snapshot, pg_snapshot)

    def seed_show_booked(
        self, snapshot: CounterSnapshot, pg_snapshot: PgSnapshot | None = None, incarnation: int | None = None
    ) -> bool:
        """Set absolute live totals for a show about to be published (or re-published) as managed.

        `cores = snap + inflight + settled[current epoch]`, as `overwrite_counters` keeps them:
        a show re-seeded after a flip round trip can still have bookings in flight (their
        write will fail its generation check and roll back, which subtracts them again), and
        confirms since the last recompute began may postdate the snapshot. Confirms of the
        other bucket predate the last pass's begin, hence this snapshot: not carried. Buckets,
        in-flight amounts and the epoch are untouched; absent keys are left alone. The
        snapshot is recorded per key like `overwrite_counters` does. Returns False (nothing
        written) for a read begun before `forget_sources`: the show must not be published then.
        """
        with self._lock:
            if incarnation is not None and incarnation != self._incarnation:
                self._window = None
                return False
            kc = 4 + 2 * (self._epoch & 1)
            for table, values in (
                (self._sub, snapshot.sub),
                (self._folder, snapshot.folder),
                (self._job, snapshot.job),
            ):
                for key, (cores, gpus) in values.items():
                    counter = table.get(key)
                    if counter is None:
                        counter = table[key] = _new_counter()
                    counter[0] = cores + counter[2] + counter[kc]
                    counter[1] = gpus + counter[3] + counter[kc + 1]
                    counter[8] = pg_snapshot
            self._replay_window(snapshot, pg_snapshot)
        return True

    # ----------------------------------------------------------------------- caps

    def set_caps(
        self,
        subs: Mapping[tuple[str, str], int],
        folders: Mapping[str, tuple[int, int]],
        jobs: Mapping[str, tuple[int, int]],
        pg_snapshot: PgSnapshot | None = None,
        *,
        complete: bool = False,
        incarnation: int | None = None,
    ) -> int:
        """Bulk write from a limit reseed (`complete=True`) or a fill of a few keys; returns removals.

        With `pg_snapshot` (the snapshot the rows were read under), a field is left alone when
        what last wrote it is provably newer than those rows: a notification whose transaction
        the snapshot does not see, an overlapping reseed or fill that read a later snapshot, or
        a removal of either kind (its source stays behind as a tombstone, so an older read
        cannot bring the cap back). Folder and job fields are decided separately, since
        Cuebot's notifications change one at a time.

        `complete` says the rows are every cap the database has for the Store's shows: a key
        the Store holds but the rows lack (a deleted subscription, a finished job, a show no
        longer managed) is removed, unless its source is newer than the snapshot, and the
        tombstones of earlier removals that this snapshot supersedes are purged. Without a
        snapshot every row is written (reference) and nothing is removed. A read begun before
        `forget_sources` (`incarnation` differs) is dropped whole: its snapshot is the old
        server's, and recording it would freeze every later cap write again.
        """
        removed = 0
        with self._lock:
            if incarnation is not None and incarnation != self._incarnation:
                return 0
            burst = self._burst
            burst_src = self._burst_src
            for key, value in subs.items():
                if _reseed_is_stale(burst_src.get(key), pg_snapshot):
                    continue
                burst[key] = value
                burst_src[key] = pg_snapshot
            self._set_pair_caps(self._folder_caps, self._folder_cap_src, folders, pg_snapshot)
            self._set_pair_caps(self._job_caps, self._job_cap_src, jobs, pg_snapshot)
            if complete and pg_snapshot is not None:
                removed += self._prune_caps(burst, burst_src, subs, pg_snapshot, pair=False)
                removed += self._prune_caps(self._folder_caps, self._folder_cap_src, folders, pg_snapshot, pair=True)
                removed += self._prune_caps(self._job_caps, self._job_cap_src, jobs, pg_snapshot, pair=True)
        return removed

    @staticmethod
    def _prune_caps(caps: dict, sources: dict, rows: Mapping, pg_snapshot: PgSnapshot, *, pair: bool) -> int:
        """Under the lock: remove caps a complete read no longer has; purge superseded tombstones."""
        removed = 0
        for key in [k for k in caps if k not in rows]:
            src = sources.get(key)
            fields = src if pair else (src,)
            if fields is None:
                fields = (None, None) if pair else (None,)
            if any(_reseed_is_stale(f, pg_snapshot) for f in fields):
                continue  # written after this read: keep it until a read that sees it
            del caps[key]
            sources[key] = (pg_snapshot, pg_snapshot) if pair else pg_snapshot
            removed += 1
        for key in [k for k in sources if k not in caps and k not in rows]:
            src = sources[key]
            fields = src if pair else (src,)
            if all(f is not pg_snapshot and not _reseed_is_stale(f, pg_snapshot) for f in fields):
                del sources[key]  # this complete read postdates the removal: nothing older can land now
        return removed

    @staticmethod
    def _set_pair_caps(
        caps: dict[str, tuple[int, int]],
        sources: dict[str, tuple[_CapSource, _CapSource]],
        rows: Mapping[str, tuple[int, int]],
        pg_snapshot: PgSnapshot | None,
    ) -> None:
        for key, (max_cores, max_gpus) in rows.items():
            old = caps.get(key)
            src_cores, src_gpus = sources.get(key, (None, None))
            stale_cores = _reseed_is_stale(src_cores, pg_snapshot)
            stale_gpus = _reseed_is_stale(src_gpus, pg_snapshot)
            if old is None:
                if stale_cores or stale_gpus:
                    continue  # removed after this read: the key stays closed until a newer read
                caps[key] = (max_cores, max_gpus)
                sources[key] = (pg_snapshot, pg_snapshot)
                continue
            if stale_cores:
                max_cores = old[0]
            else:
                src_cores = pg_snapshot
            if stale_gpus:
                max_gpus = old[1]
            else:
                src_gpus = pg_snapshot
            caps[key] = (max_cores, max_gpus)
            sources[key] = (src_cores, src_gpus)

    def apply_limit_change(self, change: LimitChange, xid: int | None = None) -> bool:
        """Set (or remove) one cap from a notification; returns False when skipped.

        Skipped when the reseed or fill that last wrote the field already saw `xid` (its value
        is at least as new), and, for a folder or job the Store does not hold, when the message
        names one field only (Cuebot's format): the other field is unknown, and a missing key
        fails closed until a fill or reseed reads both. A removal leaves its `xid` as the
        field's source, so a reseed that read the row before the delete cannot resurrect it.
        Notifications among themselves need no ordering check: PostgreSQL delivers them in
        commit order, which xids do not follow.
        """
        kind = change.kind
        key = change.key
        value = change.value
        with self._lock:
            if kind is LimitKind.SUB_BURST or kind is LimitKind.SUB_REMOVED:
                if _notification_is_stale(self._burst_src.get(key), xid):
                    return False
                if kind is LimitKind.SUB_REMOVED:
                    self._burst.pop(key, None)  # type: ignore[call-overload]
                else:
                    self._burst[key] = value  # type: ignore[index, assignment]
                self._burst_src[key] = xid  # type: ignore[index]
                return True
            vertex, index = _PAIR_KINDS[kind]
            if vertex == "folder":
                caps, sources = self._folder_caps, self._folder_cap_src
            else:
                caps, sources = self._job_caps, self._job_cap_src
            old = caps.get(key)  # type: ignore[call-overload]
            src = sources.get(key, (None, None))  # type: ignore[call-overload]
            if index >= 2:
                if _notification_is_stale(src[0], xid) and _notification_is_stale(src[1], xid):
                    return False
                if index == 3:
                    caps.pop(key, None)  # type: ignore[call-overload]
                else:
                    caps[key] = value  # type: ignore[index, assignment]
                sources[key] = (xid, xid)  # type: ignore[index]
                return True
            if old is None or _notification_is_stale(src[index], xid):
                return False
            if index == 0:
                caps[key] = (value, old[1])  # type: ignore[index]
                sources[key] = (xid, src[1])  # type: ignore[index]
            else:
                caps[key] = (old[0], value)  # type: ignore[index]
                sources[key] = (src[0], xid)  # type: ignore[index]
            return True

    # ----------------------------------------------------------------------- generations
    #
    # A show's accounting generation (accounting.triggers, bump_generation) moves with every
    # committed change that could let a booking breach a cap: a cap lowered or removed, a key
    # moved into a cap, a positive outside delta, a flip. The Store records, per show, the
    # generation up to which it has applied every such change, and `book` hands it to the
    # booking, whose transaction fails when the database has moved on. Two sources:
    #
    # * a notification carrying (gen_from, gen), applied after the change it came with, in
    #   commit order: the chain moves only from exactly gen_from, so a message lost or dropped
    #   (or a flip, which sends none) leaves a gap the show cannot book across;
    # * the reads: a cap read and a counter read each report the generations they saw in their
    #   own snapshot (`cover_generations`); every bump up to the smaller of the two is in both,
    #   so the applied generation may move up to it. This heals a gap, and seeds a show.
    #
    # A generation never moves back (values come from one sequence and grow in commit order).

    def generation(self, show: str) -> int | None:
        """The show's applied accounting generation, None when unknown (its bookings then fail)."""
        with self._lock:
            entry = self._gen.get(show)
            return None if entry is None else entry[0]

    @property
    def generation_gaps(self) -> int:
        """How many notified generations did not follow the applied one (a lost message or a flip)."""
        return self._gen_gaps

    def apply_generation(self, show: str, gen_from: int, gen: int) -> bool:
        """A notification's bump, after its change was applied (or skipped as already read); False if ignored."""
        with self._lock:
            entry = self._gen.get(show)
            if entry is None or entry[0] is None or gen <= entry[0]:
                return False  # unknown (a read will seed it) or already covered
            if entry[0] != gen_from:
                self._gen_gaps += 1
                return False  # a gap: the show waits for the reads to cover it
            entry[0] = gen
            return True

    def cover_generations(self, kind: str, gens: Mapping[str, int], incarnation: int | None = None) -> None:
        """Record what a read covered: `kind` 'caps' or 'counters', show -> generation in its snapshot.

        Call only after the read's values were written to the Store (a read dropped, say by
        `incarnation`, covers nothing). The generations must have been read in the same
        snapshot as the values, or before it.
        """
        index = 1 if kind == "caps" else 2
        with self._lock:
            if incarnation is not None and incarnation != self._incarnation:
                return
            for show, value in gens.items():
                entry = self._gen.get(show)
                if entry is None:
                    entry = self._gen[show] = [None, None, None]
                if entry[index] is None or value > entry[index]:
                    entry[index] = value
                if entry[1] is not None and entry[2] is not None:
                    covered = min(entry[1], entry[2])
                    if entry[0] is None or covered > entry[0]:
                        entry[0] = covered

    def forget_sources(self) -> None:
        """Drop every recorded snapshot and transaction id (a failover: they order nothing now).

        Counters and caps keep their values; the next absolute writes (the reseed that must
        follow) then apply unconditionally, and until then every delta is applied (high).
        """
        with self._lock:
            self._incarnation += 1
            self._gen.clear()  # the other server's generations: only new reads seed them
            for table in (self._sub, self._folder, self._job):
                for counter in table.values():
                    counter[8] = None
            self._burst_src = {k: None for k in self._burst}
            self._folder_cap_src = {k: (None, None) for k in self._folder_caps}
            self._job_cap_src = {k: (None, None) for k in self._job_caps}
            self._window = None
            for lkey, entry in self._lic.items():
                entry[4] = None
                pending = self._lic_pending.get(lkey)
                if pending:
                    # Their xids are the old server's: kept until the next read begun from now.
                    n = sum(pending.values())
                    pending.clear()
                    pending[("read", self._lic_reads)] = n
            self._lic_seen.clear()

    # ----------------------------------------------------------------------- licence limits
    #
    # One counter per limit lives in the database (accounting.licences): every proc writer,
    # this scheduler included, recounts it under the limit row's lock and is refused above the
    # max. The Store keeps that count (`base`) as notified on acct_licence (absolute values,
    # in commit order, since every writer of the limit holds its row lock until COMMIT) or read
    # by the limit reseed, and adds its own bookings on top until the count that includes them
    # has arrived, so that a managed booking over a limit is refused here, under the same lock
    # as the caps, instead of by the database. A host limit is counted +1 per booking, even
    # on a host that already holds the licence: the Store reads high there (it may refuse a
    # frame the database would take), never low.

    def _confirm_licences(self, limits: tuple[str, ...], xid: int | None) -> None:
        with self._lock:
            for lkey in limits:
                entry = self._lic.get(lkey)
                if entry is None:
                    continue
                if entry[3] > 0:
                    entry[3] -= 1
                src = entry[4]
                if xid is not None:
                    if xid in self._lic_seen.get(lkey, ()):
                        continue  # its count arrived before this confirm: base holds it
                    if isinstance(src, PgSnapshot) and src.visible(xid):
                        continue  # the last read already counted it
                    token: object = xid
                else:
                    token = ("read", self._lic_reads)
                pending = self._lic_pending.setdefault(lkey, {})
                pending[token] = pending.get(token, 0) + 1
                entry[5] += 1

    def apply_licence(self, limit: str, max_value: int, host: bool, running: int, xid: int | None = None) -> bool:
        """Set a limit's max and database count from an acct_licence notification; False if skipped.

        Skipped when the last reseed already saw `xid` (its values are at least as new). The
        committed bookings of transaction `xid` are in `running` now: they stop being counted
        on top of it.
        """
        with self._lock:
            entry = self._lic.get(limit)
            if entry is not None and _notification_is_stale(entry[4], xid):
                return False
            if entry is None:
                entry = self._lic[limit] = [max_value, host, running, 0, xid, 0]
            else:
                entry[0] = max_value
                entry[1] = host
                entry[2] = running
                entry[4] = xid
            if xid is not None:
                seen = self._lic_seen.get(limit)
                if seen is None:
                    seen = self._lic_seen[limit] = deque(maxlen=_LICENCE_SEEN)
                seen.append(xid)
                pending = self._lic_pending.get(limit)
                if pending and xid in pending:
                    entry[5] -= pending.pop(xid)
            return True

    def remove_licence(self, limit: str, xid: int | None = None) -> bool:
        """A deleted limit_record: forget it (a layer still naming it is refused as unseeded)."""
        with self._lock:
            entry = self._lic.get(limit)
            if entry is None or _notification_is_stale(entry[4], xid):
                return False
            del self._lic[limit]
            self._lic_pending.pop(limit, None)
            self._lic_seen.pop(limit, None)
            return True

    def begin_licence_read(self) -> int:
        """Call before opening the snapshot of a licence read; pass the token to set_licences."""
        with self._lock:
            self._lic_reads += 1
            return self._lic_reads

    def set_licences(
        self,
        rows: Mapping[str, tuple[int, bool, int]],
        pg_snapshot: PgSnapshot | None,
        token: int,
        *,
        complete: bool = True,
        incarnation: int | None = None,
    ) -> None:
        """Write every limit's (max, host, count) from a read under `pg_snapshot`.

        A limit whose last notification the snapshot cannot see keeps the notified values (they
        are newer). Confirmed bookings the snapshot sees committed are in its counts: they stop
        being counted on top, as do those of unknown transaction confirmed before the read began
        (`token`). With `complete`, a limit the rows lack (deleted) is forgotten.
        """
        with self._lock:
            if incarnation is not None and incarnation != self._incarnation:
                return
            for lkey, (max_value, host, running) in rows.items():
                entry = self._lic.get(lkey)
                if entry is None:
                    entry = self._lic[lkey] = [max_value, host, running, 0, pg_snapshot, 0]
                elif not _reseed_is_stale(entry[4], pg_snapshot):
                    entry[0] = max_value
                    entry[1] = host
                    entry[2] = running
                    entry[4] = pg_snapshot
                pending = self._lic_pending.get(lkey)
                if pending:
                    for t in list(pending):
                        if isinstance(t, int):
                            drop = pg_snapshot is not None and pg_snapshot.visible(t)
                        else:
                            drop = t[1] < token  # type: ignore[index]
                        if drop:
                            entry[5] -= pending.pop(t)
            if complete:
                for lkey in [k for k in self._lic if k not in rows]:
                    if _reseed_is_stale(self._lic[lkey][4], pg_snapshot):
                        continue
                    del self._lic[lkey]
                    self._lic_pending.pop(lkey, None)
                    self._lic_seen.pop(lkey, None)

    def licences(self) -> dict[str, LicenceUse]:
        """Every limit the Store holds, copied under the lock."""
        with self._lock:
            return {k: LicenceUse(e[0], e[1], e[2], e[3], e[5]) for k, e in self._lic.items()}

    def missing_licences(self, limits: Iterable[str]) -> list[str]:
        """Which of these limits `book` would refuse as unseeded."""
        with self._lock:
            return [k for k in limits if k not in self._lic]

    def full_licences(self) -> list[str]:
        """Limits at or over their max: a layer holding one cannot book now (the feed skips it)."""
        with self._lock:
            return [k for k, e in self._lic.items() if e[0] >= 0 and e[2] + e[3] + e[5] >= e[0]]

    # ----------------------------------------------------------------------- eviction

    def evict_jobs(self, jobs: Iterable[str]) -> int:
        """Drop the counters of jobs that hold nothing; returns how many were dropped.

        The runtime calls this for jobs that left the recompute's universe (FINISHED or
        deleted) with no procs, so memory stays flat over months of jobs (the reference never
        evicts). A job is kept while anything could still be a booking: live cores or GPUs,
        in-flight amounts, or settled buckets not yet proven to be in a snapshot. Caps are
        never touched here: a job reopened after its counter went can only book once its caps
        are known again, and only a complete limit reseed (fenced by its snapshot) removes a
        cap. Subscription and folder counters are few and long-lived: not evicted.
        """
        evicted = 0
        with self._lock:
            for job in jobs:
                counter = self._job.get(job)
                if counter is None or any(counter[:8]):
                    continue
                del self._job[job]
                evicted += 1
        return evicted

    # ----------------------------------------------------------------------- reads

    def audit_snapshot(self) -> CounterSnapshot:
        """Live (cores, gpus) of every key, copied under the lock."""
        with self._lock:
            return CounterSnapshot(
                sub={k: (c[0], c[1]) for k, c in self._sub.items()},
                folder={k: (c[0], c[1]) for k, c in self._folder.items()},
                job={k: (c[0], c[1]) for k, c in self._job.items()},
            )

    def below(
        self, snapshot: CounterSnapshot, pg_snapshot: PgSnapshot | None
    ) -> dict[str, dict[tuple[str, str] | str, tuple[int, int, int, int]]]:
        """Keys whose live counter reads BELOW `snapshot` (a SUM(proc) read under `pg_snapshot`).

        Call between the read and its `overwrite_counters`, once every notification committed
        before the read has been applied (the recompute waits for a heartbeat sent after it).
        Then the live counter holds everything the snapshot saw (the scheduler's own bookings
        from `book` on, every outside delta once) plus the deltas of later transactions, which
        the open window lists: those are taken back out before comparing. What remains below
        the snapshot is a proc no event counted (a disabled trigger, `session_replication_role =
        replica`): an integrity alarm, not drift. Returns vertex -> key -> (live less later
        deltas, snapshot) for cores then GPUs, as (live_c, snap_c, live_g, snap_g).
        """
        out: dict[str, dict[tuple[str, str] | str, tuple[int, int, int, int]]] = {}
        if pg_snapshot is None:
            return out
        with self._lock:
            later: dict[str, dict[object, list[int]]] = {"sub": {}, "folder": {}, "job": {}}
            deltas = [(d, 1) for d, xid in self._window or () if not pg_snapshot.visible(xid)]
            deltas += [(d, -1) for d in self._rolled]  # counted back in: the snapshot may hold them
            for delta, sign in deltas:
                for name, key in (("sub", (delta.show, delta.alloc)), ("folder", delta.folder), ("job", delta.job)):
                    adj = later[name].setdefault(key, [0, 0])
                    adj[0] += sign * delta.cores
                    adj[1] += sign * delta.gpus
            for name, table, values in (
                ("sub", self._sub, snapshot.sub),
                ("folder", self._folder, snapshot.folder),
                ("job", self._job, snapshot.job),
            ):
                for key, (cores, gpus) in values.items():
                    counter = table.get(key)
                    live_c, live_g = (0, 0) if counter is None else (counter[0], counter[1])
                    adj_c, adj_g = later[name].get(key, (0, 0))
                    if live_c - adj_c < cores or live_g - adj_g < gpus:
                        out.setdefault(name, {})[key] = (live_c - adj_c, cores, live_g - adj_g, gpus)
        return out

    def inflight_snapshot(self) -> CounterSnapshot:
        """In-flight (cores, gpus) of every key: bookings whose dispatch has not finished."""
        with self._lock:
            return CounterSnapshot(
                sub={k: (c[2], c[3]) for k, c in self._sub.items()},
                folder={k: (c[2], c[3]) for k, c in self._folder.items()},
                job={k: (c[2], c[3]) for k, c in self._job.items()},
            )

    def caps(self) -> Caps:
        """Copies of every cap map."""
        with self._lock:
            return Caps(sub=dict(self._burst), folder=dict(self._folder_caps), job=dict(self._job_caps))

    def job_cores_in_use(self, job: str) -> int:
        """Live cores of a job, 0 if unknown (advisory pre-check; `book` is the authority)."""
        with self._lock:
            counter = self._job.get(job)
            return 0 if counter is None else counter[0]

    def sub_counters(self, show: str, alloc: str) -> tuple[int, int]:
        """(booked_cores, burst) of a subscription; missing values read as 0."""
        key = (show, alloc)
        with self._lock:
            counter = self._sub.get(key)
            return (0 if counter is None else counter[0], self._burst.get(key, 0))

    def sub_counters_many(self, keys: Iterable[tuple[str, str]]) -> list[tuple[str, str, int, int]]:
        """(show, alloc, booked_cores, burst) of each subscription under one lock acquisition: the
        feed orders managed shows by these (their database counters lag). Missing values read 0."""
        with self._lock:
            out = []
            for key in keys:
                counter = self._sub.get(key)
                out.append((key[0], key[1], 0 if counter is None else counter[0], self._burst.get(key, 0)))
            return out

    def jobs_cores_in_use(self, jobs: Iterable[str]) -> list[tuple[str, int]]:
        """(job, live cores) of the jobs the Store counts, under one lock acquisition."""
        with self._lock:
            return [(job, c[0]) for job in jobs if (c := self._job.get(job)) is not None]

    def job_cap(self, job: str) -> tuple[int, int] | None:
        """(max_cores, max_gpus) of a job, or None when unseeded (which `book` reads as unlimited)."""
        with self._lock:
            return self._job_caps.get(job)

    def missing_caps(self, folders: Iterable[str], jobs: Iterable[str]) -> tuple[list[str], list[str]]:
        """Which of these folders and jobs `book` would refuse as unseeded; one lock for all of them."""
        with self._lock:
            return (
                [f for f in folders if f not in self._folder_caps],
                [j for j in jobs if j not in self._job_caps],
            )

    def folder_cap(self, folder: str) -> tuple[int, int] | None:
        """(max_cores, max_gpus) of a folder, or None when unseeded (unlimited for `book`)."""
        with self._lock:
            return self._folder_caps.get(folder)
