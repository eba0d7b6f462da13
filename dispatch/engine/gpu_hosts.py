"""GPU hosts are kept for GPU work: the rule a CPU frame meets on a host with idle GPUs.

GPU hosts are few and dear; a farm that fills them with CPU frames whenever they are idle
leaves the next GPU frame nowhere to go until those CPU frames end (OpenCue issue #991). The
rule is Cuebot's (`CoreUnitDispatcher.getGpuJobs`, `DispatchHost.removeGpu`):

* while a GPU frame waits that this host could run, no CPU frame is placed on it, so a host
  that CPU work filled drains back to GPU work as its CPU frames end;
* otherwise a CPU frame may use the host only up to what leaves 1 GPU, 1 core, 4 GB of
  memory and 4 GB of GPU memory free (Cuebot takes them off the host's idle figures before it
  looks for CPU work: so do we, `min(reserve, idle)` of each), so a GPU frame that comes later
  still finds room;
* with `CUESCHED_GPU_BACKFILL` on, CPU frames may use all of an idle GPU host (the first rule
  still holds: waiting GPU frames stop new CPU frames there).

"A GPU frame waits" means a layer asking for GPUs has WAITING frames in this cycle's read of
pending work (the feed, which has already left out work that cannot book: caps reached,
licences full, no host with its shape) whose tags, facility, OS, GPUs and GPU memory this host
matches. Cuebot asks the same of the database per host (`FIND_JOBS_BY_SHOW` with
`int_gpus_min BETWEEN 1 AND idle GPUs`); the cycle already holds the answer in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

KB_PER_GB = 1024 * 1024

# What a CPU frame leaves free on a host with idle GPUs (Cuebot's DispatchHost.removeGpu).
KEEP_GPUS = 1
KEEP_CORES = 100  # centicores
KEEP_MEM = 4 * KB_PER_GB  # KB
KEEP_GPU_MEM = 4 * KB_PER_GB  # KB

# Why a GPU host declined a CPU frame (the why-not-booking reasons).
GPU_WANTED = "gpu_wanted"
GPU_RESERVE = "gpu_reserve"


@dataclass(frozen=True, slots=True)
class GpuWant:
    """The shape of a waiting GPU layer, as far as host choice goes."""

    tags: frozenset[str]
    facility: str
    os: str | None
    gpus: int
    gpu_mem: int


class GpuWants:
    """The GPU layers waiting this cycle, and which hosts they could run on."""

    def __init__(self, wants: Iterable[GpuWant] = ()) -> None:
        # The least GPUs and GPU memory asked per (tag, facility, OS): a host that fits the
        # smallest ask of a tag is wanted by GPU work, whatever the larger ones ask.
        least: dict[tuple[str, str, str | None], tuple[int, int]] = {}
        for w in wants:
            for tag in w.tags:
                key = (tag, w.facility, w.os)
                gpus, gpu_mem = least.get(key, (w.gpus, w.gpu_mem))
                least[key] = (min(gpus, w.gpus), min(gpu_mem, w.gpu_mem))
        self._least = least

    def __bool__(self) -> bool:
        return bool(self._least)

    def want(self, tags: Iterable[str], facility: str, os: str | None, gpus_idle: int, gpu_mem_idle: int) -> bool:
        """Whether a waiting GPU frame could run on a host with these tags and idle GPUs."""
        if not self._least:
            return False
        for tag in tags:
            for key_os in (None, os):
                least = self._least.get((tag, facility, key_os))
                if least is not None and least[0] <= gpus_idle and least[1] <= gpu_mem_idle:
                    return True
        return False


NO_WANTS = GpuWants()


def decline_cpu_frame(
    *,
    cores: int,
    mem: int,
    gpu_mem: int,
    cores_idle: int,
    mem_idle: int,
    gpu_mem_idle: int,
    gpu_wanted: bool,
    backfill: bool,
) -> str | None:
    """Why a host with idle GPUs refuses a frame that asks no GPU, or None.

    The frame would book `cores` centicores, `mem` KB and `gpu_mem` KB of GPU memory (a layer
    may ask GPU memory without a GPU). Idle figures are the host's effective ones (memory: the
    least of the ledger and the agent's report). The GPU kept is kept by construction: the
    frame asks none.
    """
    if gpu_wanted:
        return GPU_WANTED
    if backfill:
        return None
    if (
        cores > cores_idle - min(KEEP_CORES, cores_idle)
        or mem > mem_idle - min(KEEP_MEM, mem_idle)
        or gpu_mem > gpu_mem_idle - min(KEEP_GPU_MEM, gpu_mem_idle)
    ):
        return GPU_RESERVE
    return None


def describe(declined: dict[str, int]) -> str:
    """The why-not-booking text for the GPU hosts that declined a CPU frame, '' for none."""
    parts = []
    if declined.get(GPU_WANTED):
        parts.append(f"{declined[GPU_WANTED]} GPU host(s) declined it: GPU frames wait for them")
    if declined.get(GPU_RESERVE):
        parts.append(
            f"{declined[GPU_RESERVE]} GPU host(s) declined it: a CPU frame must leave 1 GPU, 1 core, "
            "4 GB of memory and 4 GB of GPU memory free there (CUESCHED_GPU_BACKFILL=1 lets CPU frames "
            "use all of an idle GPU host)"
        )
    return "; ".join(parts)
