"""Template tags of the ops console: the banners every admin page carries, the console links."""

from __future__ import annotations

from typing import Any

from django import template
from django.db import DatabaseError

from ops import permissions, status

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
