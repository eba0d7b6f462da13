"""Job, layer and frame tables with their resource and stat rows.

The stat rows (job_stat, layer_stat) are kept by the frame triggers declared here, so any
writer (our dispatcher, the admin, a script, a Cuebot sharing the database) keeps them
right. Unlike Cuebot, frame INSERT and DELETE are counted too, so a seed or a submission
needs no hand-written counter updates.
"""

from __future__ import annotations

from django.db import models

from accounting import licences
from accounting import triggers as accounting_triggers
from dispatch.models import depends as depend_triggers
from dispatch.models import triggers as schema_triggers
from dispatch.models.base import fk, now_default, one_to_one, pk_field

JOB_STATES = ("PENDING", "FINISHED", "STARTUP", "SHUTDOWN", "POSTED")
FRAME_STATES = ("WAITING", "SETUP", "RUNNING", "SUCCEEDED", "DEPEND", "DEAD", "EATEN", "CHECKPOINT")


class Job(models.Model):
    pk_job = pk_field("pk_job")
    folder = fk("dispatch.Folder", "pk_folder", related_name="jobs")
    show = fk("dispatch.Show", "pk_show", related_name="jobs")
    facility = fk("dispatch.Facility", "pk_facility", related_name="jobs")
    dept = fk("dispatch.Dept", "pk_dept", related_name="jobs")
    str_name = models.CharField(max_length=255, unique=True)
    str_visible_name = models.CharField(max_length=255, null=True, blank=True)
    str_show = models.CharField(max_length=512, db_default="", default="")
    str_shot = models.CharField(max_length=64, db_default="", default="")
    str_user = models.CharField(max_length=32, db_default="", default="")
    int_uid = models.BigIntegerField(null=True, blank=True)
    str_state = models.CharField(
        max_length=16, db_default="PENDING", default="PENDING", choices=[(s, s) for s in JOB_STATES]
    )
    str_log_dir = models.CharField(max_length=4000, db_default="", default="", blank=True)
    str_os = models.CharField(max_length=12, null=True, blank=True)
    str_email = models.CharField(max_length=1024, null=True, blank=True)
    str_loki_url = models.CharField(max_length=4000, null=True, blank=True)
    b_paused = models.BooleanField(db_default=False, default=False)
    b_autoeat = models.BooleanField(db_default=False, default=False)
    b_auto_book = models.BooleanField(db_default=True, default=True)
    b_auto_unbook = models.BooleanField(db_default=True, default=True)
    b_comment = models.BooleanField(db_default=False, default=False)
    int_frame_count = models.IntegerField(db_default=0, default=0)
    int_layer_count = models.IntegerField(db_default=0, default=0)
    int_max_retries = models.SmallIntegerField(db_default=3, default=3)
    ts_started = models.DateTimeField(db_default=now_default())
    ts_stopped = models.DateTimeField(null=True, blank=True)
    ts_updated = models.DateTimeField(db_default=now_default(), null=True, blank=True)

    class Meta:
        db_table = "job"
        indexes = [
            models.Index(
                fields=["show", "facility", "str_state", "b_paused"],
                name="idx_job_pending_lookup",
                condition=models.Q(str_state="PENDING", b_paused=False),
            ),
            models.Index(fields=["folder"], name="i_job_pk_folder"),
        ]
        triggers = [
            *schema_triggers.job_fanout_triggers(),
            *accounting_triggers.job_triggers(),
            *depend_triggers.job_depend_triggers(),
        ]

    def __str__(self) -> str:
        return self.str_name


