"""The record of every control an operator or a program applies to jobs, frames and hosts.

The cap and flip history is trigger-recorded (`ops.audit`), because anyone may write those
rows. The controls here (pause, kill, retry, eat, priority, lock, drain...) change columns
the scheduler itself writes all the time (frame state, host idle), so a row trigger cannot
tell an operator's kill from a completion: the action functions of `dispatch.jobs`
write one row here in the same transaction as the change instead, so the audit row exists
exactly when the change committed.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

# "facility", "alloc", "show" and "sub" (a subscription): the farm set-up actions (ops.setup_actions);
# "service" and "show_svc" (a show's override of a service): ops.service_actions.
TARGET_KINDS = ("job", "frame", "host", "facility", "alloc", "show", "sub", "service", "show_svc")


class FarmAction(models.Model):
    id = models.BigAutoField(primary_key=True)
    ts_created = models.DateTimeField(db_default=Now())
    str_action = models.CharField(max_length=32)
    str_target_kind = models.CharField(max_length=8, choices=[(k, k) for k in TARGET_KINDS])
    str_target = models.CharField(max_length=36)  # the job's or host's id; for frames, their job's
    str_target_name = models.CharField(max_length=256, default="", blank=True)
    int_changed = models.IntegerField(default=0)
    detail = models.JSONField(default=dict, blank=True)
    str_username = models.CharField(max_length=150, default="", blank=True)

    class Meta:
        db_table = "cuesched_farm_action"
        ordering = ["-ts_created", "-id"]
        indexes = [models.Index(fields=["-ts_created"], name="i_farm_action_created")]
        verbose_name = "farm action"

    def __str__(self) -> str:
        return f"{self.str_action} {self.str_target_kind} {self.str_target_name or self.str_target}"
