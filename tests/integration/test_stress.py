"""The stress suite in its small configuration: every phase, audited, with the cap watchdog.

A real run of `manage.py stress` (all phases, a few hundred frames each, the scheduler
subprocess included): it fails if any audit invariant breaks, a cap is breached, the pass
criteria of a phase are missed, or teardown leaves rows.
"""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from dispatch.lab.seeding import farm_counts
from dispatch.lab.stress import PHASE_LETTERS, PHASES, Breach, CapWatchdog, run_stress, small

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_phase_passes_its_audit_with_no_cap_breach() -> None:
    lines: list[str] = []
    reports = run_stress(small(prefix="tstress"), emit=lines.append)
    assert [r.name for r in reports] == list(PHASES)
    text = "\n".join(lines)
    for r in reports:
        assert r.failed == [], text
        assert r.breaches == 0, text
        assert r.samples > 0, text
        assert r.booked > 0, text
    # The report keeps the words scripts read.
    assert text.count("throughput: ") == len(PHASES)
    assert text.count("cap breaches: 0") == len(PHASES)
    assert text.count("audit: OK") == len(PHASES)
    for phase in (PHASE_LETTERS[p] for p in PHASES):
        assert not any(farm_counts(f"tstress_{phase}").values())


def test_the_watchdog_counts_a_booking_over_a_lowered_cap_only_once_the_store_had_it() -> None:
    reached: dict[tuple[str, str], float] = {}
    dog = CapWatchdog(["show"], applied_at=lambda v, k, since: reached.get((v, k)))
    with dog.lowering([("job", "j1")]):
        pass
    dog._judge("job", "j1", 900, 400, last_booked=100.0)  # decrease still in transit
    reached[("job", "j1")] = 200.0
    dog._judge("job", "j1", 900, 400, last_booked=150.0)  # booked before it reached the Store
    assert dog.breaches == [] and dog.over_lowered == 2
    dog._judge("job", "j1", 900, 400, last_booked=250.0)  # booked after: a breach
    dog._judge("folder", "f1", 900, 400, last_booked=1.0)  # never lowered: a breach
    assert dog.breaches == [Breach("job", "j1", 900, 400), Breach("folder", "f1", 900, 400)]


def test_the_watchdog_forgives_an_outside_write_only_until_the_store_had_it() -> None:
    reached: dict[str, float] = {}
    dog = CapWatchdog(["show"], reached_at=lambda committed: reached.get("at") if committed <= 5.0 else None)
    write = dog.adding([("sub", "s:a")])
    dog._judge("sub", "s:a", 900, 400, last_booked=100.0)  # the write has not committed yet
    write.committed = 5.0
    dog._judge("sub", "s:a", 900, 400, last_booked=100.0)  # committed, maybe not in the Store yet
    reached["at"] = 200.0
    dog._judge("sub", "s:a", 900, 400, last_booked=150.0)  # booked before the Store had it
    assert dog.breaches == [] and dog.over_outside == 3
    dog._judge("sub", "s:a", 900, 400, last_booked=250.0)  # booked after: a breach
    rolled_back = dog.adding([("job", "j1")])
    rolled_back.aborted = True
    dog._judge("job", "j1", 900, 400, last_booked=1.0)  # a write that rolled back excuses nothing
    assert dog.breaches == [Breach("sub", "s:a", 900, 400), Breach("job", "j1", 900, 400)]


def test_command_rejects_an_unknown_phase() -> None:
    with pytest.raises(CommandError, match="unknown phase"):
        call_command("stress", "--small", "--phases", "drain,nope")


def test_the_drain_phase_runs_through_real_rqd_daemons() -> None:
    """`stress --phases drain --launcher rqd`: the drain farm's hosts are real RQD daemons, its
    frames real `true` commands, launched, reported and released through the gateway."""
    lines: list[str] = []
    (report,) = run_stress(small(prefix="tsrqd", phases=("drain",), launcher="rqd"), emit=lines.append)
    text = "\n".join(lines)
    assert report.failed == [] and report.breaches == 0, text
    assert report.booked >= report.frames > 0, text
    assert "audit: OK" in text
    assert not any(farm_counts("tsrqd_d").values())


def test_the_frame_life_phase_drains_with_retries_charged_only_to_real_failures() -> None:
    """Memory failures (exit 33, signal 9 over the reservation), hung frames (timeout, timeout_llu)
    and real failures under booking load, behind a frame-by-frame dependency: the farm drains,
    nothing is left RUNNING or DEPEND, each frame's int_retries is its real failures retried, and
    memory-failed layers are raised (dispatch/lab/stress/frame_life.py)."""
    lines: list[str] = []
    (report,) = run_stress(small(prefix="tsfl", phases=("frame_life",)), emit=lines.append)
    text = "\n".join(lines)
    assert report.failed == [] and report.breaches == 0, text
    assert "hung frames killed: 0 " not in text, text
    assert not any(farm_counts(f"tsfl_{PHASE_LETTERS['frame_life']}").values())
