"""A LISTEN connection for tests, and an exact way to say "nothing else was sent".

PostgreSQL delivers notifications to a listener in commit order. So after the transaction
under test has committed (or rolled back), a sentinel sent on the same channel from another
connection is received only after everything that transaction sent: the notifications
received before the sentinel are exactly what it sent. No sleeps, no guessing a quiet period.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connection

from accounting.notify import CHANNELS, conninfo_from_settings

DEADLINE_SECONDS = 10.0


def database_conninfo() -> str:
    """The test database, as Django's connection sees it (pytest-django renames it to test_*)."""
    return conninfo_from_settings(connection.settings_dict)


class Listener:
    def __init__(self, conninfo: str, channels: tuple[str, ...] = CHANNELS) -> None:
        self.conninfo = conninfo
        self.conn = psycopg.connect(conninfo, autocommit=True)
        for channel in channels:
            self.conn.execute(f'LISTEN "{channel}"')
        self._pending: list[psycopg.Notify] = []

    def close(self) -> None:
        self.conn.close()

    def _receive(self, deadline: float) -> psycopg.Notify:
        if self._pending:
            return self._pending.pop(0)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError("no notification before the deadline")
        # stop_after=1 can still yield several (one network packet); keep every one of them.
        self._pending.extend(self.conn.notifies(timeout=remaining, stop_after=1))
        if not self._pending:
            raise AssertionError("no notification before the deadline")
        return self._pending.pop(0)

    def next(self, timeout: float = DEADLINE_SECONDS) -> psycopg.Notify:
        """The next notification on any listened channel, waiting up to `timeout`."""
        return self._receive(time.monotonic() + timeout)

    def sent_before_sentinel(self, channel: str) -> list[str]:
        """Payloads received on `channel` before a sentinel sent now from another connection.

        Call it after the writes under test have committed or rolled back; the result is
        exactly what they delivered, in delivery order. Other channels are kept for later.
        """
        sentinel = f"sentinel-{uuid.uuid4()}"
        with psycopg.connect(self.conninfo, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (channel, sentinel))
        deadline = time.monotonic() + DEADLINE_SECONDS
        received: list[str] = []
        kept: list[psycopg.Notify] = []
        while True:
            notify = self._receive(deadline)
            if notify.channel != channel:
                kept.append(notify)
                continue
            if notify.payload == sentinel:
                self._pending = kept + self._pending
                return received
            received.append(notify.payload)


def as_json(payloads: list[str]) -> list[dict[str, Any]]:
    return [json.loads(p) for p in payloads]


@contextmanager
def listening(channels: tuple[str, ...] = CHANNELS) -> Iterator[Listener]:
    listener = Listener(database_conninfo(), channels)
    try:
        yield listener
    finally:
        listener.close()
