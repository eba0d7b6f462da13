"""Statements that move keys under running procs (a host's allocation, a job's folder,
department or show): the moved row FOR UPDATE, bounded (accounting.keylocks), then the shows of
the moved procs FOR KEY SHARE, then the move's deltas.
"""

from __future__ import annotations

import pgtrigger

from accounting.keylocks import LOCK_DECLARE, MOVE_LOCK_SECONDS, lock_for_move, lock_keys_of
from accounting.triggers.common import _refuse_unless_read_committed
from accounting.triggers.definer import DefinerTrigger
from accounting.triggers.deltas import DELTA_DECLARE, usage_func
from accounting.triggers.proc import REFUSE_OUTSIDE_MOVE_OF_MANAGED

# --- key moves: host.pk_alloc, job.pk_folder / pk_dept ------------------------------------------


def _keys_lock_trigger(
    name: str, operation: pgtrigger.Operation, condition: str, table: str, key: str, what: str
) -> pgtrigger.Trigger:
    """BEFORE ROW: the moved row FOR UPDATE, bounded (accounting.keylocks.lock_for_move).

    It waits for the in-flight proc writers of this row's key only (they hold it FOR KEY SHARE),
    and holds off later ones until COMMIT; the AFTER trigger's reads, fresh statements at READ
    COMMITTED, then see every proc those writers committed.
    """
    return DefinerTrigger(
        name=name,
        when=pgtrigger.Before,
        operation=operation,
        level=pgtrigger.Row,
        condition=pgtrigger.Condition(condition),
        declare=LOCK_DECLARE,
        func=f"{lock_for_move(table, f'SELECT OLD.{key}', what)}\n    RETURN NEW;",
    )


# Where the statement's own lock_timeout is kept while a move's bound is in force.
_SAVED_LOCK_TIMEOUT = "cuesched.move_saved_lock_timeout"


def _move_wait_bound_triggers(prefix: str, operation: pgtrigger.Operation) -> list[pgtrigger.Trigger]:
    """BEFORE / AFTER STATEMENT: a move's row lock wait is bounded, as the keys lock's is.

    The moved columns are key columns (accounting.move_locks), so the UPDATE waits for the
    in-flight proc writers in its own row lock, before any row trigger runs: the bound is set
    for the statement here (MOVE_LOCK_SECONDS, unless the session's lock_timeout is shorter)
    and the session's value put back after it. A statement that fails on the bound aborts its
    transaction (or its savepoint), which puts the value back itself.
    """
    before = DefinerTrigger(
        name=f"{prefix}_wait_bound",
        when=pgtrigger.Before,
        operation=operation,
        level=pgtrigger.Statement,
        func=f"""
    IF (SELECT s.setting::bigint FROM pg_settings s WHERE s.name = 'lock_timeout')
       NOT BETWEEN 1 AND {MOVE_LOCK_SECONDS * 1000} THEN
        PERFORM set_config('{_SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true);
        PERFORM set_config('lock_timeout', '{MOVE_LOCK_SECONDS}s', true);
    END IF;
    RETURN NULL;""",
    )
    after = DefinerTrigger(
        name=f"{prefix}_wait_restore",
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Statement,
        func=f"""
    IF COALESCE(current_setting('{_SAVED_LOCK_TIMEOUT}', true), '') <> '' THEN
        PERFORM set_config('lock_timeout', current_setting('{_SAVED_LOCK_TIMEOUT}'), true);
        PERFORM set_config('{_SAVED_LOCK_TIMEOUT}', '', true);
    END IF;
    RETURN NULL;""",
    )
    return [before, after]


def _move_trigger(
    name: str, operation: pgtrigger.Operation, condition: str, keyed: str, what: str, *, check: str = ""
) -> pgtrigger.Trigger:
    """AFTER ROW: the move's deltas, booked by the side (Store or database) that owns each show.

    The side is read from the show's flag, so the shows of the moved procs are locked FOR KEY
    SHARE first, as every proc writer locks them: a flip of one of them (its row FOR UPDATE)
    then waits for this move's COMMIT, or this move waits for the flip's and reads the flag it
    wrote. Without it a flip committed between this read and the move's commit: to unmanaged, it
    rebuilt the counters from SUM(proc) with the procs still on their old key (the new one read
    LOW once the move committed); to managed, the Store seeded without the move, which the
    database side had booked and no message ever told it (LOW again). The moved row, locked by
    the BEFORE trigger, keeps new procs off it, so the shows read here are all the move books.
    """
    return DefinerTrigger(
        name=name,
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Row,
        condition=pgtrigger.Condition(condition),
        declare=DELTA_DECLARE,
        func=usage_func(
            keyed,
            prologue=f"{_refuse_unless_read_committed(what)}\n    {check}",
            keyed_check=REFUSE_OUTSIDE_MOVE_OF_MANAGED,
            lock=lock_keys_of(f"({keyed})", tables=("show",)),
        ),
    )


_HOST_MOVED = "OLD.pk_alloc IS DISTINCT FROM NEW.pk_alloc"
_JOB_MOVED = (
    "OLD.pk_folder IS DISTINCT FROM NEW.pk_folder OR OLD.pk_dept IS DISTINCT FROM NEW.pk_dept "
    "OR OLD.pk_show IS DISTINCT FROM NEW.pk_show"
)
