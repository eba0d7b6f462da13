"""Every state change the ops console makes: one function each, one durable transaction each.

Views, admin forms and tests call only these. Each one locks the row it changes, writes only
the columns whose value really changes (`.update()`: never a whole-row save that would write
a stale copy of a live counter such as `int_cores`), and runs inside `pghistory.context`, so
the audit trail's triggers record who asked for the change (the database role is recorded
for every writer, this one or any other).

Units: callers pass WHOLE cores (what ops see on screen); the database stores centicores
(cores x 100). GPUs are counts. One meaning of 0 for every cap: it books nothing. A
subscription burst of 0 rejects every booking of that (show, allocation); a folder or job max
cores/GPUs of 0 rejects every booking of that folder or job, in the Store and in the triggers
alike (Cuebot's convention: an operator typing 0 to stop a folder must not lift its cap). -1
(any negative value, for Cuebot) is unlimited for folder and job caps; a negative burst is
refused. No cap may exceed MAX_CAP_CORES / MAX_CAP_GPUS: a typo of a few extra digits is
refused with the limit in cores, not saved.
Validation lives in this module only; forms call `validate_*` to show the same messages.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pghistory
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from accounting import blockers, db
from accounting.models import SETTINGS_ROW_ID, AccountingSettings
from accounting.units import (
    CENTICORES_PER_CORE,
    CUEBOT_UNLIMITED_CAP,
    UNLIMITED,
    centicores_to_cores,
    is_unlimited_cap,
)
from cuesched_project import conf
from dispatch.models import FolderResource, JobResource, LimitRecord, Show, Subscription

logger = logging.getLogger(__name__)

# What is booked right now, from the record of truth (non-local procs), in centicores / GPUs.
SUB_BOOKED_SQL = """
SELECT COALESCE(SUM(p.int_cores_reserved), 0)::bigint, COALESCE(SUM(p.int_gpus_reserved), 0)::bigint
FROM proc p JOIN host h ON h.pk_host = p.pk_host
WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local
"""
FOLDER_BOOKED_SQL = """
SELECT COALESCE(SUM(p.int_cores_reserved), 0)::bigint, COALESCE(SUM(p.int_gpus_reserved), 0)::bigint
FROM proc p JOIN job j ON j.pk_job = p.pk_job
WHERE j.pk_folder = %s AND NOT p.b_local
"""
JOB_BOOKED_SQL = """
SELECT COALESCE(SUM(p.int_cores_reserved), 0)::bigint, COALESCE(SUM(p.int_gpus_reserved), 0)::bigint
FROM proc p WHERE p.pk_job = %s AND NOT p.b_local
"""
SHOW_PROCS_SQL = """
SELECT COUNT(*), COALESCE(SUM(p.int_cores_reserved), 0)::bigint, COALESCE(SUM(p.int_gpus_reserved), 0)::bigint
FROM proc p WHERE p.pk_show = %s AND NOT p.b_local
"""


@dataclass(frozen=True)
class Change:
    """One column that changed, in database units (centicores for cores)."""

    column: str
    old: Any
    new: Any


@dataclass
class ActionResult:
    """What an action did: the row, the columns it wrote, warnings for the operator, and when."""

    target: str
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    committed_at: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def audit_context(actor: Any, action: str) -> pghistory.context:
    """The audit context the ops triggers record with each change: who asked and for what.

    `actor` is the console user, a name (a command passes one), or None. Every action that
    writes audited rows runs inside it, here and in dispatch.jobs' actions.
    """
    if actor is None:
        return pghistory.context(action=action)
    if isinstance(actor, str):
        return pghistory.context(action=action, username=actor)
    return pghistory.context(action=action, user=actor.pk, username=actor.get_username())


# --- validation (whole cores on screen) ---------------------------------------------------


def _whole(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValidationError(f"{what} must be a whole number of cores, not {value!r}", code="whole")
    return value


MAX_CAP_CORES = 1_000_000
"""The largest cap in whole cores any action accepts: ten times a 100,000-core farm. Above it a
value is a typo (999,999,999), not a plan; -1 says "unlimited" for folder and job caps."""
MAX_CAP_GPUS = 100_000


def _bounded(value: int, what: str, ceiling: int, unit: str) -> int:
    if value > ceiling:
        raise ValidationError(
            f"{what} of {value:,} {unit} is above the limit of {ceiling:,} {unit}"
            + ("; use -1 for unlimited" if what.startswith("max") else ""),
            code="too_large",
        )
    return value


def validate_burst(cores: Any, what: str = "burst") -> int:
    """Burst/size in whole cores, 0..MAX_CAP_CORES (0 rejects every booking); returns centicores."""
    cores = _whole(cores, what)
    if cores < 0:
        hint = " (0 stops every booking)" if what == "burst" else ""
        raise ValidationError(f"{what} cannot be negative{hint}", code="negative")
    return _bounded(cores, what, MAX_CAP_CORES, "cores") * CENTICORES_PER_CORE


def validate_max_cores(cores: Any, what: str = "max cores") -> int:
    """Folder/job max cores in whole cores: -1 unlimited, 0 books nothing; returns the column's value."""
    cores = _whole(cores, what)
    if cores == UNLIMITED:
        return UNLIMITED
    if cores < 0:
        raise ValidationError(f"{what} cannot be negative: use -1 for unlimited (0 books nothing)", code="negative")
    return _bounded(cores, what, MAX_CAP_CORES, "cores") * CENTICORES_PER_CORE


