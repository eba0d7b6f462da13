"""GPU hosts kept for GPU work (issue 28): Cuebot's reserve, the backfill setting, the drain."""

from __future__ import annotations

from dispatch.engine import gpu_hosts
from dispatch.engine.gpu_hosts import GPU_RESERVE, GPU_WANTED, GpuWant, GpuWants, decline_cpu_frame
from dispatch.engine.placement import CENTI, Demand, HostRec, HostView

GB = 1024 * 1024  # KB


def host(
    pk: str, cores: int, mem_gb: int, *, gpus: int = 0, gpu_mem_gb: int = 0, tags: tuple[str, ...] = ("t",)
) -> HostRec:
    return HostRec(
        pk=pk, name=pk, alloc="a", facility="f", os="linux", thread_mode=0, tags=tags,
        cores_total=cores * CENTI, cores_idle=cores * CENTI, mem_idle=mem_gb * GB, mem_free=mem_gb * GB,
        mem_total=mem_gb * GB, gpus_idle=gpus, gpu_mem_idle=gpu_mem_gb * GB, gpu_mem_free=gpu_mem_gb * GB,
    )  # fmt: skip


def cpu(cores: int, mem_gb: int) -> Demand:
    return Demand(cores_min=cores * CENTI, cores_max=0, mem=mem_gb * GB, gpus=0, gpu_mem=0, threadable=True)


def gpu(gpus: int = 1, gpu_mem_gb: int = 8) -> Demand:
    return Demand(cores_min=CENTI, cores_max=0, mem=4 * GB, gpus=gpus, gpu_mem=gpu_mem_gb * GB, threadable=True)


def unlimited(_alloc: str) -> int:
    return 10_000


def fill(view: HostView, d: Demand, n: int = 100) -> int:
    """Book up to n frames of one shape; how many found a host."""
    booked = 0
    for _ in range(n):
        found = view.find(d, ("t",), facility="f", os=None, room=unlimited)
        if found is None:
            break
        h, cores = found
        view.take(h, cores * CENTI, d.mem, d.gpus, d.gpu_mem)
        booked += 1
    return booked


def rule(
    cores: int, mem_gb: int, *, idle_cores: int = 16, idle_gb: int = 64, wanted: bool = False, backfill: bool = False
) -> str | None:
    return decline_cpu_frame(
        cores=cores * CENTI, mem=mem_gb * GB, gpu_mem=0, cores_idle=idle_cores * CENTI, mem_idle=idle_gb * GB,
        gpu_mem_idle=16 * GB, gpu_wanted=wanted, backfill=backfill,
    )  # fmt: skip


def test_a_cpu_frame_must_leave_one_core_and_4_gb_on_a_gpu_host() -> None:
    assert rule(15, 60) is None  # leaves exactly 1 core and 4 GB
    assert rule(16, 8) == GPU_RESERVE  # would take the last core
    assert rule(2, 61) == GPU_RESERVE  # would leave 3 GB
    # A host with less than the reserve idle keeps all of it (Cuebot: min(reserve, idle)).
    assert rule(1, 1, idle_cores=1, idle_gb=2) == GPU_RESERVE


def test_backfill_lifts_the_reserve_but_not_the_waiting_gpu_frames() -> None:
    assert rule(16, 64, backfill=True) is None
    assert rule(1, 1, wanted=True) == GPU_WANTED
    assert rule(1, 1, wanted=True, backfill=True) == GPU_WANTED


def test_gpu_memory_a_cpu_frame_asks_for_leaves_4_gb() -> None:
    args = {"cores": 100, "mem": GB, "cores_idle": 1600, "mem_idle": 64 * GB, "gpu_wanted": False, "backfill": False}
    assert decline_cpu_frame(gpu_mem=12 * GB, gpu_mem_idle=16 * GB, **args) is None
    assert decline_cpu_frame(gpu_mem=13 * GB, gpu_mem_idle=16 * GB, **args) == GPU_RESERVE