class JobResource(models.Model):
    """Job caps, priority and booked totals (centicores / GPUs)."""

    pk_job_resource = pk_field("pk_job_resource")
    job = one_to_one("dispatch.Job", "pk_job", related_name="resource")
    int_priority = models.IntegerField(db_default=1, default=1)
    int_cores = models.BigIntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_min_cores = models.IntegerField(db_default=100, default=100)
    int_min_gpus = models.IntegerField(db_default=0, default=0)
    # Caps; any negative value (-1) means unlimited, 0 books nothing. The default caps a job at 100 cores.
    int_max_cores = models.IntegerField(db_default=10000, default=10000)
    int_max_gpus = models.IntegerField(db_default=100, default=100)
    int_local_cores = models.IntegerField(db_default=0, default=0)
    int_local_gpus = models.IntegerField(db_default=0, default=0)
    int_max_rss = models.BigIntegerField(db_default=0, default=0)
    int_max_vss = models.BigIntegerField(db_default=0, default=0)
    float_tier = models.DecimalField(max_digits=16, decimal_places=2, db_default=0, default=0)

    class Meta:
        db_table = "job_resource"
        triggers = accounting_triggers.job_resource_triggers()

    def __str__(self) -> str:
        return f"caps of job {self.job.str_name}"


class JobStat(models.Model):
    """Frame counts per state for a job, kept by the frame triggers."""

    pk_job_stat = pk_field("pk_job_stat")
    job = one_to_one("dispatch.Job", "pk_job", related_name="stat")
    int_waiting_count = models.BigIntegerField(db_default=0, default=0)
    int_running_count = models.BigIntegerField(db_default=0, default=0)
    int_dead_count = models.BigIntegerField(db_default=0, default=0)
    int_depend_count = models.BigIntegerField(db_default=0, default=0)
    int_eaten_count = models.BigIntegerField(db_default=0, default=0)
    int_succeeded_count = models.BigIntegerField(db_default=0, default=0)
    int_checkpoint_count = models.BigIntegerField(db_default=0, default=0)
    int_total_count = models.BigIntegerField(db_default=0, default=0)

    class Meta:
        db_table = "job_stat"

    def __str__(self) -> str:
        return f"stats of job {self.job.str_name}"


class JobMem(models.Model):
    """Cuebot's job_mem: the job's max RSS (KB), the largest of its frames' runs.

    Made with the job (job_fanout; beside Cuebot its after_insert_job trigger), raised by every
    memory report and completion in the statement that writes the proc's use (dispatch.engine.memory,
    dispatch.engine.completion), never lowered. VSS and PSS are Cuebot's columns, kept at 0 here."""

    pk_job_mem = pk_field("pk_job_mem")
    job = one_to_one("dispatch.Job", "pk_job", related_name="mem")
    int_max_rss = models.BigIntegerField(db_default=0, default=0)
    int_max_vss = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_max = models.BigIntegerField(db_default=0, default=0)
    int_max_pss = models.BigIntegerField(db_default=0, default=0, null=True, blank=True)

    class Meta:
        db_table = "job_mem"

    def __str__(self) -> str:
        return f"max RSS of job {self.job_id}"


class JobEnv(models.Model):
    """Cuebot's job_env: one environment variable every frame of the job gets (the spec's `env`)."""

    pk_job_env = pk_field("pk_job_env")
    job = fk("dispatch.Job", "pk_job", null=True, related_name="env")
    str_key = models.CharField(max_length=2048, null=True, blank=True)
    str_value = models.CharField(max_length=2048, null=True, blank=True)

    class Meta:
        db_table = "job_env"
        indexes = [models.Index(fields=["job"], name="i_job_env_pk_job")]

    def __str__(self) -> str:
        return f"{self.str_key} of job {self.job_id}"


