"""The job, job_resource and layer_resource triggers: job moves, job caps, the counter rows."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.deltas import JOB_MOVE_KEYED
from accounting.triggers.limits import _JOB, _limit_triggers, cuebot_job_caps_trigger
from accounting.triggers.moves import _JOB_MOVED, _keys_lock_trigger, _move_trigger, _move_wait_bound_triggers
from accounting.triggers.outside import counter_outside_triggers
from accounting.triggers.usage import usage_guard_triggers

# A proc is accounted by its own show; its job's folder must be a folder of that show, or the
# folder counter would be kept by the other show's side (read LOW by the rebuild of either).
JOB_SAME_SHOW = """
    IF NEW.pk_show IS DISTINCT FROM OLD.pk_show AND EXISTS (SELECT 1 FROM proc p WHERE p.pk_job = NEW.pk_job) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: job %s has running procs: it cannot move to another show', NEW.pk_job),
            ERRCODE = 'check_violation', CONSTRAINT = 'acct_job_show_with_procs';
    END IF;
    IF EXISTS (SELECT 1 FROM folder f WHERE f.pk_folder = NEW.pk_folder AND f.pk_show IS DISTINCT FROM NEW.pk_show) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: folder %s belongs to another show than job %s', NEW.pk_folder, NEW.pk_job),
            ERRCODE = 'check_violation', CONSTRAINT = 'acct_job_folder_of_its_show';
    END IF;"""


def job_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_move_wait_bound_triggers("acct_job_move", pgtrigger.UpdateOf("pk_folder", "pk_dept", "pk_show")),
        _keys_lock_trigger(
            "acct_job_keys_lock",
            pgtrigger.UpdateOf("pk_folder", "pk_dept", "pk_show"),
            _JOB_MOVED,
            "job",
            "pk_job",
            "moving a job to another folder or department",
        ),
        _move_trigger(
            "acct_job_move",
            pgtrigger.UpdateOf("pk_folder", "pk_dept", "pk_show"),
            _JOB_MOVED,
            JOB_MOVE_KEYED,
            "moving a job to another folder or department",
            check=JOB_SAME_SHOW,
        ),
    ]


def job_resource_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("job", "job_resource", _JOB),
        *usage_guard_triggers("job_resource"),
        cuebot_job_caps_trigger(),
        *counter_outside_triggers("job_resource"),
    ]


def layer_resource_triggers() -> list[pgtrigger.Trigger]:
    return counter_outside_triggers("layer_resource")
