"""Every accounting trigger, and the SQL it runs.

In OpenCue, Cuebot's DAOs send these signals; here PostgreSQL does, so every writer (our own
completion path, the admin, a script, a DBA in psql, a Cuebot sharing the database) produces
them. The triggers are attached in the farm models' `Meta.triggers` and installed by `migrate`.

The rule they enforce: **every change to a booked amount, or to the key it is booked against,
is an event sent in the writing transaction and applied once.** A proc books
(show, alloc, folder, job, layer, dept) where alloc is its host's and folder and dept its job's,
so the events are:

| table | event | does |
|---|---|---|
| proc | INSERT, UPDATE of an accounted column, DELETE | signed deltas of the old and new keys |
| host | UPDATE OF pk_alloc | its running procs move subscription |
| job | UPDATE OF pk_folder, pk_dept | its running procs move folder and point |
| proc | TRUNCATE | unmanaged counters rebuilt, `acct_resync` |
| subscription, folder_resource, job_resource | INSERT, UPDATE, DELETE | `acct_limit_change`, every show |
| subscription, folder_resource, job_resource | TRUNCATE | `acct_resync` |
| show | UPDATE OF b_scheduler_managed | flip generation; to unmanaged: rebuild from SUM(proc) |
| the five counter tables | INSERT, UPDATE, DELETE, TRUNCATE | beside Cuebot, an unmarked change, into the ledger |
| job_resource | BEFORE INSERT, UPDATE (a negative cap) | beside Cuebot, stored as 2147483647 |
| cuesched_outside_ledger | INSERT, UPDATE, DELETE by a client | refused |
| cuesched_outside_ledger | INSERT (deferred to commit) | beside Cuebot, the top-up of what the transaction still owes |
| cuesched_accounting_settings, _epoch | DELETE | refused: the single rows must stay |

Each delta goes to the side that owns its show at that moment: a scheduler-managed show's
deltas become `acct_release` messages for the Store (unless the transaction carries the
scheduler's own "Store-accounted" marker: its bookings and compensations are already in the
Store); an unmanaged show's deltas update the five counter tables in the same statement, with
the caps checked for every positive delta (the statement fails with `check_violation` and the
cap's constraint name, as Cuebot's `verify_*` triggers do).

Ordering, the part that makes "applied once" hold under concurrency. A delta is only right if
the keys it reads (the show's flag, the host's allocation, the job's folder) cannot change
between the read and the commit. So:

* every proc statement locks the key rows of its procs (their show, job, layer and host rows,
  old and new) FOR KEY SHARE before it reads any key, in a statement of its own (under READ
  COMMITTED the next statement's snapshot then starts after whatever it waited for);
* every statement that moves keys under running procs (a flip, `UPDATE host SET pk_alloc`,
  `UPDATE job SET pk_folder / pk_dept`) locks the row it moves FOR UPDATE in a BEFORE ROW
  trigger, bounded, so it waits for the in-flight proc writers of that key, and only those, and
  later ones wait for it; its AFTER trigger then sees every committed proc it moves;
* a mover must run at READ COMMITTED (at REPEATABLE READ its snapshot predates the procs it
  waited for) and is refused otherwise; a proc writer at REPEATABLE READ or SERIALIZABLE whose
  snapshot predates a move fails on the moved row itself (40001), since the mover updated it.

See accounting/keylocks.py for why these are row locks (a privilege PostgreSQL checks, one
show's or host's keys at a time) and not one advisory lock for the farm, which any session could
take and so stop every proc write.

Concurrent writers of one unmanaged show additionally take an exclusive lock per show
(`LOCK_DB_SHOWS`) before they touch a counter row, so bookings and releases of the show apply
one transaction at a time instead of deadlocking on the shared subscription, folder and point
rows.

Cost (`manage.py bench_triggers`, see docs/benchmarks.md): statement-level triggers with
transition tables send one aggregated message per key per statement; a bulk delete of 10,000
procs sends 20 messages, not 10,000. Keys are read once per statement into arrays, which the
notification and the database-enforced halves then share.

Every trigger here is a `DefinerTrigger` (`definer.py`): it runs as its owner, the migrating role
(SECURITY DEFINER), so outside writers need SELECT at most on the cuesched_* tables it writes, and
no session setting switches it off. A new accounting trigger is declared the same way.
"""

from __future__ import annotations