class Layer(models.Model):
    pk_layer = pk_field("pk_layer")
    job = fk("dispatch.Job", "pk_job", related_name="layers")
    str_name = models.CharField(max_length=256)
    str_cmd = models.CharField(max_length=4000)
    str_range = models.CharField(max_length=4000)
    int_chunk_size = models.BigIntegerField(db_default=1, default=1)
    int_dispatch_order = models.BigIntegerField(db_default=1, default=1)
    # Per frame: cores in centicores, memory in KB (default 4 GiB).
    int_cores_min = models.BigIntegerField(db_default=100, default=100)
    int_cores_max = models.IntegerField(db_default=0, default=0)
    int_mem_min = models.BigIntegerField(db_default=4194304, default=4194304)
    int_gpus_min = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_min = models.BigIntegerField(db_default=0, default=0)
    b_threadable = models.BooleanField(db_default=True, default=True)
    b_optimize = models.BooleanField(db_default=True, default=True)
    str_tags = models.CharField(max_length=4000, db_default="", default="", blank=True)
    str_type = models.CharField(max_length=16, db_default="Render", default="Render")
    str_services = models.CharField(max_length=128, db_default="default", default="default")
    int_timeout = models.IntegerField(db_default=0, default=0)
    int_timeout_llu = models.IntegerField(db_default=0, default=0)
    ts_start_after = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "layer"
        constraints = [models.UniqueConstraint(fields=["str_name", "job"], name="c_layer_str_name_pk_job")]
        triggers = [*schema_triggers.layer_fanout_triggers(), *licences.layer_created_triggers()]

    def __str__(self) -> str:
        return self.str_name


class LayerResource(models.Model):
    pk_layer_resource = pk_field("pk_layer_resource")
    layer = one_to_one("dispatch.Layer", "pk_layer", related_name="resource")
    job = fk("dispatch.Job", "pk_job")
    int_cores = models.BigIntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_max_rss = models.BigIntegerField(db_default=0, default=0)
    int_max_vss = models.BigIntegerField(db_default=0, default=0)

    class Meta:
        db_table = "layer_resource"
        triggers = accounting_triggers.layer_resource_triggers()

    def __str__(self) -> str:
        return f"resources of layer {self.layer.str_name}"


class LayerStat(models.Model):
    pk_layer_stat = pk_field("pk_layer_stat")
    layer = one_to_one("dispatch.Layer", "pk_layer", related_name="stat")
    job = fk("dispatch.Job", "pk_job")
    int_waiting_count = models.BigIntegerField(db_default=0, default=0)
    int_running_count = models.BigIntegerField(db_default=0, default=0)
    int_dead_count = models.BigIntegerField(db_default=0, default=0)
    int_depend_count = models.BigIntegerField(db_default=0, default=0)
    int_eaten_count = models.BigIntegerField(db_default=0, default=0)
    int_succeeded_count = models.BigIntegerField(db_default=0, default=0)
    int_checkpoint_count = models.BigIntegerField(db_default=0, default=0)
    int_total_count = models.BigIntegerField(db_default=0, default=0)
    ts_started = models.DateTimeField(null=True, blank=True)
    ts_stopped = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "layer_stat"
        indexes = [
            models.Index(
                fields=["layer"], name="idx_layer_stat_waiting", condition=models.Q(int_waiting_count__gt=0)
            ),
        ]

    def __str__(self) -> str:
        return f"stats of {self.layer_id}"


class LayerMem(models.Model):
    """Cuebot's layer_mem: the layer's max RSS (KB), the largest of its frames' runs (see JobMem)."""

    pk_layer_mem = pk_field("pk_layer_mem")
    job = fk("dispatch.Job", "pk_job")
    layer = one_to_one("dispatch.Layer", "pk_layer", related_name="mem")
    int_max_rss = models.BigIntegerField(db_default=0, default=0)
    int_max_vss = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_max = models.BigIntegerField(db_default=0, default=0)
    int_max_pss = models.BigIntegerField(db_default=0, default=0, null=True, blank=True)

    class Meta:
        db_table = "layer_mem"
        indexes = [models.Index(fields=["job"], name="i_layer_mem_pk_job")]

    def __str__(self) -> str:
        return f"max RSS of layer {self.layer_id}"


