"""The ops console in the admin: its pages (custom views through `get_urls`) and the audit trail.

`Console` has no table; its admin entry is the console's door on the admin index, and its
URLs carry the console pages. Every page goes through `admin_site.admin_view` (login, staff,
CSRF) and then the console's own permission check (`ops.permissions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.db.models import CharField, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Concat
from django.http import HttpRequest, HttpResponse
from django.urls import path, reverse
from django.utils.html import format_html

from dispatch.models import Alloc, Folder, Job, Show
from ops import (
    admin_views,
    farm_admin,
    farm_views,
    job_pages,
    limits_admin,  # noqa: F401 - registers the licence limit admins
    permissions,
    services_admin,  # noqa: F401 - registers the service and show-override admins
)
from ops.admin_views import COLUMN_LABELS, shown_value
from ops.models import Console, FolderCapEvent, JobCapEvent, KillSwitchEvent, ShowManagedEvent, SubscriptionCapEvent
from ops.readonly_admin import ReadOnlyAdmin


@admin.register(Console)
class ConsoleAdmin(ReadOnlyAdmin):
    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_view(request.user)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return permissions.can_view(request.user)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return self._guard(admin_views.overview)(request)

    def _guard(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            permissions.require(permissions.can_view(request.user))
            return view(request, *args, **kwargs)

        return self.admin_site.admin_view(checked)

    def get_urls(self) -> list[Any]:
        g = self._guard
        return [
            path("", g(admin_views.overview), name="ops_console_overview"),
            path("show/<str:pk>/", g(admin_views.show_live), name="ops_show_live"),
            path("show/<str:pk>/flip/", g(admin_views.flip), name="ops_show_flip"),
            path("job/<str:pk>/", g(job_pages.job_page), name="ops_job"),
            path("job/<str:pk>/act/", g(job_pages.act), name="ops_job_act"),
            path("frame/<str:pk>/", g(job_pages.frame_page), name="ops_frame"),
            path("frame/<str:pk>/log/", g(job_pages.frame_log), name="ops_frame_log"),
            path("job/<str:pk>/why/", g(admin_views.why_job), name="ops_job_why"),
            path("frame/<str:pk>/why/", g(admin_views.why_frame), name="ops_frame_why"),
            path("audit/", g(admin_views.audit), name="ops_audit"),
            path("notifications/", g(admin_views.kill_switch), name="ops_kill_switch"),
            path("procs/", g(farm_views.procs_page), name="ops_procs"),
            path("allocations/", g(farm_views.allocations_page), name="ops_allocations"),
            *super().get_urls(),
        ]


TARGET_NAMES: dict[str, Any] = {
    "sub": Concat(
        Subquery(Show.objects.filter(pk=OuterRef("show_id")).values("str_name")[:1]),
        Value(" @ "),
        Subquery(Alloc.objects.filter(pk=OuterRef("alloc_id")).values("str_name")[:1]),
        output_field=CharField(),
    ),
    "folder": Subquery(Folder.objects.filter(pk=OuterRef("folder_id")).values("str_name")[:1]),
    "job": Subquery(Job.objects.filter(pk=OuterRef("job_id")).values("str_name")[:1]),
}


class EventAdmin(ReadOnlyAdmin):
    """Read-only history rows, filterable by time, database role and label."""

    columns: list[str] = []
    kind = ""
    list_filter = ("pgh_created_at", "db_role")
    date_hierarchy = "pgh_created_at"
    list_select_related = ("pgh_context",)
    search_fields: tuple[str, ...] = ()

    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        return ("pgh_created_at", "target", "change", "who", "db_role")

    @admin.display(description="object")
    def target(self, obj: Any) -> str:
        names = {} if getattr(obj, "target_name", None) is None else {obj.pgh_obj_id: obj.target_name}
        if self.kind == "folder" and names:
            names = {obj.folder_id: obj.target_name}
        elif self.kind == "job" and names:
            names = {obj.job_id: obj.target_name}
        label, url = admin_views.event_target(self.kind, obj, names)
        return format_html('<a href="{}">{}</a>', url, label)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The object's name in the same query (the object may be gone: then its id is shown)."""
        qs = super().get_queryset(request)
        name = TARGET_NAMES.get(self.kind)
        return qs.annotate(target_name=name) if name is not None else qs

    @admin.display(description="old → new")
    def change(self, obj: Any) -> str:
        parts = []
        for c in self.columns:
            old, new = getattr(obj, "old_" + c), getattr(obj, c)
            if old != new:
                parts.append(f"{COLUMN_LABELS[c]}: {shown_value(c, old)} → {shown_value(c, new)}")
        return "; ".join(parts)

    @admin.display(description="user")
    def who(self, obj: Any) -> str:
        meta = obj.pgh_context.metadata if obj.pgh_context_id else {}
        return meta.get("username") or "—"

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {"ops_audit_url": reverse("admin:ops_audit")}
        return super().changelist_view(request, {**(extra_context or {}), **extra})


@admin.register(SubscriptionCapEvent)
class SubscriptionCapEventAdmin(EventAdmin):
    kind = "sub"
    search_fields = ("pk_subscription", "show__str_name", "alloc__str_name")
    columns = ["int_burst", "int_size"]


@admin.register(FolderCapEvent)
class FolderCapEventAdmin(EventAdmin):
    kind = "folder"
    search_fields = ("pk_folder_resource", "folder__str_name")
    columns = ["int_max_cores", "int_max_gpus"]


@admin.register(JobCapEvent)
class JobCapEventAdmin(EventAdmin):
    kind = "job"
    search_fields = ("pk_job_resource", "job__str_name")
    columns = ["int_max_cores", "int_max_gpus"]


@admin.register(ShowManagedEvent)
class ShowManagedEventAdmin(EventAdmin):
    kind = "flip"
    columns = ["b_scheduler_managed"]
    search_fields = ("pk_show", "str_name")


@admin.register(KillSwitchEvent)
class KillSwitchEventAdmin(EventAdmin):
    kind = "kill_switch"
    columns = ["notify_enabled"]


# The farm lists (hosts, jobs, frames, procs) replace dispatch.admin's plain ones.
farm_admin.register(admin.site)
# No sidebar of raw tables beside every page: the console's own navigation is the top bar, and
# the sidebar took 260 px that pushed the lists' last columns off a 1400 px screen.
admin.site.enable_nav_sidebar = False
