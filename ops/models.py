"""Ops console models: the audit trail's event tables and the console's permissions.

The farm tables are the `dispatch` app's. Their audit triggers are declared on proxy models
here, so `makemigrations ops` carries them and the dispatch app's migrations stay untouched;
a proxy has the same table, so the triggers fire for every writer of that table.
"""

from __future__ import annotations

import pghistory
from django.db import models

from accounting.models import AccountingSettings
from dispatch.models import FolderResource, JobResource, LimitRecord, Show, Subscription
from ops.audit import ChangeEvent, CreateEvent, audit_attrs

SUB_CAPS = ["int_burst", "int_size"]
CAP_MAXES = ["int_max_cores", "int_max_gpus"]
SHOW_FLAG = ["b_scheduler_managed"]
KILL_SWITCH = ["notify_enabled"]
LIMIT_FIELDS = ["int_max_value", "b_host_limit"]

EVENT_META = {"ordering": ["-pgh_created_at", "-pgh_id"]}


class AuditedSubscription(Subscription):
    class Meta:
        proxy = True
        app_label = "ops"
        verbose_name = "subscription"


class AuditedFolderResource(FolderResource):
    class Meta:
        proxy = True
        app_label = "ops"
        verbose_name = "folder caps"


class AuditedJobResource(JobResource):
    class Meta:
        proxy = True
        app_label = "ops"
        verbose_name = "job caps"


class AuditedShow(Show):
    class Meta:
        proxy = True
        app_label = "ops"
        verbose_name = "show"


class AuditedAccountingSettings(AccountingSettings):
    class Meta:
        proxy = True
        app_label = "ops"
        verbose_name = "accounting settings"


pghistory.track(
    ChangeEvent("sub_caps", SUB_CAPS),
    fields=["pk_subscription", "show", "alloc", *SUB_CAPS],
    model_name="SubscriptionCapEvent",
    app_label="ops",
    attrs=audit_attrs(Subscription, SUB_CAPS),
    meta={**EVENT_META, "verbose_name": "subscription cap change"},
)(AuditedSubscription)

pghistory.track(
    ChangeEvent("folder_caps", CAP_MAXES),
    fields=["pk_folder_resource", "folder", *CAP_MAXES],
    model_name="FolderCapEvent",
    app_label="ops",
    attrs=audit_attrs(FolderResource, CAP_MAXES),
    meta={**EVENT_META, "verbose_name": "folder cap change"},
)(AuditedFolderResource)

pghistory.track(
    ChangeEvent("job_caps", CAP_MAXES),
    fields=["pk_job_resource", "job", *CAP_MAXES],
    model_name="JobCapEvent",
    app_label="ops",
    attrs=audit_attrs(JobResource, CAP_MAXES),
    meta={**EVENT_META, "verbose_name": "job cap change"},
)(AuditedJobResource)

pghistory.track(
    ChangeEvent("managed_flip", SHOW_FLAG),
    fields=["pk_show", "str_name", *SHOW_FLAG],
    model_name="ShowManagedEvent",
    app_label="ops",
    attrs=audit_attrs(Show, SHOW_FLAG),
    meta={**EVENT_META, "verbose_name": "managed flip"},
)(AuditedShow)


# Who turned accounting notifications off, and when, is the first question after an over-booking.
# The row always exists (made by migrate, and a trigger refuses its DELETE), so it changes by
# UPDATE; the one other way, TRUNCATE then INSERT, is recorded by its INSERT (old value empty).
pghistory.track(
    ChangeEvent("kill_switch", KILL_SWITCH),
    CreateEvent("kill_switch"),
    fields=["id", *KILL_SWITCH],
    model_name="KillSwitchEvent",
    app_label="ops",
    attrs=audit_attrs(AccountingSettings, KILL_SWITCH),
    meta={**EVENT_META, "verbose_name": "kill switch change"},
)(AuditedAccountingSettings)


class AuditedLimitRecord(LimitRecord):
    # In the accounting app (its migration 0005_limits carries the event table and triggers):
    # a licence limit is a cap of every show, changed like one.
    class Meta:
        proxy = True
        app_label = "accounting"
        verbose_name = "licence limit"


# A limit created, its max changed or its host flag switched, by whoever writes the row.
pghistory.track(
    ChangeEvent("limit_change", LIMIT_FIELDS),
    CreateEvent("limit_create"),
    fields=["pk_limit_record", "str_name", *LIMIT_FIELDS],
    model_name="LimitRecordEvent",
    app_label="accounting",
    attrs=audit_attrs(LimitRecord, LIMIT_FIELDS),
    meta={**EVENT_META, "verbose_name": "licence limit change"},
)(AuditedLimitRecord)


class Console(models.Model):
    """No table: the content type that carries the console's permissions (see ops.permissions)."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("view_console", "Can view the ops console (live counters, why not booking, audit)"),
            ("flip_show", "Can flip a show between scheduler- and database-managed accounting"),
            ("edit_caps", "Can edit subscription burst/size and folder/job max cores/GPUs"),
            ("set_kill_switch", "Can turn accounting notifications on or off"),
        ]
        verbose_name = "ops console"
        verbose_name_plural = "ops console"

    def __str__(self) -> str:
        return "ops console"
