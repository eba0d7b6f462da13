"""Django admin over every farm table; the ops console (`ops`) builds on it.

Counters that triggers, the dispatcher or the recompute own (frame counts, booked totals,
host idle) are read-only here, and an edit saves only the fields the form changed: a form
loaded a minute ago must never write its stale copy of a live counter back.

Caps (subscription burst/size, folder and job max cores/GPUs) are shown and edited in whole
cores through `ops.caps_admin.CapsAdminMixin`, which saves them through `accounting.actions`;
a show's managed flag changes only through the flip confirmation (`ops`).
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import DatabaseError
from django.db.models import Model, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from accounting import actions
from dispatch.jobs.admin import JOB_ACTIONS  # also registers the Depend and ApiToken admins
from dispatch.jobs.host_controls import TAG_RE, add_host_tags, remove_host_tags, set_host_allocation
from dispatch.models import (
    Alloc,
    Comment,
    Dept,
    Facility,
    Folder,
    FolderResource,
    Frame,
    Host,
    HostStat,
    HostTag,
    Job,
    JobEnv,
    JobMem,
    JobResource,
    JobStat,
    Layer,
    LayerEnv,
    LayerMem,
    LayerResource,
    LayerStat,
    Point,
    Proc,
    Show,
    Subscription,
)
from ops import admin_views as ops_views
from ops import permissions as ops_permissions
from ops.caps_admin import CapsAdminMixin
from ops.readonly_admin import ReadOnlyAdmin
from ops.templatetags.ops_console import ops_words
from ops.units import cores as shown_cores
from ops.units import memory_kb

STAT_COUNTS = (
    "int_waiting_count",
    "int_running_count",
    "int_dead_count",
    "int_depend_count",
    "int_eaten_count",
    "int_succeeded_count",
    "int_checkpoint_count",
    "int_total_count",
)
BOOKED = ("int_cores", "int_gpus")
HOST_IDLE = ("int_cores_idle", "int_mem_idle", "int_gpus_idle", "int_gpu_mem_idle")


def field_label(name: str) -> str:
    """A form label in words with the column's unit: "Default max cores (centicores)".

    The tables keep Cuebot's names and units; a bare "Int default max cores: 10000" reads as
    10,000 cores where it means 100.
    """
    words = ops_words(name.replace("_", " "))
    if name.startswith("int_") and "cores" in name:
        return f"{words} (centicores)"
    if name.startswith("int_") and ("mem" in name or name.endswith(("_rss", "_vss"))):
        return f"{words} (KB)"
    return words


class CoresField(forms.DecimalField):
    """A centicore column entered and shown in cores (to the hundredth), stored in centicores.

    The show's job defaults are the last centicore columns an operator types into a form: "100"
    must mean 100 cores, as everywhere else in the console, not one.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("max_length", None)
        super().__init__(max_digits=12, decimal_places=2, **kwargs)

    def prepare_value(self, value: Any) -> Any:
        # The stored value (an int of centicores) is shown in cores, a negative one (unlimited) as
        # -1; typed text is shown as typed.
        if isinstance(value, int) and not isinstance(value, bool):
            return -1 if value < 0 else Decimal(value) / 100
        return value

    def clean(self, value: Any) -> int | None:
        cores = super().clean(value)
        if cores is None:
            return None
        return -1 if cores < 0 else int((cores * 100).to_integral_value(ROUND_HALF_UP))

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return self.clean(data) != initial
        except forms.ValidationError:
            return True


