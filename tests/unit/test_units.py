"""Centicore <-> core conversion at the database boundary (design §1.2, catalog §5.4 and §5.8)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounting.units import centicores_to_cores, centicores_to_cores_cap, trunc_div


def test_sub_burst_converts_centicores_to_cores() -> None:
    assert centicores_to_cores(1000) == 10


def test_folder_preserves_unlimited_and_passes_gpus() -> None:
    # GPUs are never converted; the cap helper keeps the -1 sentinel.
    max_cores, max_gpus = -1, -1
    assert (centicores_to_cores_cap(max_cores), max_gpus) == (-1, -1)


def test_job_converts_positive_cap_to_cores() -> None:
    max_cores, max_gpus = 2000, 4
    assert (centicores_to_cores_cap(max_cores), max_gpus) == (20, 4)


def test_single_row_converts_centicores_to_cores() -> None:
    assert centicores_to_cores(4200) == 42


def test_negative_truncates_toward_zero_not_floor() -> None:
    # Cuebot's negated release of a 250-centicore proc is -2 cores in Java; `//` would give -3.
    assert centicores_to_cores(-250) == -2
    assert centicores_to_cores(250) == 2
    assert centicores_to_cores(-99) == 0
    assert centicores_to_cores(-100) == -1


def test_summing_before_converting_differs_from_per_row() -> None:
    # Why recompute converts once per key: 3 x 150 centicores is 4 cores, per row it is 3.
    assert centicores_to_cores(150 + 150 + 150) == 4
    assert sum(centicores_to_cores(150) for _ in range(3)) == 3


def test_any_negative_cap_becomes_unlimited() -> None:
    for value in (-1, -50, -100, -250, -(10**15)):
        assert centicores_to_cores_cap(value) == -1
    assert centicores_to_cores_cap(0) == 0
    assert centicores_to_cores_cap(99) == 0
    assert centicores_to_cores_cap(1600) == 16


def test_negative_burst_is_not_a_sentinel() -> None:
    # Burst goes through the plain conversion: a negative burst stays "reject all" (<= 0).
    assert centicores_to_cores(-100) == -1
    assert centicores_to_cores(-50) == 0


def test_large_values_stay_exact() -> None:
    # Float division would lose the last digits above 2**53.
    big = 123_456_789_012_345_678_901
    assert centicores_to_cores(big) == 1_234_567_890_123_456_789
    assert centicores_to_cores(-big) == -1_234_567_890_123_456_789


def test_custom_multiplier() -> None:
    assert centicores_to_cores(-2500, multiplier=1000) == -2
    assert centicores_to_cores_cap(2500, multiplier=1000) == 2
    with pytest.raises(ValueError):
        centicores_to_cores(100, multiplier=0)


def test_numeric_sums_accepted_when_integral() -> None:
    # SUM over a BIGINT column arrives as NUMERIC (Decimal).
    assert centicores_to_cores(Decimal(-250)) == -2
    with pytest.raises(TypeError):
        centicores_to_cores(Decimal("2.5"))
    with pytest.raises(TypeError):
        centicores_to_cores(250.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("numerator", [-7, -6, -1, 0, 1, 6, 7])
@pytest.mark.parametrize("denominator", [-3, -1, 1, 3])
def test_trunc_div_matches_c_semantics(numerator: int, denominator: int) -> None:
    expected = int(numerator / denominator)  # exact for these small values
    assert trunc_div(numerator, denominator) == expected


def test_cuebots_unlimited_job_cap_reads_as_unlimited() -> None:
    """2**31-1 is how a Cuebot database stores an unlimited job cap: never 21474836 cores."""
    from accounting.units import CUEBOT_UNLIMITED_CAP, centicores_to_cores_cap, format_cap, gpus_cap

    assert centicores_to_cores_cap(CUEBOT_UNLIMITED_CAP) == -1 and gpus_cap(CUEBOT_UNLIMITED_CAP) == -1
    assert (
        format_cap(CUEBOT_UNLIMITED_CAP) == "unlimited" == format_cap(-1) == format_cap(CUEBOT_UNLIMITED_CAP, gpus=True)
    )
    assert format_cap(0) == "0 cores" and format_cap(250) == "2 cores" and format_cap(3, gpus=True) == "3 GPUs"
    assert centicores_to_cores_cap(CUEBOT_UNLIMITED_CAP - 1) == (CUEBOT_UNLIMITED_CAP - 1) // 100
