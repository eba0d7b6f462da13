"""Phase `flip`: an unmanaged show flipped to managed with procs running."""

from __future__ import annotations

import time

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, reconcile, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport


def phase_flip(cfg: StressConfig) -> PhaseReport:
    flipped: dict[str, float] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(30):
            return
        show = run.seed.show_ids[0]
        flipped["procs"] = run.procs()
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (show,))
        started = time.monotonic()
        if run.wait_for("the flipped show to be published as managed", lambda: run.service.is_managed(show), 30):
            flipped["seconds"] = time.monotonic() - started

    report = run_inprocess(
        cfg,
        "flip",
        cfg.perturbation_spec("flip"),
        launcher=sim_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=reconcile,
    )
    report.notes.append(
        f"show flipped to managed with {int(flipped.get('procs', 0))} procs running, "
        f"published after {flipped.get('seconds', float('nan')):.2f}s"
    )
    return report
