"""Host choice on a mixed farm, policy against policy: frames per host-hour (issue 28).

A discrete-event run of the dispatch loop's placement on a farm of three host shapes (many
cores and little memory, few cores and much memory, GPU hosts) and a queue of five frame
shapes (light and memory-heavy, threadable and not, GPU). Every policy runs the same queue,
in the same order, with the same runtimes drawn once from one seed. Each dispatch pass does
what `DispatchLoop._book_job` does with the host view: layer by layer in queue order, each
frame placed by `HostView.find` (or on the layer's last host while it fits, the loop's hint),
booked with `HostView.take`, a layer's other frames skipped at its first frame without a host;
GPU wants set from the layers with frames left, as the loop sets them from its read. A
completion gives its resources back (`HostView.give`) and starts the next pass.

The queue is longer than the farm can run in the measured `hours`, so there is always work
waiting (a busy farm, where placement matters), and each pass looks at the first `window`
layers with frames left, as the loop's feed reads a bounded window of pending work. Frames
per host-hour are the frames completed within the hours over the farm's host-hours; core and
memory use are the core-seconds and KB-seconds booked within them over the farm's capacity.
No database, no Store, no caps: what differs between the runs is only where frames went. The
seconds per placement are wall time of the finds, to show the cost of scoring.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass

from dispatch.engine.gpu_hosts import GpuWant, GpuWants
from dispatch.engine.placement import CENTI, Demand, HostRec, HostView

KB_PER_GB = 1024 * 1024
TAG = "general"
FACILITY = "bench"


@dataclass(frozen=True)
class HostShape:
    name: str
    per_unit: int  # hosts of this shape per farm unit
    cores: int
    mem_gb: int
    gpus: int = 0
    gpu_mem_gb: int = 0


@dataclass(frozen=True)
class FrameShape:
    name: str
    share: int  # frames of this shape per 100 of the queue
    cores: int
    mem_gb: int
    threadable: bool
    runtime: float  # mean seconds
    gpus: int = 0
    gpu_mem_gb: int = 0

    @property
    def demand(self) -> Demand:
        return Demand(
            cores_min=self.cores * CENTI,
            cores_max=0,
            mem=self.mem_gb * KB_PER_GB,
            gpus=self.gpus,
            gpu_mem=self.gpu_mem_gb * KB_PER_GB,
            threadable=self.threadable,
        )


HOSTS = (
    HostShape("wide", 4, cores=32, mem_gb=64),
    HostShape("deep", 2, cores=16, mem_gb=256),
    HostShape("gpu", 1, cores=16, mem_gb=128, gpus=2, gpu_mem_gb=32),
)
FRAMES = (
    # Two per-core memory ratios, as the hosts have: 2 GB a core (wide hosts) and 16 (deep hosts).
    FrameShape("comp", 50, cores=1, mem_gb=2, threadable=False, runtime=300),
    FrameShape("render", 15, cores=4, mem_gb=8, threadable=True, runtime=600),
    FrameShape("sim", 10, cores=1, mem_gb=16, threadable=False, runtime=900),
    FrameShape("bake", 5, cores=2, mem_gb=32, threadable=True, runtime=900),
    FrameShape("ml", 5, cores=2, mem_gb=16, threadable=True, runtime=600, gpus=1, gpu_mem_gb=8),
)


@dataclass
class Result:
    policy: str
    hosts: int
    frames: int
    seconds: float
    core_use: float
    mem_use: float
    placements: int
    place_seconds: float

    @property
    def frames_per_host_hour(self) -> float:
        return self.frames / (self.hosts * self.seconds / 3600) if self.seconds else 0.0

    @property
    def us_per_placement(self) -> float:
        return 1e6 * self.place_seconds / self.placements if self.placements else 0.0


def farm(units: int) -> list[HostRec]:
    hosts = []
    for shape in HOSTS:
        for i in range(shape.per_unit * units):
            mem = shape.mem_gb * KB_PER_GB
            gpu_mem = shape.gpu_mem_gb * KB_PER_GB
            hosts.append(
                HostRec(
                    pk=f"{shape.name}-{i}",
                    name=f"{shape.name}-{i}",
                    alloc="a",
                    facility=FACILITY,
                    os="linux",
                    thread_mode=0,
                    tags=(TAG,),
                    cores_total=shape.cores * CENTI,
                    cores_idle=shape.cores * CENTI,
                    mem_idle=mem,
                    mem_free=mem,
                    mem_total=mem,
                    gpus_idle=shape.gpus,
                    gpu_mem_idle=gpu_mem,
                    gpu_mem_free=gpu_mem,
                )
            )
    return hosts


def queue(frames: int, seed: int) -> list[tuple[int, float]]:
    """(frame shape index, runtime) per frame, in submission order: jobs of 10 frames, shuffled."""
    rng = random.Random(seed)
    shapes = [i for i, f in enumerate(FRAMES) for _ in range(f.share)]
    out: list[tuple[int, float]] = []
    while len(out) < frames:
        i = rng.choice(shapes)
        out.extend((i, FRAMES[i].runtime * rng.uniform(0.8, 1.2)) for _ in range(10))
    return out[:frames]


def run(
    policy: str,
    units: int,
    hours: float,
    seed: int,
    *,
    window: int = 30,
    candidates: int = 64,
    backfill: bool = False,
) -> Result:
    view = HostView(policy, candidates=candidates, gpu_backfill=backfill)
    hosts = farm(units)
    view.replace(hosts)
    horizon = hours * 3600
    # Enough frames that the queue never runs dry within the hours (a frame per core-minute).
    cores = sum(h.cores_total for h in hosts) // CENTI
    todo = queue(int(cores * horizon / 60), seed)
    # The queue as layers: consecutive frames of one shape are one layer of one job.
    layers: list[tuple[int, list[float]]] = []
    for shape, runtime in todo:
        if layers and layers[-1][0] == shape and len(layers[-1][1]) < 10:
            layers[-1][1].append(runtime)
        else:
            layers.append((shape, [runtime]))
    layers.reverse()  # popped from the end: the first submitted first
    demands = [f.demand for f in FRAMES]
    running: list[tuple[float, int, str, int, int, int, int]] = []
    now = 0.0
    done = 0
    core_seconds = 0.0
    mem_seconds = 0.0
    placements = 0
    place_seconds = 0.0
    seq = 0

    def room(_alloc: str) -> int:
        return 1 << 30

    read: list[tuple[int, list[float]]] = []
    while now < horizon:
        # The first `window` layers with frames left, in submission order.
        read = [layer for layer in read if layer[1]]
        while len(read) < window and layers:
            read.append(layers.pop())
        view.set_gpu_wants(
            GpuWants(
                GpuWant(frozenset((TAG,)), FACILITY, None, demands[s].gpus, demands[s].gpu_mem)
                for s, _left in read
                if demands[s].gpus
            )
        )
        failed: set[int] = set()  # shapes that found no host this pass: the view only shrinks in a pass
        for shape, left in read:
            if shape in failed:
                continue
            demand = demands[shape]
            hint: HostRec | None = None
            hint_generation = -1
            while left:
                t0 = time.perf_counter()
                found = None
                if hint is not None and hint_generation == view.generation:
                    cores = view.fits(hint, demand, facility=FACILITY, os=None, room=room)
                    if cores:
                        found = (hint, cores)
                if found is None:
                    found = view.find(demand, (TAG,), facility=FACILITY, os=None, room=room)
                place_seconds += time.perf_counter() - t0
                placements += 1
                if found is None:
                    failed.add(shape)
                    break
                host, cores = found
                runtime = left.pop()
                centi = cores * CENTI
                view.take(host, centi, demand.mem, demand.gpus, demand.gpu_mem)
                if view.keeps_hint:
                    hint, hint_generation = host, view.generation
                counted = min(runtime, horizon - now)  # only what runs within the hours
                core_seconds += centi / CENTI * counted
                mem_seconds += demand.mem * counted
                seq += 1
                heapq.heappush(running, (now + runtime, seq, host.pk, centi, demand.mem, demand.gpus, demand.gpu_mem))
        if not running:
            raise RuntimeError(f"{policy}: frames left that no host of the farm can run")
        # Every completion due at the next completion's time, then the next pass.
        now = running[0][0]
        while running and running[0][0] <= now:
            _end, _seq, pk, centi, mem, gpus, gpu_mem = heapq.heappop(running)
            view.give(pk, centi, mem, gpus, gpu_mem)
            if now <= horizon:
                done += 1
    total_cores = sum(h.cores_total for h in hosts) / CENTI
    total_mem = sum(h.mem_total for h in hosts)
    return Result(
        policy=policy,
        hosts=len(hosts),
        frames=done,
        seconds=horizon,
        core_use=core_seconds / (total_cores * horizon),
        mem_use=mem_seconds / (total_mem * horizon),
        placements=placements,
        place_seconds=place_seconds,
    )