class FarmAdmin(admin.ModelAdmin):
    """Shows the text primary key read-only; `live_fields` are read-only once the row exists."""

    list_per_page = 100
    live_fields: tuple[str, ...] = ()

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        labels = {f.name: field_label(f.name) for f in self.model._meta.concrete_fields}
        kwargs["labels"] = {**labels, **(kwargs.get("labels") or {})}
        return super().get_form(request, obj, change, **kwargs)

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = [self.model._meta.pk.name, *super().get_readonly_fields(request, obj)]
        if obj is not None:
            fields += [f for f in self.live_fields if f not in fields]
        return fields

    def save_model(self, request: HttpRequest, obj: Model, form: ModelForm, change: bool) -> None:
        if not change:
            obj.save()
            return
        editable = {f.name for f in obj._meta.concrete_fields}
        changed = [name for name in form.changed_data if name in editable]
        if changed:
            obj.save(update_fields=changed)


class BigTableAdmin(FarmAdmin):
    """Frames and procs run to millions of rows: skip the extra unfiltered COUNT(*)."""

    show_full_result_count = False


@admin.register(Facility)
class FacilityAdmin(FarmAdmin):
    list_display = ("str_name", "b_default", "pk_facility")
    list_filter = ("b_default",)
    search_fields = ("str_name", "pk_facility")


@admin.register(Dept)
class DeptAdmin(FarmAdmin):
    list_display = ("str_name", "b_default", "pk_dept")
    list_filter = ("b_default",)
    search_fields = ("str_name", "pk_dept")


@admin.register(Show)
class ShowAdmin(FarmAdmin):
    list_display = (
        "str_name",
        "b_scheduler_managed",
        "b_active",
        "b_paused",
        "b_booking_enabled",
        "b_dispatch_enabled",
        "default_max_cores",
        "console",
    )
    list_filter = ("b_scheduler_managed", "b_active", "b_paused")
    search_fields = ("str_name", "pk_show")
    # The ownership flag changes only through the flip confirmation (accounting.actions.flip_show).
    live_fields = ("b_scheduler_managed",)
    actions = ("flip_to_scheduler", "flip_to_database")

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = super().get_readonly_fields(request, obj)
        return fields if "b_scheduler_managed" in fields else [*fields, "b_scheduler_managed"]

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        cores = ("int_default_min_cores", "int_default_max_cores")
        kwargs["field_classes"] = {**dict.fromkeys(cores, CoresField), **(kwargs.get("field_classes") or {})}
        labels = {"int_default_min_cores": "Default min cores of a job (cores)",
                  "int_default_max_cores": "Default max cores of a job (cores; -1 = unlimited)"}  # fmt: skip
        kwargs["labels"] = {**labels, **(kwargs.get("labels") or {})}
        return super().get_form(request, obj, change, **kwargs)

    @admin.display(description="ops console")
    def console(self, obj: Show) -> str:
        live = reverse("admin:ops_show_live", args=[obj.pk])
        flip = reverse("admin:ops_show_flip", args=[obj.pk])
        return format_html('<a href="{}">live counters</a> · <a href="{}">flip…</a>', live, flip)

    @admin.display(description="default max cores of a job", ordering="int_default_max_cores")
    def default_max_cores(self, obj: Show) -> str:
        value = obj.int_default_max_cores
        return "unlimited" if value is not None and value < 0 else shown_cores(value)

    def has_flip_permission(self, request: HttpRequest) -> bool:
        return ops_permissions.can_flip(request.user)

    @admin.action(description="Make selected shows scheduler-managed…", permissions=["flip"])
    def flip_to_scheduler(self, request: HttpRequest, queryset: QuerySet[Show]) -> HttpResponse | None:
        return ops_views.flip_many(request, list(queryset), True)

    @admin.action(description="Hand selected shows back to the database…", permissions=["flip"])
    def flip_to_database(self, request: HttpRequest, queryset: QuerySet[Show]) -> HttpResponse | None:
        return ops_views.flip_many(request, list(queryset), False)


@admin.register(Alloc)
class AllocAdmin(FarmAdmin):
    list_display = ("str_name", "str_tag", "facility", "b_enabled", "b_billable", "b_default")
    list_filter = ("b_enabled", "b_billable", "facility")
    search_fields = ("str_name", "str_tag", "pk_alloc")
    raw_id_fields = ("facility",)
    list_select_related = ("facility",)


