"""Cuebot's services and the shows' overrides of them in the console, in readable units.

The tables keep Cuebot's units; the forms show and take cores ("0.1", "2"), memory with a unit
("3.2 GB", "8GB", "512MB") and timeouts in minutes. The form runs the actions' own validation
(ops.service_actions.validate), so a bad value is an error on its field and nothing is written;
every save and delete goes through ops.service_actions: one durable transaction with its audit
row (the farm actions list shows them, kinds "service" and "show_svc"). Editing needs the cap
editors' permission (`ops.edit_caps`): a service sets what every layer naming it books.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse

from dispatch.admin import CoresField
from dispatch.jobs.spec import parse_memory
from dispatch.models import Service, ShowService
from ops import permissions
from ops import service_actions as actions
from ops.setup_actions import NotFound
from ops.units import cores as shown_cores
from ops.units import memory_kb


class ServiceCoresField(CoresField):
    """Cores to the hundredth (Cuebot's preprocess service books 0.1), never negative."""

    def clean(self, value: Any) -> int | None:
        if isinstance(value, str) and value.strip().startswith("-"):
            raise ValidationError("Cores must not be negative (0 = no max).", code="negative")
        return super().clean(value)


class MemoryField(forms.CharField):
    """KB in the table, a size with a unit on screen ("3.2 GB"); a bare number is refused."""

    def __init__(self, *, allow_zero: bool = False, **kwargs: Any) -> None:
        self.allow_zero = allow_zero
        for key in ("max_length", "min_value", "max_value", "step_size"):
            kwargs.pop(key, None)
        # Text, not the admin's number input of an integer column: "3.2 GB" is what is typed.
        kwargs["widget"] = forms.TextInput(attrs={"class": "vTextField", "size": 12})
        super().__init__(**kwargs)

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return memory_kb(value)
        return value

    def clean(self, value: Any) -> int | None:
        text = super().clean(value)
        if text in (None, ""):
            return None
        try:
            return parse_memory(text, allow_zero=self.allow_zero)
        except ValueError as exc:
            raise ValidationError(f"{exc} (e.g. '8GB', '512MB')", code="memory") from None

    def has_changed(self, initial: Any, data: Any) -> bool:
        # Shown rounded ("3.2 GB" for 3355443 KB): the text as shown, untouched, is no change.
        if isinstance(initial, int) and isinstance(data, str) and data.strip() == memory_kb(initial):
            return False
        try:
            return self.clean(data) != initial
        except ValidationError:
            return True


class TagsField(forms.CharField):
    """Cuebot's "general | desktop"; typed as "general | desktop" or "general, desktop"."""

    def clean(self, value: Any) -> str:
        text = super().clean(value)
        return actions.join_tags(text.replace(",", "|"))


LABELS = {
    "str_name": "Name",
    "b_threadable": "Threadable",
    "int_cores_min": "Cores (e.g. 1, 0.1)",
    "int_cores_max": "Max cores (0 = no max)",
    "int_mem_min": "Memory (e.g. 8GB)",
    "int_gpus_min": "GPUs",
    "int_gpus_max": "Max GPUs (0 = no max)",
    "int_gpu_mem_min": "GPU memory (e.g. 0GB, 4GB)",
    "str_tags": "Tags (general | desktop; empty = the show's allocations' tags)",
    "int_timeout": "Timeout (minutes, 0 = none)",
    "int_timeout_llu": "Timeout since the log's last update (minutes, 0 = none)",
    "int_min_memory_increase": "Memory added after a memory failure (e.g. 2GB)",
}
FIELD_CLASSES = {
    "int_cores_min": ServiceCoresField,
    "int_cores_max": ServiceCoresField,
    "int_mem_min": MemoryField,
    "int_gpu_mem_min": MemoryField,
    "int_min_memory_increase": MemoryField,
    "str_tags": TagsField,
}


class ServiceForm(ModelForm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "int_gpu_mem_min" in self.fields:
            self.fields["int_gpu_mem_min"].allow_zero = True

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.errors:
            return data
        values = {c: data[c] for c in self.changed_data if c in actions.COLUMNS and c in data}
        old = {c: getattr(self.instance, c, None) for c in actions.COLUMNS} if self.instance.pk else {}
        try:
            actions.validate(values, merged={**old, **{c: data.get(c) for c in actions.COLUMNS if c in data}})
        except ValidationError as exc:
            for message in exc.messages:
                self.add_error(None, message)
        return data


class ServiceAdminBase(admin.ModelAdmin):
    form = ServiceForm
    search_fields = ("str_name",)
    list_filter = ("b_threadable",)
    columns = (
        "str_name",
        "b_threadable",
        "int_cores_min",
        "int_cores_max",
        "int_mem_min",
        "int_gpus_min",
        "int_gpus_max",
        "int_gpu_mem_min",
        "str_tags",
        "int_timeout",
        "int_timeout_llu",
        "int_min_memory_increase",
    )

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        kwargs["labels"] = {**LABELS, **(kwargs.get("labels") or {})}
        kwargs["field_classes"] = {**FIELD_CLASSES, **(kwargs.get("field_classes") or {})}
        return super().get_form(request, obj, change, **kwargs)

    @admin.display(description="cores", ordering="int_cores_min")
    def cores(self, obj: Any) -> str:
        return shown_cores(obj.int_cores_min)

    @admin.display(description="max cores", ordering="int_cores_max")
    def max_cores(self, obj: Any) -> str:
        return shown_cores(obj.int_cores_max) if obj.int_cores_max else "none"

    @admin.display(description="memory", ordering="int_mem_min")
    def memory(self, obj: Any) -> str:
        return memory_kb(obj.int_mem_min)

    @admin.display(description="timeout", ordering="int_timeout")
    def timeout(self, obj: Any) -> str:
        return f"{obj.int_timeout} min" if obj.int_timeout else "none"

    @admin.display(description="timeout since log update", ordering="int_timeout_llu")
    def timeout_llu(self, obj: Any) -> str:
        return f"{obj.int_timeout_llu} min" if obj.int_timeout_llu else "none"

    @admin.display(description="memory-failure increase", ordering="int_min_memory_increase")
    def memory_increase(self, obj: Any) -> str:
        return memory_kb(obj.int_min_memory_increase)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return permissions.can_edit_caps(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_edit_caps(request.user)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_edit_caps(request.user)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_view(request.user)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        found = super().get_actions(request)
        found.pop("delete_selected", None)  # one audited delete at a time, from the row's page
        return found

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Not inside the admin's own transaction: each action is a durable transaction of its own.
        return self._changeform_view(request, object_id, form_url, extra_context)

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        return self._delete_view(request, object_id, extra_context)

    def _values(self, form: ModelForm, change: bool) -> dict[str, Any]:
        data = form.cleaned_data
        names = form.changed_data if change else [c for c in self.columns if c in data]
        return {c: data[c] for c in names if c in actions.COLUMNS and data.get(c) is not None}

    def _run(self, request: HttpRequest, call: Any) -> actions.Changed | None:
        try:
            return call()
        except (ValidationError, NotFound) as exc:
            text = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
            messages.error(request, f"not saved: {text}")
            return None

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        return  # no related objects; the action wrote the row


@admin.register(Service)
class ServiceAdmin(ServiceAdminBase):
    list_display = (
        "str_name",
        "cores",
        "max_cores",
        "memory",
        "str_tags",
        "b_threadable",
        "timeout",
        "timeout_llu",
        "memory_increase",
    )
    readonly_fields = ("pk_service",)
    fields = ("pk_service", *ServiceAdminBase.columns)

    def save_model(self, request: HttpRequest, obj: Service, form: ModelForm, change: bool) -> None:
        values = self._values(form, change)
        if change:
            self._run(request, lambda: actions.update_service(obj.pk, values, actor=request.user))
            return
        done = self._run(request, lambda: actions.create_service(values, actor=request.user))
        if done is not None:
            obj.pk = done.pk

    def delete_model(self, request: HttpRequest, obj: Service) -> None:
        self._run(request, lambda: actions.delete_service(obj.pk, actor=request.user))


@admin.register(ShowService)
class ShowServiceAdmin(ServiceAdminBase):
    list_display = (
        "str_name",
        "show",
        "cores",
        "max_cores",
        "memory",
        "str_tags",
        "b_threadable",
        "timeout",
        "timeout_llu",
        "memory_increase",
    )
    list_select_related = ("show",)
    list_filter = ("show", "b_threadable")
    search_fields = ("str_name", "show__str_name")
    readonly_fields = ("pk_show_service",)
    fields = ("pk_show_service", "show", *ServiceAdminBase.columns)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # An override is of one service for one show: both are set once.
        return (*self.readonly_fields, "show", "str_name") if obj is not None else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ShowService, form: ModelForm, change: bool) -> None:
        values = self._values(form, change)
        if change:
            values.pop("str_name", None)
            self._run(request, lambda: actions.update_show_service(obj.show_id, obj.pk, values, actor=request.user))
            return
        done = self._run(
            request, lambda: actions.create_show_service(form.cleaned_data["show"].pk, values, actor=request.user)
        )
        if done is not None:
            obj.pk = done.pk

    def delete_model(self, request: HttpRequest, obj: ShowService) -> None:
        self._run(request, lambda: actions.delete_show_service(obj.show_id, obj.pk, actor=request.user))
