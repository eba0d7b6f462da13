"""The Store's check-and-book is atomic across threads (design §1.1)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from accounting.store import Applied, BookingDelta, CounterSnapshot, LimitExceeded, Store

THREADS = 6
ROUNDS = 8
JOB_CAP = 100


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    # Make the interpreter switch threads as often as it can, so check and increment would
    # interleave if the lock did not cover both.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class YieldingInt(int):
    """A core count whose arithmetic hands the GIL to another thread.

    Under the GIL, CPython rarely switches threads between the Store's cap check and its
    increment (no call sits between them), so a missing lock could go unnoticed. Adding this
    to a counter sleeps for 0 s, which releases the GIL right inside the check-and-book
    window: without the lock, two threads then both pass the check at the last free core.
    """

    def __radd__(self, other: int) -> int:
        time.sleep(0)
        return int(other) + int(self)

    def __rsub__(self, other: int) -> int:
        time.sleep(0)
        return int(other) - int(self)


def run_threads(worker, count: int = THREADS) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def guarded(index: int) -> None:
        try:
            start.wait()
            worker(index)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def capped_store() -> Store:
    store = Store()
    store.set_caps({("show", "alloc"): 10**9}, {"folder": (-1, -1)}, {"job": (JOB_CAP, -1)})
    return store


@pytest.mark.usefixtures("tiny_switch_interval")
def test_threads_booking_one_job_never_exceed_its_cap() -> None:
    # The race only matters at the last free core, so fill many small jobs to their cap.
    delta = BookingDelta("show", "alloc", "folder", "job", YieldingInt(1), 0)
    for _ in range(ROUNDS):
        store = capped_store()
        applied = [0] * THREADS

        def worker(index: int, store: Store = store, applied: list[int] = applied) -> None:
            while True:
                result = store.book(delta)
                if isinstance(result, LimitExceeded):
                    # The only way to be rejected is a full job.
                    assert (result.table, result.current, result.limit) == ("job", JOB_CAP, JOB_CAP)
                    return
                assert isinstance(result, Applied)
                applied[index] += 1
                if applied[index] % 2:
                    store.confirm(delta)  # confirms interleave with books but move no live total

        run_threads(worker)
        assert sum(applied) == JOB_CAP
        assert store.job_cores_in_use("job") == JOB_CAP
        assert store.sub_counters("show", "alloc")[0] == JOB_CAP


@pytest.mark.usefixtures("tiny_switch_interval")
def test_threads_churning_at_the_cap_never_see_it_exceeded() -> None:
    # Book and roll back around a full job: while every booking that got in is still held,
    # the live total can never be above the cap, whoever looks.
    store = capped_store()
    store.seed_show_booked(CounterSnapshot(job={"job": (JOB_CAP - 2, 0)}))
    delta = BookingDelta("show", "alloc", "folder", "job", YieldingInt(1), 0)
    seen: list[int] = []

    def worker(_: int) -> None:
        highest = 0
        for _ in range(300):
            if isinstance(store.book(delta), Applied):
                highest = max(highest, store.job_cores_in_use("job"))
                store.rollback(delta)
        seen.append(highest)

    run_threads(worker)
    assert max(seen) <= JOB_CAP
    assert store.job_cores_in_use("job") == JOB_CAP - 2
    assert store.inflight_snapshot().job["job"] == (0, 0)


def test_exception_inside_a_critical_section_releases_the_lock() -> None:
    store = Store()
    with pytest.raises(ValueError):
        store.overwrite_counters(store.audit_snapshot(), 5)  # raises while holding the lock
    with pytest.raises(AttributeError):
        store.seed_show_booked(None)  # type: ignore[arg-type]
    # The lock is free again: a booking from another thread completes.
    done = threading.Event()
    threading.Thread(target=lambda: (store.book(BookingDelta("s", "a", "f", "j", 0, 0)), done.set())).start()
    assert done.wait(timeout=10)
