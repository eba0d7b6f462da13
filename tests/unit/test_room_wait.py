"""The dispatch loop's wait for Store room: woken by what the listener applies, not by a timer."""

from __future__ import annotations

import threading

from accounting.service import AccountingService


def test_an_applied_release_wakes_a_waiter_at_once() -> None:
    service = AccountingService()
    seen = service.room_generation()
    woke = threading.Event()

    def waiter() -> None:
        if service.wait_for_room(seen, timeout=30):
            woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    service._count_event("acct_release", "applied")  # what the listener reports after applying one
    thread.join(30)
    assert woke.is_set()


def test_room_seen_before_the_wait_is_not_missed() -> None:
    service = AccountingService()
    seen = service.room_generation()
    service._count_event("acct_limit_change", "applied")  # lands between the Store check and the wait
    assert service.wait_for_room(seen, timeout=0)


def test_skipped_or_dropped_messages_do_not_wake() -> None:
    service = AccountingService()
    seen = service.room_generation()
    service._count_event("acct_release", "skipped")
    service._count_event("acct_release", "dropped:malformed")
    assert not service.wait_for_room(seen, timeout=0)
