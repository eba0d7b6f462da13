"""Cuebot's `service` and `show_service` tables: a layer's defaults by the kind of work it runs.

A layer names services (`"services": ["arnold"]`); the first that resolves sets the fields its
spec leaves out (dispatch.jobs.services). `show_service` is one show's override of a service,
whole: a row there replaces the service for that show, it does not patch single fields.

The columns are Cuebot's, as its Flyway migrations leave them (V1 creates both tables, V7 adds
the timeouts, V11 renames int_gpu_min to int_gpu_mem_min as BIGINT and adds the GPU counts, V15
adds int_min_memory_increase), with Cuebot's types, nullability, defaults and index names: on a
Cuebot database these tables are Cuebot's, and adoption (dispatch.adoption) must find nothing
of cuesched's to add to them. Units are Cuebot's: cores in centicores, memory in KB, timeouts in
minutes. Cuebot has no index on show_service.pk_show (its unique (str_name, pk_show) serves the
lookups), so neither does cuesched.
"""

from __future__ import annotations

from django.db import models

from dispatch.models.base import fk, pk_field

# Cuebot's Dispatcher.MINIMUM_MEMORY_INCREASE, V15's column default: 2 GB in KB.
DEFAULT_MIN_MEMORY_INCREASE_KB = 2097152
INT_MAX = 2**31 - 1  # the INT columns' largest value (memory in KB: 2 TB)


class ServiceFields(models.Model):
    """The columns `service` and `show_service` share, in Cuebot's order and types."""

    str_name = models.CharField(max_length=36)
    b_threadable = models.BooleanField()
    int_cores_min = models.IntegerField()
    int_mem_min = models.IntegerField()
    str_tags = models.CharField(max_length=128)
    int_cores_max = models.IntegerField(db_default=0, default=0)
    int_gpu_mem_min = models.BigIntegerField(db_default=0, default=0)
    int_gpus_min = models.IntegerField(db_default=0, default=0)
    int_gpus_max = models.IntegerField(db_default=0, default=0)
    int_timeout = models.IntegerField(db_default=0, default=0)
    int_timeout_llu = models.IntegerField(db_default=0, default=0)
    int_min_memory_increase = models.IntegerField(
        db_default=DEFAULT_MIN_MEMORY_INCREASE_KB, default=DEFAULT_MIN_MEMORY_INCREASE_KB
    )

    class Meta:
        abstract = True

    @property
    def tags(self) -> list[str]:
        """ServiceDaoJdbc.splitTags: split on " | ", spaces removed."""
        return [t for t in (x.replace(" ", "") for x in (self.str_tags or "").split(" | ")) if t]


class Service(ServiceFields):
    pk_service = pk_field("pk_service")

    class Meta:
        db_table = "service"
        constraints = [models.UniqueConstraint(fields=["str_name"], name="i_service_str_name")]
        indexes = [
            models.Index(fields=["int_gpu_mem_min"], name="i_service_int_gpu_mem_min"),
            models.Index(fields=["int_gpus_min"], name="i_service_int_gpus_min"),
        ]

    def __str__(self) -> str:
        return self.str_name


class ShowService(ServiceFields):
    pk_show_service = pk_field("pk_show_service")
    show = fk("dispatch.Show", "pk_show", related_name="service_overrides", db_index=False)

    class Meta:
        db_table = "show_service"
        verbose_name = "show service override"
        constraints = [models.UniqueConstraint(fields=["str_name", "show"], name="i_show_service_str_name")]
        indexes = [
            models.Index(fields=["int_gpu_mem_min"], name="i_show_service_int_gpu_mem_min"),
            models.Index(fields=["int_gpus_min"], name="i_show_service_int_gpus_min"),
        ]

    def __str__(self) -> str:
        return f"{self.str_name} for {self.show.str_name}"
