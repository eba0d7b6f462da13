"""Rows only the scheduler's roles write: the lease and the integrity alarm."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.common import WRITER_MEMBER, WRITER_ROLE
from accounting.triggers.definer import DefinerProtect, DefinerTrigger

# --- rows only the scheduler's roles write ----------------------------------------------------
# The lease row is the one-scheduler fence (accounting.singleton): a generation moved by anyone
# else makes the holder's next booking raise LeaseLostError (the scheduler exits), or puts a
# stale holder's generation back. The integrity alarms are the only trace of a counter found
# below SUM(proc). Both are written only by sessions whose login role is a member of WRITER_ROLE
# (the scheduler; the operator's `store_status --acknowledge-alarms`), or a superuser, which is a
# member of every role. Membership, not the claim: these writes carry no accounting, and a claim
# proves nothing anyway. BEFORE STATEMENT, so a statement that would touch no row is refused too
# and the check costs one lookup per statement, not per row.
LEASE_WRITERS_ONLY = "acct_lease_writers_only"
ALARM_WRITERS_ONLY = "acct_integrity_alarm_writers_only"


def _writers_only(name: str, operation: pgtrigger.Operation, what: str, hint: str) -> pgtrigger.Trigger:
    return DefinerTrigger(
        name=name,
        when=pgtrigger.Before,
        operation=operation,
        level=pgtrigger.Statement,
        func=f"""
    IF NOT {WRITER_MEMBER} THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: %s may not %s {what}: only members of {WRITER_ROLE} write it',
                             session_user, lower(TG_OP)),
            HINT = '{hint}',
            ERRCODE = 'insufficient_privilege', CONSTRAINT = '{name}';
    END IF;
    RETURN NULL;
""",
    )


def scheduler_lease_triggers() -> list[pgtrigger.Trigger]:
    return [
        _writers_only(
            LEASE_WRITERS_ONLY,
            pgtrigger.Insert | pgtrigger.Update | pgtrigger.Delete | pgtrigger.Truncate,
            "the scheduler lease",
            "Nothing was written. The lease is taken and renewed by the scheduler itself (its login role is a "
            f"member of {WRITER_ROLE}); a standby takes it over once the holder''s deadline has passed. Stop the "
            "scheduler to release it.",
        )
    ]


def integrity_alarm_triggers() -> list[pgtrigger.Trigger]:
    """An alarm is never deleted (acknowledged, it stays as the record); only members write it."""
    return [
        DefinerProtect(name="acct_integrity_alarm_keep_rows", operation=pgtrigger.Delete),
        _writers_only(
            ALARM_WRITERS_ONLY,
            pgtrigger.Insert | pgtrigger.Update | pgtrigger.Truncate,
            "an integrity alarm",
            "Nothing was written. Alarms are raised by the scheduler and acknowledged with "
            "`manage.py store_status --acknowledge-alarms NOTE`, run as a login role that is a member of "
            f"{WRITER_ROLE}.",
        ),
    ]