@admin.register(Subscription)
class SubscriptionAdmin(CapsAdminMixin, FarmAdmin):
    list_display = ("show", "alloc", "int_burst", "int_size", "booked", "scheduler")
    list_display_links = ("show",)
    list_editable = ("int_burst", "int_size")
    list_filter = ("show__b_scheduler_managed", "alloc")
    search_fields = ("show__str_name", "alloc__str_name", "pk_subscription")
    raw_id_fields = ("show", "alloc")
    list_select_related = ("show", "alloc")
    live_fields = BOOKED
    cap_model, cap_vertex, cap_columns = "subscription", "sub", ("int_burst", "int_size")

    def cap_key(self, obj: Subscription) -> str:
        return f"{obj.show_id}:{obj.alloc_id}"

    def cap_show(self, obj: Subscription) -> Show:
        return obj.show

    def cap_capacity(self, obj: Subscription) -> tuple[int, str]:
        """A burst binds only on the allocation's hosts: above their cores it is no cap at all."""
        from ops.caps_admin import host_cores

        return host_cores(obj.alloc_id), f"the hosts of allocation {obj.alloc.str_name}"

    def apply_caps(self, obj: Subscription, cores: dict[str, int], actor: Any) -> actions.ActionResult:
        return actions.set_subscription(
            obj.pk, burst_cores=cores.get("int_burst"), size_cores=cores.get("int_size"), actor=actor
        )

    @admin.display(description="booked (table)")
    def booked(self, obj: Subscription) -> str:
        return f"{actions.cores(obj.int_cores)} cores, {obj.int_gpus} GPUs"


@admin.register(Point)
class PointAdmin(FarmAdmin):
    list_display = ("pk_point", "show", "dept", "booked_cores", "int_gpus", "b_managed")
    list_filter = ("b_managed", "show__b_scheduler_managed")
    search_fields = ("show__str_name", "dept__str_name", "pk_point")
    raw_id_fields = ("show", "dept")
    list_select_related = ("show", "dept")
    live_fields = BOOKED

    @admin.display(description="booked cores", ordering="int_cores")
    def booked_cores(self, obj: Point) -> str:
        return shown_cores(obj.int_cores)


@admin.register(Folder)
class FolderAdmin(FarmAdmin):
    list_display = ("str_name", "show", "parent_folder", "dept", "b_default", "int_priority")
    list_filter = ("b_default", "show__b_scheduler_managed")
    search_fields = ("str_name", "show__str_name", "pk_folder")
    raw_id_fields = ("parent_folder", "show", "dept")
    list_select_related = ("show", "parent_folder", "dept")
    # A folder belongs to its show: moving it under its jobs is refused by the database
    # (acct_folder_show_of_its_jobs), so the form does not offer it once the folder exists.
    live_fields = ("show",)


@admin.register(FolderResource)
class FolderResourceAdmin(CapsAdminMixin, FarmAdmin):
    list_display = ("folder", "folder__show", "int_max_cores", "int_max_gpus", "booked", "scheduler")
    list_display_links = ("folder",)
    list_editable = ("int_max_cores", "int_max_gpus")
    list_filter = ("folder__show__b_scheduler_managed",)
    search_fields = ("folder__str_name", "folder__show__str_name", "pk_folder_resource")
    raw_id_fields = ("folder",)
    list_select_related = ("folder", "folder__show")
    live_fields = BOOKED
    cap_model, cap_vertex, cap_columns = "folderresource", "folder", ("int_max_cores", "int_max_gpus")

    def cap_key(self, obj: FolderResource) -> str:
        return obj.folder_id

    def cap_show(self, obj: FolderResource) -> Show:
        return obj.folder.show

    def apply_caps(self, obj: FolderResource, cores: dict[str, int], actor: Any) -> actions.ActionResult:
        return actions.set_folder_caps(
            obj.folder_id, max_cores=cores.get("int_max_cores"), max_gpus=cores.get("int_max_gpus"), actor=actor
        )

    @admin.display(description="booked (table)")
    def booked(self, obj: FolderResource) -> str:
        return f"{actions.cores(obj.int_cores)} cores, {obj.int_gpus} GPUs"


