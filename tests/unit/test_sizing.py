"""Cores from memory (issue 28): the frame books what its memory strands, Cuebot's rule.

The numbers are Cuebot's (`VirtualProc.build` / `getCoreSpan`) for a 32-core host with 128 GB
idle; placement's own `Demand` and `HostRec` are used, so what is tested is what books.
"""

from __future__ import annotations

import pytest

from dispatch.engine import sizing
from dispatch.engine.placement import Demand, HostRec, HostView

GB = 1024 * 1024
AUTO, ALL, VARIABLE = sizing.THREAD_MODE_AUTO, sizing.THREAD_MODE_ALL, sizing.THREAD_MODE_VARIABLE


def host(
    cores: int = 32, idle: int | None = None, mem_idle: int = 128 * GB, *, mode: int = AUTO, mem_total: int = 128 * GB
) -> HostRec:
    """A host of `cores` whole cores (`idle` of them idle) with `mem_idle` KB idle on the ledger."""
    idle_cc = (cores if idle is None else idle) * 100
    return HostRec(
        pk="h1", name="h1", alloc="a", facility="f", os="linux", thread_mode=mode, tags=("t",),
        cores_total=cores * 100, cores_idle=idle_cc, mem_idle=mem_idle, mem_free=mem_total, mem_total=mem_total,
        gpus_idle=0, gpu_mem_idle=0, gpu_mem_free=0,
    )  # fmt: skip


def layer(cores: float = 1, mem_gb: float = 4, *, max_cores: int = 0, threadable: bool = True) -> Demand:
    return Demand(
        cores_min=int(cores * 100), cores_max=max_cores * 100, mem=int(mem_gb * GB), gpus=0, gpu_mem=0,
        threadable=threadable,
    )  # fmt: skip


# The table: a 32-core, 128 GB idle host, cores booked per frame (Cuebot's column).
@pytest.mark.parametrize(
    ("cores", "mem_gb", "books", "rule"),
    [
        (1, 32, 8, sizing.MEMORY),  # 32 / (128 / 32) = 8
        (4, 64, 16, sizing.MEMORY),  # 64 / 4 = 16
        (1, 127, 32, sizing.STRANDED),  # leaves 1 GB <= 1.5 GB: every idle core
        (1, 4, 1, sizing.MEMORY),  # 4 / 4 = 1
    ],
)
def test_cuebots_table(cores: int, mem_gb: int, books: int, rule: str) -> None:
    assert sizing.size(layer(cores, mem_gb), host()) == (books, rule)
    # And placement books exactly that (the Store is asked for what `find` returns).
    view = HostView()
    h = host()
    view._put(h)
    assert view.find(layer(cores, mem_gb), ["t"], facility="f", os=None, room=lambda _a: 1000) == (h, books)


def test_rounding_is_javas_half_up() -> None:
    # 4 GB per core: 6 GB is 1.5 cores -> 2 (Python's round() would say 2 too, 10 GB is 2.5 -> 3, not 2).
    assert sizing.size(layer(1, 6), host())[0] == 2
    assert sizing.size(layer(1, 10), host())[0] == 3
    assert sizing.size(layer(1, 5.9), host())[0] == 1
    # idle_memory / cores is a long division (Java): 100 KB over 3 cores is 33 per core.
    assert sizing.core_span(50, 100, 3) == 2  # 50 / 33 = 1.515 -> 2 (exact division would give 1.5 -> 2 too)
    assert sizing.core_span(49, 99, 3) == 1  # 49 / 33 = 1.48 -> 1


def test_a_partly_full_host_gives_more_cores_as_cuebot_does() -> None:
    # 64 GB idle of 128 on a 32-core host: 2 GB per core, so 4 GB is 2 cores, not 1.
    assert sizing.size(layer(1, 4), host(idle=16, mem_idle=64 * GB)) == (2, sizing.MEMORY)


def test_never_below_the_layers_min_cores() -> None:
    assert sizing.size(layer(6, 4), host()) == (6, sizing.ASKED)


