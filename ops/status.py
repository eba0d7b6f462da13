"""What the console says about the scheduler: is it up, has it applied a cap, has it taken a show.

Everything here reads the scheduler's published live view (`accounting.live`) and compares
it with the database; nothing here talks to the scheduler process itself. The wording is
the operator's: each status carries a short sentence that can be shown as is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.db import connection

from accounting import live
from accounting.models import AccountingSettings
from accounting.units import centicores_to_cores, centicores_to_cores_cap
from cuesched_project import conf


def read_view() -> dict[str, Any] | None:
    """The scheduler's live view, or None when no scheduler has ever published one."""
    with connection.cursor() as cur:
        return live.read_view(cur)


_UNREAD = object()


def view_for(request: Any) -> dict[str, Any] | None:
    """The live view, read once per request (a large farm's view is a big JSON document)."""
    cached = getattr(request, "_ops_live_view", _UNREAD)
    if cached is _UNREAD:
        cached = read_view()
        if request is not None:
            request._ops_live_view = cached
    return cached  # type: ignore[return-value]


def notifications_on() -> bool:
    return AccountingSettings.notifications_enabled()


@dataclass(frozen=True)
class SchedulerStatus:
    state: str  # "running", "stale", "absent"
    message: str
    age_seconds: float | None = None
    heartbeat: str | None = None
    pid: int | None = None
    hostname: str | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"


def scheduler_status(view: dict[str, Any] | None) -> SchedulerStatus:
    if view is None:
        return SchedulerStatus(
            "absent",
            "No scheduler has published a live view: it is not running (start `manage.py run_scheduler`). "
            "Store figures are missing; database figures are current.",
        )
    age = float(view["age_seconds"])
    common = {"age_seconds": age, "heartbeat": view.get("heartbeat"), "pid": view.get("pid")}
    common["hostname"] = view.get("hostname")
    if view.get("stale"):
        return SchedulerStatus(
            "stale",
            f"The scheduler's live view is {_ago(age)} old (it publishes every second): the scheduler "
            f"(pid {view.get('pid')} on {view.get('hostname')}) is stopped, hung or cut off from the database. "
            "Store figures below are as of then.",
            **common,
        )
    return SchedulerStatus("running", f"Scheduler pid {view.get('pid')} on {view.get('hostname')}", **common)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def ago(unix_time: float | None) -> str:
    return "never" if unix_time is None else f"{_ago(time.time() - unix_time)} ago"


# --- has the scheduler applied a cap? ---------------------------------------------------

# (vertex, database column) -> (field in the live view, conversion to the Store's units)
CAP_FIELDS = {
    ("sub", "int_burst"): ("burst", centicores_to_cores),
    ("folder", "int_max_cores"): ("max_cores", centicores_to_cores_cap),
    ("folder", "int_max_gpus"): ("max_gpus", int),
    ("job", "int_max_cores"): ("max_cores", centicores_to_cores_cap),
    ("job", "int_max_gpus"): ("max_gpus", int),
}


@dataclass(frozen=True)
class CapStatus:
    state: str  # "applied", "pending", "database", "absent", "not-enforced", "finished"
    message: str
    at: float | None = None
    short: str = ""


def cap_status(
    view: dict[str, Any] | None,
    *,
    vertex: str,
    key: str,
    column: str,
    db_value: int,
    show_id: str,
    show_managed: bool,
    finished: bool = False,
) -> CapStatus:
    """Whether the running scheduler enforces the cap the database holds now, and since when.

    `finished`: the row's job is FINISHED. The Store drops a finished job's caps (it books
    nothing more), so "not in the Store" is the expected state there, not a cap still pending.
    """
    if (vertex, column) not in CAP_FIELDS:
        return CapStatus("not-enforced", "Not a cap the scheduler enforces (subscription size is informational).")
    if not show_managed:
        return CapStatus(
            "database",
            "Database-enforced show: in force from the commit (every booking's trigger reads it).",
            short="in force (database)",
        )
    status = scheduler_status(view)
    if view is None or not status.running:
        return CapStatus(
            "absent",
            "The scheduler is not running: it reads this cap when it starts (bootstrap).",
            short="no scheduler",
        )
    field, convert = CAP_FIELDS[(vertex, column)]
    expected = convert(db_value)
    if show_id not in (view.get("managed_shows") or {}):
        return CapStatus(
            "pending",
            "The scheduler has not published this show as managed yet; it seeds the caps before it does.",
            short="show not published yet",
        )
    entry = (view.get(vertex) or {}).get(key)
    if finished and (entry is None or entry.get(field) is None):
        return CapStatus(
            "finished",
            "The job is FINISHED: it books nothing more, so the scheduler holds no cap for it. A retry reopens "
            "the job and the scheduler loads this value before it books.",
            short="job finished",
        )
    if entry is None or entry.get(field) is None:
        return CapStatus(
            "pending", "Not in the scheduler's Store yet (seeded with the next limit reseed).", short="not in Store"
        )
    have = entry[field]
    if have != expected:
        return CapStatus(
            "pending",
            f"Not applied yet: the scheduler enforces {have}, the database says {expected}. The listener applies it "
            "within a second; with notifications off, the limit reseed does (every ~5 min).",
            short=f"Store still {have}",
        )
    at = None
    for rec_vertex, rec_key, rec_field, rec_value, rec_at in reversed(view.get("recent_caps") or []):
        if (rec_vertex, rec_key, rec_field) == (vertex, key, field):
            at = rec_at if rec_value == expected else None
            break
    if at is None:
        return CapStatus(
            "applied",
            f"Applied: the scheduler enforces {expected} (from its seed or limit reseed).",
            short=f"enforces {expected}",
        )
    return CapStatus(
        "applied", f"Applied by the scheduler {ago(at)}: it enforces {expected}.", at=at, short=f"applied {ago(at)}"
    )


@dataclass(frozen=True)
class FlipStatus:
    state: str  # "published", "pending", "dropped", "database", "absent"
    message: str
    at: float | None = None


def flip_status(view: dict[str, Any] | None, show_id: str, managed_in_db: bool) -> FlipStatus:
    """Where a show's accounting is enforced right now, as the scheduler reports it."""
    published = (view or {}).get("managed_shows") or {}
    status = scheduler_status(view)
    ttl = conf.managed_shows_ttl()
    if managed_in_db:
        if not status.running:
            return FlipStatus(
                "absent",
                "Managed in the database, but no scheduler is running: nothing books this show until one starts "
                "(it seeds the show at bootstrap).",
            )
        if show_id in published:
            at = published[show_id]
            when = ago(at) if at is not None else "at its bootstrap"
            return FlipStatus("published", f"The scheduler published this show as managed {when}.", at=at)
        return FlipStatus(
            "pending",
            f"Not yet published as managed: the scheduler seeds caps and counters first (within ~{ttl:.0f} s); "
            "until then it books nothing for this show.",
        )
    if status.running and show_id in published:
        return FlipStatus(
            "dropped",
            f"Database-enforced from the commit; the scheduler still lists it and drops it within ~{ttl:.0f} s "
            "(the database triggers already check its bookings).",
        )
    return FlipStatus("database", "Database-enforced: the triggers keep and check its counters on every booking.")
