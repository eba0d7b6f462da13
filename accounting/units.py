"""Unit conversion at the PostgreSQL <-> Store boundary.

PostgreSQL holds cores as centicores (cores x 100); the Store counts whole cores. Conversion
happens only here, once per aggregated key, so truncation happens once per key.

Java and Rust integer division truncates toward zero; Python's `//` floors
(`-250 // 100 == -3`). Cuebot negates a proc's centicores before dividing, so a release of
250 centicores is -2 cores there; flooring would make it -3 and drift the counter LOW (the
unsafe direction). Float division (`int(x / m)`) would truncate correctly but loses exactness
above 2**53, and BIGINT sums can get there, so the division is done on integers only.
"""

from __future__ import annotations

from decimal import Decimal

CENTICORES_PER_CORE = 100
"""Cuebot's `CENTICORES_PER_CORE` and the scheduler's default `queue.core_multiplier`."""

UNLIMITED = -1
"""The cap sentinel for "no limit" (any negative folder/job cap is unlimited; 0 books nothing)."""

CUEBOT_UNLIMITED_CAP = 2**31 - 1
"""An unlimited job cap as a Cuebot database stores it (the INT column's largest value): Cuebot
has no unlimited job cap (its verify_job_resources refuses anything over a negative max), so
there -1 is written as this, which both read as unlimited (accounting.triggers, the same value)."""


def is_unlimited_cap(value: int | Decimal) -> bool:
    """A folder/job max cores or GPUs that means "no limit": any negative value, or Cuebot's."""
    return value < 0 or value >= CUEBOT_UNLIMITED_CAP


def gpus_cap(value: int | Decimal) -> int:
    """Folder/job max GPUs for the Store and the screen: -1 when unlimited, else the count."""
    number = _as_int(value)
    return UNLIMITED if is_unlimited_cap(number) else number


def format_cap(value: int | Decimal | None, *, gpus: bool = False, multiplier: int = CENTICORES_PER_CORE) -> str:
    """A folder/job max as the console and the CLI show it: "unlimited", "N cores", "N GPUs".

    The one formatter of stored job and folder caps (centicores for cores), so that Cuebot's
    unlimited (2147483647) never reads as 21474836 cores anywhere.
    """
    if value is None:
        return "-"
    if is_unlimited_cap(value):
        return "unlimited"
    if gpus:
        return f"{_as_int(value)} GPUs"
    return f"{centicores_to_cores_cap(value, multiplier)} cores"


def _as_int(value: int | Decimal) -> int:
    # SUM over a BIGINT column comes back as NUMERIC (a Decimal in psycopg); accept it when it
    # is integral, but refuse floats, which would silently round large values.
    if isinstance(value, int):
        return value
    if isinstance(value, Decimal) and value == value.to_integral_value():
        return int(value)
    raise TypeError(f"expected an integer number of centicores, got {value!r}")


def _check_multiplier(multiplier: int) -> int:
    if not isinstance(multiplier, int) or multiplier <= 0:
        raise ValueError(f"core multiplier must be a positive integer, got {multiplier!r}")
    return multiplier


def trunc_div(numerator: int, denominator: int) -> int:
    """Integer division truncating toward zero, like Java, Rust and C (exact for any size)."""
    quotient = abs(numerator) // abs(denominator)
    return quotient if (numerator >= 0) == (denominator > 0) else -quotient


def centicores_to_cores(value: int | Decimal, multiplier: int = CENTICORES_PER_CORE) -> int:
    """Booked sums and subscription burst: truncate toward zero, no sentinel handling.

    A negative burst stays negative (or becomes 0), which the Store reads as "reject all",
    matching Cuebot's burst check.
    """
    return trunc_div(_as_int(value), _check_multiplier(multiplier))


def centicores_to_cores_cap(value: int | Decimal, multiplier: int = CENTICORES_PER_CORE) -> int:
    """Folder and job max cores: any negative value (or Cuebot's unlimited) is the sentinel -1.

    Cuebot writes -1 for folders but also accepts other negatives (-100 means unlimited);
    truncating -100 would give -1 by luck, -50 would give 0, so the sentinel is mapped first.
    """
    number = _as_int(value)
    _check_multiplier(multiplier)
    if is_unlimited_cap(number):
        return UNLIMITED
    return number // multiplier


def usage_to_cores(value: int | Decimal, multiplier: int = CENTICORES_PER_CORE) -> int:
    """Booked usage (a key's SUM(proc), a delta): rounded toward +infinity (250 -> 3, -250 -> -2).

    Truncating a positive sum would leave a counter LOW by the fraction, and a cap check on it
    would let the truth pass the cap; rounding up only ever reads high. Caps keep truncating.
    """
    number = _as_int(value)
    _check_multiplier(multiplier)
    if number > 0:
        return -((-number) // multiplier)
    return trunc_div(number, multiplier)
