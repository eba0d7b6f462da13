"""Job controls in the admin, and the admin pages of the depend and API token tables.

`JOB_ACTIONS` are the change-list actions of `JobAdmin` (pause, resume, kill, retry, eat):
each calls `dispatch.jobs.controls` once per selected job, one transaction each, as the API and the
`job` command do. Importing this module (dispatch.admin does) registers the two admins.
"""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from dispatch.jobs.action_base import JobActionResult
from dispatch.jobs.controls import eat_frames, kill_job, pause_job, resume_job, retry_frames
from dispatch.models import ApiToken, Depend, Job

AdminAction = Callable[[admin.ModelAdmin, HttpRequest, QuerySet[Job]], None]


def _job_action(run: Callable[..., JobActionResult], label: str, done: str) -> AdminAction:
    def action(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        jobs = list(queryset.select_related(None).only("pk_job", "str_name"))
        total = sum(run(job, actor=request.user).changed for job in jobs)
        modeladmin.message_user(request, f"{done}: {total} (over {len(jobs)} selected jobs)", messages.SUCCESS)

    action.__name__ = f"{run.__name__}_selected"
    return admin.action(description=label, permissions=["change"])(action)


JOB_ACTIONS: list[AdminAction] = [
    _job_action(pause_job, "Pause the selected jobs", "Jobs paused"),
    _job_action(resume_job, "Resume the selected jobs", "Jobs resumed"),
    _job_action(kill_job, "Kill the selected jobs (their running frames are killed)", "Frames moved"),
    _job_action(retry_frames, "Retry the DEAD frames of the selected jobs", "Frames to retry"),
    _job_action(eat_frames, "Eat the waiting, dead and depending frames", "Frames eaten"),
]


class _ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Depend)
class DependAdmin(_ReadOnly):
    """Written by the submit, satisfied by the frame trigger: nothing to edit by hand."""

    list_display = ("pk_depend", "str_type", "job_depend_er", "layer_depend_er", "layer_depend_on", "b_active")
    list_filter = ("str_type", "b_active")
    search_fields = ("pk_depend", "job_depend_er__str_name")
    raw_id_fields = ("job_depend_er", "job_depend_on", "layer_depend_er", "layer_depend_on")
    list_select_related = ("job_depend_er", "layer_depend_er", "layer_depend_on")
    show_full_result_count = False  # one row per frame pair: as big as the frame table


@admin.register(ApiToken)
class ApiTokenAdmin(_ReadOnly):
    """Made with `manage.py api_token USER`; here a token can be seen (its prefix) and revoked."""

    list_display = ("prefix", "user", "ts_created")
    search_fields = ("prefix", "user__username")
    fields = ("user", "prefix", "ts_created")
