"""Placement through the real dispatch loop: before and after issue 28 on one mixed farm, one run.

`bench_placement` (dispatch.lab.placement_bench) replays the loop's placement on a simulated
farm with no database. This is the same question asked of the real runtime: the memory_mix
stress phase's farm (16-256 GB hosts, GPU hosts, 2-48 GB frames threadable and not, GPU and not,
one managed show and one unmanaged), seeded afresh into PostgreSQL for every run, drained by
the accounting service, one `DispatchLoop` and the simulated launcher (frames "run" for a drawn
wall-clock time, then complete through the normal completion path).

The two behaviours, run in the same process, alternately, round after round:

* `before`: what main did before issue 28 (commit 6be1991). A threadable frame books the cores
  its layer asks (6be1991's `Demand.whole_cores_on`: 1 when not threadable, every idle core in
  thread mode ALL, the asked cores otherwise), hosts are chosen tightest-fit on idle cores
  (`CUESCHED_HOST_FIT_POLICY=tightest`), and a host with idle GPUs takes CPU frames like any
  other (no GPU host kept).
* `after`: main as it is: cores from memory (dispatch.engine.sizing), the scored placement
  (dispatch.engine.scoring), GPU hosts kept for GPU work.
* `tightest` (optional): main's sizing and GPU rule with the old host-fit policy, which isolates
  the placement policy as bench_placement does.

Cores from memory cannot be switched off at runtime, on purpose: it is the rule that a cap is a
share of the farm, and a setting that weakens it would be a production knob to breach a burst.
So `before` is a lab-only substitution, in this process only, for the length of one run:
`sizing.size` and `gpu_hosts.decline_cpu_frame` are swapped for 6be1991's behaviour by
`behaviour()`, a context manager nothing outside dispatch.lab uses. The whole dispatch loop,
the Store, the database triggers and the completion path are main's on both sides, so what
differs is where frames go and how many cores they are charged, nothing else.

What is measured, over a window of `seconds` of wall time from the loop's start, while the queue
is longer than the farm can run in it (the command fails if no CPU frame, or no GPU frame, was
left waiting at the end of a run: the farm was not busy to the end):

* frames per host-hour: frames completed within the window / (hosts x window in hours);
* cores booked per core asked: the core-seconds frames were booked (charged) over the
  core-seconds their layers asked (1 for a layer that is not threadable); 1.0 when no frame books
  more than it asks;
* core occupancy and memory occupancy: booked core-seconds and reserved memory-seconds within the
  window over the farm's;
* stranded cores: the share of the farm's core-seconds idle on a host whose idle memory is below
  the least memory any layer of the queue asks (cores no waiting frame can use), computed from
  the bookings and completions the launcher saw and the hosts' sizes.

Simulated frames use no CPU, so "cores used" can only be what the frame is charged against what
its layer asked: that is the ratio printed. Runtimes do not depend on the cores booked (a real
threadable frame given 8 cores may run faster; the simulation does not model it).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from accounting import db
from accounting.service import AccountingService
from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.completion import Completion
from dispatch.engine.loop import DispatchLoop
from dispatch.engine.placement import CENTI, THREAD_MODE_ALL
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSpec, purge_farm
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import QUIET_LOOPS, env, fresh_farm
from dispatch.lab.stress.memory_mix import _mixed_farm

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking

PREFIX = "plloop"
HOSTS_SQL = "SELECT pk_host, int_cores, int_mem FROM host WHERE pk_host = ANY(%s)"
LEAST_MEM_SQL = "SELECT min(int_mem_min) FROM layer WHERE pk_layer = ANY(%s)"
# Frames still waiting at the window's end, of layers asking no GPU and of GPU layers: the farm was
# busy for both kinds only if each still has some (GPU frames, on one host in 8, back up first).
WAITING_SQL = """
SELECT count(*) FILTER (WHERE l.int_gpus_min = 0), count(*) FILTER (WHERE l.int_gpus_min > 0)
FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer WHERE f.pk_job = ANY(%s) AND f.str_state = 'WAITING'
"""


@dataclass(frozen=True)
class Variant:
    name: str
    cores_as_asked: bool
    policy: str
    keep_gpu_hosts: bool
    what: str


VARIANTS = {
    "before": Variant(
        "before", True, "tightest", False, "6be1991: cores as the layer asks, tightest on cores, no GPU host kept"
    ),
    "after": Variant("after", False, "scored", True, "main: cores from memory, scored, GPU hosts kept"),
    "tightest": Variant("tightest", False, "tightest", True, "main's sizing and GPU rule, tightest on cores"),
}


def asked_size(demand: sizing.LayerDemand, host: sizing.HostState) -> tuple[int, str]:
    """6be1991's `Demand.whole_cores_on`, in `sizing.size`'s shape: the cores a frame booked before
    issue 28 (no memory share, no stranded rule); (0, refusal) where that booked nothing."""
    if not demand.threadable:
        return (1, sizing.SINGLE) if host.cores_idle >= CENTI else (0, sizing.NO_IDLE_CORE)
    if host.thread_mode == THREAD_MODE_ALL:
        cores = host.cores_idle // CENTI
        if demand.cores_max > 0:
            cores = min(cores, demand.cores_max // CENTI)
        return (cores, sizing.THREAD_ALL) if cores > 0 else (0, sizing.NO_IDLE_CORE)
    if demand.cores_min > 0:
        return max(1, demand.cores_min // CENTI), sizing.ASKED
    cores = host.cores_total // CENTI + int(demand.cores_min / CENTI)
    return (cores, sizing.WHOLE_HOST) if cores > 0 else (0, sizing.HOST_TOO_SMALL)


def _no_gpu_host_kept(**_kwargs: object) -> None:
    return None


@contextmanager
def behaviour(variant: Variant) -> Iterator[None]:
    """The variant's sizing, GPU rule and host-fit policy, in this process, until the block ends."""
    saved = (sizing.size, gpu_hosts.decline_cpu_frame)
    if variant.cores_as_asked:
        sizing.size = asked_size  # type: ignore[assignment]
    if not variant.keep_gpu_hosts:
        gpu_hosts.decline_cpu_frame = _no_gpu_host_kept  # type: ignore[assignment]
    try:
        with env(CUESCHED_HOST_FIT_POLICY=variant.policy, CUESCHED_GPU_BACKFILL="0"):
            yield
    finally:
        sizing.size, gpu_hosts.decline_cpu_frame = saved


