"""URL routes: the Django admin is the ops console; /api/ is the JSON API (dispatch.jobs.api)."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include("dispatch.jobs.urls")),
]