def validate_max_gpus(gpus: Any, what: str = "max GPUs") -> int:
    """Folder/job max GPUs (a count): -1 unlimited, 0 books no GPU."""
    gpus = _whole(gpus, what)
    if gpus == UNLIMITED:
        return UNLIMITED
    if gpus < 0:
        raise ValidationError(f"{what} cannot be negative: use -1 for unlimited (0 books nothing)", code="negative")
    return _bounded(gpus, what, MAX_CAP_GPUS, "GPUs")


def cores(centicores: int) -> int:
    """Centicores to whole cores, truncating toward zero (-250 -> -2), as everywhere else."""
    return centicores_to_cores(centicores)


def _booked(sql: str, *params: str) -> tuple[int, int]:
    with connection.cursor() as cur:
        cur.execute(sql, list(params))
        cc, gpus = cur.fetchone()
    return int(cc), int(gpus)


def _write(model: Any, pk: str, current: dict[str, Any], wanted: dict[str, Any]) -> list[Change]:
    """UPDATE only the columns whose value differs; returns what changed."""
    changes = [Change(col, current[col], new) for col, new in wanted.items() if new != current[col]]
    if changes:
        model.objects.filter(pk=pk).update(**{c.column: c.new for c in changes})
    return changes


def _finish(result: ActionResult) -> ActionResult:
    result.committed_at = time.time()
    return result


# --- an operator's cap write waits for bookings, bounded, and never fails with a deadlock -----
# The proc writers take their rows in one order (limit rows first, in key order, then frames and
# hosts, then a show's accounting lock and its counters), so a cap write, which locks one row,
# only ever waits behind them. The wait is bounded by CUESCHED_CAP_WRITE_WAIT and ends in a
# message that names the session holding the row; a deadlock or serialization failure some
# other writer's order caused rolls the whole action back and runs it again (nothing of it had
# committed), three times at most.
_RETRIED_SQLSTATES = frozenset({"40P01", "40001"})
CAP_WRITE_ATTEMPTS = 3
_F = TypeVar("_F", bound=Callable[..., Any])


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc.__cause__, "sqlstate", None) or getattr(exc, "sqlstate", None)


def _bound_lock_wait() -> None:
    """In the action's transaction: no lock wait longer than CUESCHED_CAP_WRITE_WAIT."""
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('lock_timeout', %s, true)", [f"{max(1, int(conf.cap_write_wait() * 1000))}ms"])