@admin.register(Job)
class JobAdmin(FarmAdmin):
    list_display = ("str_name", "show", "folder", "str_state", "b_paused", "str_os", "ts_started", "console")
    list_filter = ("str_state", "b_paused", "show__b_scheduler_managed")
    search_fields = ("str_name", "str_show", "str_shot", "str_user", "pk_job")
    raw_id_fields = ("folder", "show", "facility", "dept")
    list_select_related = ("show", "folder")
    actions = JOB_ACTIONS  # pause, resume, kill, retry, eat: dispatch.jobs.controls

    @admin.display(description="ops console")
    def console(self, obj: Job) -> str:
        return format_html(
            '<a href="{}">why not booking?</a> · <a href="{}?job__pk_job={}">caps</a>',
            reverse("admin:ops_job_why", args=[obj.pk]),
            reverse("admin:dispatch_jobresource_changelist"),
            obj.pk,
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = super().get_readonly_fields(request, obj)
        return [*fields, "booking", "memory"] if obj is not None else fields

    @admin.display(description="booking")
    def booking(self, obj: Job) -> str:
        return ops_views.why_summary(obj.pk, None)

    @admin.display(description="memory")
    def memory(self, obj: Job) -> str:
        """Reserved against max RSS per layer (layer_mem: every launcher reports it)."""
        from ops.why import layer_memory

        return format_html_join("", "<div class='job-memory'>{}</div>", ((m.text,) for m in layer_memory(obj.pk)))


@admin.register(JobResource)
class JobResourceAdmin(CapsAdminMixin, FarmAdmin):
    list_display = ("job", "int_priority", "int_max_cores", "int_max_gpus", "booked", "scheduler")
    list_display_links = ("job",)
    list_editable = ("int_max_cores", "int_max_gpus")
    list_filter = ("job__str_state", "job__show__b_scheduler_managed")
    search_fields = ("job__str_name", "pk_job_resource")
    raw_id_fields = ("job",)
    list_select_related = ("job", "job__show")
    live_fields = BOOKED
    cap_model, cap_vertex, cap_columns = "jobresource", "job", ("int_max_cores", "int_max_gpus")

    def cap_key(self, obj: JobResource) -> str:
        return obj.job_id

    def cap_show(self, obj: JobResource) -> Show:
        return obj.job.show

    def cap_finished(self, obj: JobResource) -> bool:
        return obj.job.str_state == "FINISHED"

    def apply_caps(self, obj: JobResource, cores: dict[str, int], actor: Any) -> actions.ActionResult:
        return actions.set_job_caps(
            obj.job_id, max_cores=cores.get("int_max_cores"), max_gpus=cores.get("int_max_gpus"), actor=actor
        )

    @admin.display(description="booked (table)")
    def booked(self, obj: JobResource) -> str:
        return f"{actions.cores(obj.int_cores)} cores, {obj.int_gpus} GPUs"


@admin.register(JobStat)
class JobStatAdmin(ReadOnlyAdmin, FarmAdmin):
    list_display = ("job", *STAT_COUNTS[:3], "int_succeeded_count", "int_total_count")
    list_filter = ("job__str_state",)
    search_fields = ("job__str_name", "pk_job_stat")
    raw_id_fields = ("job",)
    list_select_related = ("job",)
    live_fields = STAT_COUNTS


@admin.register(Layer)
class LayerAdmin(ReadOnlyAdmin, FarmAdmin):
    """Layers are seen on their job's page (progress, frames, controls); no raw form."""

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        layer = Layer.objects.filter(pk=object_id).only("job_id").first()
        if layer is None:
            return super().change_view(request, object_id, form_url, extra_context)
        return HttpResponseRedirect(reverse("admin:ops_job", args=[layer.job_id]) + f"?layer={layer.pk}#frames")

    @admin.display(description="cores per frame", ordering="int_cores_min")
    def cores_min(self, obj: Layer) -> str:
        return shown_cores(obj.int_cores_min)

    @admin.display(description="memory per frame", ordering="int_mem_min")
    def memory_min(self, obj: Layer) -> str:
        return memory_kb(obj.int_mem_min)

    @admin.display(description="max RSS", ordering="mem__int_max_rss")
    def max_rss(self, obj: Layer) -> str:
        mem = getattr(obj, "mem", None)
        return memory_kb(mem.int_max_rss) if mem is not None and mem.int_max_rss else "—"

    list_display = (
        "str_name",
        "job",
        "int_dispatch_order",
        "cores_min",
        "memory_min",
        "max_rss",
        "int_gpus_min",
        "b_threadable",
        "str_tags",
    )
    list_filter = ("str_type", "b_threadable")
    search_fields = ("str_name", "str_tags", "job__str_name", "pk_layer")
    raw_id_fields = ("job",)
    list_select_related = ("job", "mem")


@admin.register(JobMem)
class JobMemAdmin(ReadOnlyAdmin, FarmAdmin):
    """Cuebot's job_mem: the job's max RSS, the largest of its frames' runs (KB)."""

    list_display = ("job", "int_max_rss", "int_gpu_mem_max")
    search_fields = ("job__str_name", "pk_job_mem")
    raw_id_fields = ("job",)
    list_select_related = ("job",)


@admin.register(LayerMem)
class LayerMemAdmin(ReadOnlyAdmin, FarmAdmin):
    """Cuebot's layer_mem: the layer's max RSS, the largest of its frames' runs (KB)."""

    list_display = ("layer", "job", "int_max_rss", "int_gpu_mem_max")
    search_fields = ("layer__str_name", "job__str_name", "pk_layer_mem")
    raw_id_fields = ("layer", "job")
    list_select_related = ("layer", "job")


@admin.register(JobEnv)
class JobEnvAdmin(ReadOnlyAdmin, FarmAdmin):
    """Cuebot's job_env: the spec's job `env`, one variable a row."""

    list_display = ("job", "str_key", "str_value")
    search_fields = ("job__str_name", "str_key", "pk_job_env")
    raw_id_fields = ("job",)
    list_select_related = ("job",)


@admin.register(LayerEnv)
class LayerEnvAdmin(ReadOnlyAdmin, FarmAdmin):
    """Cuebot's layer_env: the spec's layer `env`, over the job's."""

    list_display = ("layer", "job", "str_key", "str_value")
    search_fields = ("layer__str_name", "job__str_name", "str_key", "pk_layer_env")
    raw_id_fields = ("layer", "job")
    list_select_related = ("layer", "job")


@admin.register(LayerResource)
class LayerResourceAdmin(ReadOnlyAdmin, FarmAdmin):
    list_display = ("layer", "job", "int_cores", "int_gpus")
    search_fields = ("layer__str_name", "job__str_name", "pk_layer_resource")
    raw_id_fields = ("layer", "job")
    list_select_related = ("layer", "job")
    live_fields = BOOKED


@admin.register(LayerStat)
class LayerStatAdmin(ReadOnlyAdmin, FarmAdmin):
    list_display = ("layer", "job", *STAT_COUNTS[:3], "int_total_count", "ts_started", "ts_stopped")
    search_fields = ("layer__str_name", "job__str_name", "pk_layer_stat")
    raw_id_fields = ("layer", "job")
    list_select_related = ("layer", "job")
    live_fields = (*STAT_COUNTS, "ts_started", "ts_stopped")


@admin.register(Frame)
class FrameAdmin(BigTableAdmin):
    list_display = (
        "str_name",
        "job",
        "str_state",
        "int_version",
        "int_retries",
        "str_host",
        "int_mem_max_used",
        "ts_updated",
        "why",
    )
    list_filter = ("str_state",)
    search_fields = ("str_name", "str_host", "job__str_name", "pk_frame")
    raw_id_fields = ("layer", "job")
    list_select_related = ("job",)

    @admin.display(description="ops console")
    def why(self, obj: Frame) -> str:
        if obj.str_state != "WAITING":
            return ""
        return format_html('<a href="{}">why not booking?</a>', reverse("admin:ops_frame_why", args=[obj.pk]))

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = super().get_readonly_fields(request, obj)
        return [*fields, "booking"] if obj is not None and obj.str_state == "WAITING" else fields

    @admin.display(description="booking")
    def booking(self, obj: Frame) -> str:
        return ops_views.why_summary(obj.job_id, obj.pk)


# The host columns an allocation move and the tag edits own (dispatch.jobs.host_controls). Any
# write of host.pk_alloc moves the running procs' subscription (the accounting triggers), but a
# plain save would leave the host's ALLOC tag at the old allocation, str_tags apart from the
# host_tag rows dispatch reads, and no audit row: the host form runs those actions instead.
HOST_ACTION_FIELDS = ("alloc", "str_tags")


class HostForm(ModelForm):
    """The host form; `action_errors` (field -> messages) are an action's refusal, shown on its field."""

    action_errors: dict[str, list[str]] = {}

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name, errors in self.action_errors.items():
            for error in errors:
                self.add_error(name, error)
        return cleaned


def _refusal(exc: Exception) -> list[str]:
    return list(getattr(exc, "messages", None) or [str(exc)])


@admin.register(Host)
class HostAdmin(FarmAdmin):
    """A host's allocation and tags change through the audited host controls, with the admin user
    as the actor: the form's save runs `set_host_allocation`, `add_host_tags` and
    `remove_host_tags` (before the admin's own transaction: each is a durable one), and a refusal
    is shown as the field's error, the rest of the form not saved (an allocation move that
    succeeded beside a refused tag edit stays: it is its own action, audited). The other columns save as
    every farm form's do (only what changed). Without the hosts control role (ops.control_hosts)
    both fields are read-only."""

    form = HostForm
    list_display = (
        "str_name",
        "alloc",
        "str_lock_state",
        "int_cores",
        "int_cores_idle",
        "int_mem",
        "int_mem_idle",
        "int_gpus",
        "int_gpus_idle",
        "str_rqd_address",
    )
    list_filter = ("str_lock_state", "alloc")
    search_fields = ("str_name", "str_tags", "pk_host")
    raw_id_fields = ("alloc",)
    list_select_related = ("alloc",)
    live_fields = HOST_IDLE

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = super().get_readonly_fields(request, obj)
        if obj is not None and not ops_permissions.can_control_hosts(request.user):
            fields += [f for f in HOST_ACTION_FIELDS if f not in fields]
        return fields

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change, **kwargs)
        errors = request.__dict__.get("_host_action_errors")
        if errors:
            form = type(form.__name__, (form,), {"action_errors": errors})
        return form

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method == "POST" and object_id:
            self._run_host_actions(request, object_id)
        return super().changeform_view(request, object_id, form_url, extra_context)

    def _run_host_actions(self, request: HttpRequest, object_id: str) -> None:
        """The posted allocation and tag changes, run as the host controls, before the admin's
        transaction opens; a refusal is kept for the form the admin then validates and shows."""
        host = self.get_object(request, unquote(object_id))
        if host is None or not self.has_change_permission(request, host):
            return  # the admin answers (404, 403) as it does for any form
        before_tags = (host.str_tags or "").split()
        form = self.get_form(request, host, change=True)(request.POST, request.FILES, instance=host)
        if not form.is_valid():
            return  # the admin shows the form's own errors; nothing is run
        changed = [f for f in HOST_ACTION_FIELDS if f in form.changed_data]
        errors: dict[str, list[str]] = {}
        refused = (ValidationError, ObjectDoesNotExist, DatabaseError)
        if "alloc" in changed:
            try:
                moved = set_host_allocation(host.pk, form.cleaned_data["alloc"].pk, actor=request.user)
            except refused as exc:
                errors["alloc"] = _refusal(exc)
            else:
                messages.success(request, f"Allocation moved: {moved.detail['from']} → {moved.detail['to']}.")
        if "str_tags" in changed:
            wanted = (form.cleaned_data["str_tags"] or "").split()
            added = [t for t in dict.fromkeys(wanted) if t not in before_tags]
            removed = [t for t in before_tags if t not in wanted]
            bad = [t for t in added if not TAG_RE.match(t)]
            try:
                if bad:  # said before anything is removed
                    raise ValidationError(f"{bad[0]!r} is not a tag: 1 to 45 of letters, digits and _ . : + -")
                if removed:
                    remove_host_tags(host.pk, removed, actor=request.user)
                if added:
                    add_host_tags(host.pk, added, actor=request.user)
            except refused as exc:
                errors["str_tags"] = _refusal(exc)
            else:
                messages.success(request, f"Tags: added {added or 'none'}, removed {removed or 'none'}.")
        request.__dict__["_host_action_errors"] = errors

    def save_model(self, request: HttpRequest, obj: Model, form: ModelForm, change: bool) -> None:
        if not change:
            obj.save()
            return
        # The allocation and tags were the actions' (above): never written by the form's save.
        editable = {f.name for f in obj._meta.concrete_fields} - set(HOST_ACTION_FIELDS)
        changed = [name for name in form.changed_data if name in editable]
        if changed:
            obj.save(update_fields=changed)


