"""The accounting kill switch in the admin: one row, editable, never deleted.

Kept small on purpose; the ops console (a later issue) builds its pages on top of it.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse

from accounting import actions
from accounting.models import AccountingSettings

OFF_MEANS = (
    "Off stops every release notification (acct_release for deleted procs) at once, for every "
    "connection, without a restart. The scheduler then learns about released procs only from "
    "its recompute (about every 15 s: counters read high, so it books less, which is safe). "
    "Cap changes and procs written outside the scheduler are still notified, so no cap can be "
    "over-booked because of the switch. Shows that are not scheduler-managed are not affected: "
    "the database keeps and enforces their accounting either way."
)


@admin.register(AccountingSettings)
class AccountingSettingsAdmin(admin.ModelAdmin):
    list_display = ("__str__", "notify_enabled", "ts_updated")
    readonly_fields = ("ts_updated",)
    fieldsets = ((None, {"fields": ("notify_enabled", "ts_updated"), "description": OFF_MEANS}),)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The migration creates the row; offer "add" only if someone removed it behind our back.
        return super().has_add_permission(request) and not AccountingSettings.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj: AccountingSettings | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: AccountingSettings, form: object, change: bool) -> None:
        if change:
            # Through accounting.actions (audit context, only the switch written), once the admin's own
            # transaction has committed: the action is a durable transaction of its own.
            request._ops_notify_enabled = obj.notify_enabled  # type: ignore[attr-defined]
        else:
            super().save_model(request, obj, form, change)

    def changeform_view(
        self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        response = super().changeform_view(request, object_id, form_url, extra_context)
        enabled = request.__dict__.pop("_ops_notify_enabled", None)
        if enabled is not None:
            for warning in actions.set_notifications(enabled, actor=request.user).warnings:
                messages.warning(request, warning)
        return response