from accounting.triggers.common import (
    CORE_MULTIPLIER,
    CURRENT_XID,
    DB_ACCOUNTING_LOCK_CLASS,
    EPOCH_BUMP,
    EPOCH_GUARD,
    EPOCH_TABLE,
    GENERATION_DECLARE,
    GENERATION_SEQUENCE,
    GENERATION_TABLE,
    LOCK_DB_SHOWS,
    LOCK_DB_SHOWS_SQL,
    NEXT_SEQ,
    NOTIFY_ENABLED,
    READ_COMMITTED,
    SETTINGS_TABLE,
    SHOW_FLIP_TABLE,
    STORE_ACCOUNTED,
    WRITER_CLAIM,
    WRITER_MEMBER,
    WRITER_ON,
    WRITER_ROLE,
    WRITER_SETTING,
    _refuse_unless_read_committed,
    _tail,
    bump_generation,
    cores_cap,
    cores_from_centicores,
    gpus_cap,
    json_id,
    usage_cores,
    with_generation,
)
from accounting.triggers.deltas import (
    _ANY_POSITIVE,
    _BUMP_OUTSIDE,
    _LEDGER_UPSERT,
    _MANAGED_GROUPED,
    _RELEASE_MESSAGES,
    _RELEASE_MESSAGES_PLAIN,
    _RELEASE_ORDER,
    _RELEASE_ROWS,
    APPLY_UNMANAGED,
    CAP_CONSTRAINTS,
    CAP_FOLDER_MAX_CORES,
    CAP_FOLDER_MAX_GPUS,
    CAP_FOLDER_MISSING,
    CAP_JOB_MAX_CORES,
    CAP_JOB_MAX_GPUS,
    CAP_JOB_MISSING,
    CAP_LAYER_MISSING,
    CAP_SUBSCRIPTION_BURST,
    CAP_SUBSCRIPTION_MISSING,
    CUEBOT_ACCOUNTS,
    CUEBOT_WRITES,
    DB_APPLY,
    DELTA_DECLARE,
    DELTAS,
    HOST_MOVE_KEYED,
    JOB_MOVE_KEYED,
    NOTIFY_MANAGED,
    OUTSIDE_FOLDER,
    OUTSIDE_JOB,
    OUTSIDE_LAYER,
    OUTSIDE_LEDGER_TABLE,
    OUTSIDE_POINT,
    OUTSIDE_SUB,
    PROC_CHANGED,
    PROC_DELETE_KEYED,
    PROC_INSERT_KEYED,
    PROC_UPDATE_KEYED,
    RECORD_OUTSIDE,
    RELEASE_PAYLOAD,
    WRITER_OPTION,
    _usage_trigger,
    read_deltas,
    usage_func,
)
from accounting.triggers.folder import (
    FOLDER_SHOW_OF_ITS_JOBS,
    folder_resource_triggers,
    folder_triggers,
)
from accounting.triggers.host import (
    host_triggers,
)
from accounting.triggers.job import (
    JOB_SAME_SHOW,
    job_resource_triggers,
    job_triggers,
    layer_resource_triggers,
)
from accounting.triggers.limits import (
    _FOLDER,
    _JOB,
    _SUB,
    CUEBOT_JOB_CAPS_FUNC,
    DISPLAY_LIFT,
    DISPLAY_LIFT_SETTING,
    DISPLAY_LIFT_SQL,
    NORMALIZE_CUEBOT_JOB_CAPS_SQL,
    SUB_PAYLOAD,
    SUB_REMOVED_PAYLOAD,
    _key_changed,
    _limit_triggers,
    _lowered,
    cap_payload,
    cap_removed_payload,
    cuebot_job_caps_trigger,
    limit_delete_func,
    limit_insert_func,
    limit_update_func,
    resync_func,
)
from accounting.triggers.moves import (
    _keys_lock_trigger,
    _move_trigger,
)
from accounting.triggers.outside import (
    _ARRAYS,
    _BOOKED_C,
    _BOOKED_G,
    _COUNTER_NOW,
    _INTO,
    _KEY_SHOW,
    _MISSING,
    _OUTSIDE_COUNTERS,
    _OWED,
    _PROC_NOW,
    _SUM_PROC,
    _TOPUP_LOCKS,
    _TRUNCATE_OWED,
    OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS,
    OUTSIDE_TOPUP_FUNC,
    counter_outside_func,
    counter_outside_triggers,
    counter_truncate_func,
    outside_ledger_triggers,
    point_triggers,
)
from accounting.triggers.proc import (
    KEYS_VISIBLE,
    MANAGED_BOOKED_OUTSIDE,
    MANAGED_GROWN,
    PROC_DELETE_FUNC,
    PROC_INSERT_FUNC,
    PROC_TRUNCATE_FUNC,
    PROC_UPDATE_FUNC,
    REFUSE_OUTSIDE_BOOKING_OF_MANAGED,
    REFUSE_OUTSIDE_MOVE_OF_MANAGED,
    proc_triggers,
    refuse_outside_booking_of_managed,
)
from accounting.triggers.rebuild import (
    _IN_TARGET,
    _LIVE_OR_HOLDING,
    _REBUILT,
    REBUILD_TABLES,
    RECONCILE_SQL,
    UNMANAGED_SHOWS_SQL,
    _rebuild_ctes,
    rebuild_sql,
)
from accounting.triggers.scheduler_rows import (
    ALARM_WRITERS_ONLY,
    LEASE_WRITERS_ONLY,
    _writers_only,
    integrity_alarm_triggers,
    scheduler_lease_triggers,
)
from accounting.triggers.show import (
    _ANY_FLIP,
    _TO_UNMANAGED,
    FLIP_BUMP,
    FLIP_LEDGER_RESTORE_SQL,
    FLIP_LEDGER_SAVE_SQL,
    FLIP_LIFT_DECLARE,
    FLIP_LIFT_SQL,
    FLIP_NORMALIZE_JOB_CAPS_SQL,
    FLIP_RESTORE_SQL,
    SHOW_FLIP_FUNC,
    show_triggers,
)
from accounting.triggers.singletons import (
    _REAL_BUMP,
    GENERATION_BUMP_ONLY,
    epoch_triggers,
    settings_triggers,
    show_flip_triggers,
    show_generation_triggers,
)
from accounting.triggers.subscription import (
    subscription_triggers,
)
from accounting.triggers.usage import (
    _USAGE_KEYS,
    _USAGE_SOURCES,
    COUNTER_REBUILD_SETTING,
    COUNTER_REBUILD_SQL,
    usage_guard_triggers,
)

