"""Phase `listener_kill`: the listener's backend is terminated twice under load; the reseed heals."""

from __future__ import annotations

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport


def phase_listener_kill(cfg: StressConfig) -> PhaseReport:
    kills: list[int] = []

    def perturb(run: Run) -> None:
        listener = run.service.listener
        for i in range(2):
            if not run.under_load(20 * (i + 1)):
                return
            pid, reconnects = listener.backend_pid, listener.stats.reconnects
            with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            kills.append(pid or 0)
            run.wait_for(
                "the listener to reconnect",
                lambda r=reconnects: listener.stats.reconnects > r and listener.connected.is_set(),
                30,
            )

    report = run_inprocess(
        cfg,
        "listener_kill",
        cfg.perturbation_spec("listener_kill"),
        launcher=sim_launcher(cfg, runtime=True),
        perturb=perturb,
    )
    report.notes.append(f"listener backends terminated: {len(kills)}, reconnects healed by the reseed")
    if len(kills) < 2:
        report.failed.append("the listener was not killed twice under load")
    return report
