"""A Cuebot stand-in: Cuebot's own SQL, replayed against an adopted Cuebot database.

Why: cuesched runs beside a live Cuebot on Cuebot's database, and the tests must show that
what Cuebot writes is counted exactly once. A JVM Cuebot is not available here, so its writes
are replayed statement by statement, copied from OpenCue's cuebot sources
(cuebot/src/main/java/com/imageworks/spcue/...). This module reimplements none of cuesched's
logic: every statement below is Cuebot's, and the Python around it only plays the part of the
Java caller (which statement runs when, in one transaction per Cuebot service call).

Which DAO each statement comes from:

- `book`: dao/postgres/ProcDaoJdbc.java, INSERT_VIRTUAL_PROC (insertVirtualProc), then
  procCreated(): host idle counters down, then subscription, layer_resource, job_resource,
  folder_resource and point up by the proc's cores and GPUs (non-local proc). Cuebot's
  DispatchQuery only dispatches shows with b_scheduler_managed = false, so the caller books
  unmanaged shows only; Cuebot's verify_* triggers refuse a booking over a cap.
- `unbook`: ProcDaoJdbc.deleteVirtualProc(): DELETE_VIRTUAL_PROC ... RETURNING, then
  procDestroyed(): host idle counters up; for a scheduler-managed show only
  AccountingNotifier.notifyRelease() (its exact payload, when `notifier=True`, i.e. Cuebot's
  accounting.notify.enabled=true), otherwise the five tables down.
- `orphans`: ProcDaoJdbc.GET_ORPHANED_PROC_LIST (procs whose ts_ping is older than
  ORPHANED_PROC_INTERVAL, 300 s), which Cuebot's MaintenanceManagerSupport then unbooks.
- `recalculate_subs`: the V45 plpgsql function Cuebot's maintenance task calls.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import psycopg

# ProcDaoJdbc.INSERT_VIRTUAL_PROC
INSERT_VIRTUAL_PROC = (
    "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, "
    "int_mem_reserved, int_mem_pre_reserved, int_mem_used, int_gpus_reserved, int_gpu_mem_reserved, "
    "int_gpu_mem_pre_reserved, int_gpu_mem_used, b_local) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
# ProcDaoJdbc.procCreated (non-local)
PROC_CREATED = (
    (
        "UPDATE host SET int_cores_idle = int_cores_idle - %(c)s, int_mem_idle = int_mem_idle - %(m)s, "
        "int_gpus_idle = int_gpus_idle - %(g)s, int_gpu_mem_idle = int_gpu_mem_idle - %(gm)s WHERE pk_host = %(host)s"
    ),
    "UPDATE subscription SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_show = %(show)s AND pk_alloc = %(alloc)s",
    "UPDATE layer_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s WHERE pk_layer = %(layer)s",
    "UPDATE job_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s WHERE pk_job = %(job)s",
    "UPDATE folder_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_folder = (SELECT pk_folder FROM job WHERE pk_job=%(job)s)",
    "UPDATE point SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_dept = (SELECT pk_dept FROM job WHERE pk_job=%(job)s) "
    "AND pk_show = (SELECT pk_show FROM job WHERE pk_job=%(job)s)",
)
# ProcDaoJdbc.DELETE_VIRTUAL_PROC
DELETE_VIRTUAL_PROC = (
    "DELETE FROM proc WHERE pk_proc=%s RETURNING int_cores_reserved, int_mem_reserved, "
    "int_gpus_reserved, int_gpu_mem_reserved"
)
PROC_DESTROYED_HOST = (
    "UPDATE host SET int_cores_idle = int_cores_idle + %(c)s, int_mem_idle = int_mem_idle + %(m)s, "
    "int_gpus_idle = int_gpus_idle + %(g)s, int_gpu_mem_idle = int_gpu_mem_idle + %(gm)s WHERE pk_host = %(host)s"
)
# ShowDaoJdbc.isSchedulerManaged
IS_SCHEDULER_MANAGED = "SELECT b_scheduler_managed FROM show WHERE pk_show=%s"
# ProcDaoJdbc.procDestroyed, unmanaged non-local
PROC_DESTROYED = tuple(s.replace("+ %(c)s", "- %(c)s").replace("+ %(g)s", "- %(g)s") for s in PROC_CREATED[1:])
# ProcDaoJdbc.GET_ORPHANED_PROC_LIST (joins as Cuebot's, ORPHANED_PROC_INTERVAL = 300 s)
ORPHANED_PROCS = (
    "SELECT proc.pk_proc FROM proc, host, host_stat, alloc, job WHERE proc.pk_host = host.pk_host "
    "AND host.pk_host = host_stat.pk_host AND host.pk_alloc = alloc.pk_alloc AND job.pk_job = proc.pk_job "
    "AND current_timestamp - proc.ts_ping > interval '300' second ORDER BY proc.ts_ping"
)


def notifier_release_payload(
    show: str, alloc: str, folder: str, job: str, layer: str, dept: str, cores: int, gpus: int
) -> str:
    """AccountingNotifier.notifyRelease's String.format, exactly (cores in centicores / 100, negated)."""
    return (
        f'{{"show":"{show}","alloc":"{alloc}","folder":"{folder}","job":"{job}",'
        f'"layer":"{layer}","dept":"{dept}","cores":{-cores // 100},"gpus":{-gpus}}}'
    )


