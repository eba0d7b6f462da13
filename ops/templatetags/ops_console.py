"""Template tags of the ops console: the banners every admin page carries, the console links."""

from __future__ import annotations

from typing import Any

from django import template
from django.db import DatabaseError
from django.utils import timezone

from accounting import blockers
from cuesched_project import conf
from ops import drift, history_charts, permissions, status

register = template.Library()


@register.inclusion_tag("ops/_banners.html", takes_context=True)
def ops_banners(context: dict[str, Any]) -> dict[str, Any]:
    """Kill switch off, scheduler stale or absent: said on every page a console user opens."""
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not permissions.can_view(user):
        return {"show": False}
    try:
        view = status.view_for(request)
        notify_on = status.notifications_on()
    except DatabaseError:
        return {"show": False}
    return {
        "show": True,
        "sched": status.scheduler_status(view),
        "locks": [] if view is None or view.get("stale") else blockers.view_lines(view),
        "notify_on": notify_on,
        "can_set_kill_switch": permissions.can_set_kill_switch(user),
    }


@register.inclusion_tag("ops/_nav.html", takes_context=True)
def ops_nav(context: dict[str, Any]) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    return {"show": user is not None and permissions.can_view(user)}


@register.inclusion_tag("ops/_bar.html")
def ops_bar(row: Any) -> dict[str, Any]:
    return {"row": row}


@register.inclusion_tag("ops/_drift.html")
def ops_drift(drift: int | None) -> dict[str, Any]:
    return {"drift": drift}


CAP_HEADERS = {
    "int burst": "burst (cores)",
    "int size": "size (cores)",
    "int max cores": "max cores (-1 = unlimited)",
    "int max gpus": "max GPUs (-1 = unlimited)",
}


@register.simple_tag
def ops_cap_header(text: str) -> str:
    """Change-list headers of cap columns, which are edited in whole cores (model names are Cuebot's)."""
    text = str(text)
    return CAP_HEADERS.get(text, text[:1].upper() + text[1:])


@register.filter
def drift_flagged(value: int | None) -> bool:
    """Past the drift threshold (ops.drift): only then is a drift painted red."""
    return drift.flagged(value)


@register.filter
def drift_title(value: int | None) -> str:
    return (
        f"counter minus SUM(proc) from one consistent read (managed shows: as the last recompute measured); "
        f"flagged past ±{drift.threshold_cores()} cores"
    )


@register.simple_tag(takes_context=True)
def ops_freshness(context: dict[str, Any]) -> dict[str, Any]:
    """When this page's data was read, and after how long without a fresh answer it is stale.

    A live page refreshes every `refresh_ms`; missing three refreshes (at least 10 s) means
    the browser is showing old figures. A page that does not refresh (a list) is a snapshot:
    it turns stale after `CUESCHED_OPS_SNAPSHOT_STALE_SECONDS`.
    """
    refresh_ms = context.get("refresh_ms")
    if refresh_ms:
        stale_after = max(10.0, 3 * float(refresh_ms) / 1000)
        title = "live page: turns red when no fresh answer arrived for this long"
    else:
        stale_after = snapshot_stale_seconds()
        title = "a snapshot: reload the page for current figures"
    return {"at": timezone.localtime().strftime("%H:%M:%S"), "stale_after": stale_after, "title": title}


def snapshot_stale_seconds() -> float:
    """A page that does not refresh itself (a list) reads as stale after this many seconds."""
    return conf.env_float("CUESCHED_OPS_SNAPSHOT_STALE_SECONDS", 60.0)


@register.inclusion_tag("ops/_history.html", takes_context=True)
def ops_history(context: dict[str, Any], show: str | None = None) -> dict[str, Any]:
    """The history charts (last hour, last day) of the farm, or of one show."""
    windows = history_charts.show_charts(show) if show else history_charts.farm_charts()
    return {"windows": windows, "scope": "show" if show else "farm"}


@register.filter
def duration_s(seconds: float | None) -> str:
    """Seconds as the operator reads them: 42 s, 7 min, 3.5 h."""
    return "—" if seconds is None else status._ago(float(seconds))
