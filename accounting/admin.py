"""The accounting kill switch in the admin: one row, editable, never deleted.

The switch itself is read-only here: it changes only through the console's confirmation page
(`ops_kill_switch`), which says what turning it off means before anything is written. A plain
change form would let one unticked box and "Save" silence release notifications farm-wide.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

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
    readonly_fields = ("notify_enabled", "ts_updated", "change_it")
    fieldsets = ((None, {"fields": ("notify_enabled", "ts_updated", "change_it"), "description": OFF_MEANS}),)

    @admin.display(description="change it")
    def change_it(self, obj: AccountingSettings) -> str:
        """The only way to flip the switch: the confirmation page (which the console gates by role)."""
        target = "false" if obj.notify_enabled else "true"
        url = reverse("admin:ops_kill_switch") + f"?enabled={target}"
        label = "Turn notifications off…" if obj.notify_enabled else "Turn notifications on…"
        return format_html('<a href="{}" id="kill-switch-confirm-link" class="button">{}</a>', url, label)

    def get_readonly_fields(self, request: HttpRequest, obj: AccountingSettings | None = None) -> tuple[str, ...]:
        # When the row is being re-created (someone deleted it), the switch is a field of the form.
        return self.readonly_fields if obj is not None else ("ts_updated",)

    def get_fieldsets(self, request: HttpRequest, obj: AccountingSettings | None = None) -> Any:
        if obj is None:
            return ((None, {"fields": ("notify_enabled",), "description": OFF_MEANS}),)
        return self.fieldsets

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The migration creates the row; offer "add" only if someone removed it behind our back.
        return super().has_add_permission(request) and not AccountingSettings.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj: AccountingSettings | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: AccountingSettings, form: object, change: bool) -> None:
        # On an existing row nothing here is editable (the switch goes through its confirmation);
        # a posted form must not write the row back, not even its own copy of the switch.
        if not change:
            super().save_model(request, obj, form, change)
