"""Phase `drops`: the listener drops 30% of the release notifications under load; the recompute heals."""

from __future__ import annotations

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport


def phase_drops(cfg: StressConfig) -> PhaseReport:
    drops: dict[str, int] = {}

    def perturb(run: Run) -> None:
        run.service.listener.drop_release_ratio = 0.3
        run.wait_for("the load to end", lambda: not run.loop_alive(), cfg.phase_timeout)

    def heal(run: Run) -> None:
        listener = run.service.listener
        listener.drop_release_ratio = 0.0
        drops["dropped"] = listener.stats.injected_drops
        # The backstop heals what was dropped (it also ran every second during the phase).
        with db.connect(application_name="cuesched-stress-recompute") as conn:
            run.service.recomputer.run_once(conn)

    report = run_inprocess(
        cfg,
        "drops",
        cfg.perturbation_spec("drops"),
        launcher=sim_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=heal,
        loop_env={"CUESCHED_RECOMPUTE_INTERVAL": "1"},
    )
    report.notes.append(f"acct_release messages dropped by the listener: {drops.get('dropped', 0)} (30% injected)")
    if not drops.get("dropped"):
        report.failed.append("no release was dropped")
    return report
