"""What every job, depend and host action shares: the job lookup, the result an action returns,
the raw cursor its SQL runs on, and the retry of a transaction that lost a deadlock.

The actions themselves: `submit` (a spec to a job), `controls` (pause, resume, kill, retry, eat,
priority, caps, layer minimums, frame kill), `depends` (a job waiting for another while both
run), `host_controls` (lock, unlock, drain). One function each, one durable transaction each,
writing only the columns that change, and one `FarmAction` row in that same transaction
(`audit`), so the audit trail holds a control exactly when it committed. The command line, the
JSON API, the OpenCue client API and the console call these and nothing else; they check who
may act, these functions do not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from django.db import OperationalError, connection

from dispatch.models import Job

DEADLOCK_ATTEMPTS = 3
T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass
class JobActionResult:
    """What an action did to one job: `changed` counts the rows (frames, or 1 for the job) it moved."""

    job_id: str
    action: str
    changed: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


class JobNotFound(LookupError):
    pass


def pg_cursor() -> psycopg.Cursor[Any]:
    """A server-side-binding cursor on Django's connection, inside its current transaction.

    Django's own cursors bind parameters client-side (arrays become SQL literals, and binary
    parameters such as COMPLETE_SQL's are refused); this one sends arrays as parameters.
    """
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


def resolve_job(ref: str) -> Job:
    """A job by its id, else by its (unique) name."""
    if not isinstance(ref, str) or not ref:
        raise JobNotFound(f"no job {ref!r}")
    job = Job.objects.filter(pk=ref).first() or Job.objects.filter(str_name=ref).first()
    if job is None:
        raise JobNotFound(f"no job with id or name {ref!r}")
    return job


def job_id_of(job: Job | str) -> str:
    return job.pk_job if isinstance(job, Job) else resolve_job(job).pk_job


RETRYABLE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def is_deadlock(exc: BaseException) -> bool:
    """Our raw cursors raise psycopg's errors, Django's cursors wrap them (the cause)."""
    return isinstance(exc, RETRYABLE) or isinstance(exc.__cause__, RETRYABLE)


def retry_on_deadlock(attempt: Callable[[], T], what: str) -> T:
    """Run one action's durable transaction, again (up to DEADLOCK_ATTEMPTS times) when it lost a
    deadlock or a serialization failure to a concurrent writer (a booking batch locks frames and
    hosts too). Each try is a whole transaction, so a retry starts from what has committed."""
    for n in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            return attempt()
        except (OperationalError, psycopg.errors.OperationalError) as exc:
            if n == DEADLOCK_ATTEMPTS or not is_deadlock(exc):
                raise
            logger.info("%s: deadlock with a concurrent writer, retrying", what)
    raise AssertionError("unreachable")