def test_clamped_to_the_layers_max_cores_zero_is_none() -> None:
    assert sizing.size(layer(1, 64, max_cores=10), host()) == (10, sizing.MAX)
    assert sizing.size(layer(1, 64, max_cores=0), host()) == (16, sizing.MEMORY)
    # The stranded rule is clamped too.
    assert sizing.size(layer(1, 127, max_cores=4), host()) == (4, sizing.MAX)


def test_stranded_threshold_is_1_5_gb_inclusive() -> None:
    left_exactly = 128 * GB - sizing.MEM_STRANDED_KB  # leaves exactly 1.5 GB
    assert sizing.size(Demand(100, 0, left_exactly, 0, 0, True), host()) == (32, sizing.STRANDED)
    assert sizing.size(Demand(100, 0, left_exactly - 1, 0, 0, True), host())[1] == sizing.MEMORY
    # On a partly busy host "every idle core" is the idle ones.
    assert sizing.size(layer(1, 10), host(idle=5, mem_idle=11 * GB)) == (5, sizing.STRANDED)


def test_memory_share_above_the_idle_cores_takes_them_all() -> None:
    # 96 GB of 128 idle is 24 cores' share; 10 cores are idle: all 10, never more.
    assert sizing.size(layer(1, 96), host(idle=10)) == (10, sizing.IDLE)
    # ...but never below the layer's min: the host refuses instead.
    assert sizing.size(layer(12, 96), host(idle=10)) == (0, sizing.BELOW_MIN)


def test_thread_mode_all_takes_every_idle_whole_core() -> None:
    assert sizing.size(layer(1, 4), host(idle=20, mode=ALL)) == (20, sizing.THREAD_ALL)
    assert sizing.size(layer(1, 4, max_cores=8), host(mode=ALL)) == (8, sizing.MAX)
    h = host(mode=ALL)
    h.cores_idle = 2050  # 20.5 idle: whole cores only
    assert sizing.size(layer(1, 4), h)[0] == 20


def test_thread_mode_variable_takes_at_least_two() -> None:
    assert sizing.size(layer(1, 4), host(mode=VARIABLE)) == (2, sizing.VARIABLE)
    assert sizing.size(layer(1, 32), host(mode=VARIABLE)) == (8, sizing.MEMORY)
    assert sizing.size(layer(3, 4), host(mode=VARIABLE)) == (3, sizing.ASKED)
    # A threadable frame is refused on a VARIABLE host with one idle core.
    assert sizing.size(layer(1, 4), host(idle=1, mode=VARIABLE)) == (0, sizing.VARIABLE_ONE_CORE)
    # A non-threadable one is not.
    assert sizing.size(layer(1, 4, threadable=False), host(idle=1, mode=VARIABLE)) == (1, sizing.SINGLE)


def test_non_threadable_layers_take_one_core_whatever_they_ask() -> None:
    for asks in (1, 8, 0, -2):
        assert sizing.size(layer(asks, 64, threadable=False), host()) == (1, sizing.SINGLE)
    assert sizing.size(layer(1, 127, threadable=False), host()) == (1, sizing.SINGLE)


def test_zero_is_the_whole_host_and_waits_for_an_idle_one() -> None:
    assert sizing.size(layer(0, 4), host()) == (32, sizing.WHOLE_HOST)
    assert sizing.size(layer(0, 4), host(idle=31)) == (0, sizing.HOST_NOT_IDLE)
    view = HostView()
    busy, idle = host(idle=31), host(cores=16)
    idle.pk = "h2"
    view._put(busy)
    view._put(idle)
    assert view.find(layer(0, 4), ["t"], facility="f", os=None, room=lambda _a: 1000) == (idle, 16)


def test_all_but_n() -> None:
    assert sizing.size(layer(-2, 4), host()) == (30, sizing.ALL_BUT)
    assert sizing.size(layer(-2, 4), host(idle=30)) == (30, sizing.ALL_BUT)
    assert sizing.size(layer(-2, 4), host(idle=29)) == (0, sizing.HOST_NOT_IDLE)
    # Refused on a host with N or fewer cores.
    assert sizing.size(layer(-2, 4), host(cores=2)) == (0, sizing.HOST_TOO_SMALL)
    assert sizing.size(layer(-2, 4), host(cores=1)) == (0, sizing.HOST_TOO_SMALL)
    assert sizing.size(layer(-2, 4), host(cores=3)) == (1, sizing.ALL_BUT)


