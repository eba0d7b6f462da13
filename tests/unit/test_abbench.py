"""The A/B bench's reading of `bench` output and its arithmetic (dispatch/lab/abbench.py).

No database: the text is what bench prints (its summary lines, the format every revision since
the integrity work prints, old sides included), and the arithmetic is checked on known rounds.
"""

from __future__ import annotations

import pytest

from accounting.bench import Spread
from dispatch.lab.abbench import Comparison, Figure, compare, format_table, parse_bench_output
from dispatch.management.commands.bench import Command as Bench

OUTPUT = """\
2026-12-01 19:59:38,817 INFO accounting.limits: limit reseed: 3 subscriptions, 1 folders, 6 jobs in 0.008s
  drain-hold/batched/store run 1: throughput: 270 frames/s over a 0.07s booking window (wall 0.08s), booked 20
  floor run 1: 674 frames/s
drain-hold/batched/store: 2850 frames/s (min 2691, max 3447, 3 runs)
contended/per-proc/database: 32 frames/s (min 32, max 32, 1 runs)
floor (bulk writes, no scheduling, batches of 500): 3341 frames/s (min 3249, max 3826, 3 runs)
drain-hold/batched/store as a share of the floor: 85%
ratio Store / database-enforced, contended/batched: 1.39x
releases/store, 8 agents, one frame per transaction: 1234 completions/s (min 1200, max 1300, 3 runs)
recompute cycle with 100000 procs (99998 booked) over 10000 jobs: 0.812 s (min 0.790, max 0.901, 5 runs)
  store side 0.100 s (min 0.1, max 0.2, 5 runs); pg side 0.700 s (min 0.6, max 0.8, 5 runs)
notification-to-Store delay over 1000 releases: p50 0.50 ms, p99 1.20 ms, max 3.00 ms
Store book+confirm pairs/s (one thread): 225000 pairs/s (min 220000, max 230000, 3 runs)
feed read (300 jobs, 1200 hosts), fair share on, host test: 12.5 ms (min 11.0, max 14.0, 20 calls)
drain/store/limits-on: 2500 frames/s (min 2400, max 2600, 3 runs)
limits on / off, store: 0.97x
wrote artifacts/bench/bench.json and artifacts/bench/bench.png
"""


def test_every_summary_figure_is_read_and_single_runs_and_logs_are_not() -> None:
    figures = parse_bench_output(OUTPUT)
    assert {name: (f.value, f.unit) for name, f in figures.items()} == {
        "drain-hold/batched/store": (2850.0, "frames/s"),
        "contended/per-proc/database": (32.0, "frames/s"),
        "floor (bulk writes, no scheduling, batches of 500)": (3341.0, "frames/s"),
        "drain-hold/batched/store as a share of the floor": (85.0, "%"),
        "ratio Store / database-enforced, contended/batched": (1.39, "x"),
        "releases/store, 8 agents, one frame per transaction": (1234.0, "completions/s"),
        # What a run happened to book is not part of the figure's name: both sides must match.
        "recompute cycle with 100000 procs over 10000 jobs": (0.812, "s"),
        "notification-to-Store delay p50": (0.5, "ms"),
        "notification-to-Store delay p99": (1.2, "ms"),
        "notification-to-Store delay max": (3.0, "ms"),
        "Store book+confirm pairs/s (one thread)": (225000.0, "pairs/s"),
        "feed read (300 jobs, 1200 hosts), fair share on, host test": (12.5, "ms"),
        "drain/store/limits-on": (2500.0, "frames/s"),
    }
    assert figures["drain-hold/batched/store"].better == "higher"
    assert figures["recompute cycle with 100000 procs over 10000 jobs"].better == "lower"
    assert figures["ratio Store / database-enforced, contended/batched"].better == ""


def test_the_parser_reads_the_line_bench_prints_today() -> None:
    """Tied to bench's own formatter: a change of its summary format must change the parser too."""
    spread = {"median": 1161.4, "min": 1074.0, "max": 1282.2, "runs": 3}
    line = f"contended/batched/store: {Bench._fmt(spread, 'frames/s')}"
    assert parse_bench_output(line) == {
        "contended/batched/store": Figure("contended/batched/store", 1161.0, "frames/s")
    }
    recompute = f"recompute cycle with 10 procs (10 booked) over 5 jobs: {Spread(0.5, 0.4, 0.6, 5).fmt()}"
    assert parse_bench_output(recompute)["recompute cycle with 10 procs over 5 jobs"].value == 0.5


def _round(**values: float) -> dict[str, Figure]:
    return {name: Figure(name, v, "frames/s") for name, v in values.items()}


def test_medians_per_side_ratio_of_medians_and_the_range_of_round_ratios() -> None:
    old = [_round(a=100, b=50), _round(a=200, b=50), _round(a=150)]
    new = [_round(a=110, b=40), _round(a=180, b=60), _round(a=150, c=7)]
    rows = {c.name: c for c in compare(old, new)}
    a = rows["a"]
    assert (a.old_median, a.new_median) == (150, 150)
    assert a.ratio == pytest.approx(1.0)
    assert a.round_ratios == pytest.approx([1.1, 0.9, 1.0])
    assert a.spread == pytest.approx((0.9, 1.1))
    b = rows["b"]  # absent from round 3: its two rounds only
    assert b.old == [50, 50, None] and b.new == [40, 60, None]
    assert b.ratio == pytest.approx(1.0) and b.spread == pytest.approx((0.8, 1.2))
    c = rows["c"]  # on the new side only
    assert c.old_median is None and c.ratio is None and c.spread is None and c.round_ratios == []
    assert list(rows) == ["a", "b", "c"]  # bench's order, the new side's first


def test_a_zero_on_the_old_side_gives_no_ratio_rather_than_a_division_error() -> None:
    c = Comparison("x", "frames/s", "higher", [0.0, 10.0], [5.0, 20.0])
    assert c.round_ratios == [2.0]
    assert c.ratio == pytest.approx(12.5 / 5.0)  # medians 12.5 and 5
    assert Comparison("y", "frames/s", "higher", [0.0], [5.0]).ratio is None


def test_rounds_must_pair_up() -> None:
    with pytest.raises(ValueError, match="2 old rounds against 1 new"):
        compare([_round(a=1), _round(a=2)], [_round(a=1)])


def test_the_table_shows_medians_ratio_and_spread_aligned() -> None:
    lines = format_table(compare([_round(a=100), _round(a=200)], [_round(a=110), _round(a=180)]))
    assert lines[0].split() == ["figure", "unit", "better", "old", "new", "new/old", "per-round", "new/old", "rounds"]
    assert lines[1].split() == ["a", "frames/s", "higher", "150", "145", "0.97", "0.90-1.10", "2"]
