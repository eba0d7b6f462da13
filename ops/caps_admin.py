"""What the farm admin's cap pages need from the console: whole-core fields, actions, status.

`CapsAdminMixin` goes on the Subscription, FolderResource and JobResource admins (in
`dispatch.admin`): their cap columns are shown and edited in whole cores, inline on the change
list (`list_editable`) and on the change form; a save goes through `accounting.actions` (only
the changed cap columns, with the operator recorded for the audit trail, warnings shown);
and a "scheduler" column and panel say whether the running scheduler enforces the new value
yet, and since when. Everything else on these rows is read-only except for superusers.

Nothing is saved from a guess. A save of the inline change list, which commits every row
changed there at once, always goes through a confirmation page listing each change (old → new,
in cores); a change form asks the same when a cap would book nothing (0) or exceed every host
that could run it. The confirmation re-posts the same data with `CONFIRM_FIELD`: what is saved
is exactly what was confirmed, validated again by the form and the action.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import connection
from django.db.models import Model
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from accounting import actions
from accounting.units import CENTICORES_PER_CORE, is_unlimited_cap
from ops import admin_views, permissions, status
from ops.forms import cap_formfield, db_to_cores

_VIEW: ContextVar[dict[str, Any] | None] = ContextVar("ops_live_view", default=None)
_FULL: ContextVar[bool] = ContextVar("ops_full_status", default=False)
_CAP_NAMES = {"int_burst": "burst", "int_size": "size", "int_max_cores": "max cores", "int_max_gpus": "max GPUs"}
# The other columns of these rows that hold cores or memory, in the database's units (centicores,
# KB). Next to a cap shown in whole cores, a bare "Int min cores: 100" reads as 100 cores: each
# is named with its unit, and shown read-only in both units.
UNIT_COLUMNS: dict[str, tuple[str, str]] = {
    "int_cores": ("booked cores", "centicores"),
    "int_min_cores": ("min cores", "centicores"),
    "int_local_cores": ("local cores", "centicores"),
    "int_max_rss": ("max RSS", "KB"),
    "int_max_vss": ("max VSS", "KB"),
}
_KB_UNITS = (("TB", 1024**3), ("GB", 1024**2), ("MB", 1024))
CONFIRM_FIELD = "_ops_confirmed"
# Every host's cores, or those of one allocation (centicores): the most a cap can ever use.
_ALL_HOST_CORES_SQL = "SELECT COALESCE(SUM(int_cores), 0)::bigint FROM host"
_ALLOC_HOST_CORES_SQL = "SELECT COALESCE(SUM(int_cores), 0)::bigint FROM host WHERE pk_alloc = %s"


def shown_with_unit(value: int | None, unit: str) -> str:
    """'1 core (100 centicores)', '2.5 cores (250 centicores)', '4 GB (4194304 KB)': both units."""
    if value is None:
        return "-"
    if unit == "centicores":
        whole, part = divmod(abs(value), CENTICORES_PER_CORE)
        number = f"{'-' if value < 0 else ''}{whole}" + (f".{part:02d}".rstrip("0") if part else "")
        return f"{number} {'core' if abs(value) == CENTICORES_PER_CORE else 'cores'} ({value} centicores)"
    for name, size in _KB_UNITS:
        if abs(value) >= size:
            return f"{value / size:.3g} {name} ({value} KB)"
    return f"{value} KB"


def _unit_display(column: str) -> Callable[[Any], str]:
    label, unit = UNIT_COLUMNS[column]

    def display(obj: Any) -> str:
        return shown_with_unit(getattr(obj, column), unit)

    display.short_description = f"{label} ({unit})"  # type: ignore[attr-defined]
    display.__name__ = f"{column}_with_unit"
    return display


def cap_shown(model_name: str, column: str, value: int | None) -> str:
    """A cap as the operator's form shows it (whole cores, GPUs), for those who may only read it.

    The read-only path must not fall back to the raw column: a viewer reading "150000" where an
    operator reads 1500 takes the cap for 100 times what it is.
    """
    if value is None:
        return "-"
    field = cap_formfield(model_name, column)
    if field is None:
        return str(value)
    if field.unlimited_ok and is_unlimited_cap(value):
        return "unlimited (-1)"
    shown = field.to_screen(value)
    if value == 0:
        return f"{shown} (books nothing)"
    return f"{shown:g}" if isinstance(shown, float) else str(shown)


def _cap_display(model_name: str, column: str) -> Callable[[Any], str]:
    field = cap_formfield(model_name, column)

    def display(obj: Any) -> str:
        return cap_shown(model_name, column, getattr(obj, column))

    display.short_description = field.label if field is not None else column  # type: ignore[attr-defined]
    display.__name__ = f"{column}_shown"
    return display


def _with_unit(shown: str, column: str) -> str:
    """'12 cores', '4 GPUs' on the confirmation; 'unlimited (-1)' and '0 (books nothing)' as they are."""
    if not shown[:1].isdigit() or "(" in shown:
        return shown
    return f"{shown} {'GPUs' if 'gpus' in column else 'cores'}"


def host_cores(alloc_id: str | None = None) -> int:
    """Whole cores of every host (or of one allocation's): above it a cap can never bind."""
    with connection.cursor() as cur:
        if alloc_id is None:
            cur.execute(_ALL_HOST_CORES_SQL)
        else:
            cur.execute(_ALLOC_HOST_CORES_SQL, [alloc_id])
        (cc,) = cur.fetchone()
    return int(cc) // CENTICORES_PER_CORE


class CapsAdminMixin:
    """Mixed into a FarmAdmin for a cap table; subclasses say which vertex and how to act."""

    cap_model = ""  # "subscription", "folderresource", "jobresource"
    cap_vertex = ""  # "sub", "folder", "job"
    cap_columns: tuple[str, ...] = ()

    # -- the per-row data the status needs ------------------------------------------------
    def cap_key(self, obj: Any) -> str:
        raise NotImplementedError

    def cap_show(self, obj: Any) -> Any:
        raise NotImplementedError

    def apply_caps(self, obj: Any, cores: dict[str, int], actor: Any) -> actions.ActionResult:
        raise NotImplementedError

    def cap_finished(self, obj: Any) -> bool:
        """Whether the row's job is FINISHED (only job caps: the Store drops those)."""
        return False

    def cap_capacity(self, obj: Any) -> tuple[int, str]:
        """The whole cores any host that could book for this row has, and where they are."""
        return host_cores(), "the farm's hosts"

    # -- the confirmation -------------------------------------------------------------------
    def cap_risks(self, obj: Any, column: str, new_db: int) -> list[str]:
        """Why saving `new_db` (database units) in `column` deserves a second look, if it does."""
        if column == "int_max_gpus" or new_db < 0:
            if new_db == 0:
                return ["0 GPUs: it starts no new GPU frame (-1 is unlimited)."]
            return []
        if new_db == 0:
            what = "show on this allocation" if self.cap_vertex == "sub" else self.cap_vertex
            return [f"0 books nothing: the {what} starts no new frame; what runs now keeps running."]
        cores, where = self.cap_capacity(obj)
        new = new_db // CENTICORES_PER_CORE
        if new > cores and column != "int_size":
            return [f"{new:,} cores is more than the {cores:,} cores of {where}: is it a typo?"]
        # Said before the save (it used to come only after): lowering below what runs stops nothing.
        booked = int(getattr(obj, "int_cores", 0) or 0)
        if column != "int_size" and booked > new_db:
            return [
                f"{actions.cores(booked)} cores are booked now, above the new {new:,}: nothing running stops; "
                "new frames wait until the booking is below it."
            ]
        return []

    def _changes_of(self, form: ModelForm) -> list[dict[str, Any]]:
        obj = form.instance
        rows = []
        for column in (c for c in self.cap_columns if c in form.changed_data):
            old, new = form.initial.get(column), form.cleaned_data[column]
            rows.append(
                {
                    "object": str(obj),
                    "field": _CAP_NAMES.get(column, column),
                    "old": _with_unit(cap_shown(self.cap_model, column, old), column),
                    "new": _with_unit(cap_shown(self.cap_model, column, new), column),
                    "risks": self.cap_risks(obj, column, new),
                }
            )
        return rows

    def _confirm_page(self, request: HttpRequest, changes: list[dict[str, Any]], back: str) -> TemplateResponse:
        posted = [(k, v) for k in request.POST for v in request.POST.getlist(k) if k != "csrfmiddlewaretoken"]
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "title": "Confirm the cap changes",
            "opts": self.model._meta,  # type: ignore[attr-defined]
            "changes": changes,
            "risky": sum(1 for c in changes if c["risks"]),
            "posted": posted,
            "confirm_field": CONFIRM_FIELD,
            "back": back,
        }
        return TemplateResponse(request, "ops/cap_confirm.html", context)

    def _change_form_confirmation(self, request: HttpRequest, object_id: str) -> HttpResponse | None:
        """The confirmation page a change form's save needs, or None to let the admin go on."""
        obj = self.get_object(request, unquote(object_id))  # type: ignore[attr-defined]
        if obj is None or not self.has_change_permission(request, obj):
            return None
        form = self.get_form(request, obj, change=True)(request.POST, request.FILES, instance=obj)  # type: ignore[attr-defined]
        if not form.is_valid():
            return None  # the admin shows the errors
        changes = self._changes_of(form)
        if not any(c["risks"] for c in changes):
            return None
        return self._confirm_page(request, changes, request.get_full_path())

    def _changelist_confirmation(self, request: HttpRequest) -> HttpResponse | None:
        """Every row an inline save would change, to confirm, or None (invalid: the admin says why)."""
        if not self.list_editable or not self.has_change_permission(request):  # type: ignore[attr-defined]
            return None
        formset_class = self.get_changelist_formset(request)  # type: ignore[attr-defined]
        prefix = formset_class.get_default_prefix()
        queryset = self._get_list_editable_queryset(request, prefix)  # type: ignore[attr-defined]
        formset = formset_class(request.POST, request.FILES, queryset=queryset, prefix=prefix)
        if not formset.is_valid():
            return None
        changes = [c for form in formset.forms if form.has_changed() for c in self._changes_of(form)]
        if not changes:
            return None
        return self._confirm_page(request, changes, request.get_full_path())

    # -- fields -----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # The read-only "<column>_with_unit" displays (see UNIT_COLUMNS), found by name as the
        # admin finds any method it lists in readonly_fields.
        if name.endswith("_with_unit") and name[: -len("_with_unit")] in UNIT_COLUMNS:
            return _unit_display(name[: -len("_with_unit")])
        # The caps in whole cores for those who may only read them ("<column>_shown").
        if name.endswith("_shown") and name[: -len("_shown")] in self.cap_columns:
            return _cap_display(self.cap_model, name[: -len("_shown")])
        raise AttributeError(name)

    def get_list_display(self, request: HttpRequest) -> Any:
        shown = super().get_list_display(request)  # type: ignore[misc]
        if self.has_change_permission(request):
            return shown
        return [f"{c}_shown" if c in self.cap_columns else c for c in shown]

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = cap_formfield(self.cap_model, db_field.name)
        if field is not None:
            return field
        field = super().formfield_for_dbfield(db_field, request, **kwargs)  # type: ignore[misc]
        if field is not None and db_field.name in UNIT_COLUMNS:  # editable (superusers): the unit in the label
            label, unit = UNIT_COLUMNS[db_field.name]
            field.label = f"{label} ({unit})"
            field.help_text = "100 centicores = 1 core." if unit == "centicores" else "In KB (1 GB = 1048576 KB)."
        return field

    def _raw_readonly_fields(self, request: HttpRequest, obj: Model | None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))  # type: ignore[misc]
        if obj is not None and not request.user.is_superuser:
            editable = set(self.cap_columns) if self.has_change_permission(request, obj) else set()
            fields += [f.name for f in obj._meta.concrete_fields if f.name not in editable and f.name not in fields]
        return fields

    def _shown_as(self, column: str) -> str:
        if column in UNIT_COLUMNS:
            return f"{column}_with_unit"
        return f"{column}_shown" if column in self.cap_columns else column

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        fields = [self._shown_as(f) for f in self._raw_readonly_fields(request, obj)]
        return [*fields, "scheduler"] if obj is not None else fields

    def get_exclude(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        # A column shown read-only through its "_with_unit"/"_shown" display must not also be a form field.
        exclude = list(super().get_exclude(request, obj) or ())  # type: ignore[misc]
        raw = self._raw_readonly_fields(request, obj)
        return [*exclude, *(f for f in raw if f in UNIT_COLUMNS or f in self.cap_columns)]

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_change_permission(request, obj) and permissions.can_edit_caps(request.user)  # type: ignore[misc]

    # -- saving -----------------------------------------------------------------------------
    def save_model(self, request: HttpRequest, obj: Any, form: ModelForm, change: bool) -> None:
        if not change:
            obj.save()
            return
        caps = [c for c in form.changed_data if c in self.cap_columns]
        editable = {f.name for f in obj._meta.concrete_fields}
        others = [c for c in form.changed_data if c in editable and c not in self.cap_columns]
        if others:
            obj.save(update_fields=others)
        if not caps:
            return
        # The admin saves inside its own transaction.atomic(); an action is a durable transaction
        # of its own, so it runs once the admin's block has committed (see _run_pending).
        cores = {c: db_to_cores(c, form.cleaned_data[c]) for c in caps}
        request.__dict__.setdefault("_ops_pending", []).append((obj, cores))
        request._ops_caps_saved = True  # type: ignore[attr-defined]

    def _run_pending(self, request: HttpRequest) -> None:
        for obj, cores in request.__dict__.pop("_ops_pending", []):
            try:
                result = self.apply_caps(obj, cores, request.user)
            except (ValidationError, ObjectDoesNotExist) as exc:
                messages.error(request, f"{obj}: not saved: {exc}")
                continue
            for warning in result.warnings:
                messages.warning(request, warning)

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method == "POST" and object_id and CONFIRM_FIELD not in request.POST:
            confirmation = self._change_form_confirmation(request, object_id)
            if confirmation is not None:
                return confirmation
        response = super().changeform_view(request, object_id, form_url, extra_context)  # type: ignore[misc]
        self._run_pending(request)
        return response

    def response_change(self, request: HttpRequest, obj: Any) -> HttpResponse:
        response = super().response_change(request, obj)  # type: ignore[misc]
        if getattr(request, "_ops_caps_saved", False) and "_continue" not in request.POST:
            # Back to the form: its "scheduler" panel shows when the new cap is applied.
            messages.info(request, "The scheduler panel below shows when the running scheduler applies it.")
            opts = obj._meta
            return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk]))
        return response

    # -- the scheduler status ---------------------------------------------------------------
    def _with_view(self, request: HttpRequest, call: Callable[[], HttpResponse], *, full: bool) -> HttpResponse:
        token, full_token = _VIEW.set(status.view_for(request)), _FULL.set(full)
        try:
            response = call()
            if hasattr(response, "render"):
                response.render()
            return response
        finally:
            _VIEW.reset(token)
            _FULL.reset(full_token)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if request.method == "POST" and "_save" in request.POST and CONFIRM_FIELD not in request.POST:
            confirmation = self._changelist_confirmation(request)
            if confirmation is not None:
                return confirmation
        extra = {**(extra_context or {}), "refresh_ms": int(admin_views.refresh_seconds() * 1000)}
        response = self._with_view(
            request,
            lambda: super(CapsAdminMixin, self).changelist_view(request, extra),  # type: ignore[misc]
            full=False,
        )
        self._run_pending(request)
        return response

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "refresh_ms": int(admin_views.refresh_seconds() * 1000)}
        return self._with_view(
            request,
            lambda: super(CapsAdminMixin, self).change_view(request, object_id, form_url, extra),  # type: ignore[misc]
            full=True,
        )

    def cap_statuses(self, obj: Any) -> list[tuple[str, status.CapStatus]]:
        view = _VIEW.get()
        show = self.cap_show(obj)
        return [
            (
                column,
                status.cap_status(
                    view,
                    vertex=self.cap_vertex,
                    key=self.cap_key(obj),
                    column=column,
                    db_value=getattr(obj, column),
                    show_id=show.pk,
                    show_managed=show.b_scheduler_managed,
                    finished=self.cap_finished(obj),
                ),
            )
            for column in self.cap_columns
        ]

    def scheduler(self, obj: Any) -> str:
        """Per enforced cap: a badge and a short word on the change list, the full sentence on the form."""
        rows = [(c, s) for c, s in self.cap_statuses(obj) if s.state != "not-enforced"]
        full = _FULL.get()
        return format_html(
            '<div id="cap-status-{}" data-live class="ops-cap-status">{}</div>',
            obj.pk,
            format_html_join(
                "",
                '<div><span class="badge {}" title="{}">{}</span> <span class="ops-note">{}: {}</span></div>',
                ((s.state, s.message, s.state, _CAP_NAMES.get(c, c), s.message if full else s.short) for c, s in rows),
            ),
        )

    scheduler.short_description = "scheduler"  # type: ignore[attr-defined]
