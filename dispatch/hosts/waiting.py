"""RQD hosts that wait for an operator: the unknown host that no default allocation takes.

Why not refuse it: RQD 1.37 retries its startup report (every 15 s) only when the answer is
UNAVAILABLE; any other status makes the daemon exit 1 and stay down, so a refusal turned a new
render node into a dead one that someone had to restart by hand after creating its host. Cuebot
registers such a host into the facility's default allocation; cuesched does that when
`CUESCHED_RQD_DEFAULT_ALLOC` names one, and otherwise lists it here (`cuesched_waiting_host`),
answers UNAVAILABLE with what to do, and lets the daemon keep retrying. An operator admits it
(`manage.py rqd_hosts admit NAME --alloc ALLOC`): the host is registered as its last report
described it, with an audit row, and its next startup report finds it known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from accounting import db as acct_db
from dispatch.hosts.agent import HostSpec, register_host

RECORD_SQL = """
INSERT INTO cuesched_waiting_host (str_name, str_address, int_cores, int_mem, int_gpus, int_gpu_mem, str_os,
                                   str_tags, int_reports, ts_first_seen, ts_last_seen)
VALUES (%(name)s, %(address)s, %(cores)s, %(mem)s, %(gpus)s, %(gpu_mem)s, %(os)s, %(tags)s, 1, now(), now())
ON CONFLICT (str_name) DO UPDATE SET
  str_address = EXCLUDED.str_address, int_cores = EXCLUDED.int_cores, int_mem = EXCLUDED.int_mem,
  int_gpus = EXCLUDED.int_gpus, int_gpu_mem = EXCLUDED.int_gpu_mem, str_os = EXCLUDED.str_os,
  str_tags = EXCLUDED.str_tags, int_reports = cuesched_waiting_host.int_reports + 1, ts_last_seen = now()
"""
WAITING_SQL = """
SELECT str_name, str_address, int_cores, int_mem, int_gpus, int_gpu_mem, str_os, str_tags, int_reports,
       ts_first_seen, ts_last_seen
FROM cuesched_waiting_host WHERE (%(name)s::text IS NULL OR str_name = %(name)s) ORDER BY str_name
"""
LOCK_SQL = "SELECT 1 FROM cuesched_waiting_host WHERE str_name = %s FOR UPDATE"
DELETE_SQL = "DELETE FROM cuesched_waiting_host WHERE str_name = %s"
SET_ADDRESS_SQL = "UPDATE host SET str_rqd_address = %s WHERE pk_host = %s"
AUDIT_SQL = """
INSERT INTO cuesched_farm_action (str_action, str_target_kind, str_target, str_target_name, int_changed, detail,
                                  str_username)
VALUES ('admit_host', 'host', %(host)s, %(name)s, 1, %(detail)s, %(user)s)
"""


class HostWaiting(Exception):
    """The report's host is unknown and waits for an operator (answered UNAVAILABLE: RQD retries)."""


@dataclass(frozen=True)
class Waiting:
    name: str
    address: str | None
    cores: int
    memory_kb: int
    gpus: int
    gpu_memory_kb: int
    os: str
    tags: str
    reports: int
    first_seen: Any
    last_seen: Any


def record(conn: psycopg.Connection, spec: HostSpec, address: str | None) -> None:
    """List (or refresh) the unknown host as its report describes it."""
    conn.execute(
        RECORD_SQL,
        {
            "name": spec.name,
            "address": address,
            "cores": spec.cores or 0,
            "mem": spec.memory_kb or 0,
            "gpus": spec.gpus,
            "gpu_mem": spec.gpu_memory_kb,
            "os": (spec.os or "")[:32],
            "tags": " ".join(spec.tags)[:512],
        },
    )


def waiting(conn: psycopg.Connection, name: str | None = None) -> list[Waiting]:
    return [Waiting(*row) for row in conn.execute(WAITING_SQL, {"name": name}).fetchall()]


def admit(name: str, alloc: str, *, actor: str = "", conn: psycopg.Connection | None = None) -> str:
    """Register the waiting host `name` into allocation `alloc`, as its last report described it;
    returns pk_host. One transaction: the host rows, the address its RQD answers at, the waiting
    row gone and the audit row. Raises LookupError for a host that is not waiting and ValueError
    for an unknown allocation (nothing written)."""
    own = conn is None
    conn = conn or acct_db.connect(autocommit=True, application_name="cuesched-rqd-admit")
    try:
        with conn.transaction():
            if conn.execute(LOCK_SQL, (name,)).fetchone() is None:
                raise LookupError(f"no RQD host named {name!r} is waiting (manage.py rqd_hosts lists them)")
            (row,) = waiting(conn, name)
            spec = HostSpec(
                name=row.name,
                alloc=alloc,
                cores=row.cores or None,
                memory_kb=row.memory_kb or None,
                gpus=row.gpus,
                gpu_memory_kb=row.gpu_memory_kb,
                os=row.os or None,
                tags=tuple(t for t in row.tags.split() if t),
            )
            pk_host = register_host(spec, conn)
            if row.address:
                conn.execute(SET_ADDRESS_SQL, (row.address, pk_host))
            conn.execute(DELETE_SQL, (name,))
            detail = {"alloc": alloc, "address": row.address, "cores": row.cores, "memory_kb": row.memory_kb}
            conn.execute(AUDIT_SQL, {"host": pk_host, "name": name, "detail": Jsonb(detail), "user": actor})
        return pk_host
    finally:
        if own:
            conn.close()
