"""Phase `slow_listener` (issue 27, row 2): the listener's path slow, not frozen, while caps drop."""

from __future__ import annotations

import time

from accounting import db
from dispatch.lab.netfreeze import FreezableProxy
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import LOWER_JOB_SQL, Run, int_launcher, run_inprocess
from dispatch.lab.stress.listener_wedge import HALVE_FOLDER_SQL, HALVE_SUB_SQL
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import CapWatchdog


def phase_slow_listener(cfg: StressConfig) -> PhaseReport:
    """Issue 27 row 2: the listener's path slow, not frozen, while caps are lowered under load.

    The listener connects through a relay that holds every byte `sl_delay` seconds (within the
    heartbeat deadline: the listener stays fresh and the Store keeps enforcing, on caps it hears
    of that much late). Subscriptions and folders are lowered to half of what they hold and a
    quarter of the jobs to 4 cores while the loop books. The breach rule is strict here: a key
    over its lowered cap is a breach for any booking decided after the lowering committed,
    whenever the Store applied it; the booking transaction's generation check must refuse them
    all until the Store has the lowering.
    """
    proxy = FreezableProxy().start()
    figures: dict[str, float] = {}
    lowered: list[tuple[str, str]] = []
    watchdogs: dict[int, CapWatchdog] = {}

    def perturb(run: Run) -> None:
        service, listener = run.service, run.service.listener

        def applied_at(vertex: str, key: str, since: float) -> float | None:
            return figures.get("lowered")  # strict: nothing decided after the commit may be over

        run.watchdog.applied_at = applied_at
        watchdogs[0] = run.watchdog
        if not run.under_load(30):
            return
        proxy.delay = cfg.sl_delay
        figures["slowed"] = time.time()
        # The held heartbeats arrive: fresh again behind the slow path, still booking.
        run.stop_loop.wait(cfg.sl_delay + 0.5)
        if not run.wait_for("the listener fresh behind the slow relay", service.can_enforce, cfg.sl_deadline + 5):
            return
        wedges = listener.stats.wedges
        rejected = run.loop.totals.rejected["generation"]
        seed = run.seed
        jobs = list(seed.job_ids[::4])
        keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
        keys += [("folder", f) for f in seed.folder_ids] + [("job", j) for j in jobs]
        params = {"shows": list(seed.show_ids), "folders": list(seed.folder_ids), "floor": 800}
        with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
            lowered.extend(("sub", k) for (k,) in conn.execute(HALVE_SUB_SQL, params))
            lowered.extend(("folder", k) for (k,) in conn.execute(HALVE_FOLDER_SQL, params))
            lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
            conn.commit()
        figures["lowered"] = time.time()
        run.stop_loop.wait(cfg.sl_after)
        figures["enforcing"] = float(service.can_enforce())
        figures["wedges"] = listener.stats.wedges - wedges
        figures["generation_rejected"] = run.loop.totals.rejected["generation"] - rejected
        figures["skipped_behind"] = run.loop.totals.skipped_behind
        proxy.delay = 0.0

    try:
        report = run_inprocess(
            cfg,
            "slow_listener",
            cfg.integrity_spec(
                "slow_listener",
                hosts=cfg.lw_hosts,
                frames_per_layer=cfg.lw_frames_per_layer,
                sub_burst=1_000_000,
                folder_max_cores=-1,
                job_max_cores=10_000,
            ),
            launcher=int_launcher(cfg),
            perturb=perturb,
            loop_env={"CUESCHED_HEARTBEAT_DEADLINE": str(cfg.sl_deadline)},
            listener_connect=lambda: proxy.connect(application_name="cuesched-listener"),
        )
    finally:
        proxy.close()
    if not lowered:
        report.failed.append("no cap was lowered")
        return report
    dog = watchdogs.get(0)
    last = dog.last_over_lowered if dog is not None else {}
    report.notes.append(
        f"listener delayed {cfg.sl_delay:.1f}s (deadline {cfg.sl_deadline:.1f}s); {len(lowered)} caps lowered "
        f"under load; {int(figures.get('generation_rejected', 0))} bookings refused on a moved generation, "
        f"{int(figures.get('skipped_behind', 0))} job visits skipped while the Store was behind"
    )
    over = [t for key, t in last.items() if key in set(lowered)]
    if over:
        report.notes.append(
            f"cap lowering commit -> last booking decided on a key over its lowered cap: "
            f"{max(over) - figures['lowered']:+.3f}s (breach if positive)"
        )
    else:
        report.notes.append("no booking was decided on a key over its lowered cap")
    if figures.get("wedges"):
        report.failed.append("the slow listener was declared wedged: the phase did not test a fresh one")
    return report