def test_no_idle_whole_core_refuses() -> None:
    h = host(idle=0)
    h.cores_idle = 50
    assert sizing.size(layer(1, 4), h) == (0, sizing.NO_IDLE_CORE)
    assert sizing.size(layer(1, 4, threadable=False), h) == (0, sizing.NO_IDLE_CORE)


def test_describe_says_asks_one_books_eight() -> None:
    text = sizing.describe(layer(1, 32), host(), "h1")
    assert text == (
        "asks 1 core, books 8 on h1: its 32 GB are 8 cores' share of the host's 128 GB idle memory over 32 cores"
    )
    assert "books 32" in sizing.describe(layer(1, 127), host()) and "1.5 GB or less" in sizing.describe(
        layer(1, 127), host()
    )
    assert sizing.describe(layer(0, 4), host(idle=31), "h1") == (
        "asks the whole host (cores 0): h1 refuses it, that is 32 cores and it has 31 cores idle"
    )
    assert "VARIABLE" in sizing.describe(layer(1, 4), host(idle=1, mode=VARIABLE))
    assert sizing.describe(layer(6, 4), host()) == "asks 6 cores, books 6 on the host"


def test_memory_and_gpu_checks_still_refuse_the_host() -> None:
    """Sizing decides cores only: placement still refuses a host without the memory or GPUs."""
    view = HostView()
    h = host()
    h.mem_free = 16 * GB  # the agent reports less free than the ledger's idle: the lesser counts
    view._put(h)
    room = lambda _a: 1000  # noqa: E731
    assert view.find(layer(1, 32), ["t"], facility="f", os=None, room=room) is None
    assert view.find(layer(1, 8), ["t"], facility="f", os=None, room=room) == (h, 2)
    gpu = Demand(cores_min=100, cores_max=0, mem=8 * GB, gpus=1, gpu_mem=0, threadable=True)
    assert view.find(gpu, ["t"], facility="f", os=None, room=room) is None
    h.gpus_idle = 1
    assert view.find(gpu, ["t"], facility="f", os=None, room=room) == (h, 2)


def test_a_sized_frame_needs_the_room_under_the_burst_for_what_it_books() -> None:
    view = HostView()
    h = host()
    view._put(h)
    # 8 cores' share: a subscription with 7 cores of room refuses it (never a 7-core booking).
    assert view.find(layer(1, 32), ["t"], facility="f", os=None, room=lambda _a: 7) is None
    assert view.find(layer(1, 32), ["t"], facility="f", os=None, room=lambda _a: 8) == (h, 8)


def test_a_fraction_of_a_core_from_a_service_is_rounded_up_never_booked_below_the_minimum() -> None:
    """A service gives cores to the hundredth (issue 29: an operator's 2.5-core `arnold`); whole
    cores are booked, so a threadable frame asks 3, never 2 (it asked 2 before: failed then)."""
    assert sizing.asked_cores(layer(2.5, 4)) == 3
    assert sizing.size(layer(2.5, 4), host()) == (3, sizing.ASKED)
    assert sizing.size(layer(2.5, 4), host(idle=2)) == (0, sizing.BELOW_MIN)
    assert sizing.describe(layer(2.5, 4), host(), "h1").startswith("asks 3 cores, books 3 on h1")
    # A max of 2.5 and a min of 2.5: 3, the minimum wins over the floor of the max.
    capped = Demand(cores_min=250, cores_max=250, mem=64 * GB, gpus=0, gpu_mem=0, threadable=True)
    assert sizing.size(capped, host())[0] == 3
    # Below one core (Cuebot's 0.1-core `preprocess`): not threadable, 1 core, as before.
    assert sizing.size(layer(0.1, 0.375, threadable=False), host()) == (1, sizing.SINGLE)
