"""Phase `listener_wedge` (issue 16): the listener's path frozen while caps drop."""

from __future__ import annotations

import time
from collections.abc import Callable

from accounting import db
from dispatch.lab.netfreeze import FreezableProxy
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import LOWER_JOB_SQL, Run, int_launcher, run_inprocess
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import CapWatchdog, recent_caps_lookup

# Each subscription (folder) of the farm's shows lowered to half of what it holds now, whole
# cores, at least `floor` centicores.
HALVE_SUB_SQL = """
UPDATE subscription s SET int_burst = GREATEST(%(floor)s, COALESCE(u.cc, 0) / 200 * 100)
FROM (
  SELECT s2.pk_subscription,
         (SELECT SUM(p.int_cores_reserved) FROM proc p JOIN host h ON h.pk_host = p.pk_host
          WHERE p.pk_show = s2.pk_show AND h.pk_alloc = s2.pk_alloc AND NOT p.b_local) AS cc
  FROM subscription s2 WHERE s2.pk_show = ANY(%(shows)s)
) u
WHERE s.pk_subscription = u.pk_subscription
RETURNING s.pk_show || ':' || s.pk_alloc
"""
HALVE_FOLDER_SQL = """
UPDATE folder_resource fr SET int_max_cores = GREATEST(%(floor)s, COALESCE(u.cc, 0) / 200 * 100)
FROM (
  SELECT f.pk_folder,
         (SELECT SUM(p.int_cores_reserved) FROM proc p JOIN job j ON j.pk_job = p.pk_job
          WHERE j.pk_folder = f.pk_folder AND NOT p.b_local) AS cc
  FROM folder f WHERE f.pk_folder = ANY(%(folders)s)
) u
WHERE fr.pk_folder = u.pk_folder
RETURNING fr.pk_folder
"""


def phase_listener_wedge(cfg: StressConfig) -> PhaseReport:
    """Issue 16: the listener's path frozen while caps are lowered; the heartbeat deadline bounds it.

    The listener connects through a relay this phase freezes (dispatch.lab.netfreeze); the
    heartbeat sender, the dispatch loop and the cap writer go direct. So heartbeats are sent
    but none come back: within the deadline the service must stop booking managed shows
    (`can_enforce` False), and after the thaw reconnect, reseed (the lowered caps with it) and
    book again. A booking decided over a lowered cap later than the lowering commit plus the
    deadline plus 1 s is a breach, whatever the listener had applied.

    Its farm's caps leave room (the hosts bind): a frozen listener delivers no release either,
    so a Store at its caps could not book anything over a lowered cap, and the bound would hold
    trivially. Here the loop goes on booking the hosts its own completions free, the caps are
    lowered to half of what each key holds, and every booking until the pause is over them.
    """
    proxy = FreezableProxy().start()
    figures: dict[str, float] = {}
    lowered: list[tuple[str, str]] = []
    watchdogs: dict[int, CapWatchdog] = {}
    slack = 1.0

    def perturb(run: Run) -> None:
        service, listener = run.service, run.service.listener
        lookup = recent_caps_lookup(service)

        def applied_at(vertex: str, key: str, since: float) -> float | None:
            seen = lookup(vertex, key, since)
            if "lowered" not in figures:
                return seen
            bound = figures["lowered"] + listener.deadline + slack
            return bound if seen is None else min(seen, bound)

        run.watchdog.applied_at = applied_at
        watchdogs[0] = run.watchdog
        if not run.under_load(30):
            return
        if not run.wait_for("the listener to be fresh through the relay", service.can_enforce, 10):
            return
        wedges, reconnects = listener.stats.wedges, listener.stats.reconnects
        frozen = time.monotonic()
        figures["freeze"] = time.time()
        proxy.freeze()
        run.stop_loop.wait(min(0.5, listener.deadline / 4))  # a moment into the freeze
        lower_farm_caps(run, lowered)
        figures["lowered"] = time.time()
        if run.wait_for("the service to stop enforcing", lambda: not service.can_enforce(), listener.deadline + 5):
            figures["paused"] = time.time()
        run.stop_loop.wait(max(0.0, cfg.lw_freeze - (time.monotonic() - frozen)))
        proxy.thaw()
        figures["thaw"] = time.time()
        if run.wait_for("the listener to be fresh again after the thaw", service.can_enforce, 30):
            figures["resumed"] = time.time()
        figures["wedges"] = listener.stats.wedges - wedges
        figures["reconnects"] = listener.stats.reconnects - reconnects

    report = run_behind_relay(cfg, "listener_wedge", proxy, perturb, cfg.lw_deadline)
    dog = watchdogs.get(0)
    last = dog.last_over_lowered if dog is not None else {}
    if not lowered:
        report.failed.append("no cap was lowered")
        return report
    if "paused" in figures:
        report.notes.append(
            f"listener path frozen -> service stopped enforcing: {figures['paused'] - figures['freeze']:.3f}s "
            f"(heartbeat deadline {cfg.lw_deadline:.1f}s)"
        )
    report.notes.append(
        f"caps lowered {figures['lowered'] - figures['freeze']:.3f}s into the freeze: {len(lowered)} "
        f"(subscriptions and folders to half their use, a quarter of the jobs to 4 cores); "
        f"frozen {figures.get('thaw', 0.0) - figures['freeze']:.2f}s"
    )
    over = [t for key, t in last.items() if key in set(lowered)]
    if over:
        report.notes.append(
            f"cap lowering commit -> last booking decided on a key over its lowered cap: "
            f"{max(over) - figures['lowered']:+.3f}s (breach past {cfg.lw_deadline + slack:.1f}s)"
        )
    else:
        report.notes.append("no booking was decided on a key over its lowered cap")
    if "resumed" in figures:
        report.notes.append(
            f"thaw -> enforcing again (reconnected, reseeded): {figures['resumed'] - figures['thaw']:.3f}s; "
            f"wedges detected {int(figures.get('wedges', 0))}, reconnects {int(figures.get('reconnects', 0))}"
        )
    if not figures.get("wedges"):
        report.failed.append("the listener never noticed its frozen path")
    return report


