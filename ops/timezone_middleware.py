"""The viewer's time zone for every console time: the browser tells it in the `ops_tz` cookie
(set by templates/ops/_timezone.html from `Intl.DateTimeFormat`), the server's `TIME_ZONE`
otherwise. An unknown or malformed zone is ignored, never an error page."""

from __future__ import annotations

import zoneinfo
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse
from django.utils import timezone

COOKIE = "ops_tz"


def zone_of(request: HttpRequest) -> zoneinfo.ZoneInfo | None:
    name = request.COOKIES.get(COOKIE, "")
    if not name or len(name) > 64:
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return None


class ViewerTimezoneMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        zone = zone_of(request)
        if zone is None:
            timezone.deactivate()
        else:
            timezone.activate(zone)
        try:
            return self.get_response(request)
        finally:
            timezone.deactivate()