@dataclass
class Run:
    """What one frame did: its host, centicores booked and asked, KB reserved, start and end."""

    host: str
    cores: int
    asked: int
    mem: int
    start: float
    end: float | None = None


class RecordingLauncher(SimulatedLauncher):
    """The simulated launcher, noting each run's booking and when its completion was reported."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.runs: dict[str, Run] = {}

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        failures = super().launch(bookings)
        failed = {b.pk_proc for b, _ in failures}
        now = self._clock()
        for b in bookings:
            if b.pk_proc not in failed:
                asked = sizing.asked_cores(b.layer.demand) * CENTI
                self.runs[b.pk_proc] = Run(b.host.pk, b.cores, asked, b.mem, now)
        return failures

    def poll_completions(self) -> list[Completion]:
        out = super().poll_completions()
        now = self._clock()
        for c in out:
            run = self.runs.get(c.pk_proc)
            if run is not None and run.end is None:
                run.end = now
        return out


@dataclass
class Result:
    variant: str
    round: int
    hosts: int
    seconds: float
    frames: int
    booked_core_s: float
    asked_core_s: float
    core_occupancy: float
    mem_occupancy: float
    stranded: float
    waiting_left: tuple[int, int]  # (CPU frames, GPU frames) still waiting at the window's end
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def frames_per_host_hour(self) -> float:
        return self.frames / (self.hosts * self.seconds / 3600) if self.seconds else 0.0

    @property
    def booked_per_asked(self) -> float:
        return self.booked_core_s / self.asked_core_s if self.asked_core_s else 0.0


def measure(
    runs: Sequence[Run],
    hosts: dict[str, tuple[int, int]],
    t0: float,
    t1: float,
    least_mem: int,
) -> tuple[int, float, float, float, float, float]:
    """(frames completed, booked core-s, asked core-s, core occupancy, memory occupancy, stranded
    share) within [t0, t1], from the runs and the hosts' (centicores, KB)."""
    frames = 0
    booked = asked = mem_s = 0.0
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, host, cores, mem): + booked, - freed
    for r in runs:
        end = r.end if r.end is not None else t1
        if r.end is not None and r.end <= t1:
            frames += 1
        overlap = max(0.0, min(end, t1) - max(r.start, t0))
        booked += r.cores / CENTI * overlap
        asked += r.asked / CENTI * overlap
        mem_s += r.mem * overlap
        events.append((r.start, 1, r.host, r.cores, r.mem))
        if r.end is not None:
            events.append((r.end, 0, r.host, -r.cores, -r.mem))
    events.sort()
    idle = {pk: [cores, mem] for pk, (cores, mem) in hosts.items()}

    def stranded_now() -> float:
        return sum(c / CENTI for c, m in idle.values() if c >= CENTI and m < least_mem)

    stranded = 0.0
    last = t0
    level = stranded_now()
    for when, _order, pk, cores, mem in events:
        if when > last and when > t0:
            stranded += level * (min(when, t1) - max(last, t0))
            last = when
        if when >= t1:
            break
        idle[pk][0] -= cores
        idle[pk][1] -= mem
        level = stranded_now()
    if last < t1:
        stranded += level * (t1 - max(last, t0))
    span = t1 - t0
    farm_cores = sum(c for c, _ in hosts.values()) / CENTI
    farm_mem = sum(m for _, m in hosts.values())
    return (
        frames,
        booked,
        asked,
        booked / (farm_cores * span) if span else 0.0,
        mem_s / (farm_mem * span) if span else 0.0,
        stranded / (farm_cores * span) if span else 0.0,
    )


