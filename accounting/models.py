"""The accounting kill switch: one row, read by the notification triggers on every statement.

It lives in a table, not in a setting: `ALTER DATABASE ... SET` reaches only new sessions,
while a committed row is seen by the next statement of every connection at once (the
triggers read it under READ COMMITTED). Off means the triggers emit no `acct_release` and
no `acct_limit_change` at all; the scheduler then heals from its recompute (~15 s) and
limit reseed (~5 min) loops. The database-enforced accounting of shows that are not
scheduler-managed does not depend on it.
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models

from accounting import host_memory
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
            "On: every proc delete of a scheduler-managed show sends its release (acct_release), "
            "inside the writing transaction. Off: releases are not sent, for every connection "
            "from the next statement on, and the scheduler corrects its counters from SUM(proc) "
            "every ~15 s (it under-books meanwhile). Cap changes and positive deltas are always "
            "sent, so switching this off can never let a booking over a cap."
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


class AccountingEpoch(models.Model):
    """One row that every statement moving accounting keys bumps (a flip, a host or job move).

    A proc writer at REPEATABLE READ or SERIALIZABLE locks it FOR SHARE before it reads any key,
    so a move or flip that committed after its snapshot fails it with a serialization failure
    (40001) instead of letting it account against a key that has moved (see
    `accounting.triggers`). READ COMMITTED writers never touch it.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=SETTINGS_ROW_ID, editable=False)
    int_moves = models.BigIntegerField(db_default=0, default=0)
    ts_moved = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = accounting_triggers.EPOCH_TABLE
        verbose_name = "accounting epoch"
        constraints = [
            models.CheckConstraint(condition=models.Q(id=SETTINGS_ROW_ID), name="cuesched_accounting_epoch_single_row"),
        ]
        triggers = accounting_triggers.epoch_triggers()

    def __str__(self) -> str:
        return f"{self.int_moves} key moves"


class ShowFlip(models.Model):
    """How many times each show changed owner; written by the flip trigger, read by the scheduler.

    The scheduler publishes a show as managed together with the generation its seed read, and
    its booking transaction checks that generation: a show that went unmanaged and back since
    the seed books nothing until it is seeded again, however fast the round trip was. No
    foreign key: the trigger writes it for whatever show row is flipped.
    """

    pk_show = models.CharField(max_length=36, primary_key=True)
    int_generation = models.BigIntegerField(db_default=0, default=0)
    b_managed = models.BooleanField()
    ts_flipped = models.DateTimeField()

    class Meta:
        db_table = accounting_triggers.SHOW_FLIP_TABLE
        verbose_name = "show flip"
        triggers = accounting_triggers.show_flip_triggers()

    def __str__(self) -> str:
        return f"show {self.pk_show} generation {self.int_generation}"


class ShowGeneration(models.Model):
    """Each show's accounting generation: bumped by every change the Store must apply before it books the show.

    Written by the accounting triggers in the writing transaction (a cap lowered or removed, a
    key moved into a cap, a positive outside delta, a flip; see accounting.triggers,
    bump_generation) and carried by the notification of the change. The Store records the
    generation it applied per show, and the booking transaction refuses a show's bookings
    decided under another one (dispatch.engine.booking). Releases and cap raises never bump.
    `int_prev_generation` is the value before the last bump, so the Store can tell a gap in the
    chain; `str_reason` says what bumped it last. The seeds create a missing row (generation 0).
    """

    pk_show = models.CharField(max_length=36, primary_key=True)
    int_generation = models.BigIntegerField(db_default=0, default=0)
    int_prev_generation = models.BigIntegerField(db_default=0, default=0)
    str_reason = models.CharField(max_length=16, db_default="", default="")
    ts_bumped = models.DateTimeField(null=True)

    class Meta:
        db_table = accounting_triggers.GENERATION_TABLE
        verbose_name = "show generation"
        triggers = accounting_triggers.show_generation_triggers()

    def __str__(self) -> str:
        return f"show {self.pk_show} accounting generation {self.int_generation}"


