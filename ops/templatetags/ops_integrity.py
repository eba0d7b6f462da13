"""The integrity banner every console page carries: booking stopped over trigger problems, open alarms.

Kept apart from the other banners (ops_console.ops_banners) so that it stays one small,
self-contained piece: it reads the scheduler's published view (`trigger_health`, what its
continuous trigger check found) and the open rows of `cuesched_integrity_alarm`, nothing else.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.db import DatabaseError, connection

from accounting import integrity
from ops import permissions, status

register = template.Library()


@register.inclusion_tag("ops/_integrity_banner.html", takes_context=True)
def ops_integrity_banner(context: dict[str, Any]) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not permissions.can_view(user):
        return {"show": False}
    try:
        view = status.view_for(request)
        with connection.cursor() as cursor:
            alarms = integrity.open_alarms(cursor)
    except DatabaseError:
        return {"show": False}
    health = (view or {}).get("trigger_health") or {}
    stale = view is None or view.get("stale")
    problems = [] if stale else list(health.get("problems") or [])
    return {
        "show": bool(problems or alarms),
        "problems": problems,
        "recovering": bool(health.get("recovering")),
        "alarms": [{"id": a[0], "raised": a[1], "kind": a[2], "summary": a[3]} for a in alarms],
    }
