"""`Store.below`: the recompute's integrity judgment, a counter below SUM(proc) and nothing else.

The comparison runs between a pass's read and its overwrite, once every older notification has
arrived (the service waits for a heartbeat). What legitimately moved the live counter after the
read (a release or outside delta of a later transaction, a booking rolled back) must not read as
a finding; a proc no event counted must.
"""

from __future__ import annotations

from accounting.store import Applied, PgSnapshot
from tests.unit.test_store import SUB, delta, live, recompute, snap, store_with_caps

READ = PgSnapshot(100, 100, frozenset())


def test_a_proc_no_event_counted_is_below_on_every_key() -> None:
    store = store_with_caps()
    recompute(store, snap(4), PgSnapshot(90, 90, frozenset()))
    store.begin_recompute()
    found = store.below(snap(10, 2), READ)  # 6 cores and 2 GPUs nobody told the Store of
    assert found["sub"] == {SUB: (4, 10, 0, 2)}
    assert set(found) == {"sub", "folder", "job"}


def test_exact_or_high_counters_are_not_below() -> None:
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot(90, 90, frozenset()))
    store.begin_recompute()
    assert store.below(snap(10), READ) == {}
    assert store.below(snap(7), READ) == {}  # high: a lost release, the safe direction


def test_a_release_committed_after_the_read_is_taken_back_out_before_comparing() -> None:
    store = store_with_caps()
    recompute(store, snap(10), PgSnapshot(90, 90, frozenset()))
    store.begin_recompute()
    assert store.apply_delta(delta(-4), xid=105)  # the read (xmax 100) still counted the proc
    assert live(store)[0] == (6, 0)
    assert store.below(snap(10), READ) == {}


def test_an_outside_delta_the_read_saw_is_counted_and_one_it_did_not_see_is_not_needed() -> None:
    store = store_with_caps()
    recompute(store, snap(0), PgSnapshot(90, 90, frozenset()))
    store.begin_recompute()
    assert store.apply_delta(delta(3), xid=95)  # seen by the read: part of its SUM
    assert store.below(snap(3), READ) == {}
    assert store.apply_delta(delta(2), xid=110)  # after the read: taken back out, still exact
    assert store.below(snap(3), READ) == {}


def test_a_booking_rolled_back_during_the_pass_is_counted_back_in() -> None:
    """A compensated booking: its proc committed before the read, was deleted by the
    compensation (no release sent) and the Store rolled it back before the comparison."""
    store = store_with_caps()
    recompute(store, snap(0), PgSnapshot(90, 90, frozenset()))
    booked = store.book(delta(5))
    assert isinstance(booked, Applied)
    store.begin_recompute()
    store.rollback(booked.delta)
    assert live(store)[0] == (0, 0)
    assert store.below(snap(5), READ) == {}
    assert store.below(snap(6), READ)["sub"] == {SUB: (5, 6, 0, 0)}  # more than it: still found


def test_no_snapshot_judges_nothing() -> None:
    store = store_with_caps()
    store.begin_recompute()
    assert store.below(snap(10), None) == {}