class LayerEnv(models.Model):
    """Cuebot's layer_env: one environment variable the layer's frames get, over the job's."""

    pk_layer_env = pk_field("pk_layer_env")
    layer = fk("dispatch.Layer", "pk_layer", null=True, related_name="env")
    job = fk("dispatch.Job", "pk_job", null=True)
    str_key = models.CharField(max_length=2048, null=True, blank=True)
    str_value = models.CharField(max_length=2048, null=True, blank=True)

    class Meta:
        db_table = "layer_env"
        indexes = [
            models.Index(fields=["layer"], name="i_layer_env_pk_layer"),
            models.Index(fields=["job"], name="i_layer_env_pk_job"),
        ]

    def __str__(self) -> str:
        return f"{self.str_key} of layer {self.layer_id}"


class Frame(models.Model):
    pk_frame = pk_field("pk_frame")
    layer = fk("dispatch.Layer", "pk_layer", related_name="frames")
    job = fk("dispatch.Job", "pk_job", related_name="frames")
    str_name = models.CharField(max_length=256)
    str_state = models.CharField(
        max_length=24, db_default="WAITING", default="WAITING", choices=[(s, s) for s in FRAME_STATES]
    )
    int_number = models.BigIntegerField()
    int_depend_count = models.BigIntegerField(db_default=0, default=0)
    int_exit_status = models.BigIntegerField(db_default=-1, default=-1)
    int_retries = models.BigIntegerField(db_default=0, default=0)
    int_dispatch_order = models.BigIntegerField(db_default=0, default=0)
    int_layer_order = models.IntegerField(db_default=0, default=0)
    int_version = models.IntegerField(db_default=0, default=0)
    str_host = models.CharField(max_length=256, null=True, blank=True)
    int_cores = models.IntegerField(db_default=0, default=0)
    int_mem_reserved = models.BigIntegerField(db_default=0, default=0)
    int_mem_used = models.BigIntegerField(db_default=0, default=0)
    int_mem_max_used = models.BigIntegerField(db_default=0, default=0)
    int_gpus = models.IntegerField(db_default=0, default=0)
    int_gpu_mem_reserved = models.BigIntegerField(db_default=0, default=0)
    int_gpu_mem_max_used = models.BigIntegerField(db_default=0, default=0)
    str_checkpoint_state = models.CharField(max_length=12, db_default="DISABLED", default="DISABLED")
    int_checkpoint_count = models.SmallIntegerField(db_default=0, default=0)
    ts_started = models.DateTimeField(null=True, blank=True)
    ts_stopped = models.DateTimeField(null=True, blank=True)
    ts_last_run = models.DateTimeField(null=True, blank=True)
    ts_updated = models.DateTimeField(db_default=now_default(), null=True, blank=True)
    # cuesched's own: why the last run ended as it did when its exit status alone does not say it
    # (a memory failure and its raised memory, a timeout, a NIMBY lock); NULL after an ordinary end.
    # Written by the completion path (dispatch.engine.completion), shown on the frame and why pages.
    str_reason = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "frame"
        constraints = [models.UniqueConstraint(fields=["str_name", "job"], name="c_frame_str_name_pk_job")]
        indexes = [
            models.Index(
                fields=["layer", "int_dispatch_order", "int_layer_order"],
                name="i_frame_waiting_dispatch",
                condition=models.Q(str_state="WAITING"),
            ),
            models.Index(fields=["job", "str_state"], name="i_frame_pk_job_state"),
            # The console's farm-wide frame list, most recently changed first: without it every
            # page view sorted all frames (0.5 s at 500,000). A state filter walks it too, or for a
            # rare state takes i_frame_pk_job_state and sorts the few rows. One btree insert per
            # frame update; those that set ts_updated change str_state too, so were not HOT anyway.
            models.Index(fields=["-ts_updated", "pk_frame"], name="i_frame_updated"),
        ]
        triggers = [*schema_triggers.frame_stat_triggers(), *depend_triggers.frame_depend_triggers()]

    def __str__(self) -> str:
        return self.str_name
