"""URL routes: the Django admin is the ops console; /api/ is the JSON API (dispatch.jobs.api)."""

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path, re_path
from django.views import defaults
from django.views.generic import RedirectView

from dispatch.jobs import api

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    re_path(r"^api$", api.not_found),  # not a redirect to /api/: a client gets JSON at once
    path("api/", include("dispatch.jobs.urls")),
]


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500 page, but JSON under /api/ (an error raised outside an API view, DEBUG off)."""
    if request.path == "/api" or request.path.startswith("/api/"):
        return api.error_response(api.ApiError(500, "internal error; the server log has the details"))
    return defaults.server_error(request)


handler500 = server_error
