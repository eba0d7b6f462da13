"""`bench_placement` runs both policies on one queue and prints the figures (issue 28)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from dispatch.lab.placement_bench import queue, run


def test_the_same_queue_for_every_policy_and_all_its_frames_accounted() -> None:
    assert queue(200, 3) == queue(200, 3)
    tight, scored = run("tightest", 1, 1.0, 3, window=20), run("scored", 1, 1.0, 3, window=20)
    assert tight.hosts == scored.hosts == 7
    assert tight.frames > 0 and scored.frames > 0
    assert 0 < tight.core_use <= 1 and 0 < scored.mem_use <= 1


def test_the_command_prints_frames_per_host_hour_before_and_after() -> None:
    out = StringIO()
    call_command("bench_placement", "--units", "1", "--hours", "0.5", "--window", "20", stdout=out)
    text = out.getvalue()
    assert "frames/host-h" in text and "\ntightest " in text and "\nscored " in text
    assert "scored against tightest:" in text


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(CommandError, match="--policies takes"):
        call_command("bench_placement", "--policies", "best")
