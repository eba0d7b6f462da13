"""Phase `slow_listener` (issue 27, row 2): the listener's path slow, not frozen, while caps drop."""

from __future__ import annotations

import time

from dispatch.lab.netfreeze import FreezableProxy
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run
from dispatch.lab.stress.listener_wedge import lower_farm_caps, run_behind_relay
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
        lower_farm_caps(run, lowered)
        figures["lowered"] = time.time()
        run.stop_loop.wait(cfg.sl_after)
        figures["enforcing"] = float(service.can_enforce())
        figures["wedges"] = listener.stats.wedges - wedges
        figures["generation_rejected"] = run.loop.totals.rejected["generation"] - rejected
        figures["skipped_behind"] = run.loop.totals.skipped_behind
        proxy.delay = 0.0

    report = run_behind_relay(cfg, "slow_listener", proxy, perturb, cfg.sl_deadline)
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