__all__ = [
    "ALARM_WRITERS_ONLY",
    "APPLY_UNMANAGED",
    "CAP_CONSTRAINTS",
    "CAP_FOLDER_MAX_CORES",
    "CAP_FOLDER_MAX_GPUS",
    "CAP_FOLDER_MISSING",
    "CAP_JOB_MAX_CORES",
    "CAP_JOB_MAX_GPUS",
    "CAP_JOB_MISSING",
    "CAP_LAYER_MISSING",
    "CAP_SUBSCRIPTION_BURST",
    "CAP_SUBSCRIPTION_MISSING",
    "CORE_MULTIPLIER",
    "COUNTER_REBUILD_SETTING",
    "COUNTER_REBUILD_SQL",
    "CUEBOT_ACCOUNTS",
    "CUEBOT_JOB_CAPS_FUNC",
    "CUEBOT_WRITES",
    "CURRENT_XID",
    "DB_ACCOUNTING_LOCK_CLASS",
    "DB_APPLY",
    "DELTAS",
    "DELTA_DECLARE",
    "DISPLAY_LIFT",
    "DISPLAY_LIFT_SETTING",
    "DISPLAY_LIFT_SQL",
    "EPOCH_BUMP",
    "EPOCH_GUARD",
    "EPOCH_TABLE",
    "FLIP_BUMP",
    "FLIP_LEDGER_RESTORE_SQL",
    "FLIP_LEDGER_SAVE_SQL",
    "FLIP_LIFT_DECLARE",
    "FLIP_LIFT_SQL",
    "FLIP_NORMALIZE_JOB_CAPS_SQL",
    "FLIP_RESTORE_SQL",
    "FOLDER_SHOW_OF_ITS_JOBS",
    "GENERATION_BUMP_ONLY",
    "GENERATION_DECLARE",
    "GENERATION_SEQUENCE",
    "GENERATION_TABLE",
    "HOST_MOVE_KEYED",
    "JOB_MOVE_KEYED",
    "JOB_SAME_SHOW",
    "KEYS_VISIBLE",
    "LEASE_WRITERS_ONLY",
    "LOCK_DB_SHOWS",
    "LOCK_DB_SHOWS_SQL",
    "MANAGED_BOOKED_OUTSIDE",
    "MANAGED_GROWN",
    "NEXT_SEQ",
    "NORMALIZE_CUEBOT_JOB_CAPS_SQL",
    "NOTIFY_ENABLED",
    "NOTIFY_MANAGED",
    "OUTSIDE_FOLDER",
    "OUTSIDE_JOB",
    "OUTSIDE_LAYER",
    "OUTSIDE_LEDGER_TABLE",
    "OUTSIDE_LEDGER_WRITTEN_BY_TRIGGERS",
    "OUTSIDE_POINT",
    "OUTSIDE_SUB",
    "OUTSIDE_TOPUP_FUNC",
    "PROC_CHANGED",
    "PROC_DELETE_FUNC",
    "PROC_DELETE_KEYED",
    "PROC_INSERT_FUNC",
    "PROC_INSERT_KEYED",
    "PROC_TRUNCATE_FUNC",
    "PROC_UPDATE_FUNC",
    "PROC_UPDATE_KEYED",
    "READ_COMMITTED",
    "REBUILD_TABLES",
    "RECONCILE_SQL",
    "RECORD_OUTSIDE",
    "REFUSE_OUTSIDE_BOOKING_OF_MANAGED",
    "REFUSE_OUTSIDE_MOVE_OF_MANAGED",
    "RELEASE_PAYLOAD",
    "SETTINGS_TABLE",
    "SHOW_FLIP_FUNC",
    "SHOW_FLIP_TABLE",
    "STORE_ACCOUNTED",
    "SUB_PAYLOAD",
    "SUB_REMOVED_PAYLOAD",
    "UNMANAGED_SHOWS_SQL",
    "WRITER_CLAIM",
    "WRITER_MEMBER",
    "WRITER_ON",
    "WRITER_OPTION",
    "WRITER_ROLE",
    "WRITER_SETTING",
    "_ANY_FLIP",
    "_ANY_POSITIVE",
    "_ARRAYS",
    "_BOOKED_C",
    "_BOOKED_G",
    "_BUMP_OUTSIDE",
    "_COUNTER_NOW",
    "_FOLDER",
    "_INTO",
    "_IN_TARGET",
    "_JOB",
    "_KEY_SHOW",
    "_LEDGER_UPSERT",
    "_LIVE_OR_HOLDING",
    "_MANAGED_GROUPED",
    "_MISSING",
    "_OUTSIDE_COUNTERS",
    "_OWED",
    "_PROC_NOW",
    "_REAL_BUMP",
    "_REBUILT",
    "_RELEASE_MESSAGES",
    "_RELEASE_MESSAGES_PLAIN",
    "_RELEASE_ORDER",
    "_RELEASE_ROWS",
    "_SUB",
    "_SUM_PROC",
    "_TOPUP_LOCKS",
    "_TO_UNMANAGED",
    "_TRUNCATE_OWED",
    "_USAGE_KEYS",
    "_USAGE_SOURCES",
    "_key_changed",
    "_keys_lock_trigger",
    "_limit_triggers",
    "_lowered",
    "_move_trigger",
    "_rebuild_ctes",
    "_refuse_unless_read_committed",
    "_tail",
    "_usage_trigger",
    "_writers_only",
    "bump_generation",
    "cap_payload",
    "cap_removed_payload",
    "cores_cap",
    "cores_from_centicores",
    "counter_outside_func",
    "counter_outside_triggers",
    "counter_truncate_func",
    "cuebot_job_caps_trigger",
    "epoch_triggers",
    "folder_resource_triggers",
    "folder_triggers",
    "gpus_cap",
    "host_triggers",
    "integrity_alarm_triggers",
    "job_resource_triggers",
    "job_triggers",
    "json_id",
    "layer_resource_triggers",
    "limit_delete_func",
    "limit_insert_func",
    "limit_update_func",
    "outside_ledger_triggers",
    "point_triggers",
    "proc_triggers",
    "read_deltas",
    "rebuild_sql",
    "refuse_outside_booking_of_managed",
    "resync_func",
    "scheduler_lease_triggers",
    "settings_triggers",
    "show_flip_triggers",
    "show_generation_triggers",
    "show_triggers",
    "subscription_triggers",
    "usage_cores",
    "usage_func",
    "usage_guard_triggers",
    "with_generation",
]
