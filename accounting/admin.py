"""The accounting kill switch in the admin: one row, editable, never deleted.

Kept small on purpose; the ops console (a later issue) builds its pages on top of it.
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from accounting.models import AccountingSettings

OFF_MEANS = (
    "Off stops every acct_release and acct_limit_change notification at once, for every "
    "connection, without a restart. The scheduler then learns about released procs only from "
    "its recompute (about every 15 s: counters read high, so it books less, which is safe) and "
    "about cap changes only from its limit reseed (about every 5 min: a lowered burst or max can "
    "be over-booked until then). Shows that are not scheduler-managed are not affected: the "
    "database keeps and enforces their accounting either way."
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
        # Write only the switch, so a stale form never rewrites anything else.
        if change:
            obj.save(update_fields=["notify_enabled", "ts_updated"])
        else:
            super().save_model(request, obj, form, change)
