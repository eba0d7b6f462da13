"""Host scoring (issue 28): the E-PVM stranding score, and the host view's choice by it."""

from __future__ import annotations

import pytest

from dispatch.engine.placement import CENTI, Demand, HostRec, HostView
from dispatch.engine.scoring import Weights, frames_more, stranding_score

GB = 1024 * 1024  # KB


def host(
    pk: str, cores: int, mem_gb: int, *, gpus: int = 0, gpu_mem_gb: int = 0, tags: tuple[str, ...] = ("t",)
) -> HostRec:
    return HostRec(
        pk=pk, name=pk, alloc="a", facility="f", os="linux", thread_mode=0, tags=tags,
        cores_total=cores * CENTI, cores_idle=cores * CENTI, mem_idle=mem_gb * GB, mem_free=mem_gb * GB,
        mem_total=mem_gb * GB, gpus_idle=gpus, gpu_mem_idle=gpu_mem_gb * GB, gpu_mem_free=gpu_mem_gb * GB,
    )  # fmt: skip


def demand(cores: int, mem_gb: float, *, threadable: bool = False, gpus: int = 0, gpu_mem_gb: int = 0) -> Demand:
    return Demand(
        cores_min=cores * CENTI, cores_max=0, mem=int(mem_gb * GB), gpus=gpus, gpu_mem=gpu_mem_gb * GB,
        threadable=threadable,
    )  # fmt: skip


def unlimited(_alloc: str) -> int:
    return 10_000


def choose(view: HostView, d: Demand) -> str | None:
    found = view.find(d, ("t",), facility="f", os=None, room=unlimited)
    return None if found is None else found[0].pk


# -- the score: the Rust scheduler's parity examples (placement.rs, scoring_tests) --------------
def test_a_perfect_fit_and_a_host_in_the_frames_proportions_score_zero() -> None:
    assert stranding_score((400, 4 * GB, 0, 0), (400, 4 * GB, 0, 0)) == 0.0
    assert frames_more((6400, 64 * GB, 0, 0), (400, 4 * GB, 0, 0)) == 15
    assert stranding_score((6400, 64 * GB, 0, 0), (400, 4 * GB, 0, 0)) == 0.0


def test_memory_left_behind_by_the_cores_scores_the_frames_it_could_have_held() -> None:
    # 4 cores, 64 GB; a 4-core 4 GB frame: the cores bind (no second frame), 60 GB = 15 frames stranded.
    assert stranding_score((400, 64 * GB, 0, 0), (400, 4 * GB, 0, 0)) == pytest.approx(15.0)
    assert stranding_score((400, 64 * GB, 0, 0), (400, 4 * GB, 0, 0), Weights(mem=2.0)) == pytest.approx(30.0)
    # And the reverse: cores left behind by the memory.
    assert stranding_score((3200, 8 * GB, 0, 0), (100, 4 * GB, 0, 0)) == pytest.approx(30.0)


def test_a_frame_without_gpus_pays_for_the_gpus_it_would_keep_idle() -> None:
    cpu_host = stranding_score((400, 4 * GB, 0, 0), (400, 4 * GB, 0, 0))
    gpu_host = stranding_score((400, 4 * GB, 8, 80 * GB), (400, 4 * GB, 0, 0))
    assert cpu_host == 0.0
    assert gpu_host == pytest.approx(2.0 * 8 + 2.0 * 80)


def test_gpu_frames_are_scored_on_their_gpus() -> None:
    # 4 GPUs / 16 GB for a 2-GPU 8 GB frame: one more fits exactly, nothing stranded on the GPUs.
    assert frames_more((6400, 64 * GB, 4, 16 * GB), (400, 4 * GB, 2, 8 * GB)) == 1
    one_more = stranding_score((6400, 64 * GB, 4, 16 * GB), (400, 4 * GB, 2, 8 * GB))
    assert one_more == pytest.approx((6400 - 400 - 400) / 400 + (64 - 4 - 4) / 4)