def farm_spec(hosts: int, jobs: int, frames_per_layer: int, seed: int) -> FarmSpec:
    """The memory_mix phase's farm at this size (prefix of its own)."""
    cfg = StressConfig(prefix=PREFIX, seed=seed, mm_hosts=hosts, mm_jobs=jobs, mm_frames_per_layer=frames_per_layer)
    return replace(cfg.memory_mix_spec(), prefix=PREFIX)


def run_once(
    variant: Variant,
    spec: FarmSpec,
    *,
    seconds: float,
    runtime: tuple[float, float],
    launcher_seed: int,
    round_no: int = 1,
) -> Result:
    """Seed the farm afresh, run the real loop under the variant for `seconds`, measure, purge."""
    seed = fresh_farm(spec)
    _mixed_farm(seed)
    with db.connect(autocommit=True, application_name="cuesched-bench-placement") as conn:
        hosts = {pk: (int(c), int(m)) for pk, c, m in conn.execute(HOSTS_SQL, (list(seed.host_ids),)).fetchall()}
        row = conn.execute(LEAST_MEM_SQL, (list(seed.layer_ids),)).fetchone()
        least_mem = int(row[0]) if row and row[0] is not None else 0
        conn.execute("ANALYZE frame, proc, host, host_stat, job, layer")
    stop_service = threading.Event()
    stop_loop = threading.Event()
    launcher = RecordingLauncher(
        runtime_min=runtime[0], runtime_max=runtime[1], failure_rate=0, launch_failure_rate=0, seed=launcher_seed
    )
    errors: list[BaseException] = []
    try:
        with behaviour(variant), env(**QUIET_LOOPS):
            service = AccountingService()
            service.start(stop_service, bootstrap_timeout=30)
            try:
                loop = DispatchLoop(service, launcher)

                def target() -> None:
                    try:
                        loop.run(stop_loop)
                    except BaseException as exc:  # reported below, never swallowed
                        errors.append(exc)

                thread = threading.Thread(target=target, name=f"placement-loop-{variant.name}", daemon=True)
                t0 = time.monotonic()
                thread.start()
                stop_loop.wait(seconds)
                t1 = time.monotonic()
                stop_loop.set()
                thread.join(120)
                if thread.is_alive():
                    errors.append(RuntimeError("the dispatch loop did not stop within 120 s"))
            finally:
                stop_loop.set()
                stop_service.set()
                service.join()
        with db.connect(autocommit=True, application_name="cuesched-bench-placement") as conn:
            row = conn.execute(WAITING_SQL, (list(seed.job_ids),)).fetchone()
            waiting = (int(row[0]), int(row[1])) if row else (0, 0)
    finally:
        launcher.close()
        purge_farm(spec.prefix)
    if errors:
        raise RuntimeError(f"{variant.name}: the loop raised {type(errors[0]).__name__}: {errors[0]}")
    frames, booked, asked, cores_occ, mem_occ, stranded = measure(
        list(launcher.runs.values()), hosts, t0, t1, least_mem
    )
    return Result(
        variant=variant.name,
        round=round_no,
        hosts=len(hosts),
        seconds=t1 - t0,
        frames=frames,
        booked_core_s=booked,
        asked_core_s=asked,
        core_occupancy=cores_occ,
        mem_occupancy=mem_occ,
        stranded=stranded,
        waiting_left=waiting,
        refused=dict(loop.totals.rejected),
    )


def run_rounds(
    variants: Sequence[Variant],
    spec: FarmSpec,
    *,
    rounds: int,
    seconds: float,
    runtime: tuple[float, float],
    emit: Callable[[Result], None] = lambda _r: None,
) -> list[Result]:
    """Every variant once per round; the order turns round each round (ABBA), so a load that drifts
    over the run weighs on both sides alike. The launcher's runtimes come from the round's seed."""
    out = []
    for i in range(rounds):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for v in order:
            r = run_once(v, spec, seconds=seconds, runtime=runtime, launcher_seed=i + 1, round_no=i + 1)
            out.append(r)
            emit(r)
    return out


@dataclass(frozen=True)
class Summary:
    variant: str
    frames_per_host_hour: float
    booked_per_asked: float
    core_occupancy: float
    mem_occupancy: float
    stranded: float


def summarise(results: Sequence[Result], variant: str) -> Summary:
    mine = [r for r in results if r.variant == variant]

    def med(f: Callable[[Result], float]) -> float:
        return statistics.median(f(r) for r in mine) if mine else 0.0

    return Summary(
        variant,
        med(lambda r: r.frames_per_host_hour),
        med(lambda r: r.booked_per_asked),
        med(lambda r: r.core_occupancy),
        med(lambda r: r.mem_occupancy),
        med(lambda r: r.stranded),
    )


def round_ratios(results: Sequence[Result], new: str, old: str) -> list[float]:
    """Frames per host-hour, new over old, round by round."""
    by = {(r.variant, r.round): r for r in results}
    out = []
    for (v, i), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        if v == new and (old, i) in by and by[(old, i)].frames_per_host_hour:
            out.append(r.frames_per_host_hour / by[(old, i)].frames_per_host_hour)
    return out


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