def cap_write(table: str) -> Callable[[_F], _F]:
    """Run a cap action again on a deadlock or serialization failure; a lock wait that gave up is
    a ValidationError naming who holds `table`'s row, with nothing changed."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, CAP_WRITE_ATTEMPTS + 1):
                try:
                    return fn(*args, **kwargs)
                except DatabaseError as exc:
                    state = _sqlstate(exc)
                    if state in _RETRIED_SQLSTATES and attempt < CAP_WRITE_ATTEMPTS:
                        logger.info("%s: %s (another writer's lock order); running it again", fn.__name__, state)
                        continue
                    if state == "55P03":
                        with connection.cursor() as cur:
                            held = blockers.describe(blockers.row_lock_holders(cur, (table,)))
                        raise ValidationError(
                            f"the {table} row stayed locked for {conf.cap_write_wait():.0f} s, so nothing was "
                            f"changed: {held}. Retry, or end that session.",
                            code="busy",
                        ) from exc
                    raise
            raise AssertionError("unreachable")  # pragma: no cover

        return run  # type: ignore[return-value]

    return wrap


# --- the actions --------------------------------------------------------------------------


def flip_show(show_id: str, managed: bool, *, actor: Any) -> ActionResult:
    """Hand a show's accounting to the scheduler's Store (managed) or back to the database.

    To managed: the database triggers stop enforcing the show at commit; the scheduler seeds
    its caps and counters from the database and only then publishes the show as managed
    (within its managed-shows TTL, ~30 s), and until then books nothing for it. To unmanaged:
    the show's trigger rewrites the five accounting tables from SUM(proc) in this very
    transaction and the database enforces every booking from commit on.
    """
    if not isinstance(managed, bool):
        raise ValidationError("managed must be true or false", code="invalid")
    result = ActionResult(target=show_id)
    with transaction.atomic(durable=True), audit_context(actor, "flip_show"):
        # The show's row FOR UPDATE, bounded: it waits for this show's proc writers only (they
        # hold the row FOR KEY SHARE, accounting.keylocks), and names them if it gives up.
        with connection.cursor() as cursor:
            db.lock_for_move(cursor, "show", [show_id], timeout=conf.flip_lock_wait(), what="the flip")
        show = Show.objects.select_for_update().only("b_scheduler_managed").get(pk=show_id)
        result.changes = _write(
            Show, show_id, {"b_scheduler_managed": show.b_scheduler_managed}, {"b_scheduler_managed": managed}
        )
        if result.changes and managed and not AccountingSettings.notifications_enabled():
            result.warnings.append(
                "Notifications are OFF: the scheduler learns of finished frames of this show only from its "
                "recompute (~15 s) and of cap changes only from its limit reseed (~5 min)."
            )
    return _finish(result)


@cap_write("subscription")
def set_subscription(
    sub_id: str, *, burst_cores: int | None = None, size_cores: int | None = None, actor: Any
) -> ActionResult:
    """Set a subscription's burst (the hard cap) and/or size, in whole cores."""
    wanted: dict[str, int] = {}
    if burst_cores is not None:
        wanted["int_burst"] = validate_burst(burst_cores, "burst")
    if size_cores is not None:
        wanted["int_size"] = validate_burst(size_cores, "size")
    result = ActionResult(target=sub_id)
    with transaction.atomic(durable=True), audit_context(actor, "set_subscription"):
        _bound_lock_wait()
        sub = Subscription.objects.select_for_update().only("int_burst", "int_size", "show", "alloc").get(pk=sub_id)
        current = {"int_burst": sub.int_burst, "int_size": sub.int_size}
        result.changes = _write(Subscription, sub_id, current, wanted)
        new_burst = wanted.get("int_burst")
        if new_burst is not None and new_burst < sub.int_burst:
            booked, _ = _booked(SUB_BOOKED_SQL, sub.show_id, sub.alloc_id)
            if new_burst == 0:
                result.warnings.append(
                    f"A burst of 0 stops every new booking of this show on this allocation; "
                    f"the {cores(booked)} cores running now keep running."
                )
            elif booked > new_burst:
                result.warnings.append(
                    f"The show books {cores(booked)} cores on this allocation now, above the new burst of "
                    f"{cores(new_burst)}: it books nothing new here until {cores(booked - new_burst)} cores "
                    "of running frames finish. Nothing running is stopped."
                )
    return _finish(result)


def _max_warning(kind: str, booked_cc: int, booked_gpus: int, new: dict[str, int]) -> list[str]:
    out = []
    mc = new.get("int_max_cores")
    if mc is not None and mc > 0 and booked_cc > mc:  # (0 has its own warning below)
        out.append(
            f"The {kind} books {cores(booked_cc)} cores now, above the new max of {cores(mc)}: it starts no new "
            f"frame until {cores(booked_cc - mc)} cores of running frames finish. Nothing running is stopped."
        )
    mg = new.get("int_max_gpus")
    if mg is not None and mg > 0 and booked_gpus > mg:
        out.append(
            f"The {kind} books {booked_gpus} GPUs now, above the new max of {mg}: it starts no new GPU frame "
            f"until {booked_gpus - mg} GPUs are released. Nothing running is stopped."
        )
    if new.get("int_max_cores") == 0:
        out.append(
            f"A max cores of 0 stops every new booking of this {kind}; the {cores(booked_cc)} cores running now "
            "keep running (-1 is unlimited)."
        )
    if new.get("int_max_gpus") == 0:
        out.append(f"A max GPUs of 0 stops every new GPU booking of this {kind} (-1 is unlimited).")
    return out


def _max_wanted(max_cores: int | None, max_gpus: int | None) -> dict[str, int]:
    wanted: dict[str, int] = {}
    if max_cores is not None:
        wanted["int_max_cores"] = validate_max_cores(max_cores)
    if max_gpus is not None:
        wanted["int_max_gpus"] = validate_max_gpus(max_gpus)
    return wanted