def lower_farm_caps(run: Run, lowered: list[tuple[str, str]]) -> None:
    """Under load, in one committed transaction: every subscription and folder of the phase's farm
    lowered to half of what it holds, a quarter of its jobs to 4 cores; the keys go to `lowered`
    and the watchdog is told (its breach rule for lowered caps)."""
    seed = run.seed
    jobs = list(seed.job_ids[::4])
    keys = [("sub", f"{s}:{a}") for s in seed.show_ids for a in seed.alloc_ids]
    keys += [("folder", f) for f in seed.folder_ids] + [("job", j) for j in jobs]
    params = {"shows": list(seed.show_ids), "folders": list(seed.folder_ids), "floor": 800}
    with run.watchdog.lowering(keys), db.connect(autocommit=False, application_name="cuesched-stress") as conn:
        lowered.extend(("sub", k) for (k,) in conn.execute(HALVE_SUB_SQL, params))
        lowered.extend(("folder", k) for (k,) in conn.execute(HALVE_FOLDER_SQL, params))
        # The largest frame's cores: a cap below it would leave that job's frames unbookable.
        lowered.extend(("job", k) for (k,) in conn.execute(LOWER_JOB_SQL, (400, jobs)))
        conn.commit()


def run_behind_relay(
    cfg: StressConfig, phase: str, proxy: FreezableProxy, perturb: Callable[[Run], None], deadline: float
) -> PhaseReport:
    """The phase on its farm (the hosts bind, not the caps), its listener connected through
    `proxy` and the heartbeat deadline at `deadline`; the relay is closed whatever happens."""
    try:
        return run_inprocess(
            cfg,
            phase,
            cfg.integrity_spec(
                phase,
                hosts=cfg.lw_hosts,
                frames_per_layer=cfg.lw_frames_per_layer,
                sub_burst=1_000_000,
                folder_max_cores=-1,
                job_max_cores=10_000,
            ),
            launcher=int_launcher(cfg),
            perturb=perturb,
            loop_env={"CUESCHED_HEARTBEAT_DEADLINE": str(deadline)},
            listener_connect=lambda: proxy.connect(application_name="cuesched-listener"),
        )
    finally:
        proxy.close()
