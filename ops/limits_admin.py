"""Licence limits in the console: create one, change its max or host flag, see its use.

Every save goes through `accounting.actions` (`create_limit`, `set_limit`): one durable
transaction each, with the operator recorded in the audit trail and a warning when a max is
lowered below use. The use columns (`int_running`, `int_frames`) are the triggers' count and
are never editable. The audit events are listed beside (`LimitRecordEvent`).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse

from accounting import actions
from accounting.licences import limit_max, limit_max_sql
from dispatch.models import LayerLimit, LimitRecord
from ops import permissions
from ops.models import LimitRecordEvent
from ops.readonly_admin import ReadOnlyAdmin


@admin.register(LimitRecord)
class LimitRecordAdmin(admin.ModelAdmin):
    list_display = ("str_name", "int_max_value", "max_read_text", "b_host_limit", "int_running", "int_frames", "full")
    search_fields = ("str_name",)
    readonly_fields = ("int_running", "int_frames")
    fields = ("str_name", "int_max_value", "b_host_limit", "int_running", "int_frames")

    def get_queryset(self, request: HttpRequest) -> QuerySet[LimitRecord]:
        # The max as every writer's check reads it (a NULL one, or a negative one beside Cuebot, runs nothing).
        return super().get_queryset(request).annotate(max_read=RawSQL(limit_max_sql("limit_record.int_max_value"), ()))

    @staticmethod
    def _max_read(obj: LimitRecord) -> int:
        max_read = getattr(obj, "max_read", None)
        return limit_max(obj.int_max_value, cuebot=False) if max_read is None else max_read

    @admin.display(boolean=True, description="full")
    def full(self, obj: LimitRecord) -> bool:
        max_read = self._max_read(obj)
        return max_read >= 0 and obj.int_running >= max_read

    @admin.display(description="max as read")
    def max_read_text(self, obj: LimitRecord) -> str:
        max_read = self._max_read(obj)
        if max_read < 0:
            return "unlimited"
        if max_read != obj.int_max_value:
            return "0: runs nothing (Cuebot reads this max as none)"
        return str(max_read)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The name is what job specs refer to: set once.
        return (*self.readonly_fields, "str_name") if obj is not None else self.readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return permissions.can_edit_caps(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_edit_caps(request.user)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a limit still named by layers cannot go; an unused one is left in place

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_view(request.user)

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Not inside the admin's own transaction: each action is a durable transaction of its own.
        return self._changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request: HttpRequest, obj: LimitRecord, form: ModelForm, change: bool) -> None:
        data = form.cleaned_data
        try:
            if not change:
                result = actions.create_limit(
                    data["str_name"], data["int_max_value"], host_limit=data["b_host_limit"], actor=request.user
                )
                obj.pk = result.target
            else:
                result = actions.set_limit(
                    obj.pk,
                    max_value=data["int_max_value"] if "int_max_value" in form.changed_data else None,
                    host_limit=data["b_host_limit"] if "b_host_limit" in form.changed_data else None,
                    actor=request.user,
                )
        except ValidationError as exc:
            messages.error(request, f"not saved: {'; '.join(exc.messages)}")
            return
        for warning in result.warnings:
            messages.warning(request, warning)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        return  # no related objects; the action wrote the row


@admin.register(LimitRecordEvent)
class LimitRecordEventAdmin(ReadOnlyAdmin):
    list_display = (
        "pgh_created_at",
        "pgh_label",
        "str_name",
        "old_int_max_value",
        "int_max_value",
        "b_host_limit",
        "who",
    )
    list_filter = ("pgh_label",)
    search_fields = ("str_name", "pk_limit_record")

    @admin.display(description="user")
    def who(self, obj: Any) -> str:
        meta = obj.pgh_context.metadata if obj.pgh_context_id else {}
        return meta.get("username") or "—"

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_view(request.user)


@admin.register(LayerLimit)
class LayerLimitAdmin(ReadOnlyAdmin):
    """Which layers hold which limit: set by the job spec's layer `limits`, read here."""

    list_display = ("pk_layer_limit", "layer", "limit")
    search_fields = ("limit__str_name", "layer__str_name", "pk_layer_limit")
    list_select_related = ("layer", "limit")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return permissions.can_view(request.user)