def _current_caps(row: FolderResource | JobResource) -> dict[str, int]:
    """The row's caps as the actions compare them: any unlimited form is -1.

    On a Cuebot database an unlimited job cap is stored as 2**31-1 (see
    accounting.triggers.cuebot_job_caps_trigger); asking for -1 again changes nothing.
    """
    return {
        column: UNLIMITED if is_unlimited_cap(value) else value
        for column, value in (("int_max_cores", row.int_max_cores), ("int_max_gpus", row.int_max_gpus))
    }


@cap_write("folder_resource")
def set_folder_caps(
    folder_id: str, *, max_cores: int | None = None, max_gpus: int | None = None, actor: Any
) -> ActionResult:
    """Set a folder's max cores (whole cores, -1 unlimited) and/or max GPUs."""
    wanted = _max_wanted(max_cores, max_gpus)
    result = ActionResult(target=folder_id)
    with transaction.atomic(durable=True), audit_context(actor, "set_folder_caps"):
        _bound_lock_wait()
        row = FolderResource.objects.select_for_update().only("int_max_cores", "int_max_gpus").get(folder_id=folder_id)
        current = _current_caps(row)
        result.changes = _write(FolderResource, row.pk, current, wanted)
        if result.changes:
            result.warnings = _max_warning("folder", *_booked(FOLDER_BOOKED_SQL, folder_id), wanted)
    return _finish(result)


@cap_write("job_resource")
def set_job_caps(job_id: str, *, max_cores: int | None = None, max_gpus: int | None = None, actor: Any) -> ActionResult:
    """Set a job's max cores (whole cores, -1 unlimited) and/or max GPUs."""
    wanted = _max_wanted(max_cores, max_gpus)
    result = ActionResult(target=job_id)
    with transaction.atomic(durable=True), audit_context(actor, "set_job_caps"):
        _bound_lock_wait()
        row = JobResource.objects.select_for_update().only("int_max_cores", "int_max_gpus").get(job_id=job_id)
        current = _current_caps(row)
        result.changes = _write(JobResource, row.pk, current, wanted)
        if result.changes:
            result.warnings = _max_warning("job", *_booked(JOB_BOOKED_SQL, job_id), wanted)
    return _finish(result)


def set_notifications(enabled: bool, *, actor: Any) -> ActionResult:
    """The kill switch: on/off for every connection from the commit on (see AccountingSettings)."""
    if not isinstance(enabled, bool):
        raise ValidationError("enabled must be true or false", code="invalid")
    result = ActionResult(target=str(SETTINGS_ROW_ID))
    with transaction.atomic(durable=True), audit_context(actor, "set_notifications"):
        row = AccountingSettings.objects.select_for_update().filter(id=SETTINGS_ROW_ID).first()
        if row is None:
            AccountingSettings.objects.create(id=SETTINGS_ROW_ID, notify_enabled=enabled)
            result.changes = [Change("notify_enabled", None, enabled)]
        elif row.notify_enabled != enabled:
            # .update() bypasses auto_now, so the timestamp is written explicitly.
            AccountingSettings.objects.filter(id=SETTINGS_ROW_ID).update(
                notify_enabled=enabled, ts_updated=timezone.now()
            )
            result.changes = [Change("notify_enabled", row.notify_enabled, enabled)]
        if result.changes and not enabled:
            result.warnings.append(
                "Releases are OFF: the scheduler learns of finished frames only from its recompute (~15 s) and "
                "books less meanwhile; cap changes and outside bookings are still sent."
            )
    return _finish(result)


def show_procs(show_id: str) -> tuple[int, int, int]:
    """(procs, centicores, GPUs) the show runs now: what a flip confirmation page states."""
    with connection.cursor() as cur:
        cur.execute(SHOW_PROCS_SQL, [show_id])
        n, cc, gpus = cur.fetchone()
    return int(n), int(cc), int(gpus)


# --- licence limits (limit_record): a cap of every show ------------------------------------

LIMIT_NAME_MAX = 255


