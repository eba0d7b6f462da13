"""Stateful property test: the Store against a plain model of PostgreSQL and the dispatcher.

The model keeps what the database would hold (proc rows and caps, written by transactions
with increasing xids that commit in any order), what the dispatcher has booked, and the
notifications PostgreSQL would deliver (in commit order, on one LISTEN connection; some are
dropped, as on a reconnect). Recompute passes and limit reseeds read honest snapshots: a
`PgSnapshot` built from the transactions in progress at the moment of the read, and the rows
visible under it, so procs that commit between `begin_recompute` and the read, or between the
read and the overwrite, straddle the pass exactly as they would in production.

Properties:
* no counter ever reads below the truth (committed proc rows plus bookings whose proc has
  not committed): a dropped release may only make it read high;
* booked cores and GPUs never exceed a cap that was in force when `book` ran;
* after two recompute passes with no activity in between, every counter equals the truth,
  even when releases that the passes already reflect are delivered afterwards;
* a cap always holds the newest value among the notifications and reseeds applied to it.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from accounting.store import (
    Applied,
    BookingDelta,
    CounterSnapshot,
    LimitChange,
    LimitExceeded,
    LimitKind,
    PgSnapshot,
    Store,
)

SHOW = "show"
ALLOCS = ("alloc-a", "alloc-b")
JOB_FOLDER = {"job-1": "folder-1", "job-2": "folder-1", "job-3": "folder-2"}
FOLDERS = ("folder-1", "folder-2")
SUBS = tuple((SHOW, a) for a in ALLOCS)

# A cap field: ("sub", (show, alloc), 0) | ("folder", id, 0 cores / 1 gpus) | ("job", id, 0|1).
CapField = tuple[str, object, int]
CAP_FIELDS: tuple[CapField, ...] = (
    *(("sub", s, 0) for s in SUBS),
    *(("folder", f, i) for f in FOLDERS for i in (0, 1)),
    *(("job", j, i) for j in JOB_FOLDER for i in (0, 1)),
)
CAP_VALUES = {
    ("sub", 0): (0, 8, 20, 60, 60),
    ("folder", 0): (-1, 0, 6, 15, 40),
    ("folder", 1): (-1, 0, 2, 6),
    ("job", 0): (-1, 4, 10, 30),
    ("job", 1): (-1, 1, 4),
}
# Cap changes go to a few fields only, so that two changes of one field (and their races
# with a reseed) are common.
HOT_CAP_FIELDS: tuple[CapField, ...] = (
    ("sub", SUBS[0], 0),
    ("folder", "folder-1", 0),
    ("job", "job-1", 0),
)
KIND = {
    ("sub", 0): LimitKind.SUB_BURST,
    ("folder", 0): LimitKind.FOLDER_MAX_CORES,
    ("folder", 1): LimitKind.FOLDER_MAX_GPUS,
    ("job", 0): LimitKind.JOB_MAX_CORES,
    ("job", 1): LimitKind.JOB_MAX_GPUS,
}


@dataclass(eq=False)
class Proc:
    """A booking and/or its proc row."""

    delta: BookingDelta
    booked: bool  # False for procs Cuebot started before the show became managed
    insert_xid: int | None = None
    insert_committed: bool = False
    confirmed: bool = False
    rolled_back: bool = False
    delete_xid: int | None = None
    delete_committed: bool = False

    def row_visible(self) -> bool:
        return self.insert_committed and not self.delete_committed

    def counts(self) -> bool:
        """Whether the truth holds this proc: a row in the database, or a live booking."""
        if self.rolled_back:
            return False  # the scheduler gave it back; the row is being compensated away
        if self.insert_committed:
            return not self.delete_committed
        return self.booked


@dataclass
class Txn:
    xid: int
    kind: str  # insert | delete | compensate | cap
    proc: Proc | None = None
    cap: tuple[CapField, int] | None = None


@dataclass
class Reseed:
    pg: PgSnapshot
    values: dict[CapField, int]
    reflects: dict[CapField, int]  # commit sequence of the newest change visible per field


@dataclass
class Pass:
    epoch: int
    read: tuple[CounterSnapshot, PgSnapshot] | None = None


@dataclass
class CapHistory:
    values: dict[int, int] = field(default_factory=dict)  # commit sequence -> value
    latest: int = 0  # commit sequence of the newest committed change
    applied: int = 0  # newest change any applied notification or reseed reflects


def keys_of(delta: BookingDelta) -> tuple[tuple[str, str], str, str]:
    return (delta.show, delta.alloc), delta.folder, delta.job


def expected_decision(audit: CounterSnapshot, caps, d: BookingDelta) -> Applied | LimitExceeded:
    """The reference cap rules (design §1.3, §1.4), restated independently of the Store.

    Issue 20: a folder/job cap of 0 books nothing, as a burst of 0; a negative one is unlimited.
    """
    skey, fkey, jkey = keys_of(d)
    sub = audit.sub.get(skey, (0, 0))
    fol = audit.folder.get(fkey, (0, 0))
    job = audit.job.get(jkey, (0, 0))
    fcap = caps.folder.get(fkey, (0, 0))
    jcap = caps.job.get(jkey, (0, 0))
    if d.cores > 0:
        burst = caps.sub.get(skey, 0)
        if burst <= 0 or sub[0] + d.cores > burst:
            return LimitExceeded("subscription", sub[0], burst)
        for table, cur, cap in (("folder", fol[0], fcap[0]), ("job", job[0], jcap[0])):
            if cap >= 0 and cur + d.cores > cap:
                return LimitExceeded(table, cur, cap)
    if d.gpus > 0:
        for table, cur, cap in (("folder_gpus", fol[1], fcap[1]), ("job_gpus", job[1], jcap[1])):
            if cap >= 0 and cur + d.gpus > cap:
                return LimitExceeded(table, cur, cap)
    return Applied(d)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = Store()
        self.next_xid = 100
        self.commit_seq = 0
        self.open: list[Txn] = []
        self.procs: list[Proc] = []
        self.queue: deque[tuple[str, object, int]] = deque()  # (channel, payload, xid)
        self.pass_: Pass | None = None
        self.reseeds: list[Reseed] = []
        self.db_caps: dict[CapField, int] = {}
        self.history: dict[CapField, CapHistory] = {}
        self.procs_at_converge = 0

    # ------------------------------------------------------------------ database model

    def new_xid(self) -> int:
        xid = self.next_xid
        self.next_xid += 1
        return xid

    def pg_snapshot(self) -> PgSnapshot:
        xip = frozenset(t.xid for t in self.open)
        return PgSnapshot(min(xip, default=self.next_xid), self.next_xid, xip)

    def truth(self) -> CounterSnapshot:
        out = CounterSnapshot(
            sub={s: (0, 0) for s in SUBS},
            folder={f: (0, 0) for f in FOLDERS},
            job={j: (0, 0) for j in JOB_FOLDER},
        )
        for p in self.procs:
            if p.counts():
                self._add(out, p.delta)
        return out

    def read_counters(self) -> CounterSnapshot:
        """SUM(proc) with the zero baseline, as the recompute reads it."""
        out = CounterSnapshot(
            sub={s: (0, 0) for s in SUBS},
            folder={f: (0, 0) for f in FOLDERS},
            job={j: (0, 0) for j in JOB_FOLDER},
        )
        for p in self.procs:
            if p.row_visible():
                self._add(out, p.delta)
        return out

    @staticmethod
    def _add(out: CounterSnapshot, d: BookingDelta) -> None:
        skey, fkey, jkey = keys_of(d)
        for table, key in ((out.sub, skey), (out.folder, fkey), (out.job, jkey)):
            cores, gpus = table[key]
            table[key] = (cores + d.cores, gpus + d.gpus)

    def cap_rows(self, values: dict[CapField, int]):
        subs = {key: values[("sub", key, 0)] for key in SUBS}
        folders = {f: (values[("folder", f, 0)], values[("folder", f, 1)]) for f in FOLDERS}
        jobs = {j: (values[("job", j, 0)], values[("job", j, 1)]) for j in JOB_FOLDER}
        return subs, folders, jobs

    def commit(self, txn: Txn) -> None:
        self.open.remove(txn)
        self.commit_seq += 1
        if txn.kind == "insert":
            txn.proc.insert_committed = True
        elif txn.kind in ("delete", "compensate"):
            txn.proc.delete_committed = True
            if txn.kind == "delete":
                d = txn.proc.delta
                release = BookingDelta(d.show, d.alloc, d.folder, d.job, -d.cores, -d.gpus)
                self.queue.append(("release", release, txn.xid))
        else:
            cap_field, value = txn.cap
            self.db_caps[cap_field] = value
            hist = self.history[cap_field]
            hist.values[self.commit_seq] = value
            hist.latest = self.commit_seq
            self.queue.append(("cap", (cap_field, self.commit_seq, value), txn.xid))

    # ------------------------------------------------------------------ set-up

    @initialize(
        caps=st.fixed_dictionaries(
            {f: st.sampled_from(CAP_VALUES[(f[0], f[2])]) for f in CAP_FIELDS},
        ),
        cuebot_procs=st.lists(
            st.tuples(st.sampled_from(ALLOCS), st.sampled_from(sorted(JOB_FOLDER)), st.integers(1, 4)),
            max_size=3,
        ),
    )
    def bootstrap(self, caps: dict[CapField, int], cuebot_procs: list[tuple[str, str, int]]) -> None:
        # Procs Cuebot booked before the show became managed; then caps, seed, publish.
        for alloc, job, cores in cuebot_procs:
            proc = Proc(BookingDelta(SHOW, alloc, JOB_FOLDER[job], job, cores, 0), booked=False)
            proc.insert_xid = self.new_xid()
            proc.insert_committed = True
            self.procs.append(proc)
        self.db_caps = dict(caps)
        self.history = {f: CapHistory(values={0: v}) for f, v in caps.items()}
        pg = self.pg_snapshot()
        self.store.set_caps(*self.cap_rows(self.db_caps), pg_snapshot=pg)
        self.store.seed_show_booked(self.read_counters(), pg_snapshot=pg)

    # ------------------------------------------------------------------ dispatcher
    # Few rules, each always enabled and choosing among the actions that are possible right
    # now: with many preconditioned rules, Hypothesis's swarm testing leaves most runs short.

    @rule(
        alloc=st.sampled_from(ALLOCS),
        job=st.sampled_from(sorted(JOB_FOLDER)),
        cores=st.integers(0, 5),
        gpus=st.integers(0, 2),
        open_txn=st.booleans(),
    )
    def book(self, alloc: str, job: str, cores: int, gpus: int, open_txn: bool) -> None:
        d = BookingDelta(SHOW, alloc, JOB_FOLDER[job], job, cores, gpus)
        audit, caps = self.store.audit_snapshot(), self.store.caps()
        result = self.store.book(d)
        assert result == expected_decision(audit, caps, d)
        if isinstance(result, LimitExceeded):
            assert self.store.audit_snapshot() == audit
            return
        proc = Proc(d, booked=True)
        self.procs.append(proc)
        if open_txn:  # the dispatcher opens its transaction right after booking
            self.start(Txn(self.new_xid(), "insert", proc))
        # The cap in force when book ran bounds the truth, not just the Store's view of it.
        truth = self.truth()
        skey, fkey, jkey = keys_of(d)
        if cores > 0:
            assert truth.sub[skey][0] <= caps.sub[skey]
            for cur, cap in ((truth.folder[fkey][0], caps.folder[fkey][0]), (truth.job[jkey][0], caps.job[jkey][0])):
                assert cap < 0 or cur <= cap
        if gpus > 0:
            for cur, cap in ((truth.folder[fkey][1], caps.folder[fkey][1]), (truth.job[jkey][1], caps.job[jkey][1])):
                assert cap < 0 or cur <= cap

    def start(self, txn: Txn) -> None:
        if txn.kind == "insert":
            txn.proc.insert_xid = txn.xid
        elif txn.kind in ("delete", "compensate"):
            txn.proc.delete_xid = txn.xid
        self.open.append(txn)

    def choose(self, data, actions: list[tuple[str, list]]):
        """Draw one (action, item) among the actions that have candidates, or None."""
        live = [(name, items) for name, items in actions if items]
        if not live:
            return None
        name, items = data.draw(st.sampled_from(live), label="action")
        return name, data.draw(st.sampled_from(items), label=name)

    @rule(data=st.data())
    def dispatcher(self, data) -> None:
        unstarted = [p for p in self.procs if p.booked and not p.rolled_back and p.insert_xid is None]
        inserting = [t for t in self.open if t.kind == "insert"]
        launched = [p for p in self.procs if p.booked and p.insert_committed and not p.confirmed and not p.rolled_back]
        picked = self.choose(
            data,
            [  # the happy path is listed more than once: it is what production mostly does
                ("open_txn", unstarted),
                ("open_txn", unstarted),
                ("rollback_before_txn", unstarted),
                ("commit_and_confirm", inserting),
                ("commit_and_confirm", inserting),
                ("abort_txn", inserting),
                ("confirm", launched),
                ("confirm", launched),
                ("launch_fails", [p for p in launched if p.delete_xid is None]),
            ],
        )
        if picked is None:
            return
        action, item = picked
        if action == "open_txn":
            self.start(Txn(self.new_xid(), "insert", item))
        elif action == "rollback_before_txn":
            self.store.rollback(item.delta)
            item.rolled_back = True
        elif action == "commit_and_confirm":
            self.commit(item)
            self.store.confirm(item.proc.delta)
            item.proc.confirmed = True
        elif action == "abort_txn":
            self.open.remove(item)
            self.store.rollback(item.proc.delta)
            item.proc.rolled_back = True
        elif action == "confirm":
            self.store.confirm(item.delta)
            item.confirmed = True
        else:
            # Rollback, then the scheduler's own compensating DELETE (which sends no NOTIFY).
            self.store.rollback(item.delta)
            item.rolled_back = True
            self.start(Txn(self.new_xid(), "compensate", item))

    # ------------------------------------------------------------------ the database: Cuebot, admins, commits

    @rule(data=st.data())
    def database(self, data) -> None:
        deletable = [p for p in self.procs if p.row_visible() and p.delete_xid is None and not p.rolled_back]
        picked = self.choose(
            data,
            [
                ("commit", list(self.open)),
                ("start_delete", deletable),
                ("start_cap_change", list(HOT_CAP_FIELDS)),
                ("admin_sets_cap", list(HOT_CAP_FIELDS)),
                ("abort_cap_change", [t for t in self.open if t.kind == "cap"]),
            ],
        )
        action, item = picked
        if action == "commit":
            self.commit(item)
        elif action == "start_delete":
            self.start(Txn(self.new_xid(), "delete", item))
        elif action in ("start_cap_change", "admin_sets_cap"):
            value = data.draw(st.sampled_from(CAP_VALUES[(item[0], item[2])]), label="value")
            txn = Txn(self.new_xid(), "cap", cap=(item, value))
            self.start(txn)
            if action == "admin_sets_cap":  # an UPDATE in its own short transaction
                self.commit(txn)
        else:
            self.open.remove(item)

    # ------------------------------------------------------------------ listener

    def deliver_head(self) -> None:
        channel, payload, xid = self.queue.popleft()
        if channel == "release":
            self.store.apply_delta(payload, xid)
            return
        cap_field, seq, value = payload
        vertex, key, index = cap_field
        self.store.apply_limit_change(LimitChange(KIND[(vertex, index)], key, value), xid)
        hist = self.history[cap_field]
        hist.applied = max(hist.applied, seq)

    @precondition(lambda self: bool(self.queue))
    @rule(drop=st.integers(0, 4))
    def listener(self, drop: int) -> None:
        if drop == 0:
            self.queue.popleft()  # lost while the listener reconnected
        else:
            self.deliver_head()

    # ------------------------------------------------------------------ recompute loop

    @rule(data=st.data())
    def recompute(self, data) -> None:
        if self.pass_ is None:
            self.pass_ = Pass(self.store.begin_recompute())
        elif data.draw(st.integers(0, 9), label="fails") == 0:
            self.pass_ = None  # the pass failed after begin: no overwrite
        elif self.pass_.read is None:
            self.pass_.read = (self.read_counters(), self.pg_snapshot())
        else:
            counters, pg = self.pass_.read
            if data.draw(st.booleans(), label="partial"):
                # Some keys missing from the read: they must keep their live value.
                counters = CounterSnapshot(
                    sub={k: v for k, v in counters.sub.items() if data.draw(st.booleans())},
                    folder={k: v for k, v in counters.folder.items() if data.draw(st.booleans())},
                    job={k: v for k, v in counters.job.items() if data.draw(st.booleans())},
                )
            self.store.overwrite_counters(counters, self.pass_.epoch, pg)
            self.pass_ = None

    # ------------------------------------------------------------------ limit reseeds (two loops may overlap)

    @rule(data=st.data())
    def reseed(self, data) -> None:
        if len(self.reseeds) < 2 and (not self.reseeds or data.draw(st.booleans(), label="read")):
            self.reseeds.append(
                Reseed(self.pg_snapshot(), dict(self.db_caps), {f: h.latest for f, h in self.history.items()})
            )
            return
        reseed = data.draw(st.sampled_from(self.reseeds), label="apply")
        self.reseeds.remove(reseed)
        self.store.set_caps(*self.cap_rows(reseed.values), pg_snapshot=reseed.pg)
        for f, seq in reseed.reflects.items():
            self.history[f].applied = max(self.history[f].applied, seq)

    # ------------------------------------------------------------------ convergence

    def full_pass(self) -> None:
        epoch = self.store.begin_recompute()
        self.store.overwrite_counters(self.read_counters(), epoch, self.pg_snapshot())

    def converge(self, deliver_before: bool) -> None:
        # Let every open transaction finish and every launched proc be confirmed...
        while self.open:
            self.commit(self.open[0])
        for proc in self.procs:
            if not proc.booked or not proc.insert_committed or proc.confirmed or proc.rolled_back:
                continue
            self.store.confirm(proc.delta)
            proc.confirmed = True
        if deliver_before:
            while self.queue:
                self.deliver_head()
                self.caps_hold_the_newest_applied_value()
        # ...then two passes with no activity between them,
        self.pass_ = None
        self.full_pass()
        self.full_pass()
        # and releases the passes already reflect arrive late: they must change nothing.
        while self.queue:
            self.deliver_head()
            self.caps_hold_the_newest_applied_value()
        assert self.store.audit_snapshot() == self.truth()
        self.caps_hold_the_newest_applied_value()
        self.procs_at_converge = len(self.procs)

    @precondition(lambda self: len(self.procs) >= self.procs_at_converge + 6)
    @rule(deliver_before=st.booleans())
    def quiesce_and_converge(self, deliver_before: bool) -> None:
        self.converge(deliver_before)

    def teardown(self) -> None:
        # Every run ends quiet: the counters must have converged (unless a step already failed).
        if sys.exc_info()[0] is None:
            self.converge(deliver_before=False)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def never_below_truth(self) -> None:
        audit = self.store.audit_snapshot()
        truth = self.truth()
        for live, true in ((audit.sub, truth.sub), (audit.folder, truth.folder), (audit.job, truth.job)):
            for key, (cores, gpus) in true.items():
                have = live.get(key, (0, 0))
                assert have[0] >= cores and have[1] >= gpus, (key, have, (cores, gpus))

    @invariant()
    def inflight_is_exactly_the_unsettled_bookings(self) -> None:
        expected = CounterSnapshot()
        for p in self.procs:
            if p.booked and not p.confirmed and not p.rolled_back:
                skey, fkey, jkey = keys_of(p.delta)
                for table, key in ((expected.sub, skey), (expected.folder, fkey), (expected.job, jkey)):
                    cores, gpus = table.get(key, (0, 0))
                    table[key] = (cores + p.delta.cores, gpus + p.delta.gpus)
        inflight = self.store.inflight_snapshot()
        for have, want in (
            (inflight.sub, expected.sub),
            (inflight.folder, expected.folder),
            (inflight.job, expected.job),
        ):
            assert {k: v for k, v in have.items() if v != (0, 0)} == {k: v for k, v in want.items() if v != (0, 0)}

    @invariant()
    def caps_hold_the_newest_applied_value(self) -> None:
        if not self.history:
            return
        caps = self.store.caps()
        for cap_field, hist in self.history.items():
            vertex, key, index = cap_field
            have = caps.sub[key] if vertex == "sub" else getattr(caps, vertex)[key][index]
            assert have == hist.values[hist.applied], (cap_field, have, hist)


StoreMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase
