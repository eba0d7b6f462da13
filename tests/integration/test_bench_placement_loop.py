"""`bench_placement --real-loop` at a size of seconds: the real dispatch loop drains the
memory_mix farm under the behaviour before issue 28 and main's, alternated, and prints the
figures. What is asserted is that both sides ran and every figure is printed, never a speed;
plus the lab-only switch: it sizes as 6be1991 did while it is on, and puts main's rule back.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.placement import Demand, HostRec
from dispatch.lab import placement_loop
from dispatch.lab.placement_loop import VARIANTS, Run, asked_size, behaviour, measure
from dispatch.lab.seeding import farm_counts

pytestmark = pytest.mark.django_db(transaction=True)

GB = 1024 * 1024


def _host(cores: int = 32, mem_gb: int = 128) -> HostRec:
    return HostRec(
        pk="h", name="h", alloc="a", facility="f", os="linux", thread_mode=0, tags=("t",),
        cores_total=cores * 100, cores_idle=cores * 100, mem_idle=mem_gb * GB, mem_free=mem_gb * GB,
        mem_total=mem_gb * GB, gpus_idle=0, gpu_mem_idle=0, gpu_mem_free=0,
    )  # fmt: skip


def test_the_before_switch_books_what_the_layer_asks_and_main_s_rule_comes_back() -> None:
    demand = Demand(cores_min=100, cores_max=0, mem=32 * GB, gpus=0, gpu_mem=0, threadable=True)
    main_size, main_decline = sizing.size, gpu_hosts.decline_cpu_frame
    assert sizing.size(demand, _host())[0] == 8  # Cuebot's rule: 32 GB of 128 GB over 32 cores
    with behaviour(VARIANTS["before"]):
        assert sizing.size is asked_size
        assert sizing.size(demand, _host())[0] == 1  # 6be1991: the cores the layer asks
        assert gpu_hosts.decline_cpu_frame(cores=100) is None
    assert sizing.size is main_size and gpu_hosts.decline_cpu_frame is main_decline
    with behaviour(VARIANTS["after"]):
        assert sizing.size is main_size


def test_measure_counts_frames_in_the_window_and_stranded_cores() -> None:
    # One 4-core, 10 GB host; a 1-core frame reserving 9 GB leaves 3 cores with 1 GB: stranded
    # for the 2 GB the least layer asks, over half the window.
    hosts = {"h": (400, 10 * GB)}
    runs = [Run("h", 100, 100, 9 * GB, start=0.0, end=5.0), Run("h", 200, 100, 2 * GB, start=5.0, end=None)]
    frames, booked, asked, cores_occ, mem_occ, stranded = measure(runs, hosts, 0.0, 10.0, 2 * GB)
    assert frames == 1
    assert booked == pytest.approx(1 * 5 + 2 * 5) and asked == pytest.approx(5 + 5)
    assert cores_occ == pytest.approx(15 / 40) and mem_occ == pytest.approx((9 * 5 + 2 * 5) / 100)
    assert stranded == pytest.approx(3 * 5 / 40)


@pytest.mark.one_server
def test_the_real_loop_runs_before_and_after_and_prints_the_figures() -> None:
    out = io.StringIO()
    call_command(
        "bench_placement", "--real-loop", "--rounds", "2", "--seconds", "4", "--hosts", "8", "--jobs", "60",
        "--frames-per-layer", "5", "--runtime-min", "0.5", "--runtime-max", "1", stdout=out,
    )  # fmt: skip
    text = out.getvalue()
    rows = [line.split()[:2] for line in text.splitlines() if line[:5].strip().isdigit()]
    assert rows == [["1", "before"], ["1", "after"], ["2", "after"], ["2", "before"]], text
    assert "load average before:" in text and "load average after:" in text
    for name in ("before", "after"):
        assert f"\n{name}: frames per host-hour " in text and "cores booked per core asked" in text
    assert "after against before: frames per host-hour x" in text
    assert not any(farm_counts(placement_loop.PREFIX).values())  # every run's farm purged


def test_unknown_variants_are_refused() -> None:
    with pytest.raises(CommandError, match="--variants takes"):
        call_command("bench_placement", "--real-loop", "--variants", "before")
