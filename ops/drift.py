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


def measured(view: dict[str, Any] | None, vertex: str) -> dict[str, tuple[int, float | None]] | None:
    """Per-key drift recompute passes corrected lately (CUESCHED_DRIFT_MEMORY_SECONDS), with the
    unix time of the pass, or None when no recompute has measured yet. Keys absent were
    measured at 0."""
    rc = (view or {}).get("recompute")
    if not rc or "drift_keys" not in rc:
        return None
    keys = (rc.get("drift_keys") or {}).get(vertex) or {}
    return {k: (int(v[0]), float(v[1])) if isinstance(v, list) else (int(v), None) for k, v in keys.items()}


def seeded_at(view: dict[str, Any] | None, show: str) -> float | None:
    """When the scheduler published a managed show (its seed in), or None while it is not.

    Between a flip's commit and the seed at the next managed-shows tick the Store holds nothing
    for the show, and a recompute in that window "corrects" it from 0 to SUM(proc): a measured
    drift of minus the show's whole booking that is no fault of any counter (nothing was
    enforced from it). Until the seed is in there is no drift to show, only "seeding".
    """
    published = (view or {}).get("managed_shows") or {}
    if show not in published:
        return None
    at = published[show]
    return float(at) if at is not None else 0.0


def key_drift(found: dict[str, tuple[int, float | None]] | None, key: str, since: float | None) -> int | None:
    """A managed key's drift as measured after its show's seed (`since`); None: nothing measured.

    A pass from before the seed measured the unseeded Store and is left out: the seed itself
    set the key from SUM(proc), which is drift 0. A pass after the seed counts at once, so a real
    negative drift goes red at the first recompute that finds it.
    """
    if found is None:
        return None
    cores, at = found.get(key, (0, None))
    if since is not None and at is not None and at < since:
        return 0
    return cores


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
