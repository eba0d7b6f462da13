"""Procs by age and last ping, and which of them are stuck.

A proc row is booked work. Its own `ts_ping` is set when it is booked (and by whatever reports
on it); its host's agent pings `host_stat.ts_ping` every few seconds while it lives. A proc is
STUCK when neither has been heard from for `CUESCHED_OPS_STUCK_PROC_SECONDS`: its host is gone
or hung, yet the proc still holds cores against every cap. Without this page such procs look
like normal running work (3,326 of them did on a 2,000-host farm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import connection

from accounting.units import centicores_to_cores
from cuesched_project import conf


def stuck_seconds() -> float:
    """A proc with no ping from itself or its host for this many seconds is flagged stuck."""
    return conf.env_float("CUESCHED_OPS_STUCK_PROC_SECONDS", 300.0)


def stuck_label() -> str:
    seconds = stuck_seconds()
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


STUCK_COUNT_SQL = """
SELECT COUNT(*) FROM proc p LEFT JOIN host_stat hs ON hs.pk_host = p.pk_host
WHERE GREATEST(p.ts_ping, COALESCE(hs.ts_ping, p.ts_ping)) < now() - make_interval(secs => %(secs)s)
"""

PROCS_SQL = """
SELECT p.pk_proc, p.pk_frame, f.str_name, j.pk_job, j.str_name, s.str_name, h.str_name, COALESCE(hs.str_state, '?'),
       p.int_cores_reserved, p.int_gpus_reserved,
       EXTRACT(EPOCH FROM now() - p.ts_booked)::float8,
       EXTRACT(EPOCH FROM now() - p.ts_ping)::float8,
       EXTRACT(EPOCH FROM now() - hs.ts_ping)::float8,
       EXTRACT(EPOCH FROM now() - GREATEST(p.ts_ping, COALESCE(hs.ts_ping, p.ts_ping)))::float8 AS silent
FROM proc p
JOIN job j ON j.pk_job = p.pk_job
JOIN show s ON s.pk_show = p.pk_show
JOIN host h ON h.pk_host = p.pk_host
LEFT JOIN frame f ON f.pk_frame = p.pk_frame
LEFT JOIN host_stat hs ON hs.pk_host = p.pk_host
WHERE (NOT %(stuck)s OR GREATEST(p.ts_ping, COALESCE(hs.ts_ping, p.ts_ping)) < now() - make_interval(secs => %(secs)s))
ORDER BY silent DESC, p.ts_booked, p.pk_proc
LIMIT %(limit)s OFFSET %(offset)s
"""


@dataclass(frozen=True)
class ProcRow:
    pk: str
    frame: str | None
    frame_name: str | None
    job: str
    job_name: str
    show_name: str
    host_name: str
    host_state: str
    cores: int
    gpus: int
    age_seconds: float
    proc_ping_seconds: float
    host_ping_seconds: float | None
    silent_seconds: float
    stuck: bool


def stuck_count() -> int:
    with connection.cursor() as cur:
        cur.execute(STUCK_COUNT_SQL, {"secs": stuck_seconds()})
        return int(cur.fetchone()[0])


def proc_rows(*, stuck_only: bool, limit: int, offset: int = 0) -> list[ProcRow]:
    """Longest-silent first: the procs to look at lead the page (one query whatever the page size)."""
    secs = stuck_seconds()
    params: dict[str, Any] = {"stuck": stuck_only, "secs": secs, "limit": limit, "offset": offset}
    with connection.cursor() as cur:
        cur.execute(PROCS_SQL, params)
        rows = cur.fetchall()
    return [
        ProcRow(
            pk=r[0],
            frame=r[1],
            frame_name=r[2],
            job=r[3],
            job_name=r[4],
            show_name=r[5],
            host_name=r[6],
            host_state=r[7],
            cores=centicores_to_cores(r[8]),
            gpus=int(r[9]),
            age_seconds=float(r[10]),
            proc_ping_seconds=float(r[11]),
            host_ping_seconds=None if r[12] is None else float(r[12]),
            silent_seconds=float(r[13]),
            stuck=float(r[13]) > secs,
        )
        for r in rows
    ]
