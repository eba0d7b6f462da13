"""Phase `fairshare` (issue 19): shares converge to the subscription sizes, whatever the priorities."""

from __future__ import annotations

import statistics
import time

from accounting import db
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSeed, FarmSpec
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess
from dispatch.lab.stress.registry import PHASE_LETTERS
from dispatch.lab.stress.report import PhaseReport

FS_SIZES = (0.5, 0.3, 0.2)
FS_PRIORITIES = (1, 100, 200)
FS_BOOKED_SQL = "SELECT pk_show, SUM(int_cores_reserved) FROM proc WHERE pk_show = ANY(%s) GROUP BY 1"


def phase_fairshare(cfg: StressConfig) -> PhaseReport:
    """Shares converge to the subscription sizes, whatever the priorities, with 0 cap breaches.

    Three shows on one allocation, sized 50/30/20% of the farm, the smallest at the highest
    priority, each allowed to borrow up to fs_burst_share of the farm; the first two are
    managed (ordered by the Store's live counters), the third is not (by the trigger-kept
    ones). Frames run fs_runtime_min-max s, so every core changes hands many times. Sampled
    every 50 ms: from fs_converge_by on, each show's share of the booked cores, averaged over
    the last fs_window seconds, stays within fs_tolerance of its share of the sizes. Shares of
    what is booked, not of the farm: cores between a completion and the next booking are idle
    for every show alike.
    """
    capacity = cfg.fs_hosts * 8 * 100  # centicores
    spec = FarmSpec(
        prefix=f"{cfg.prefix}_{PHASE_LETTERS['fairshare']}",
        seed=cfg.seed,
        shows=len(FS_SIZES),
        managed_shows=2,
        allocs=1,
        hosts=cfg.fs_hosts,
        jobs=cfg.fs_jobs_per_show * len(FS_SIZES),
        layers=1,
        frames_per_layer=cfg.fs_frames_per_layer,
        manual_tags=0,
        host_cores_choices=(8,),
        host_mem_gb_choices=(64,),
        layer_cores_choices=(1,),
        layer_mem_gb_choices=(1,),
        sub_burst=int(capacity * cfg.fs_burst_share),
        job_max_cores=capacity,
    )
    samples: list[tuple[float, dict[str, int]]] = []

    def prepare(seed: FarmSeed) -> None:
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            for i, show in enumerate(seed.show_ids):
                conn.execute(
                    "UPDATE subscription SET int_size = %s WHERE pk_show = %s", (int(capacity * FS_SIZES[i]), show)
                )
                conn.execute(
                    "UPDATE job_resource SET int_priority = %s"
                    " WHERE pk_job IN (SELECT pk_job FROM job WHERE pk_show = %s)",
                    (FS_PRIORITIES[i], show),
                )

    def sample(run: Run) -> None:
        shows = list(run.seed.show_ids)
        started = time.monotonic()
        with db.connect(autocommit=True, application_name="cuesched-stress-fairshare") as conn:
            while run.loop_alive() and time.monotonic() - started < cfg.fs_seconds:
                booked = dict.fromkeys(shows, 0)
                booked.update({s: int(c) for s, c in conn.execute(FS_BOOKED_SQL, (shows,)).fetchall()})
                samples.append((time.monotonic() - started, booked))
                time.sleep(0.05)

    report = run_inprocess(
        cfg,
        "fairshare",
        spec,
        launcher=SimulatedLauncher(
            runtime_min=cfg.fs_runtime_min,
            runtime_max=cfg.fs_runtime_max,
            failure_rate=0.0,
            launch_failure_rate=0.0,
            seed=cfg.seed,
        ),
        perturb=sample,
        duration=0.001,
        prepare=prepare,
        loop_env={"CUESCHED_FAIR_SHARE": "1"},
    )
    report.frames = cfg.frames(spec)
    if not samples:
        report.failed.append("no share was sampled")
        return report
    shows = list(samples[0][1])
    sizes = {s: FS_SIZES[i] for i, s in enumerate(shows)}

    def share(booked: dict[str, int], show: str) -> float:
        total = sum(booked.values())
        return booked[show] / total if total else 0.0

    # Each sample's shares averaged over the fs_window seconds up to it: one frame is a big
    # part of a small farm, and the cores that free up between two cycles go to one show.
    smooth: list[tuple[float, dict[str, float]]] = []
    for t, _b in samples:
        recent = [b for u, b in samples if t - cfg.fs_window < u <= t]
        smooth.append((t, {s: statistics.fmean(share(b, s) for b in recent) for s in shows}))
    late = [(t, sh) for t, sh in smooth if t >= cfg.fs_converge_by]
    late_raw = [(t, b) for t, b in samples if t >= cfg.fs_converge_by]
    worst = {s: max((abs(sh[s] - sizes[s]) for _t, sh in late), default=1.0) for s in shows}
    worst_raw = {s: max((abs(share(b, s) - sizes[s]) for _t, b in late_raw), default=1.0) for s in shows}
    converged_at = None
    for i in range(len(smooth)):
        if all(abs(sh[s] - sizes[s]) <= cfg.fs_tolerance for _t, sh in smooth[i:] for s in shows):
            converged_at = smooth[i][0]
            break
    mean = {s: statistics.fmean(share(b, s) for _t, b in late_raw) if late_raw else 0.0 for s in shows}
    used = statistics.fmean(sum(b.values()) / capacity for _t, b in late_raw) if late_raw else 0.0
    report.notes.append(
        f"fair share: sizes {'/'.join(f'{x:.0%}' for x in FS_SIZES)} of {capacity // 100} cores, priorities "
        f"{'/'.join(map(str, FS_PRIORITIES))}; mean share of the booked cores after {cfg.fs_converge_by:.1f}s "
        + "/".join(f"{mean[s]:.1%}" for s in shows)
        + f"; worst deviation over {cfg.fs_window:.1f}s windows "
        + "/".join(f"{worst[s]:.1%}" for s in shows)
        + ", of one sample "
        + "/".join(f"{worst_raw[s]:.1%}" for s in shows)
        + f"; within {cfg.fs_tolerance:.0%} from {'never' if converged_at is None else f'{converged_at:.2f}s'}"
        + f" ({len(samples)} samples); farm {used:.0%} booked on average"
    )
    if not late:
        report.failed.append(f"the load ended before {cfg.fs_converge_by:.1f}s")
    elif converged_at is None or converged_at > cfg.fs_converge_by:
        report.failed.append(
            f"shares not within {cfg.fs_tolerance:.0%} of the sizes from {cfg.fs_converge_by:.1f}s on: worst "
            + ", ".join(f"show {i} {worst[s]:.1%}" for i, s in enumerate(shows))
        )
    return report
