"""Organisation tables: facility, department, show, allocation, subscription, point, folder.

Units follow Cuebot: cores in centicores (cores x 100), memory in KB, GPUs as counts.
"""

from __future__ import annotations

from django.db import models

from accounting import triggers as accounting_triggers
from dispatch.models import triggers as schema_triggers
from dispatch.models.base import fk, now_default, one_to_one, pk_field


class Facility(models.Model):
    pk_facility = pk_field("pk_facility")
    str_name = models.CharField(max_length=36, unique=True)
    b_default = models.BooleanField(db_default=False, default=False)

    class Meta:
        db_table = "facility"
        verbose_name_plural = "facilities"

    def __str__(self) -> str:
        return self.str_name


class Dept(models.Model):
    pk_dept = pk_field("pk_dept")
    str_name = models.CharField(max_length=36, unique=True)
    b_default = models.BooleanField(db_default=False, default=False)

    class Meta:
        db_table = "dept"
        verbose_name = "department"

    def __str__(self) -> str:
        return self.str_name


class Show(models.Model):
    pk_show = pk_field("pk_show")
    str_name = models.CharField(max_length=512, unique=True)
    b_paused = models.BooleanField(db_default=False, default=False)
    b_booking_enabled = models.BooleanField(db_default=True, default=True)
    b_dispatch_enabled = models.BooleanField(db_default=True, default=True)
    b_active = models.BooleanField(db_default=True, default=True)
    int_default_min_cores = models.IntegerField(db_default=100, default=100)
    int_default_max_cores = models.IntegerField(db_default=10000, default=10000)
    int_default_min_gpus = models.IntegerField(db_default=0, default=0)
    int_default_max_gpus = models.IntegerField(db_default=100, default=100)
    int_job_insert_count = models.BigIntegerField(db_default=0, default=0)
    int_frame_insert_count = models.BigIntegerField(db_default=0, default=0)
    int_frame_success_count = models.BigIntegerField(db_default=0, default=0)
    int_frame_fail_count = models.BigIntegerField(db_default=0, default=0)
    str_comment_email = models.CharField(max_length=1024, null=True, blank=True)
    # V45: who owns accounting for the whole show. true = the scheduler's Store.
    b_scheduler_managed = models.BooleanField(db_default=False, default=False)

    class Meta:
        db_table = "show"
        triggers = accounting_triggers.show_triggers()

    def __str__(self) -> str:
        return self.str_name


class Alloc(models.Model):
    pk_alloc = pk_field("pk_alloc")
    facility = fk("dispatch.Facility", "pk_facility", related_name="allocs")
    str_name = models.CharField(max_length=36, unique=True)
    str_tag = models.CharField(max_length=24, null=True, blank=True)
    b_allow_edit = models.BooleanField(db_default=True, default=True)
    b_default = models.BooleanField(db_default=False, default=False)
    b_billable = models.BooleanField(db_default=True, default=True)
    b_enabled = models.BooleanField(db_default=True, default=True)

    class Meta:
        db_table = "alloc"
        verbose_name = "allocation"

    def __str__(self) -> str:
        return self.str_name


class Subscription(models.Model):
    pk_subscription = pk_field("pk_subscription")
    alloc = fk("dispatch.Alloc", "pk_alloc", related_name="subscriptions")
    show = fk("dispatch.Show", "pk_show", related_name="subscriptions")
    int_size = models.BigIntegerField(db_default=0, default=0)
    # The hard cap on booked cores for (show, alloc), in centicores. 0 freezes the subscription.
    int_burst = models.BigIntegerField(db_default=0, default=0)
    int_cores = models.IntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    float_tier = models.DecimalField(max_digits=16, decimal_places=2, db_default=0, default=0)

    class Meta:
        db_table = "subscription"
        constraints = [models.UniqueConstraint(fields=["show", "alloc"], name="c_subscription_uk")]
        triggers = accounting_triggers.subscription_triggers()

    def __str__(self) -> str:
        # Names, not ids: this is the title of the record on every admin page and message.
        return f"{self.show.str_name} @ {self.alloc.str_name}"


class Point(models.Model):
    """Per (show, department) usage; written by the recompute for display, never enforced."""

    pk_point = pk_field("pk_point")
    dept = fk("dispatch.Dept", "pk_dept", related_name="points")
    show = fk("dispatch.Show", "pk_show", related_name="points")
    str_ti_task = models.CharField(max_length=36, null=True, blank=True)
    int_cores = models.IntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_min_cores = models.IntegerField(db_default=0, default=0)
    int_min_gpus = models.IntegerField(db_default=0, default=0)
    b_managed = models.BooleanField(db_default=False, default=False)
    float_tier = models.DecimalField(max_digits=16, decimal_places=2, db_default=0, default=0)
    ts_updated = models.DateTimeField(db_default=now_default(), null=True, blank=True)

    class Meta:
        db_table = "point"
        constraints = [models.UniqueConstraint(fields=["show", "dept"], name="c_point_pk_show_dept")]
        triggers = accounting_triggers.point_triggers()

    def __str__(self) -> str:
        return f"{self.show_id}:{self.dept_id}"


class Folder(models.Model):
    """A group of jobs inside a show; its caps live in folder_resource."""

    pk_folder = pk_field("pk_folder")
    parent_folder = fk("dispatch.Folder", "pk_parent_folder", null=True, related_name="children")
    show = fk("dispatch.Show", "pk_show", related_name="folders")
    dept = fk("dispatch.Dept", "pk_dept", null=True, related_name="folders")
    str_name = models.CharField(max_length=36)
    int_priority = models.IntegerField(db_default=1, default=1)
    b_default = models.BooleanField(db_default=False, default=False)
    b_exclude_managed = models.BooleanField(db_default=False, default=False)
    int_job_min_cores = models.IntegerField(db_default=-1, default=-1)
    int_job_max_cores = models.IntegerField(db_default=-1, default=-1)
    int_job_min_gpus = models.IntegerField(db_default=-1, default=-1)
    int_job_max_gpus = models.IntegerField(db_default=-1, default=-1)
    int_job_priority = models.IntegerField(db_default=-1, default=-1)
    f_order = models.IntegerField(db_default=0, default=0)

    class Meta:
        db_table = "folder"
        constraints = [
            models.UniqueConstraint(fields=["show", "parent_folder", "str_name"], name="c_folder_uk"),
        ]
        triggers = [*schema_triggers.folder_fanout_triggers(), *accounting_triggers.folder_triggers()]

    def __str__(self) -> str:
        return self.str_name


class FolderResource(models.Model):
    """Folder caps and booked totals. Exactly one row per folder, made by the folder insert trigger."""

    pk_folder_resource = pk_field("pk_folder_resource")
    folder = one_to_one("dispatch.Folder", "pk_folder", related_name="resource")
    int_cores = models.IntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_min_cores = models.IntegerField(db_default=0, default=0)
    int_min_gpus = models.IntegerField(db_default=0, default=0)
    # Caps in centicores / GPUs; any negative value (-1) means unlimited, 0 books nothing.
    int_max_cores = models.IntegerField(db_default=-1, default=-1)
    int_max_gpus = models.IntegerField(db_default=-1, default=-1)
    float_tier = models.DecimalField(max_digits=16, decimal_places=2, db_default=0, default=0)

    class Meta:
        db_table = "folder_resource"
        triggers = accounting_triggers.folder_resource_triggers()

    def __str__(self) -> str:
        return f"caps of folder {self.folder.str_name}"
