"""bench_store runs end to end and reports every configuration (figures are not asserted)."""

from __future__ import annotations

from io import StringIO

from django.core.management import call_command


def test_bench_store_prints_each_workload() -> None:
    out = StringIO()
    call_command("bench_store", pairs=2_000, repeats=1, threads=3, stdout=out)
    lines = out.getvalue().splitlines()
    # Each row ends: threads, median, min, max, rejected share.
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[-5]) for r in rows] == [
        ("no", "1"),
        ("no", "3"),
        ("half", "1"),
        ("half", "3"),
    ]
    assert [r[-1] for r in rows] == ["0%", "0%", "50%", "50%"]
