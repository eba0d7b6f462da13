"""The accounting kill switch: one row, read by the notification triggers on every statement.

It lives in a table, not in a setting: `ALTER DATABASE ... SET` reaches only new sessions,
while a committed row is seen by the next statement of every connection at once (the
triggers read it under READ COMMITTED). Off means the triggers emit no `acct_release` and
no `acct_limit_change` at all; the scheduler then heals from its recompute (~15 s) and
limit reseed (~5 min) loops. The database-enforced accounting of shows that are not
scheduler-managed does not depend on it.
"""

from __future__ import annotations

from django.db import models

from accounting import triggers as accounting_triggers

SETTINGS_ROW_ID = 1


class AccountingSettings(models.Model):
    """The single settings row (id 1). A missing row reads as `notify_enabled = true`."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=SETTINGS_ROW_ID, editable=False)
    notify_enabled = models.BooleanField(
        db_default=True,
        default=True,
        verbose_name="send accounting notifications",
        help_text=(
            "On: every proc delete of a scheduler-managed show sends acct_release, and every "
            "burst / max cores / max GPUs change sends acct_limit_change, inside the writing "
            "transaction. Off: nothing is sent, for every connection from the next statement on; "
            "the scheduler then corrects its counters from SUM(proc) every ~15 s and its caps "
            "every ~5 min, so a lowered cap can be over-booked until then."
        ),
    )
    ts_updated = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "cuesched_accounting_settings"
        verbose_name = "accounting settings"
        verbose_name_plural = "accounting settings"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(id=SETTINGS_ROW_ID), name="cuesched_accounting_settings_single_row"
            ),
        ]
        triggers = accounting_triggers.settings_triggers()

    def __str__(self) -> str:
        return "notifications on" if self.notify_enabled else "notifications OFF"

    @classmethod
    def notifications_enabled(cls) -> bool:
        """What the triggers read: the row's flag, or on when the row is missing."""
        row = cls.objects.filter(id=SETTINGS_ROW_ID).only("notify_enabled").first()
        return True if row is None else row.notify_enabled

    @classmethod
    def set_notifications_enabled(cls, enabled: bool) -> None:
        """Flip the kill switch; it takes effect for every connection when the caller commits."""
        cls.objects.update_or_create(id=SETTINGS_ROW_ID, defaults={"notify_enabled": enabled})
