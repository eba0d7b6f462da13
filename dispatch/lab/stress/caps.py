"""Phase `caps`: subscription, folder and job caps lowered under load."""

from __future__ import annotations

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import LOWER_JOB_SQL, Run, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport

LOWER_SUB_SQL = "UPDATE subscription SET int_burst = %s WHERE pk_show = ANY(%s) RETURNING pk_show || ':' || pk_alloc"
LOWER_FOLDER_SQL = "UPDATE folder_resource SET int_max_cores = %s WHERE pk_folder = ANY(%s) RETURNING pk_folder"


def phase_caps(cfg: StressConfig) -> PhaseReport:
    lowered: list[tuple[str, str]] = []

    def perturb(run: Run) -> None:
        if not run.under_load(40):
            return
        seed = run.seed
        sub_keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
        jobs = list(seed.job_ids[::2])
        keys = [*sub_keys, *(("folder", f) for f in seed.folder_ids), *(("job", j) for j in jobs)]
        with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
            burst = max(cfg.pert_burst // 3, 8) * 100
            lowered.extend(("sub", k) for (k,) in conn.execute(LOWER_SUB_SQL, (burst, list(seed.show_ids))))
            folder_cap = max(cfg.pert_folder_max_cores // 3, 8) * 100
            lowered.extend(
                ("folder", k) for (k,) in conn.execute(LOWER_FOLDER_SQL, (folder_cap, list(seed.folder_ids)))
            )
            lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
            conn.commit()

    report = run_inprocess(
        cfg, "caps", cfg.perturbation_spec("caps"), launcher=sim_launcher(cfg, runtime=True), perturb=perturb
    )
    report.notes.append(f"caps lowered under load: {len(lowered)} (subscriptions, folders, half the jobs)")
    if not lowered:
        report.failed.append("no cap was lowered")
    return report