def test_gpu_wants_match_tags_facility_os_and_the_gpus_idle() -> None:
    wants = GpuWants([GpuWant(frozenset({"t"}), "f", None, 2, 8 * GB), GpuWant(frozenset({"u"}), "f", "linux", 1, GB)])
    assert wants.want(("t",), "f", "linux", 2, 8 * GB)
    assert not wants.want(("t",), "f", "linux", 1, 8 * GB)  # one idle GPU: the frame asks two
    assert not wants.want(("t",), "g", "linux", 4, 64 * GB)  # another facility
    assert wants.want(("u",), "f", "linux", 1, GB)
    assert not wants.want(("u",), "f", "windows", 1, GB)  # the layer's job runs on linux only
    assert not wants.want(("v",), "f", "linux", 8, 64 * GB)
    assert not GpuWants() and not GpuWants().want(("t",), "f", None, 8, 64 * GB)


def test_cpu_frames_fill_a_gpu_host_only_up_to_the_reserve_by_default() -> None:
    view = HostView("scored")
    view.replace([host("g", 16, 64, gpus=2, gpu_mem_gb=32)])
    assert fill(view, cpu(1, 2)) == 15  # the 16th core is kept
    assert view.find(cpu(1, 2), ("t",), facility="f", os=None, room=unlimited) is None
    assert view.gpu_declined == {GPU_RESERVE: 1}
    assert "CUESCHED_GPU_BACKFILL" in gpu_hosts.describe(view.gpu_declined)
    # The GPU frame that comes later still finds its host.
    assert fill(view, gpu(), 1) == 1


def test_with_backfill_cpu_frames_may_use_all_of_an_idle_gpu_host() -> None:
    view = HostView("scored", gpu_backfill=True)
    view.replace([host("g", 16, 64, gpus=2, gpu_mem_gb=32)])
    assert fill(view, cpu(1, 2)) == 16


def test_while_gpu_frames_wait_no_new_cpu_frame_goes_to_a_gpu_host() -> None:
    for backfill in (False, True):
        view = HostView("scored", gpu_backfill=backfill)
        view.replace([host("g", 16, 64, gpus=2, gpu_mem_gb=32), host("c", 8, 32)])
        assert fill(view, cpu(1, 2), 4) == 4
        assert view.hosts["g"].cores_idle == 1600  # CPU work prefers the host without GPUs
        view.set_gpu_wants(GpuWants([GpuWant(frozenset({"t"}), "f", None, 1, 8 * GB)]))
        assert fill(view, cpu(1, 2)) == 4  # the CPU host's last 4 cores; the GPU host declines
        assert view.gpu_declined == {GPU_WANTED: 1}
        assert "GPU frames wait for them" in gpu_hosts.describe(view.gpu_declined)
        assert fill(view, gpu(), 1) == 1  # and the GPU frame gets it
        # Once no GPU frame waits, CPU frames may use it again (up to the reserve, by default):
        # it has a GPU idle still. With none idle, the rule is moot (no GPU frame could use it).
        view.set_gpu_wants(GpuWants())
        assert fill(view, cpu(1, 2)) == (16 - 1 if backfill else 16 - 1 - 1)


def test_gpu_frames_are_not_held_back_by_the_rule() -> None:
    view = HostView("scored")
    view.replace([host("g", 4, 64, gpus=4, gpu_mem_gb=32)])
    view.set_gpu_wants(GpuWants([GpuWant(frozenset({"t"}), "f", None, 1, 8 * GB)]))
    assert fill(view, gpu()) == 4  # every core and GPU: the reserve is for CPU frames only


def test_gpu_memory_a_completion_gives_back_is_free_again_at_once() -> None:
    """Found by the memory_mix stress phase: `take` lowers the cached free GPU memory, and a
    completion's ledger row gave back only the idle one, so a GPU host stayed too full for GPU
    frames until the next reload (10 s) while nothing ran on it."""
    view = HostView("scored")
    view.replace([host("g", 16, 64, gpus=2, gpu_mem_gb=16)])
    assert fill(view, gpu(1, 8), 2) == 2
    g = view.hosts["g"]
    # Both frames complete: the guarded UPDATE ... RETURNING gives the ledger back.
    view.set_ledger([("g", g.cores_total, 64 * GB, 2, 16 * GB)])
    assert fill(view, gpu(1, 8), 2) == 2
