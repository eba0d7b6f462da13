"""Phase `saturation`: the caps, not the hosts, stop the bookings; they must stop exactly there."""

from __future__ import annotations

from accounting import db
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.stress.audit import BOOKED_BY_KEY_SQL
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess
from dispatch.lab.stress.report import PhaseReport


def phase_saturation(cfg: StressConfig) -> PhaseReport:
    spec = cfg.saturation_spec()
    burst = spec.sub_burst
    per_sub: dict[str, int] = {}

    def at_the_caps(run: Run) -> None:
        # Read before the audit: what the caps let in, per subscription (centicores).
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            rows = conn.execute(BOOKED_BY_KEY_SQL, {"shows": list(run.seed.show_ids)}).fetchall()
        per_sub.update({k: int(c) for v, k, c, _g in rows if v == "sub"})

    # Frames never finish: the caps, not completions, decide what runs.
    launcher = SimulatedLauncher(
        runtime_min=3600, runtime_max=3600, failure_rate=0.0, launch_failure_rate=0.0, seed=cfg.seed
    )
    report = run_inprocess(cfg, "saturation", spec, launcher=launcher, duration=cfg.sat_seconds, heal=at_the_caps)
    report.notes.append(
        "booked/burst per subscription (cores): "
        + ", ".join(f"{c // 100}/{burst // 100}" for c in sorted(per_sub.values(), reverse=True))
    )
    total = sum(per_sub.values())
    if total < 0.5 * burst * spec.allocs:
        report.failed.append(f"saturation booked {total // 100} cores, under half the total burst")
    # Exactly at the caps: no subscription keeps room for the smallest frame.
    smallest = min(spec.layer_cores_choices) * 100
    loose = {k: c for k, c in per_sub.items() if burst - c >= smallest}
    if len(per_sub) < spec.allocs or loose:
        report.failed.append(f"subscriptions not stopped at their burst: {loose or 'some booked nothing'}")
    return report
