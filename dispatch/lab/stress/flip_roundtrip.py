"""Phase `flip_roundtrip` (issue 16): a managed show flipped out and back faster than the managed-shows tick."""

from __future__ import annotations

import random
import statistics
import time

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, int_launcher, reconcile, run_inprocess
from dispatch.lab.stress.report import PhaseReport

FLIP_SQL = "UPDATE show SET b_scheduler_managed = %s WHERE pk_show = %s"


def phase_flip_roundtrip(cfg: StressConfig) -> PhaseReport:
    """Issue 16: a managed show with live procs flipped out and back, faster than the managed-shows tick.

    The tick (CUESCHED_MANAGED_SHOWS_TTL) is longer than a round trip, so the published set
    looks the same before and after; only the flip generation (checked by the booking
    transaction, and by the recompute before it overwrites) can tell the Store its counters
    and caps of that show are stale. Each trip must end with the show seeded again at its new
    generation before it books as managed.
    """
    trips: list[tuple[int, float, float]] = []
    invisible = [0]  # trips the published set never showed: the show stayed published throughout

    def perturb(run: Run) -> None:
        show = run.seed.show_ids[0]
        rng = random.Random(f"{cfg.seed}/flip_roundtrip")
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            for trip_no in range(cfg.fr_trips):
                if not run.under_load(10) or not run.loop_alive():
                    break
                procs = run.procs()
                started = time.monotonic()
                conn.execute(FLIP_SQL, (False, show))
                # Out for a moment (the database's). Even trips stay out longer than a recompute
                # interval (a recompute reads the show unmanaged and would zero its counters),
                # odd ones shorter (often no recompute sees it: only the generation tells).
                if trip_no % 2 == 0:
                    out = rng.uniform(max(0.1, cfg.fr_recompute), max(0.3, 2 * cfg.fr_recompute))
                else:
                    out = rng.uniform(0.01, cfg.fr_recompute / 2)
                out_until = started + out
                published = True
                while time.monotonic() < out_until:
                    published = published and run.service.is_managed(show)
                    time.sleep(0.002)
                conn.execute(FLIP_SQL, (True, show))
                trip = time.monotonic() - started
                invisible[0] += published and run.service.is_managed(show)
                row = conn.execute(
                    "SELECT int_generation FROM cuesched_show_flip WHERE pk_show = %s", (show,)
                ).fetchone()
                generation = int(row[0]) if row else None
                if not run.wait_for(
                    "the show seeded again at its new generation",
                    lambda g=generation: run.service.managed_generation(show) == g,
                    cfg.fr_ttl + 10,
                ):
                    break
                trips.append((procs, trip, time.monotonic() - started))
                run.stop_loop.wait(rng.uniform(0.2, 0.6))  # books as managed again for a while

    report = run_inprocess(
        cfg,
        "flip_roundtrip",
        cfg.integrity_spec("flip_roundtrip"),
        launcher=int_launcher(cfg),
        perturb=perturb,
        heal=reconcile,
        loop_env={"CUESCHED_MANAGED_SHOWS_TTL": str(cfg.fr_ttl), "CUESCHED_RECOMPUTE_INTERVAL": str(cfg.fr_recompute)},
    )
    if trips:
        report.notes.append(
            f"round trips: {len(trips)} (managed-shows tick {cfg.fr_ttl:.1f}s), procs running at each "
            f"{min(t[0] for t in trips)}-{max(t[0] for t in trips)}, out and back in "
            f"{max(t[1] for t in trips):.3f}s at most, seeded again at the new generation after "
            f"{statistics.median(t[2] for t in trips):.3f}s median, {max(t[2] for t in trips):.3f}s max; "
            f"{invisible[0]} of them never left the published set (only the flip generation told)"
        )
    if len(trips) < min(2, cfg.fr_trips):
        report.failed.append(f"only {len(trips)} round trips under load")
    if any(t[1] >= cfg.fr_ttl for t in trips):
        report.failed.append("a round trip took longer than the managed-shows tick")
    return report
