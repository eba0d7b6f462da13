"""The JSON API's routes, included under /api/ (see dispatch.jobs.api for the contract)."""

from django.urls import path

from dispatch.jobs import api

app_name = "api"

urlpatterns = [
    path("jobs", api.submit, name="jobs"),
    path("jobs/<str:ref>", api.job_detail, name="job"),
    path("jobs/<str:ref>/<str:action>", api.job_action, name="job-action"),
    path("limits", api.limits, name="limits"),
    path("limits/<str:ref>", api.limit_detail, name="limit"),
]
