"""The stress suite's sizes: one configuration for every phase, full size or the test suite's `small`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dispatch.lab.seeding import FarmSpec
from dispatch.lab.stress.registry import PHASE_LETTERS, PHASES


@dataclass(frozen=True)
class StressConfig:
    """Sizes of the three farm shapes; caps in whole cores (the spec stores centicores)."""

    prefix: str = "stress"
    seed: int = 0x0C0FFEE
    phases: tuple[str, ...] = PHASES
    # drain (the reference's defaults)
    hosts: int = 1200
    jobs: int = 300
    layers: int = 4
    frames_per_layer: int = 5
    # saturation
    sat_hosts: int = 400
    sat_jobs: int = 150
    sat_layers: int = 2
    sat_frames_per_layer: int = 10
    sat_burst: int = 150  # cores per subscription
    sat_job_max_cores: int = 20
    sat_seconds: float = 4.0  # the phase never drains: how long frames are offered
    # perturbations: a farm whose caps bind while frames complete and release
    pert_hosts: int = 200
    pert_jobs: int = 60
    pert_layers: int = 2
    pert_frames_per_layer: int = 10
    pert_burst: int = 120  # cores per subscription
    pert_folder_max_cores: int = 300
    pert_job_max_cores: int = 12
    runtime_min: float = 0.02  # simulated frame runtime in the perturbation phases, s
    runtime_max: float = 0.15
    phase_timeout: float = 300.0
    watch_interval: float = 0.02  # s between watchdog samples
    # the integrity phases (issues 15 and 16): the perturbation farm's hosts, jobs and caps,
    # with more frames that run longer, so the load outlasts the faults
    int_frames_per_layer: int = 30
    int_runtime_min: float = 0.3
    int_runtime_max: float = 1.0
    # outside_writers: writes in all (bounded), writer threads, mean pause between two writes, s
    ow_ops: int = 1200
    ow_writers: int = 4
    ow_pause: float = 0.02
    # outside_managed (issue 27, row 1): raw 1-core bookings of the managed show tried in all, by
    # how many writers (each pauses ow_pause on average between two), against subscriptions of
    # this burst (cores), which is what binds there
    om_ops: int = 2000
    om_writers: int = 4
    om_burst: int = 20
    # split_brain: the standby's lock poll (CUESCHED_STANDBY_POLL_INTERVAL's default), s
    sb_poll: float = 1.0
    # listener_wedge: hosts and frames per layer of its farm (the hosts, not the caps, bind
    # there, so bookings go on while the Store hears no release); the listener's heartbeat
    # deadline and how long its path stays frozen, s
    lw_hosts: int = 40
    lw_frames_per_layer: int = 25
    lw_deadline: float = 3.0
    lw_freeze: float = 6.0
    # flip_roundtrip: round trips, the managed-shows tick (longer than a trip), the recompute
    # (shorter than the 0.1-0.3 s a show stays out, so a recompute sees it unmanaged), s
    fr_trips: int = 10
    fr_ttl: float = 5.0
    fr_recompute: float = 0.1
    # fairshare (issue 19): 8-core hosts, one-core frames of fs_runtime_min-max s; three shows
    # sized 50/30/20% of the farm, each with a burst of fs_burst_share of it, the smallest one at
    # the highest priority; how long the load runs, and from when each show's share of the
    # booked cores, averaged over fs_window, must stay within fs_tolerance (absolute) of its
    # share of the sizes, s
    fs_hosts: int = 100
    fs_jobs_per_show: int = 4
    fs_frames_per_layer: int = 2000
    fs_runtime_min: float = 1.0
    fs_runtime_max: float = 3.0
    fs_burst_share: float = 0.7
    fs_seconds: float = 20.0
    fs_converge_by: float = 6.0
    fs_tolerance: float = 0.1
    fs_window: float = 1.0
    # stall (issue 27, row 7): frames per layer of its farm (four shows, two managed), how long
    # the other shows' booking rate is measured before and during the hold, s, and the least
    # ratio of the two that passes
    stall_frames_per_layer: int = 60
    stall_window: float = 5.0
    stall_min_ratio: float = 0.5
    # slow_listener (issue 27, row 2): the listener path's steady delay and its heartbeat deadline
    # (the delay plus a heartbeat interval stays inside it), and how long the load runs after the
    # lowering, s
    sl_delay: float = 2.5
    sl_deadline: float = 4.5
    sl_after: float = 6.0
    # memory_mix (issue 28): hosts and jobs of its memory-heavy mixed farm (2 layers a job, one of
    # them threadable, some asking a GPU), frames per layer; runtimes are runtime_min-max
    mm_hosts: int = 120
    mm_jobs: int = 60
    mm_frames_per_layer: int = 10
    # drain on real frames: `simulated` (default), or `rqd` - the drain farm's first
    # `rqd_daemons` hosts are real OpenCue RQD daemons (one per host, on this machine), its
    # layers run `true`, and the rqd launcher and the gateway carry every frame
    launcher: str = "simulated"
    rqd_daemons: int = 4

    def drain_spec(self) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_{PHASE_LETTERS['drain']}",
            seed=self.seed,
            hosts=self.hosts,
            jobs=self.jobs,
            layers=self.layers,
            frames_per_layer=self.frames_per_layer,
        )

    def saturation_spec(self) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_{PHASE_LETTERS['saturation']}",
            seed=self.seed,
            hosts=self.sat_hosts,
            jobs=self.sat_jobs,
            layers=self.sat_layers,
            frames_per_layer=self.sat_frames_per_layer,
            manual_tags=4,
            host_cores_choices=(8, 16, 32),
            host_mem_gb_choices=(32, 64),
            layer_cores_choices=(2, 4),
            layer_mem_gb_choices=(2, 4),
            sub_burst=self.sat_burst * 100,
            job_max_cores=self.sat_job_max_cores * 100,
        )

    def perturbation_spec(self, phase: str) -> FarmSpec:
        return FarmSpec(
            prefix=f"{self.prefix}_{PHASE_LETTERS[phase]}",
            seed=self.seed,
            hosts=self.pert_hosts,
            jobs=self.pert_jobs,
            layers=self.pert_layers,
            frames_per_layer=self.pert_frames_per_layer,
            manual_tags=4,
            host_cores_choices=(8, 16, 32),
            host_mem_gb_choices=(32, 64),
            layer_cores_choices=(1, 2, 4),
            layer_mem_gb_choices=(1, 2),
            sub_burst=self.pert_burst * 100,
            folder_max_cores=self.pert_folder_max_cores * 100,
            job_max_cores=self.pert_job_max_cores * 100,
            managed=phase != "flip",
        )

    def integrity_spec(self, phase: str, **shape: Any) -> FarmSpec:
        """The perturbation farm for an integrity phase; `shape` overrides FarmSpec fields (shows...)."""
        base = replace(
            self.perturbation_spec(phase),
            prefix=f"{self.prefix}_{PHASE_LETTERS[phase]}",
            frames_per_layer=self.int_frames_per_layer,
            managed=True,
        )
        return replace(base, **shape)

    def memory_mix_spec(self) -> FarmSpec:
        """Memory runs out before cores on most hosts: 16-256 GB hosts, 2-48 GB frames, a quarter of
        the layers asking a GPU (the phase makes its GPU hosts); one managed show, one not."""
        return FarmSpec(
            prefix=f"{self.prefix}_{PHASE_LETTERS['memory_mix']}",
            seed=self.seed,
            shows=2,
            managed_shows=1,
            allocs=1,
            hosts=self.mm_hosts,
            jobs=self.mm_jobs,
            layers=2,
            frames_per_layer=self.mm_frames_per_layer,
            manual_tags=0,
            host_cores_choices=(8, 16, 32),
            host_mem_gb_choices=(16, 64, 256),
            layer_cores_choices=(1, 2, 4),
            layer_mem_gb_choices=(2, 8, 24, 48),
            layer_gpus_choices=(0, 0, 0, 1),
            sub_burst=100_000 * 100,
            job_max_cores=16 * 100,
        )

    def frames(self, spec: FarmSpec) -> int:
        return spec.jobs * spec.layers * spec.frames_per_layer


def small(cfg: StressConfig | None = None, **overrides: Any) -> StressConfig:
    """The configuration the test suite runs: every phase, a few hundred frames each."""
    base = cfg or StressConfig()
    sizes: dict[str, Any] = {
        "hosts": 60,
        "jobs": 20,
        "layers": 2,
        "frames_per_layer": 5,
        "sat_hosts": 40,
        "sat_jobs": 20,
        "sat_layers": 2,
        "sat_frames_per_layer": 5,
        "sat_burst": 30,
        "sat_job_max_cores": 8,
        "sat_seconds": 1.5,
        "pert_hosts": 40,
        "pert_jobs": 20,
        "pert_layers": 2,
        "pert_frames_per_layer": 5,
        "pert_burst": 40,
        "pert_folder_max_cores": 90,
        "pert_job_max_cores": 8,
        "phase_timeout": 60.0,
        "int_frames_per_layer": 10,
        "ow_ops": 240,
        "ow_writers": 3,
        "om_ops": 200,
        "om_writers": 2,
        "lw_hosts": 10,
        "lw_frames_per_layer": 8,
        "lw_deadline": 1.5,
        "lw_freeze": 3.0,
        "fr_trips": 4,
        "fr_ttl": 2.0,
        "fs_hosts": 8,
        "fs_jobs_per_show": 2,
        "fs_frames_per_layer": 400,
        "fs_runtime_min": 0.3,
        "fs_runtime_max": 1.0,
        "fs_seconds": 6.0,
        "fs_converge_by": 3.0,
        "stall_frames_per_layer": 25,
        "stall_window": 2.0,
        "stall_min_ratio": 0.2,
        "sl_delay": 1.0,
        "sl_deadline": 2.5,
        "sl_after": 2.5,
        "mm_hosts": 16,
        "mm_jobs": 12,
        "mm_frames_per_layer": 6,
    }
    sizes.update(overrides)
    return replace(base, **sizes)
