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
"""The cap sentinel Cuebot writes for "no limit" (any negative folder/job cap is unlimited; 0 books nothing)."""


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
    """Folder and job max cores: any negative value is the unlimited sentinel -1.

    Cuebot writes -1 but also accepts other negatives (a job max of -100 means unlimited);
    truncating -100 would give -1 by luck, -50 would give 0, so the sentinel is mapped first.
    """
    number = _as_int(value)
    _check_multiplier(multiplier)
    if number < 0:
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