def validate_limit_max(value: Any) -> int:
    """A limit's max: a whole number >= 0, or -1 for unlimited (counted, never refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValidationError(f"max must be a whole number of licences, not {value!r}", code="whole")
    if value < UNLIMITED:
        raise ValidationError(
            "max cannot be below -1: -1 is unlimited on cuesched's own schema but runs nothing on a Cuebot "
            "database (use a large number there); 0 lets nothing run",
            code="negative",
        )
    if value > CUEBOT_UNLIMITED_CAP:
        raise ValidationError(f"max {value} is out of range", code="range")
    return value


def validate_limit_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValidationError("a limit needs a name (the job spec's layer `limits` names it)", code="required")
    name = name.strip()
    if len(name) > LIMIT_NAME_MAX:
        raise ValidationError(f"a limit name is at most {LIMIT_NAME_MAX} characters", code="long")
    return name


def _limit_warning(row: LimitRecord, new_max: int | None) -> list[str]:
    if new_max is None or new_max < 0 or row.int_running <= new_max:
        return []
    unit = "hosts" if row.b_host_limit else "frames"
    return [
        f"Limit {row.str_name} is used by {row.int_running} {unit} now, above the new max of {new_max}: no new "
        f"frame holding it starts until {row.int_running - new_max} {unit} finish. Nothing running is stopped."
    ]


def create_limit(name: Any, max_value: Any = UNLIMITED, *, host_limit: bool = False, actor: Any) -> ActionResult:
    """Create a licence limit (OpenCue's limit_record); its use starts at 0 and follows the procs."""
    name = validate_limit_name(name)
    max_value = validate_limit_max(max_value)
    if not isinstance(host_limit, bool):
        raise ValidationError("host_limit must be true or false", code="invalid")
    with transaction.atomic(durable=True), audit_context(actor, "create_limit"):
        if LimitRecord.objects.filter(str_name=name).exists():
            raise ValidationError(f"a limit named {name!r} already exists", code="exists")
        row = LimitRecord.objects.create(str_name=name, int_max_value=max_value, b_host_limit=host_limit)
        result = ActionResult(target=row.pk)
        result.changes = [
            Change("str_name", None, name),
            Change("int_max_value", None, max_value),
            Change("b_host_limit", None, host_limit),
        ]
    return _finish(result)


@cap_write("limit_record")
def set_limit(limit_id: str, *, max_value: Any = None, host_limit: Any = None, actor: Any) -> ActionResult:
    """Change a limit's max and/or host flag. Lowering the max below use refuses new frames only."""
    wanted: dict[str, Any] = {}
    if max_value is not None:
        wanted["int_max_value"] = validate_limit_max(max_value)
    if host_limit is not None:
        if not isinstance(host_limit, bool):
            raise ValidationError("host_limit must be true or false", code="invalid")
        wanted["b_host_limit"] = host_limit
    result = ActionResult(target=limit_id)
    with transaction.atomic(durable=True), audit_context(actor, "set_limit"):
        _bound_lock_wait()
        row = LimitRecord.objects.select_for_update().get(pk=limit_id)
        current = {"int_max_value": row.int_max_value, "b_host_limit": row.b_host_limit}
        result.changes = _write(LimitRecord, limit_id, current, wanted)
        if result.changes:
            row.refresh_from_db()
            result.warnings = _limit_warning(row, wanted.get("int_max_value"))
    return _finish(result)


def limit_use() -> list[dict[str, Any]]:
    """Every limit with its max and use (the trigger-kept count, and a recount from proc beside it)."""
    from accounting.licences import LIMIT_USE_SQL

    with connection.cursor() as cur:
        cur.execute(LIMIT_USE_SQL + " ORDER BY r.str_name")
        rows = cur.fetchall()
    return [
        {
            "id": pk,
            "name": name,
            "max": mx,
            # What every writer's check compares with: a NULL max, or a negative one on a Cuebot
            # database (Cuebot reads it as none), is 0 here, whatever `max` says.
            "max_read": max_read,
            "host_limit": host,
            "running": running,
            "counted_from_procs": counted,
            "frames": frames,
            "full": max_read >= 0 and running >= max_read,
        }
        for pk, name, mx, host, running, counted, frames, max_read in rows
    ]


def acknowledge_integrity_alarms(actor: Any, note: str) -> int:
    """Close every open integrity alarm (accounting/integrity.py): the operator has looked.

    The note is required: an alarm means procs ran uncounted, so closing one says what was found
    (the trigger re-enabled, the replica-mode session, the restore). Who and when are written on
    the alarm rows themselves, which are the audit trail of the alarm. Returns how many closed.
    """
    from accounting.models import IntegrityAlarm

    note = (note or "").strip()
    if not note:
        raise ValidationError(
            "an acknowledgement needs a note saying what was found and done (see the runbook's integrity alarm)"
        )
    who = actor if isinstance(actor, str) else actor.get_username()
    with transaction.atomic(durable=True), audit_context(actor, "acknowledge_integrity_alarms"):
        rows = IntegrityAlarm.objects.select_for_update().filter(ts_acknowledged__isnull=True)
        return rows.update(ts_acknowledged=timezone.now(), str_acknowledged_by=who[:150], str_ack_note=note)
