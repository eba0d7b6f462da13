"""The placement replay (issue 32): a recorded run's host-view calls replay to the same answers."""

from __future__ import annotations

from dispatch.lab.placement_bench import run
from dispatch.lab.placement_replay import recording, replay


def test_a_recorded_run_replays_to_every_answer_it_gave() -> None:
    with recording() as trace:
        result = run("scored", 1, 0.5, 3, window=20)
    kinds = {op[0] for op in trace}
    assert {"clear", "put", "find", "take", "give", "wants"} <= kinds
    again = replay(trace)
    # A placement is the hint's check, then a search if the hint no longer fits.
    assert again.finds > 0 and again.fits > 0 and again.finds + again.fits >= result.placements
    assert again.mismatches == 0
    assert again.score_calls > 0 and again.seconds > 0


def test_a_different_policy_is_told_apart() -> None:
    """The check has teeth: the same calls under the tightest policy do not give the same answers."""
    with recording() as trace:
        run("scored", 1, 0.5, 3, window=20)
    assert replay(trace, fit="tightest").mismatches > 0
