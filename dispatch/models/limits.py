"""Licence limits: OpenCue's `limit_record` and `layer_limit`, with the use kept beside the max.

The columns are Cuebot's (names and types); `int_running` (what the max is compared with:
frames, or hosts for a `b_host_limit`) and `int_frames` are cuesched's, written only by the
triggers in `accounting.licences`, which recount them from `proc` under the limit row's lock.
"""

from __future__ import annotations

from django.db import models

from accounting import licences
from dispatch.models.base import fk, pk_field


class LimitRecord(models.Model):
    pk_limit_record = pk_field("pk_limit_record")
    str_name = models.CharField(max_length=255, unique=True)
    # Any negative value is unlimited (counted, never refused); 0 lets nothing run.
    int_max_value = models.IntegerField(db_default=-1, default=-1)
    # Count one per host running any frame of the limit (a per-machine licence), not per frame.
    b_host_limit = models.BooleanField(db_default=False, default=False)
    int_running = models.IntegerField(db_default=0, default=0, editable=False)
    int_frames = models.IntegerField(db_default=0, default=0, editable=False)

    class Meta:
        db_table = "limit_record"
        triggers = licences.limit_record_triggers()

    def __str__(self) -> str:
        return self.str_name


class LayerLimit(models.Model):
    pk_layer_limit = pk_field("pk_layer_limit")
    layer = fk("dispatch.Layer", "pk_layer", related_name="limits")
    limit = fk("dispatch.LimitRecord", "pk_limit_record", related_name="layers")

    class Meta:
        db_table = "layer_limit"
        constraints = [models.UniqueConstraint(fields=["layer", "limit"], name="c_layer_limit_unique")]
        triggers = licences.layer_limit_triggers()

    def __str__(self) -> str:
        return f"limit {self.limit_id} on layer {self.layer_id}"
