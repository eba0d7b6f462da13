"""The proc table: one row per running frame, and the record of truth for every booked counter.

A kill marks the proc (`ts_kill`, `str_kill`) instead of deleting it: the proc stays booked until
the run has really ended (its completion, or the lost-host sweep), and the completion reads the
mark from the row it deletes (dispatch.engine.completion, dispatch.engine.kills)."""

from __future__ import annotations

from django.db import models

from accounting import host_memory, licences
from accounting import triggers as accounting_triggers
from dispatch.models.base import fk, now_default, pk_field


class Proc(models.Model):
    pk_proc = pk_field("pk_proc")
    host = fk("dispatch.Host", "pk_host", related_name="procs")
    show = fk("dispatch.Show", "pk_show", related_name="procs")
    job = fk("dispatch.Job", "pk_job", related_name="procs")
    layer = fk("dispatch.Layer", "pk_layer", related_name="procs")
    frame = models.OneToOneField(
        "dispatch.Frame", on_delete=models.DO_NOTHING, db_column="pk_frame", related_name="proc"
    )
    # The canonical booked amounts: centicores, KB, GPUs.
    int_cores_reserved = models.BigIntegerField()
    int_mem_reserved = models.BigIntegerField()
    int_mem_pre_reserved = models.BigIntegerField(db_default=0, default=0)
    int_mem_used = models.BigIntegerField(db_default=0, default=0)
    int_mem_max_used = models.BigIntegerField(db_default=0, default=0)
    int_virt_used = models.BigIntegerField(db_default=0, default=0)
    int_virt_max_used = models.BigIntegerField(db_default=0, default=0)
    int_gpus_reserved = models.IntegerField(db_default=0, default=0)
    int_gpu_mem_reserved = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_pre_reserved = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_used = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_max_used = models.BigIntegerField(db_default=0, default=0)
    b_unbooked = models.BooleanField(db_default=False, default=False)
    b_local = models.BooleanField(db_default=False, default=False)
    str_redirect = models.CharField(max_length=265, null=True, blank=True)
    ts_ping = models.DateTimeField(db_default=now_default())
    ts_booked = models.DateTimeField(db_default=now_default())
    ts_dispatched = models.DateTimeField(db_default=now_default())
    # cuesched's own: when a kill of this run was asked for, and what its frame becomes when
    # the run ends ('JOB': eaten; 'FRAME': back to WAITING). NULL: not being killed.
    ts_kill = models.DateTimeField(null=True, blank=True)
    str_kill = models.CharField(max_length=8, null=True, blank=True)

    class Meta:
        db_table = "proc"
        indexes = [
            models.Index(fields=["show"], name="i_proc_pk_show"),
            # The kill sender's poll: only the procs being killed (few, and short-lived).
            models.Index(fields=["ts_kill"], name="i_proc_killing", condition=models.Q(ts_kill__isnull=False)),
        ]
        constraints = [
            # Cuebot's before_insert_proc: a proc always books something.
            models.CheckConstraint(condition=models.Q(int_cores_reserved__gt=0), name="c_proc_cores_positive"),
        ]
        triggers = [
            *accounting_triggers.proc_triggers(),
            *licences.proc_licence_triggers(),
            *host_memory.proc_triggers(),
        ]

    def __str__(self) -> str:
        return f"proc {self.pk_proc} of frame {self.frame_id}"
