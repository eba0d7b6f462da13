"""Phase `straddle`: bookings land inside a recompute window held open between its begin and its snapshot."""

from __future__ import annotations

import time
from collections import Counter

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, reconcile, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport


def phase_straddle(cfg: StressConfig) -> PhaseReport:
    stalled = Counter[str]()

    def perturb(run: Run) -> None:
        if not run.under_load():
            return
        recomputer = run.service.recomputer

        def stall() -> None:
            before = run.loop.totals.booked
            deadline = time.monotonic() + 2.0
            # Hold the window open until bookings landed inside it (or 2 s passed).
            while run.loop.totals.booked < before + 10 and time.monotonic() < deadline and run.loop_alive():
                time.sleep(0.005)
            stalled["windows"] += 1
            stalled["bookings"] += run.loop.totals.booked - before

        recomputer.before_snapshot = stall
        try:
            with db.connect(application_name="cuesched-stress-recompute") as conn:
                for _ in range(3):
                    if not run.loop_alive():
                        break
                    recomputer.run_once(conn)
                # A booking confirmed inside the window is both in the snapshot and in the
                # kept bucket: counted twice for one pass (a safe over-count, by design); the
                # next pass, as the recompute loop would run it, reconciles.
                recomputer.before_snapshot = None
                recomputer.run_once(conn)
        finally:
            recomputer.before_snapshot = None

    report = run_inprocess(
        cfg,
        "straddle",
        cfg.perturbation_spec("straddle"),
        launcher=sim_launcher(cfg, runtime=True),
        perturb=perturb,
        heal=reconcile,
    )
    report.notes.append(f"recompute windows stalled: {stalled['windows']}, bookings inside them: {stalled['bookings']}")
    if not stalled["bookings"]:
        report.failed.append("no booking landed inside a stalled recompute window")
    return report
