"""The Store's licence-limit vertex: refused at the max under the caps' lock, high until the count arrives."""

from __future__ import annotations

from accounting.store import LICENCE, LICENCE_UNSEEDED, Applied, BookingDelta, LimitExceeded, PgSnapshot, Store

L = "11111111-1111-1111-1111-111111111111"


def _store(max_value: int, running: int = 0, *, xid: int = 10) -> Store:
    store = Store()
    store.set_caps({("s", "a"): 1000}, {"f": (-1, -1)}, {"j": (-1, -1)})
    store.apply_licence(L, max_value, False, running, xid)
    return store


def _book(store: Store) -> Applied | LimitExceeded:
    return store.book(BookingDelta("s", "a", "f", "j", 1, 0, (L,)))


def test_a_limit_the_store_does_not_hold_fails_closed() -> None:
    store = Store()
    store.set_caps({("s", "a"): 1000}, {"f": (-1, -1)}, {"j": (-1, -1)})
    result = _book(store)
    assert isinstance(result, LimitExceeded) and result.table == LICENCE_UNSEEDED and result.key == L


def test_refused_at_the_max_counting_bookings_in_flight_and_nothing_changed() -> None:
    store = _store(2, running=1)
    first = _book(store)
    assert isinstance(first, Applied)
    second = _book(store)
    assert isinstance(second, LimitExceeded) and (second.table, second.current, second.limit) == (LICENCE, 2, 2)
    # Nothing of the refused booking was counted anywhere.
    assert store.licences()[L].used == 2
    assert store.audit_snapshot().job["j"] == (1, 0)
    store.rollback(first.delta)
    assert store.licences()[L].used == 1
    assert isinstance(_book(store), Applied)


def test_unlimited_is_counted_never_refused() -> None:
    store = _store(-1, running=500)
    assert all(isinstance(_book(store), Applied) for _ in range(10))


def test_a_confirmed_booking_stays_counted_until_its_own_count_arrives() -> None:
    store = _store(5, running=0)
    booking = _book(store)
    assert isinstance(booking, Applied)
    store.confirm(booking.delta, xid=20)
    assert store.licences()[L].used == 1  # in pending: base 0 has not seen transaction 20
    store.apply_licence(L, 5, False, 0, 19)  # an older writer's count: still pending
    assert store.licences()[L].used == 1
    store.apply_licence(L, 5, False, 1, 20)  # its own: now in base, no longer on top
    use = store.licences()[L]
    assert (use.base, use.inflight, use.pending, use.used) == (1, 0, 0, 1)


def test_a_count_that_arrived_before_the_confirm_is_not_counted_twice() -> None:
    store = _store(5, running=0)
    booking = _book(store)
    assert isinstance(booking, Applied)
    store.apply_licence(L, 5, False, 1, 30)  # the listener beat the confirm
    assert store.licences()[L].used == 2  # high meanwhile: base 1 + in flight 1
    store.confirm(booking.delta, xid=30)
    assert store.licences()[L].used == 1


def test_a_reseed_drops_what_its_snapshot_saw_and_keeps_what_it_did_not() -> None:
    store = _store(5, running=0)
    a, b = _book(store), _book(store)
    assert isinstance(a, Applied) and isinstance(b, Applied)
    store.confirm(a.delta, xid=40)
    store.confirm(b.delta, xid=45)
    token = store.begin_licence_read()
    store.set_licences({L: (5, False, 1)}, PgSnapshot(42, 46, frozenset({45})), token)
    use = store.licences()[L]
    assert (use.base, use.pending) == (1, 1)  # 40 seen by the read, 45 still in progress there
    # A confirm without a transaction id is dropped only by a read begun after it.
    c = _book(store)
    assert isinstance(c, Applied)
    store.confirm(c.delta, xid=None)
    store.set_licences({L: (5, False, 1)}, PgSnapshot(42, 46, frozenset({45})), token)
    assert store.licences()[L].pending == 2
    later = store.begin_licence_read()
    store.set_licences({L: (5, False, 3)}, PgSnapshot(50, 50, frozenset()), later)
    use = store.licences()[L]
    assert (use.base, use.pending, use.used) == (3, 0, 3)


def test_a_reseed_older_than_the_last_notification_keeps_the_notified_count() -> None:
    store = _store(5, running=0)
    token = store.begin_licence_read()
    store.apply_licence(L, 1, False, 4, 60)  # committed after the read's snapshot
    store.set_licences({L: (5, False, 0)}, PgSnapshot(55, 58, frozenset()), token)
    use = store.licences()[L]
    assert (use.max, use.base) == (1, 4)
    assert L in store.full_licences()


def test_licence_payloads_parse_and_bad_ones_are_refused() -> None:
    import pytest

    from accounting.channels import PayloadError, parse_licence

    notice = parse_licence(f'{{"id":"{L}","name":"arnold","max":100,"host":true,"running":37,"xid":9,"seq":1}}')
    assert (notice.limit, notice.max, notice.host, notice.running, notice.removed, notice.xid) == (
        L, 100, True, 37, False, 9
    )  # fmt: skip
    assert parse_licence(f'{{"id":"{L}","removed":true,"xid":9,"seq":2}}').removed
    for bad in (
        f'{{"id":"{L}","max":1,"running":-1}}',
        f'{{"id":"{L}","max":1,"running":1,"host":"yes"}}',
        '{"id":"not-a-uuid","max":1,"running":1}',
        f'{{"id":"{L}","running":1}}',
    ):
        with pytest.raises(PayloadError):
            parse_licence(bad)


def test_a_licence_payload_without_a_max_runs_nothing() -> None:
    """A NULL max (Cuebot's column allows one) reads as 0, never as unlimited nor as a dropped message."""
    from accounting.channels import parse_licence

    notice = parse_licence(f'{{"id":"{L}","name":"arnold","max":null,"host":false,"running":0,"xid":9,"seq":1}}')
    assert notice.max == 0
    store = _store(notice.max)
    assert store.full_licences() == [L]


def test_one_reading_of_a_limit_max_in_python() -> None:
    from accounting.licences import limit_max, limit_max_problem

    assert [limit_max(v, cuebot=False) for v in (None, -5, -1, 0, 3)] == [0, -5, -1, 0, 3]
    assert [limit_max(v, cuebot=True) for v in (None, -5, -1, 0, 3)] == [0, 0, 0, 0, 3]
    assert limit_max_problem("arnold", -1, cuebot=False) is None
    assert "no max" in (limit_max_problem("arnold", None, cuebot=False) or "")
    assert "negative max" in (limit_max_problem("arnold", -1, cuebot=True) or "")