@admin.register(HostStat)
class HostStatAdmin(ReadOnlyAdmin, FarmAdmin):
    list_display = ("host", "str_state", "str_os", "int_mem_total", "int_mem_free", "int_load", "ts_ping")
    list_filter = ("str_state", "str_os")
    search_fields = ("host__str_name", "pk_host_stat")
    raw_id_fields = ("host",)
    list_select_related = ("host",)


@admin.register(HostTag)
class HostTagAdmin(ReadOnlyAdmin, FarmAdmin):
    list_display = ("str_tag", "str_tag_type", "host", "b_constant")
    list_filter = ("str_tag_type", "b_constant")
    search_fields = ("str_tag", "host__str_name", "pk_host_tag")
    raw_id_fields = ("host",)
    list_select_related = ("host",)


@admin.register(Comment)
class CommentAdmin(ReadOnlyAdmin, FarmAdmin):
    """Read-only: a comment is added, edited and deleted by dispatch.jobs.comments' audited actions
    (which keep job.b_comment and host.b_comment), from the OpenCue clients."""

    list_display = ("str_subject", "job", "host", "str_user", "ts_created")
    search_fields = ("str_subject", "str_user", "job__str_name", "host__str_name", "pk_comment")
    raw_id_fields = ("job", "host")
    list_select_related = ("job", "host")


@admin.register(Proc)
class ProcAdmin(BigTableAdmin):
    list_display = (
        "pk_proc",
        "host",
        "show",
        "job",
        "frame",
        "int_cores_reserved",
        "int_mem_reserved",
        "int_mem_used",
        "int_mem_max_used",
        "int_gpus_reserved",
        "b_local",
        "ts_booked",
    )
    list_filter = ("b_local", "b_unbooked", "show__b_scheduler_managed")
    search_fields = ("host__str_name", "job__str_name", "pk_proc")
    raw_id_fields = ("host", "show", "job", "layer", "frame")
    list_select_related = ("host", "show", "job", "frame")
