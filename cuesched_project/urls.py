"""URL routes: the Django admin is the ops console; /api/ is the JSON API (dispatch.jobs.api)."""

from django.contrib import admin
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.http import HttpRequest, HttpResponse
from django.urls import include, path, re_path, reverse
from django.views import defaults
from django.views.generic import RedirectView

from dispatch.jobs import api


def console_login(request: HttpRequest) -> HttpResponse:
    """The admin's login, landing on the farm overview: the admin index (a list of 24 tables)
    is where a login without a destination, or with the index as its destination, used to go."""
    wanted = request.POST.get(REDIRECT_FIELD_NAME) or request.GET.get(REDIRECT_FIELD_NAME)
    extra = {}
    if not wanted or wanted == reverse("admin:index"):
        extra[REDIRECT_FIELD_NAME] = reverse("admin:ops_console_overview")
        if request.method == "POST":
            request.POST = request.POST.copy()
            request.POST[REDIRECT_FIELD_NAME] = extra[REDIRECT_FIELD_NAME]
    return admin.site.login(request, extra_context=extra)


urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/login/", console_login),
    path("admin/", admin.site.urls),
    re_path(r"^api$", api.not_found),  # not a redirect to /api/: a client gets JSON at once
    path("api/", include("ops.services_api")),  # ops.service_actions' routes, before the API's catch-all
    path("api/", include("dispatch.jobs.urls")),
]


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500 page, but JSON under /api/ (an error raised outside an API view, DEBUG off)."""
    if request.path == "/api" or request.path.startswith("/api/"):
        return api.error_response(api.ApiError(500, "internal error; the server log has the details"))
    return defaults.server_error(request)


handler500 = server_error
