"""How the console writes farm figures: cores (not centicores), GB or MB (not KB), one time format.

The tables keep Cuebot's units (centicores, KB) and the database's UTC; a person reads
"2 cores", "2 GB", "512 MB" and a time in their own time zone with the zone named
("2026-12-01 21:04:05 CET"). The zone is the one `ops.timezone_middleware` activated for the
request (the browser's, else the server's `TIME_ZONE`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.utils import timezone

CENTI = 100
KB_PER_MB = 1024
KB_PER_GB = 1024 * 1024
TIME_FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def cores(centicores: int | None) -> str:
    """Whole cores, with one decimal only when a value is fractional (a 0.5-core booking)."""
    if centicores is None:
        return "—"
    value = centicores / CENTI
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def memory_kb(kb: int | None) -> str:
    """KB as GB from 1 GB up ("2 GB", "1.5 GB", "12 GB"), MB below it ("512 MB")."""
    if kb is None:
        return "—"
    if abs(kb) >= KB_PER_GB:
        value = kb / KB_PER_GB
        return f"{value:.0f} GB" if value >= 10 or value == int(value) else f"{value:.1f} GB"
    return f"{round(kb / KB_PER_MB)} MB"


def local_time(value: dt.datetime | None) -> str:
    """One format for every time the console prints, in the request's zone, the zone named."""
    if value is None:
        return "—"
    return timezone.localtime(value).strftime(TIME_FORMAT)


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def run_time(started: Any, stopped: Any, now: dt.datetime, running: bool) -> str:
    """A frame's run time: to now while it runs, to its stop once it stopped."""
    if started is None:
        return "—"
    end = now if running or stopped is None or stopped < started else stopped
    return duration((end - started).total_seconds())
