"""The folder and folder_resource triggers: a folder keeps its jobs' show; folder caps and counters."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.definer import DefinerTrigger
from accounting.triggers.limits import _FOLDER, _limit_triggers
from accounting.triggers.outside import counter_outside_triggers
from accounting.triggers.usage import usage_guard_triggers

# A folder's caps are bumped, sent and rebuilt by the folder's show as its row reads at the time:
# a folder moved to another show than its jobs' would have a cap lowering bump the other show's
# generation (and a round trip through another show within one transaction would hide the
# lowering from the managed show's bookings), and its counter would be kept by the wrong show.
# So a folder moves between shows only with no job of another show in it. Nothing in cuesched or
# in Cuebot's SQL moves a folder between shows. The EXISTS runs after the folder row is locked
# (a job insert or move into it holds or waits for that lock through its foreign key and
# acct_job_move), on a fresh READ COMMITTED snapshot, so a job that committed into the folder
# first is seen.
FOLDER_SHOW_OF_ITS_JOBS = "acct_folder_show_of_its_jobs"


def folder_triggers() -> list[pgtrigger.Trigger]:
    return [
        DefinerTrigger(
            name=FOLDER_SHOW_OF_ITS_JOBS,
            when=pgtrigger.Before,
            operation=pgtrigger.UpdateOf("pk_show"),
            level=pgtrigger.Row,
            condition=pgtrigger.Condition("OLD.pk_show IS DISTINCT FROM NEW.pk_show"),
            func=f"""
    IF EXISTS (SELECT 1 FROM job j WHERE j.pk_folder = NEW.pk_folder AND j.pk_show IS DISTINCT FROM NEW.pk_show) THEN
        RAISE EXCEPTION USING
            MESSAGE = format('cuesched: folder %s holds jobs of show %s: it cannot move to show %s', NEW.pk_folder,
                             (SELECT j.pk_show FROM job j WHERE j.pk_folder = NEW.pk_folder
                              AND j.pk_show IS DISTINCT FROM NEW.pk_show LIMIT 1), NEW.pk_show),
            HINT = 'Nothing was moved. A folder''s caps are accounted by its show: move its jobs to a folder of '
                   'their show first, or create the folder in the other show.',
            ERRCODE = 'check_violation', CONSTRAINT = '{FOLDER_SHOW_OF_ITS_JOBS}';
    END IF;
    RETURN NEW;
""",
        )
    ]


def folder_resource_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("folder", "folder_resource", _FOLDER),
        *usage_guard_triggers("folder_resource"),
        *counter_outside_triggers("folder_resource"),
    ]
