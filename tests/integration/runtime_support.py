"""Helpers for tests that run the real scheduler runtime against the test database.

Rows are written with plain SQL on autocommit connections of their own, because the
runtime under test reads them from other connections and NOTIFY only fires on commit.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg

from accounting import db
from accounting.scheduler import SchedulerOptions, SchedulerProcess


def uid(tag: str, i: int = 0) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"cuesched-test:{tag}:{i}"))


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> float:
    """Poll until true; returns the seconds waited. Polling with a deadline, never a bare sleep."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - started


@dataclass
class MiniFarm:
    """One facility, one show, one alloc+subscription, one folder, `jobs` jobs of one layer, hosts."""

    show: str
    alloc: str
    folder: str
    dept: str
    jobs: list[str]
    layers: list[str]
    hosts: list[str]
    frames: dict[str, list[str]] = field(default_factory=dict)
    _proc_seq: int = 0

    def add_proc(self, conn: psycopg.Connection, job_index: int = 0, cores: int = 1, gpus: int = 0) -> str:
        """Start one WAITING frame of a job as a proc of `cores` whole cores (frame, proc, host)."""
        job, layer = self.jobs[job_index], self.layers[job_index]
        frame = self.frames[job].pop()
        pk_proc = uid(f"proc-{self.show}", self._proc_seq)
        self._proc_seq += 1
        host = self.hosts[self._proc_seq % len(self.hosts)]
        with conn.transaction():
            conn.execute(
                "UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1 WHERE pk_frame = %s", (frame,)
            )
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved, int_gpus_reserved) VALUES (%s, %s, %s, %s, %s, %s, %s, 1048576, %s)",
                (pk_proc, host, self.show, layer, job, frame, cores * 100, gpus),
            )
            conn.execute(
                "UPDATE host SET int_cores_idle = int_cores_idle - %s, int_mem_idle = int_mem_idle - 1048576,"
                " int_gpus_idle = int_gpus_idle - %s WHERE pk_host = %s",
                (cores * 100, gpus, host),
            )
        return pk_proc

    def delete_procs(self, conn: psycopg.Connection, procs: list[str]) -> None:
        with conn.transaction():
            conn.execute("DELETE FROM proc WHERE pk_proc = ANY(%s)", (procs,))


def make_farm(
    conn: psycopg.Connection,
    tag: str,
    *,
    managed: bool = True,
    burst_cores: int = 100,
    folder_max_cores: int = -1,
    job_max_cores: int = 10000,
    jobs: int = 2,
    frames: int = 20,
    hosts: int = 4,
    host_cores: int = 64,
) -> MiniFarm:
    """Create a small farm in one committed transaction. Caps in whole cores (stored x100)."""
    f = MiniFarm(
        show=uid(f"{tag}-show"),
        alloc=uid(f"{tag}-alloc"),
        folder=uid(f"{tag}-folder"),
        dept=uid(f"{tag}-dept"),
        jobs=[uid(f"{tag}-job", i) for i in range(jobs)],
        layers=[uid(f"{tag}-layer", i) for i in range(jobs)],
        hosts=[uid(f"{tag}-host", i) for i in range(hosts)],
    )
    facility = uid(f"{tag}-facility")
    with conn.transaction():
        conn.execute("INSERT INTO facility (pk_facility, str_name) VALUES (%s, %s)", (facility, f"{tag}_fac"))
        conn.execute("INSERT INTO dept (pk_dept, str_name) VALUES (%s, %s)", (f.dept, f"{tag}_dept"))
        conn.execute(
            "INSERT INTO show (pk_show, str_name, b_scheduler_managed) VALUES (%s, %s, %s)",
            (f.show, f"{tag}_show", managed),
        )
        conn.execute(
            "INSERT INTO alloc (pk_alloc, pk_facility, str_name, str_tag) VALUES (%s, %s, %s, %s)",
            (f.alloc, facility, f"{tag}_alloc", f"{tag}_a"[:24]),
        )
        conn.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst)"
            " VALUES (%s, %s, %s, %s, %s)",
            (uid(f"{tag}-sub"), f.alloc, f.show, burst_cores * 100, burst_cores * 100),
        )
        conn.execute(
            "INSERT INTO folder (pk_folder, pk_show, pk_dept, str_name) VALUES (%s, %s, %s, %s)",
            (f.folder, f.show, f.dept, f"{tag}_folder"),
        )
        conn.execute(
            "UPDATE folder_resource SET int_max_cores = %s WHERE pk_folder = %s",
            (folder_max_cores * 100 if folder_max_cores > 0 else folder_max_cores, f.folder),
        )
        for i, (job, layer) in enumerate(zip(f.jobs, f.layers, strict=True)):
            conn.execute(
                "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (job, f.folder, f.show, facility, f.dept, f"{tag}_job{i}"),
            )
            conn.execute(
                "UPDATE job_resource SET int_max_cores = %s WHERE pk_job = %s",
                (job_max_cores * 100 if job_max_cores > 0 else job_max_cores, job),
            )
            conn.execute(
                "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range) VALUES (%s, %s, %s, 'true', %s)",
                (layer, job, f"{tag}_layer{i}", f"1-{frames}"),
            )
            ids = [uid(f"{tag}-frame-{i}", n) for n in range(frames)]
            f.frames[job] = ids
            conn.execute(
                "INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, int_number)"
                " SELECT t.pk, %s, %s, to_char(t.n, 'FM0000') || '-l', t.n"
                " FROM unnest(%s::text[]) WITH ORDINALITY AS t(pk, n)",
                (layer, job, ids),
            )
        for i, host in enumerate(f.hosts):
            conn.execute(
                "INSERT INTO host (pk_host, pk_alloc, str_name, int_cores, int_cores_idle, int_mem, int_mem_idle,"
                " int_gpus, int_gpus_idle) VALUES (%s, %s, %s, %s, %s, %s, %s, 8, 8)",
                (host, f.alloc, f"{tag}_h{i}", host_cores * 100, host_cores * 100, 1 << 30, 1 << 30),
            )
            conn.execute(
                "INSERT INTO host_stat (pk_host_stat, pk_host, str_os, int_mem_total, int_mem_free)"
                " VALUES (%s, %s, 'linux', %s, %s)",
                (uid(f"{tag}-hs", i), host, 1 << 30, 1 << 30),
            )
    return f


@contextmanager
def running_scheduler(**options: float | int | None) -> Iterator[SchedulerProcess]:
    """A real SchedulerProcess (lock, listener, loops, publisher) in a thread of this test."""
    process = SchedulerProcess(SchedulerOptions(bootstrap_timeout=30, **options))  # type: ignore[arg-type]
    thread = threading.Thread(target=process.run, name="test-scheduler", daemon=True)
    thread.start()
    try:
        if not process.ready.wait(30):
            raise AssertionError(f"scheduler did not become ready: {process.service.listener.stats.last_error}")
        yield process
    finally:
        process.stop.set()
        thread.join(15)


def autocommit_conn() -> psycopg.Connection:
    return db.connect(autocommit=True, application_name="cuesched-test")
