"""The Store's accounting-generation bookkeeping (issue 27, rows 2 and 3), without a database.

A booking carries the generation the Store had applied for its show when it was decided; the
booking transaction refuses it if the database's moved since. So the Store must never claim a
generation whose change it has not applied: a notification moves it only along an unbroken
chain (gen_from must be the applied one), and the reads move it only up to what both a cap
read and a counter read have seen.
"""

from __future__ import annotations

import pytest

from accounting import channels
from accounting.store import UNKNOWN_GENERATION, Applied, BookingDelta, LimitChange, LimitKind, Store

SHOW, ALLOC, FOLDER, JOB = (f"{c}" * 8 + "-0000-4000-8000-" + f"{c}" * 12 for c in "abcd")


def seeded(gen: int = 10) -> Store:
    store = Store()
    store.set_caps({(SHOW, ALLOC): 100}, {FOLDER: (-1, -1)}, {JOB: (40, -1)})
    store.cover_generations("caps", {SHOW: gen})
    store.cover_generations("counters", {SHOW: gen})
    return store


def book(store: Store, cores: int = 1) -> Applied:
    result = store.book(BookingDelta(SHOW, ALLOC, FOLDER, JOB, cores, 0))
    assert isinstance(result, Applied), result
    return result


def test_a_show_the_store_holds_no_generation_for_books_under_one_that_never_matches() -> None:
    store = Store()
    store.set_caps({(SHOW, ALLOC): 100}, {FOLDER: (-1, -1)}, {JOB: (40, -1)})
    assert book(store).generation == UNKNOWN_GENERATION
    # One read alone vouches for half of what a bump can change: still unknown.
    store.cover_generations("caps", {SHOW: 7})
    assert store.generation(SHOW) is None
    assert book(store).generation == UNKNOWN_GENERATION
    store.cover_generations("counters", {SHOW: 9})
    assert store.generation(SHOW) == 7, "up to the smaller of the two reads"
    assert book(store).generation == 7


def test_a_notification_moves_the_generation_only_along_an_unbroken_chain() -> None:
    store = seeded(10)
    assert store.apply_generation(SHOW, 10, 12)
    assert store.generation(SHOW) == 12
    assert book(store).generation == 12
    # A message from before (already covered) changes nothing.
    assert not store.apply_generation(SHOW, 8, 10)
    assert store.generation(SHOW) == 12
    # A gap (a lost message, or a flip, which sends none) is never stepped over.
    assert not store.apply_generation(SHOW, 15, 17)
    assert store.generation(SHOW) == 12
    assert store.generation_gaps == 1
    assert book(store).generation == 12, "the booking stays at 12, which the database (17) refuses"


def test_the_reads_heal_a_gap_and_never_move_the_generation_back() -> None:
    store = seeded(10)
    store.apply_generation(SHOW, 10, 11)
    assert not store.apply_generation(SHOW, 13, 14)  # 12 and 13 were lost
    store.cover_generations("caps", {SHOW: 14})
    assert store.generation(SHOW) == 11, "the counters have not been read since"
    store.cover_generations("counters", {SHOW: 14})
    assert store.generation(SHOW) == 14
    # An older read landing late cannot take it back.
    store.cover_generations("caps", {SHOW: 9})
    store.cover_generations("counters", {SHOW: 9})
    assert store.generation(SHOW) == 14
    assert store.apply_generation(SHOW, 14, 20)
    assert store.generation(SHOW) == 20


def test_a_booking_keeps_the_generation_it_was_decided_under() -> None:
    store = seeded(10)
    before = book(store)
    store.apply_limit_change(LimitChange(LimitKind.JOB_CAPS, JOB, (5, -1)), xid=None)
    store.apply_generation(SHOW, 10, 11)
    after = store.book(BookingDelta(SHOW, ALLOC, FOLDER, JOB, 1, 0))
    assert before.generation == 10
    assert isinstance(after, Applied) and after.generation == 11


def test_a_failover_forgets_every_generation_and_a_read_of_the_old_server_covers_nothing() -> None:
    store = seeded(10)
    incarnation = store.incarnation
    store.forget_sources()
    assert store.generation(SHOW) is None
    assert not store.apply_generation(SHOW, 10, 11)
    store.cover_generations("caps", {SHOW: 30}, incarnation)
    store.cover_generations("counters", {SHOW: 30}, incarnation)
    assert store.generation(SHOW) is None, "reads begun before the failover must not seed it"
    store.cover_generations("caps", {SHOW: 30}, store.incarnation)
    store.cover_generations("counters", {SHOW: 31}, store.incarnation)
    assert store.generation(SHOW) == 30


# --------------------------------------------------------------------------- payloads


def test_release_and_cap_payloads_carry_the_generation_of_their_bump() -> None:
    base = f'"show":"{SHOW}","alloc":"{ALLOC}","folder":"{FOLDER}","job":"{JOB}","layer":"{JOB}","dept":"{JOB}"'
    release = channels.parse_release("{" + base + ',"cores":8,"gpus":0,"xid":5,"seq":1,"gen_from":3,"gen":9}')
    assert release.generation == (3, 9)
    assert channels.parse_release("{" + base + ',"cores":-8,"gpus":0,"xid":5,"seq":1}').generation is None
    cap = channels.parse_limit_change(
        f'{{"vertex":"job","id":"{JOB}","max_cores":5,"max_gpus":-1,"xid":6,"seq":1,'
        f'"show":"{SHOW}","gen_from":0,"gen":4}}'
    )
    assert cap.generation == (SHOW, 0, 4)
    sub = channels.parse_limit_change(
        f'{{"vertex":"sub","show":"{SHOW}","alloc":"{ALLOC}","burst":5,"xid":6,"seq":1,"gen_from":4,"gen":5}}'
    )
    assert sub.generation == (SHOW, 4, 5)


@pytest.mark.parametrize(
    "tail",
    [',"gen":9', ',"gen_from":3', ',"gen_from":9,"gen":9', ',"gen_from":3,"gen":"9"', ',"gen_from":-1,"gen":2'],
)
def test_a_malformed_generation_drops_the_message(tail: str) -> None:
    """Dropped whole, never half-applied: the show then waits for the reads to cover the gap."""
    with pytest.raises(channels.PayloadError):
        channels.parse_limit_change(
            f'{{"vertex":"sub","show":"{SHOW}","alloc":"{ALLOC}","burst":5,"xid":6,"seq":1{tail}}}'
        )
