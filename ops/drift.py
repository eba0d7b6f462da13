"""Drift as the console shows it: from one consistent read, flagged only past a threshold.

The old column compared the scheduler's published Store figure (up to a second old) with a
SUM(proc) read now, and even for database-enforced shows read the counters and SUM(proc) in two
statements: while frames start and finish, healthy shows read +-12 in red. Two sources are
consistent, so only they are used:

* a database-enforced key: its trigger-kept counter and SUM(proc) read in one REPEATABLE READ
  snapshot (`consistent_read`), where a healthy counter equals SUM(proc) exactly;
* a scheduler-managed key: what the last recompute measured when it corrected the Store (the
  Store's figure minus SUM(proc) in the recompute's own snapshot), published in the live view.

A counter reading HIGH (positive drift) is safe but books less; LOW (negative) is what the
safety rule forbids and is always worth a look. Either is flagged only when its size passes
`CUESCHED_OPS_DRIFT_THRESHOLD_CORES`, so the rounding of fractional cores never paints red.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

from cuesched_project import conf


def threshold_cores() -> int:
    """Drift of at most this many whole cores (either sign) is shown but not flagged."""
    return conf.env_int("CUESCHED_OPS_DRIFT_THRESHOLD_CORES", 2)


def flagged(drift: int | None) -> bool:
    return drift is not None and abs(drift) > threshold_cores()


def measured(view: dict[str, Any] | None, vertex: str) -> dict[str, int] | None:
    """Per-key drift recompute passes corrected lately (CUESCHED_DRIFT_MEMORY_SECONDS), or None
    when no recompute has measured yet. Keys absent were measured at 0."""
    rc = (view or {}).get("recompute")
    if not rc or "drift_keys" not in rc:
        return None
    keys = (rc.get("drift_keys") or {}).get(vertex) or {}
    return {k: int(v[0]) if isinstance(v, list) else int(v) for k, v in keys.items()}


@contextmanager
def consistent_read() -> Iterator[None]:
    """Every query inside reads one snapshot (REPEATABLE READ, read only).

    Inside an already open transaction (a test's, or ATOMIC_REQUESTS) the isolation level can
    no longer be set; that transaction's reads are used as they are.
    """
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        yield
