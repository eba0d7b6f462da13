"""How old is what a console page shows, and is the scheduler behind it still running?

A page must never look live when it is not: the ages here are the server's at render time, and
the page's script (templates/ops/_refresh.html) keeps ageing them in the browser, so a page whose
web server went away shows its heartbeat growing old instead of a frozen "0.7 s ago". When the
scheduler itself stopped, the listener and recompute cards say so (their figures are the last
view's) instead of staying green.
"""

from __future__ import annotations

import time
from typing import Any

from accounting import live
from ops import procs


def scheduler_ages(view: dict[str, Any] | None) -> dict[str, Any]:
    """Ages for the scheduler cards and the thresholds past which the browser marks them late."""
    recompute = (view or {}).get("recompute") or {}
    loops = (view or {}).get("loops") or {}
    interval = float((loops.get("recompute") or {}).get("interval") or 15.0)
    at = recompute.get("at")
    return {
        "sched_stale_after": live.STALE_AFTER_SECONDS,
        "recompute_age": None if at is None else max(0.0, time.time() - float(at)),
        # Three missed recomputes (at least 30 s): the card turns red in the browser.
        "recompute_late_after": max(30.0, 3 * interval),
        "stuck_procs": procs.stuck_count(),
        "stuck_after_label": procs.stuck_label(),
    }
