"""The JSON API's routes, included under /api/ (see dispatch.jobs.api for the contract).

Each route answers with or without its trailing slash (a client should not get an HTML 404 or
a redirect for a slash), and every other path under /api/ is a JSON 404.
"""

from django.urls import re_path

from dispatch.jobs import api

app_name = "api"

urlpatterns = [
    re_path(r"^jobs/?$", api.jobs, name="jobs"),
    re_path(r"^jobs/(?P<ref>[^/]+)/?$", api.job_detail, name="job"),
    re_path(r"^jobs/(?P<ref>[^/]+)/layers/?$", api.job_layers, name="job-layers"),
    re_path(r"^jobs/(?P<ref>[^/]+)/frames/?$", api.job_frames, name="job-frames"),
    re_path(r"^jobs/(?P<ref>[^/]+)/frames/(?P<frame_ref>[^/]+)/log/?$", api.frame_log, name="frame-log"),
    re_path(r"^jobs/(?P<ref>[^/]+)/(?P<action>[^/]+)/?$", api.job_action, name="job-action"),
    re_path(r"^limits/?$", api.limits, name="limits"),
    re_path(r"^limits/(?P<ref>[^/]+)/?$", api.limit_detail, name="limit"),
    re_path(r"", api.not_found, name="not-found"),
]
