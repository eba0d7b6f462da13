"""The one owner of the Store: wires the loops around it and serves the dispatcher.

Only `run_scheduler` builds an AccountingService; web processes never hold a Store
(gunicorn runs several workers, and two Stores would jointly over-book).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from accounting.store import Applied, BookingDelta, LimitExceeded, Store


@dataclass(frozen=True)
class NotManaged:
    """The show is not scheduler-managed: the database-enforced accounting decides."""

    delta: BookingDelta


BookingResult = Applied | LimitExceeded | NotManaged


class AccountingService:
    """Facade over the Store for the hot path; the managed decision is taken once per booking."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self._managed: frozenset[str] = frozenset()
        self._managed_lock = threading.Lock()

    # -- managed shows (published by accounting.managed_shows after their seed) --
    def managed_shows(self) -> frozenset[str]:
        return self._managed

    def publish_managed(self, shows: frozenset[str]) -> None:
        with self._managed_lock:
            self._managed = shows

    def is_managed(self, show: str) -> bool:
        return show in self._managed

    # -- hot path --
    def apply_booking(self, delta: BookingDelta) -> BookingResult:
        if delta.show not in self._managed:
            return NotManaged(delta)
        return self.store.book(delta)

    def confirm_booking(self, booking: BookingResult) -> None:
        # Deliberately no managed re-check: an applied booking is settled even if the show flipped.
        if isinstance(booking, Applied):
            self.store.confirm(booking.delta)

    def rollback_booking(self, booking: BookingResult) -> None:
        if isinstance(booking, Applied):
            self.store.rollback(booking.delta)
