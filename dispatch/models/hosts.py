"""Render hosts, their live stats and tags."""

from __future__ import annotations

from django.db import models

from accounting import host_memory
from accounting import triggers as accounting_triggers
from dispatch.models.base import fk, now_default, one_to_one, pk_field

HOST_LOCK_STATES = ("OPEN", "LOCKED", "NIMBY_LOCKED")
HOST_STATES = ("UP", "DOWN", "REBOOTING", "REBOOT_WHEN_IDLE", "REPAIR")
TAG_TYPES = ("ALLOC", "MANUAL", "HOSTNAME", "HARDWARE")


class Host(models.Model):
    """A render host. Cores in centicores, memory in KB; `*_idle` is what is not booked."""

    pk_host = pk_field("pk_host")
    alloc = fk("dispatch.Alloc", "pk_alloc", related_name="hosts")
    str_name = models.CharField(max_length=45, unique=True)
    str_fqdn = models.CharField(max_length=128, null=True, blank=True)
    str_lock_state = models.CharField(
        max_length=36, db_default="OPEN", default="OPEN", choices=[(s, s) for s in HOST_LOCK_STATES]
    )
    b_nimby = models.BooleanField(db_default=False, default=False)
    b_unlock_boot = models.BooleanField(db_default=False, default=False)
    b_unlock_idle = models.BooleanField(db_default=False, default=False)
    b_reboot_idle = models.BooleanField(db_default=False, default=False)
    b_comment = models.BooleanField(db_default=False, default=False)
    str_tags = models.CharField(max_length=128, null=True, blank=True)
    int_thread_mode = models.IntegerField(db_default=0, default=0)
    int_cores = models.BigIntegerField()
    int_cores_idle = models.BigIntegerField()
    int_mem = models.BigIntegerField()
    int_mem_idle = models.BigIntegerField()
    int_gpus = models.BigIntegerField(db_default=0, default=0)
    int_gpus_idle = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_idle = models.BigIntegerField(db_default=0, default=0)
    # Not Cuebot's: where an RQD host's daemon answers (ip:port), set by its startup report;
    # null for hosts of our own agents.
    str_rqd_address = models.CharField(max_length=160, null=True, blank=True)
    ts_created = models.DateTimeField(db_default=now_default())
    ts_last_updated = models.DateTimeField(db_default=now_default(), null=True, blank=True)

    class Meta:
        db_table = "host"
        constraints = [
            # Cuebot's verify_host_resources, as constraints: idle never goes negative.
            models.CheckConstraint(
                condition=models.Q(
                    int_cores_idle__gte=0, int_mem_idle__gte=0, int_gpus_idle__gte=0, int_gpu_mem_idle__gte=0
                ),
                name="c_host_idle_not_negative",
            ),
        ]
        triggers = [*accounting_triggers.host_triggers(), *host_memory.host_triggers()]

    def __str__(self) -> str:
        return self.str_name


class HostStat(models.Model):
    pk_host_stat = pk_field("pk_host_stat")
    host = one_to_one("dispatch.Host", "pk_host", related_name="stat")
    str_state = models.CharField(
        max_length=32, db_default="UP", default="UP", choices=[(s, s) for s in HOST_STATES]
    )
    str_os = models.CharField(max_length=32, null=True, blank=True)
    int_mem_total = models.BigIntegerField(db_default=0, default=0)
    int_mem_free = models.BigIntegerField(db_default=0, default=0)
    int_swap_total = models.BigIntegerField(db_default=0, default=0)
    int_swap_free = models.BigIntegerField(db_default=0, default=0)
    int_mcp_total = models.BigIntegerField(db_default=0, default=0)
    int_mcp_free = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_total = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_free = models.BigIntegerField(db_default=0, default=0)
    int_load = models.BigIntegerField(db_default=0, default=0)
    ts_ping = models.DateTimeField(db_default=now_default())
    ts_booted = models.DateTimeField(db_default=now_default(), null=True, blank=True)

    class Meta:
        db_table = "host_stat"

    def __str__(self) -> str:
        return f"{self.host_id} {self.str_state}"


class HostTag(models.Model):
    pk_host_tag = pk_field("pk_host_tag")
    host = fk("dispatch.Host", "pk_host", related_name="tags")
    str_tag = models.CharField(max_length=45)
    # Upper-case types are what dispatch reads; the mixed-case default is Cuebot's.
    str_tag_type = models.CharField(max_length=24, db_default="Hardware", default="Hardware")
    b_constant = models.BooleanField(db_default=False, default=False)

    class Meta:
        db_table = "host_tag"
        indexes = [models.Index(fields=["str_tag"], name="i_host_tag_str_tag")]

    def __str__(self) -> str:
        return f"{self.str_tag} ({self.str_tag_type})"


class WaitingHost(models.Model):
    """cuesched's own: an RQD whose host is unknown and that no default allocation takes
    (`CUESCHED_RQD_DEFAULT_ALLOC` unset). Its reports are answered UNAVAILABLE, the one status on
    which RQD 1.37 retries its startup (every 15 s) instead of exiting, and it waits here, as its
    last report described it, until an operator admits it into an allocation (`manage.py rqd_hosts
    admit NAME --alloc ALLOC`, dispatch.hosts.waiting); its next startup report then registers it."""

    id = models.BigAutoField(primary_key=True)
    str_name = models.CharField(max_length=45, unique=True)
    str_address = models.CharField(max_length=160, null=True, blank=True)
    int_cores = models.IntegerField(db_default=0, default=0)  # whole cores
    int_mem = models.BigIntegerField(db_default=0, default=0)  # KB
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_gpu_mem = models.BigIntegerField(db_default=0, default=0)  # KB
    str_os = models.CharField(max_length=32, db_default="", default="", blank=True)
    str_tags = models.CharField(max_length=512, db_default="", default="", blank=True)
    int_reports = models.BigIntegerField(db_default=1, default=1)
    ts_first_seen = models.DateTimeField(db_default=now_default())
    ts_last_seen = models.DateTimeField(db_default=now_default())

    class Meta:
        db_table = "cuesched_waiting_host"
        ordering = ["str_name"]

    def __str__(self) -> str:
        return f"{self.str_name} (waiting since {self.ts_first_seen:%Y-%m-%d %H:%M})"