class SchedulerLease(models.Model):
    """The one-scheduler fence: which scheduler may commit bookings, by generation.

    A scheduler that takes the advisory lock bumps `int_generation` (under the exclusive
    accounting-keys lock, so the previous holder's last batch has committed first) and every
    booking transaction it writes checks the generation it got. A scheduler whose lock session
    died and was replaced cannot commit a single booking after the takeover.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=SETTINGS_ROW_ID, editable=False)
    int_generation = models.BigIntegerField(db_default=0, default=0)
    str_holder = models.CharField(max_length=255, db_default="", default="")
    ts_acquired = models.DateTimeField(null=True)
    # The holder's heartbeat: renewed to clock_timestamp() + CUESCHED_LEASE_TTL by its lock
    # session every few seconds. Past it, a standby may terminate the holder's sessions and take
    # over (accounting/singleton.py). NULL: a holder that renews no deadline (never terminated).
    ts_deadline = models.DateTimeField(null=True)

    class Meta:
        db_table = "cuesched_scheduler_lease"
        verbose_name = "scheduler lease"
        constraints = [
            models.CheckConstraint(condition=models.Q(id=SETTINGS_ROW_ID), name="cuesched_scheduler_lease_single_row"),
        ]
        triggers = accounting_triggers.scheduler_lease_triggers()

    def __str__(self) -> str:
        return f"generation {self.int_generation} held by {self.str_holder or 'nobody'}"


class OutsideLedger(models.Model):
    """What a transaction that writes procs without counting them still owes each counter row.

    Beside Cuebot only (see accounting.triggers, OUTSIDE_LEDGER_TABLE): written by the proc
    triggers and the counter tables' triggers of a writer without the cuesched mark, emptied at
    its commit by the top-up. A row never outlives its transaction. UNLOGGED (its migration):
    nothing in it is worth a WAL record, and after a crash there is no transaction left to owe.
    """

    pk = models.CompositePrimaryKey("xid", "tbl", "k1", "k2")
    xid = models.BigIntegerField()
    # The counter table, in Cuebot's lock order: 1 subscription, 2 layer, 3 job, 4 folder, 5 point.
    tbl = models.SmallIntegerField()
    k1 = models.TextField()
    k2 = models.TextField()
    cc = models.BigIntegerField()
    g = models.BigIntegerField()
    # What the transaction's proc writes booked on the key (net): the top-up checks caps there only.
    bc = models.BigIntegerField(db_default=0)
    bg = models.BigIntegerField(db_default=0)

    class Meta:
        db_table = accounting_triggers.OUTSIDE_LEDGER_TABLE
        triggers = accounting_triggers.outside_ledger_triggers()

    def __str__(self) -> str:
        return f"xid {self.xid} owes {self.cc} centicores to {self.tbl}:{self.k1}:{self.k2}"


class HostLedger(models.Model):
    """The hosts a transaction changed the memory of, recounted at its commit (accounting.host_memory).

    Written by the proc and host triggers only; one row per transaction, deleted by the recount.
    UNLOGGED (its migration), like the outside ledger: a row never outlives its transaction.
    """

    xid = models.BigIntegerField(primary_key=True)
    hosts = ArrayField(models.TextField())
    # The hosts whose reservations this transaction grew: refused above the host's memory.
    grown = ArrayField(models.TextField())

    class Meta:
        db_table = host_memory.HOST_LEDGER_TABLE
        triggers = host_memory.ledger_triggers()

    def __str__(self) -> str:
        return f"xid {self.xid} recounts {len(self.hosts)} host(s)"


class IntegrityAlarm(models.Model):
    """A counter found BELOW SUM(proc): something wrote procs that no trigger counted.

    Raised by the scheduler (accounting/integrity.py) when a recompute finds a managed show's
    Store counter, or the reconcile an unmanaged show's database counter, under the truth. The
    pass has corrected the counter by then, so the alarm is the only trace: it stays open until
    an operator acknowledges it (`store_status --acknowledge-alarms NOTE`, audited here by who and
    when), and a scheduler restart does not clear it. A row per finding, with the keys and amounts.
    """

    id = models.BigAutoField(primary_key=True)
    ts_raised = models.DateTimeField(db_default=models.functions.Now())
    # store_low: a managed show's Store counter; db_low: an unmanaged show's counter tables.
    str_kind = models.CharField(max_length=32)
    str_summary = models.TextField()
    details = models.JSONField(default=dict)
    ts_acknowledged = models.DateTimeField(null=True, blank=True)
    str_acknowledged_by = models.CharField(max_length=150, blank=True, default="")
    str_ack_note = models.TextField(blank=True, default="")

    class Meta:
        db_table = "cuesched_integrity_alarm"
        indexes = [
            models.Index(
                fields=["ts_raised"], name="i_integrity_alarm_open", condition=models.Q(ts_acknowledged__isnull=True)
            )
        ]
        triggers = accounting_triggers.integrity_alarm_triggers()

    def __str__(self) -> str:
        return f"integrity alarm {self.id} ({self.str_kind}): {self.str_summary}"