def test_booking_a_frame_leaves_its_hosts_score_for_the_same_frame_unchanged() -> None:
    """Why the loop may place a layer's next frame on the same host without a new search."""
    idle, ask = (3200, 100 * GB, 0, 0), (100, 16 * GB, 0, 0)
    before = stranding_score(idle, ask)
    after = stranding_score(tuple(i - a for i, a in zip(idle, ask, strict=True)), ask)  # type: ignore[arg-type]
    assert before == after


# -- the host view's choice ------------------------------------------------------------------
def farm(fit: str, **kw: object) -> HostView:
    view = HostView(fit, **kw)  # type: ignore[arg-type]
    # Many cores and little memory, few cores and much memory.
    view.replace([host("wide", 32, 64), host("deep", 16, 256)])
    return view


def test_scored_placement_sends_big_memory_frames_to_big_memory_hosts() -> None:
    tight = farm("tightest")
    scored = farm("scored")
    heavy, light = demand(1, 48), demand(1, 2)
    # Tightest on cores sends both to the host with the fewest idle cores.
    assert choose(tight, heavy) == "deep" and choose(tight, light) == "deep"
    assert choose(scored, heavy) == "deep"
    assert choose(scored, light) == "wide"


def test_scored_placement_books_more_frames_on_a_mixed_farm_than_tightest_on_cores() -> None:
    """16 light frames, 5 heavy ones, then 40 light ones, in that order, on the two hosts."""

    def fill(view: HostView) -> int:
        booked = 0
        for d in [demand(1, 2)] * 16 + [demand(1, 48)] * 5 + [demand(1, 2)] * 40:
            found = view.find(d, ("t",), facility="f", os=None, room=unlimited)
            if found is not None:
                h, cores = found
                view.take(h, cores * CENTI, d.mem, d.gpus, d.gpu_mem)
                booked += 1
        return booked

    # Tightest on cores: the light frames take all of "deep"'s cores (224 GB stranded), so one
    # heavy frame fits, on "wide", and leaves it 16 GB for 8 light ones: 16 + 1 + 8.
    assert fill(farm("tightest")) == 25
    # Scored: light frames go to "wide", heavy ones to "deep"; both fill up: 16 + 5 + 16 + 8.
    assert fill(farm("scored")) == 45


def test_a_host_too_small_for_the_memory_is_passed_over_and_none_found_when_no_host_fits() -> None:
    view = farm("scored")
    assert choose(view, demand(1, 100)) == "deep"
    assert choose(view, demand(1, 300)) is None
    assert choose(view, demand(33, 1, threadable=True)) is None


def test_the_search_stops_after_its_candidate_shapes() -> None:
    view = HostView("scored", candidates=1)
    view.replace([host("deep", 16, 256), host("wide", 32, 64)])
    # Tightest first: "deep" (16 idle cores) is the only shape scored, though "wide" fits better.
    assert choose(view, demand(1, 2)) == "deep"
    assert choose(farm("scored", candidates=2), demand(1, 2)) == "wide"


def test_the_index_follows_bookings_and_give_backs() -> None:
    view = farm("scored")
    wide = view.hosts["wide"]
    view.take(wide, 3100, 60 * GB, 0, 0)  # one core and 4 GB left
    assert choose(view, demand(1, 2)) == "wide"  # 1 GB... its last core strands 2 GB; deep would strand 112 frames
    assert choose(view, demand(2, 2, threadable=True)) == "deep"
    view.give("wide", 3100, 60 * GB, 0, 0)
    assert choose(view, demand(2, 2, threadable=True)) == "wide"
    # No empty cell is left behind to be scanned.
    for by_cores in view._by_tag.values():
        for cells in by_cores.values():
            assert all(cells.values())


def test_an_unknown_fit_policy_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="scored, tightest, loosest"):
        HostView("best")