@dataclass
class Proc:
    pk_proc: str
    host: str
    alloc: str
    show: str
    job: str
    layer: str
    frame: str
    cores: int
    gpus: int = 0
    mem: int = 1_048_576


class CuebotStandIn:
    """One Cuebot, one connection: each method is one Cuebot service call (one transaction)."""

    def __init__(self, url: str, *, notifier: bool = False) -> None:
        self.conn = psycopg.connect(url, autocommit=True, application_name="cuebot-standin")
        self.notifier = notifier

    def close(self) -> None:
        self.conn.close()

    def book(self, *, host: str, alloc: str, show: str, job: str, layer: str, frame: str, cores: int) -> Proc:
        """DispatchSupportService.reserveProc -> ProcDaoJdbc.insertVirtualProc (+ procCreated)."""
        proc = Proc(str(uuid.uuid4()), host, alloc, show, job, layer, frame, cores)
        with self.conn.transaction():
            self.conn.execute(
                INSERT_VIRTUAL_PROC,
                (proc.pk_proc, host, show, layer, job, frame, cores, proc.mem, proc.mem, 0, 0, 0, 0, 0, False),
            )
            params = {"c": cores, "m": proc.mem, "g": 0, "gm": 0, "host": host, "show": show, "alloc": alloc}
            params.update(job=job, layer=layer)
            for stmt in PROC_CREATED:
                self.conn.execute(stmt, params)
        return proc

    def unbook(self, proc: Proc) -> bool:
        """ProcDaoJdbc.deleteVirtualProc (+ procDestroyed), as FrameCompleteHandler calls it."""
        with self.conn.transaction():
            row = self.conn.execute(DELETE_VIRTUAL_PROC, (proc.pk_proc,)).fetchone()
            if row is None:
                return False
            cores, mem, gpus, gpu_mem = row
            params = {"c": cores, "m": mem, "g": gpus, "gm": gpu_mem, "host": proc.host}
            self.conn.execute(PROC_DESTROYED_HOST, params)
            (managed,) = self.conn.execute(IS_SCHEDULER_MANAGED, (proc.show,)).fetchone()
            if managed:
                if self.notifier:
                    folder, dept = self.conn.execute(
                        "SELECT pk_folder, pk_dept FROM job WHERE pk_job=%s", (proc.job,)
                    ).fetchone()
                    payload = notifier_release_payload(
                        proc.show, proc.alloc, folder, proc.job, proc.layer, dept, cores, gpus
                    )
                    self.conn.execute("SELECT pg_notify(%s, %s)", ("acct_release", payload))
                return True
            params.update(show=proc.show, alloc=proc.alloc, job=proc.job, layer=proc.layer)
            for stmt in PROC_DESTROYED:
                self.conn.execute(stmt, params)
        return True

    def orphans(self) -> list[str]:
        """ProcDaoJdbc.findOrphanedVirtualProcs: what Cuebot's maintenance would unbook now."""
        return [r[0] for r in self.conn.execute(ORPHANED_PROCS)]

    def recalculate_subs(self) -> None:
        """Cuebot's maintenance task: SELECT recalculate_subs() (V45)."""
        self.conn.execute("SELECT recalculate_subs()")
