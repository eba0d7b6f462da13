"""The host agent: what runs on a render host, whichever transport brings it work (q2, celery).

Four jobs, all on the agent's own psycopg connections (never the scheduler's):

* **register** the host (`register_host`): host + host_stat + host_tag rows, upserted by name,
  so restarting an agent is idempotent. Cores come from `os.cpu_count()` unless given, memory
  from /proc/meminfo unless given, GPUs from the options, the OS from `platform`; tags are the
  allocation's tag, the host name and the given manual tags. A host that already exists keeps
  its booked resources: idle = total - what its procs reserve.
* **heartbeat** (`Heartbeat`): every few seconds `host_stat.ts_ping = now()` and the free memory
  (`int_mem_free`, KB, from MemAvailable). A host an agent-less launcher marked DOWN comes back
  UP with its agent's first ping; REPAIR and the other operator states are left alone.
* **run a frame** (`run_frame`): the task a launcher enqueues carries only the proc id and the
  host name; everything else is read from the database, so a stale task (its proc released
  by a kill, a lost-host sweep or a compensation) runs nothing. The layer's command gets the
  reference's `#...#` tokens substituted (`frameset.substitute_tokens`, the chunk found from
  the layer's range) and the RQD-style `CUE_*` environment. The command runs without a shell
  when it is a plain argument list (`shlex.split`), and through `/bin/sh -c` when it uses shell
  syntax (`;`, `&&`, `|`, redirections, `$VAR`, globs, ...): RQD runs every command through a
  shell, and farm commands routinely chain steps, so refusing them would break real jobs, while
  plain commands skip a needless process and any quoting surprise. stdout and stderr go to
  `<log root>/<show>/<job>/<layer>.<frame>.log` (appended: a retry adds its own header).
* **report** the end through the normal release path, from the agent itself:
  `completion.complete` on the agent's connection, one transaction (frame state by exit status
  and retries, proc delete whose trigger releases, host idle back). Nothing travels back
  through the broker. The scheduler learns of it from the database: its host view reloads
  every `CUESCHED_HOST_REFRESH_INTERVAL` seconds (and the Store hears the release trigger).

**Kill.** A kill marks the proc (`proc.ts_kill`, dispatch.engine.kills) and leaves it booked.
While a frame runs, the agent checks its proc every `kill_poll` seconds: marked, the process
group gets SIGTERM, then SIGKILL after a grace period, and once it has exited the agent writes
its completion, which the completion path records as killed (so the cores are counted until the
process is really gone); gone (released by the lost-host sweep, an operator, a previous
behaviour's forced release), the process group is ended the same way and no completion is
written (the releaser wrote it). A task whose proc is already marked when it starts runs
nothing and ends the proc killed.

**Duplicates.** A broker may deliver a task twice (q2 re-delivers after its retry time, celery
after a lost connection with late acks). A run holds a session advisory lock on its proc for
its whole life, and a task whose proc is gone or locked does nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from django.conf import settings

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine import kills
from dispatch.engine.completion import EXIT_STATUS_DOWN_HOST, EXIT_STATUS_KILLED, Completion, complete
from dispatch.engine.memory import KILL_MEMORY, Use, follow_use
from dispatch.jobs import logs as frame_logs
from dispatch.jobs.frameset import Chunk, FrameRangeError, chunk_frames, parse_frames, substitute_tokens

logger = logging.getLogger(__name__)

CENTI = 100
EXIT_COMMAND_NOT_FOUND = 127  # the shell's status for a command that does not exist
EXIT_CANNOT_EXECUTE = 126

# ---------------------------------------------------------------------------------------
# Registration and heartbeat
# ---------------------------------------------------------------------------------------

ALLOC_BY_NAME_SQL = "SELECT pk_alloc, str_tag FROM alloc WHERE str_name = %s"
HOST_BY_NAME_SQL = "SELECT pk_host, pk_alloc FROM host WHERE str_name = %s"
ALLOC_TAG_SQL = "SELECT str_tag FROM alloc WHERE pk_alloc = %s"

# Upsert by name. On conflict the totals follow the agent, and idle is total minus what the
# host's procs hold (never negative: a host shrunk under running frames reads 0 idle).
UPSERT_HOST_SQL = """
INSERT INTO host (pk_host, pk_alloc, str_name, str_fqdn, str_lock_state, str_tags, int_cores, int_cores_idle,
                  int_mem, int_mem_idle, int_gpus, int_gpus_idle, int_gpu_mem, int_gpu_mem_idle)
VALUES (%(pk)s, %(alloc)s, %(name)s, %(fqdn)s, 'OPEN', %(tags)s, %(cores)s, %(cores)s, %(mem)s, %(mem)s,
        %(gpus)s, %(gpus)s, %(gpu_mem)s, %(gpu_mem)s)
ON CONFLICT (str_name) DO UPDATE SET
  str_fqdn = EXCLUDED.str_fqdn, str_tags = EXCLUDED.str_tags,
  int_cores = EXCLUDED.int_cores, int_mem = EXCLUDED.int_mem, int_gpus = EXCLUDED.int_gpus,
  int_gpu_mem = EXCLUDED.int_gpu_mem,
  int_cores_idle = GREATEST(0, EXCLUDED.int_cores - COALESCE(
      (SELECT SUM(p.int_cores_reserved) FROM proc p WHERE p.pk_host = host.pk_host), 0)),
  int_mem_idle = GREATEST(0, EXCLUDED.int_mem - COALESCE(
      (SELECT SUM(p.int_mem_reserved) FROM proc p WHERE p.pk_host = host.pk_host), 0)),
  int_gpus_idle = GREATEST(0, EXCLUDED.int_gpus - COALESCE(
      (SELECT SUM(p.int_gpus_reserved) FROM proc p WHERE p.pk_host = host.pk_host), 0)),
  int_gpu_mem_idle = GREATEST(0, EXCLUDED.int_gpu_mem - COALESCE(
      (SELECT SUM(p.int_gpu_mem_reserved) FROM proc p WHERE p.pk_host = host.pk_host), 0)),
  ts_last_updated = now()
RETURNING pk_host
"""

# Named only when the allocation really changes: a statement that sets pk_alloc moves the
# accounting of the host's running procs and takes the farm-wide accounting-keys lock.
MOVE_HOST_SQL = "UPDATE host SET pk_alloc = %s WHERE pk_host = %s AND pk_alloc IS DISTINCT FROM %s"

UPSERT_HOST_STAT_SQL = """
INSERT INTO host_stat (pk_host_stat, pk_host, str_state, str_os, int_mem_total, int_mem_free, int_gpu_mem_total,
                       int_gpu_mem_free, ts_ping, ts_booted)
VALUES (%(pk)s, %(host)s, 'UP', %(os)s, %(mem)s, %(free)s, %(gpu_mem)s, %(gpu_mem)s, now(), now())
ON CONFLICT (pk_host) DO UPDATE SET
  str_state = CASE WHEN host_stat.str_state = 'DOWN' THEN 'UP' ELSE host_stat.str_state END,
  str_os = EXCLUDED.str_os, int_mem_total = EXCLUDED.int_mem_total, int_mem_free = EXCLUDED.int_mem_free,
  int_gpu_mem_total = EXCLUDED.int_gpu_mem_total, int_gpu_mem_free = EXCLUDED.int_gpu_mem_free,
  ts_ping = now(), ts_booted = now()
"""

DELETE_TAGS_SQL = "DELETE FROM host_tag WHERE pk_host = %s AND NOT b_constant"
INSERT_TAG_SQL = (
    "INSERT INTO host_tag (pk_host_tag, pk_host, str_tag, str_tag_type, b_constant) VALUES (%s, %s, %s, %s, false)"
)

# The ping. A host marked DOWN because it had no live agent comes back with it.
PING_SQL = """
UPDATE host_stat SET ts_ping = now(), int_mem_free = %(free)s,
  str_state = CASE WHEN str_state = 'DOWN' THEN 'UP' ELSE str_state END
WHERE pk_host = %(host)s
"""


@dataclass(frozen=True)
class HostSpec:
    """What the agent registers. Cores whole, memory KB."""

    name: str
    alloc: str | None = None  # allocation name; None keeps an existing host's allocation
    cores: int | None = None
    memory_kb: int | None = None
    gpus: int = 0
    gpu_memory_kb: int = 0
    os: str | None = None
    tags: tuple[str, ...] = ()

    def resolved_cores(self) -> int:
        return self.cores if self.cores else (os.cpu_count() or 1)

    def resolved_memory(self) -> int:
        return self.memory_kb if self.memory_kb else meminfo()["MemTotal"]

    def resolved_os(self) -> str:
        return self.os or platform.system().lower()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KB (MemTotal, MemAvailable, ...); zeros where it cannot be read."""
    out = {"MemTotal": 0, "MemAvailable": 0}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0])
    except OSError:
        logger.warning("agent: /proc/meminfo is not readable; reporting 0 KB")
    return out


def free_memory_kb(spec: HostSpec) -> int:
    """Free memory to report, KB: MemAvailable, at most the advertised total.

    With a --memory override the host is a share of a bigger machine, and the machine's other
    users (other agents' frames, the database) are not this host's: what its own frames use is
    taken off where it is judged, from their RSS (dispatch.engine.memory). Subtracting the whole
    machine's use from the share, as before, read a 2 GB agent on a busy 24 GB machine as out of
    memory with nothing running."""
    info = meminfo()
    available = info.get("MemAvailable", 0)
    total = spec.resolved_memory()
    if not info.get("MemTotal", 0):
        return total
    return max(0, min(total, available))


def tree_rss_kb(pid: int) -> int:
    """RSS of a frame's whole process tree, KB: the process and every descendant (as RQD measures it)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in tree:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue  # it ended between the listing and the read
    return total // 1024


def _new_id() -> str:
    return str(uuid.uuid4())


def register_host(spec: HostSpec, conn: psycopg.Connection | None = None) -> str:
    """Create or update the host rows for `spec` in one transaction; returns pk_host."""
    own = conn is None
    conn = conn or acct_db.connect(autocommit=True, application_name=f"cuesched-agent-{spec.name}")
    try:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute(HOST_BY_NAME_SQL, (spec.name,))
            existing = cur.fetchone()
            if spec.alloc:
                cur.execute(ALLOC_BY_NAME_SQL, (spec.alloc,))
                row = cur.fetchone()
                if row is None:
                    raise ValueError(f"no allocation named {spec.alloc!r}")
                pk_alloc, alloc_tag = row
            elif existing:
                pk_alloc = existing[1]
                cur.execute(ALLOC_TAG_SQL, (pk_alloc,))
                alloc_tag = cur.fetchone()[0]
            else:
                raise ValueError(f"host {spec.name!r} is new: name its allocation (--alloc)")
            cores = spec.resolved_cores() * CENTI
            mem = spec.resolved_memory()
            tags = [(alloc_tag, "ALLOC"), (spec.name, "HOSTNAME")]
            tags += [(t, "MANUAL") for t in spec.tags if t not in {alloc_tag, spec.name}]
            cur.execute(
                UPSERT_HOST_SQL,
                {
                    "pk": existing[0] if existing else _new_id(),
                    "alloc": pk_alloc,
                    "name": spec.name,
                    "fqdn": socket.getfqdn(),
                    "tags": " ".join(t for t, _ in tags),
                    "cores": cores,
                    "mem": mem,
                    "gpus": spec.gpus,
                    "gpu_mem": spec.gpu_memory_kb,
                },
            )
            pk_host = cur.fetchone()[0]
            if existing and existing[1] != pk_alloc:
                cur.execute(MOVE_HOST_SQL, (pk_alloc, pk_host, pk_alloc))
            cur.execute(
                UPSERT_HOST_STAT_SQL,
                {
                    "pk": _new_id(),
                    "host": pk_host,
                    "os": spec.resolved_os(),
                    "mem": mem,
                    "free": free_memory_kb(spec),
                    "gpu_mem": spec.gpu_memory_kb,
                },
            )
            cur.execute(DELETE_TAGS_SQL, (pk_host,))
            for tag, kind in tags:
                cur.execute(INSERT_TAG_SQL, (_new_id(), pk_host, tag, kind))
    finally:
        if own:
            conn.close()
    logger.info(
        "agent: registered host %s (%d cores, %d MB, %d GPUs, tags %s)",
        spec.name,
        spec.resolved_cores(),
        spec.resolved_memory() // 1024,
        spec.gpus,
        " ".join(t for t, _ in tags),
    )
    return pk_host


class Heartbeat:
    """Pings host_stat every `interval` seconds from a daemon thread, on its own connection.

    A database error is logged and retried at the next beat (the scheduler treats a host as
    lost only after `CUESCHED_LOST_HOST_TIMEOUT`, many beats later).
    """

    def __init__(self, pk_host: str, spec: HostSpec, interval: float | None = None) -> None:
        self.pk_host = pk_host
        self.spec = spec
        self.interval = conf.agent_heartbeat_interval() if interval is None else interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0

    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.spec.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        conn: psycopg.Connection | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = acct_db.connect(autocommit=True, application_name=f"cuesched-agent-{self.spec.name}")
                conn.execute(PING_SQL, {"free": free_memory_kb(self.spec), "host": self.pk_host})
                self.beats += 1
            except psycopg.Error as exc:
                logger.warning("agent %s: heartbeat failed (%s); retrying", self.spec.name, exc)
                if conn is not None:
                    conn.close()
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


HOST_PROCS_SQL = "SELECT pk_proc FROM proc WHERE pk_host = %s AND NOT b_local"


def release_previous_runs(pk_host: str, conn: psycopg.Connection | None = None) -> int:
    """Requeue the frames a previous life of this host's agent left RUNNING; returns how many.

    An agent that starts runs nothing yet, so every proc on its host belongs to a run that
    died with the previous agent (or to a task still queued for it, whose proc release only
    makes that task a no-op). They are released the lost-host way (exit 399, frame back to
    WAITING, no retry counted) instead of waiting for the lost-host timeout.
    """
    own = conn is None
    conn = conn or acct_db.connect(autocommit=True, application_name="cuesched-agent")
    try:
        procs = [r[0] for r in conn.execute(HOST_PROCS_SQL, (pk_host,)).fetchall()]
        if not procs:
            return 0
        result = complete(conn, [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk in procs])
        logger.warning("agent: host restarted: %d frame(s) of its previous agent back to WAITING", result.released)
        return result.released
    finally:
        if own:
            conn.close()


# A stopping agent takes its host out of placement first, so the scheduler books nothing
# more on it while its frames are ended; the next agent's registration brings it back UP.
# Only UP: REPAIR and the other operator states are the operator's.
MARK_STOPPING_DOWN_SQL = "UPDATE host_stat SET str_state = 'DOWN' WHERE pk_host = %s AND str_state = 'UP'"
TRY_RUN_LOCK_SQL = "SELECT pg_try_advisory_lock(hashtext('cuesched-run:' || %s))"
RUN_UNLOCK_SQL = "SELECT pg_advisory_unlock(hashtext('cuesched-run:' || %s))"


@dataclass
class StopReport:
    """What a stopping agent did with the frames booked on its host."""

    marked_down: bool = False
    requeued_running: int = 0  # frames that were running: their process group was ended first
    requeued_queued: int = 0  # booked, their task not started yet: it will run nothing
    still_running: list[str] = field(default_factory=list)  # runs that had not ended by the deadline

    def summary(self) -> str:
        text = (
            f"{self.requeued_running} running frame(s) ended and requeued, "
            f"{self.requeued_queued} queued frame(s) requeued"
        )
        if self.marked_down:
            text += ", host marked DOWN until its agent starts again"
        if self.still_running:
            text += f"; {len(self.still_running)} run(s) had not ended by the deadline: {', '.join(self.still_running)}"
        return text


def stop_host_work(pk_host: str, host: str, *, timeout: float | None = None) -> StopReport:
    """End or requeue every frame booked on this agent's host: the stop path of SIGTERM/SIGINT.

    Without it a stopped agent left its frames RUNNING with their procs booked (holding the
    show's subscription and the job's cores) until the lost-host timeout or the next agent
    start. The order matters: the host goes DOWN first (no new booking lands on it), then
    every proc on it is released the lost-host way (exit 399, WAITING, no retry charged).
    A frame whose run is in progress (its run lock is held) sees its proc gone at its next
    kill poll and ends its process group, as for any kill; this waits for those runs to let
    go of their locks, up to `timeout` (default: kill poll + kill grace + 5 s). A proc whose
    task has not started yet is released while this holds its run lock, so that task, when
    a broker delivers it, finds the proc gone and runs nothing.
    """
    if timeout is None:
        timeout = conf.agent_kill_poll() + conf.agent_kill_grace() + 5.0
    deadline = time.monotonic() + timeout
    report = StopReport()
    conn = acct_db.connect(autocommit=True, application_name=f"cuesched-agent-{host}")
    try:
        report.marked_down = conn.execute(MARK_STOPPING_DOWN_SQL, (pk_host,)).rowcount > 0
        procs = [r[0] for r in conn.execute(HOST_PROCS_SQL, (pk_host,)).fetchall()]
        locked: list[str] = []  # procs whose run lock this holds: no run in progress
        running: list[str] = []
        for pk in procs:
            (locked if conn.execute(TRY_RUN_LOCK_SQL, (pk,)).fetchone()[0] else running).append(pk)
        try:
            if procs:
                complete(conn, [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk in procs])
        finally:
            for pk in locked:
                conn.execute(RUN_UNLOCK_SQL, (pk,))
        report.requeued_queued = len(locked)
        report.requeued_running = len(running)
        pending = list(running)
        while pending and time.monotonic() < deadline:
            pending = [pk for pk in pending if not _take_and_drop_run_lock(conn, pk)]
            if pending:
                time.sleep(0.1)
        report.still_running = pending
    finally:
        conn.close()
    return report


def _take_and_drop_run_lock(conn: psycopg.Connection, pk_proc: str) -> bool:
    """Whether no run of `pk_proc` is in progress any more (its run lock is free)."""
    if not conn.execute(TRY_RUN_LOCK_SQL, (pk_proc,)).fetchone()[0]:
        return False
    conn.execute(RUN_UNLOCK_SQL, (pk_proc,))
    return True


def queue_name(host: str) -> str:
    """The broker queue of one host (q2 list key, celery queue): one consumer, its agent."""
    return f"cuesched.host.{host}"


# ---------------------------------------------------------------------------------------
# Scheduler side: is there a live agent behind a host?
# ---------------------------------------------------------------------------------------

# Hosts of a launch batch whose agent has not pinged within the agent timeout.
SILENT_HOSTS_SQL = """
SELECT h.pk_host, h.str_name, EXTRACT(EPOCH FROM now() - hs.ts_ping)::float8
FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE h.pk_host = ANY(%(hosts)s::text[]) AND hs.ts_ping < now() - make_interval(secs => %(timeout)s)
"""
# Cuebot marks a host that stops reporting DOWN; we do it at the first launch that finds it
# silent, so the loop's next booking on it fails its guard and the view drops the host,
# instead of booking and compensating on it again and again. Its agent's next ping sets it UP.
MARK_DOWN_SQL = """
UPDATE host_stat SET str_state = 'DOWN'
WHERE pk_host = ANY(%(hosts)s::text[]) AND str_state = 'UP' AND ts_ping < now() - make_interval(secs => %(timeout)s)
"""


def silent_hosts(conn: psycopg.Connection, hosts: list[str], timeout: float) -> dict[str, str]:
    """{pk_host: reason} for the hosts with no live agent; they are marked DOWN."""
    if not hosts:
        return {}
    with conn.cursor() as cur:
        cur.execute(SILENT_HOSTS_SQL, {"hosts": hosts, "timeout": timeout})
        rows = cur.fetchall()
        if rows:
            cur.execute(MARK_DOWN_SQL, {"hosts": [r[0] for r in rows], "timeout": timeout})
    return {pk: f"no live agent on host {name} (last ping {age:.0f}s ago); host marked DOWN" for pk, name, age in rows}


# ---------------------------------------------------------------------------------------
# Running a frame
# ---------------------------------------------------------------------------------------

# Everything a run needs, from the proc: a task whose proc is gone (or on another host) runs nothing.
RUN_CONTEXT_SQL = """
SELECT p.pk_proc, p.pk_frame, p.pk_layer, p.pk_job, p.int_cores_reserved, p.int_mem_reserved,
       p.int_gpus_reserved, p.int_gpu_mem_reserved,
       f.str_name, f.int_number, f.int_dispatch_order, f.int_retries,
       l.str_name, l.str_cmd, l.str_range, l.int_chunk_size,
       j.str_name, j.str_shot, j.str_user, s.str_name, h.str_name, l.int_timeout, l.int_timeout_llu, p.pk_host,
       l.b_threadable, j.int_uid,
       COALESCE((SELECT jsonb_object_agg(e.str_key, COALESCE(e.str_value, '')) FROM job_env e
                 WHERE e.pk_job = p.pk_job AND e.str_key IS NOT NULL), '{}'::jsonb),
       COALESCE((SELECT jsonb_object_agg(e.str_key, COALESCE(e.str_value, '')) FROM layer_env e
                 WHERE e.pk_layer = p.pk_layer AND e.str_key IS NOT NULL), '{}'::jsonb)
FROM proc p
JOIN frame f ON f.pk_frame = p.pk_frame
JOIN layer l ON l.pk_layer = p.pk_layer
JOIN job j ON j.pk_job = p.pk_job
JOIN show s ON s.pk_show = p.pk_show
JOIN host h ON h.pk_host = p.pk_host
WHERE p.pk_proc = %s AND f.str_state = 'RUNNING'
"""
KILL_STATE_SQL = "SELECT ts_kill IS NOT NULL, str_kill FROM proc WHERE pk_proc = %s"
LOCK_PROC_SQL = "SELECT pg_try_advisory_lock(hashtext('cuesched-run:' || %s))"

_PASSED_ENV = frozenset(("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TZ", "TMPDIR", "TERM"))
_SHELL_CHARS = re.compile(r"[;&|<>()$`*?\[\]{}~!\n\\]")


@dataclass
class RunContext:
    pk_proc: str
    pk_frame: str
    pk_layer: str
    pk_job: str
    cores: int
    mem: int
    gpus: int
    gpu_mem: int
    frame_name: str
    number: int
    dispatch_order: int
    retries: int
    layer: str
    command: str
    range: str
    chunk_size: int
    job: str
    shot: str
    user: str
    show: str
    host: str
    timeout: int = 0  # minutes (layer.int_timeout); 0: none
    timeout_llu: int = 0  # minutes of log silence (layer.int_timeout_llu); 0: none
    pk_host: str = ""  # the host's id: where the frame's memory reports go
    threadable: bool = True  # layer.b_threadable: CUE_THREADABLE
    uid: int | None = None  # job.int_uid: RQD's RunFrame.uid (the agent runs frames as itself)
    job_env: dict[str, str] = field(default_factory=dict)  # job_env, the spec's job `env`
    layer_env: dict[str, str] = field(default_factory=dict)  # layer_env, over the job's


@dataclass
class RunResult:
    """What one task did: `exit_status` None when nothing ran or the run was killed."""

    pk_proc: str
    ran: bool = False
    exit_status: int | None = None
    killed: bool = False
    skipped: str | None = None
    log_path: str | None = None
    command: list[str] = field(default_factory=list)
    started_at: float | None = None
    stopped_at: float | None = None
    states: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], {})}


def _chunk_of(ctx: RunContext) -> Chunk:
    """The frame row's chunk, as the submit made it (a range that no longer parses: the frame alone)."""
    try:
        chunks = chunk_frames(parse_frames(ctx.range), max(1, ctx.chunk_size))
    except FrameRangeError:
        return Chunk(0, (ctx.number,))
    if 0 <= ctx.dispatch_order < len(chunks) and chunks[ctx.dispatch_order].number == ctx.number:
        return chunks[ctx.dispatch_order]
    for chunk in chunks:
        if chunk.number == ctx.number:
            return chunk
    return Chunk(0, (ctx.number,))


def command_argv(command: str) -> list[str]:
    """The argv to exec: the split command, or `/bin/sh -c command` when it needs a shell."""
    if _SHELL_CHARS.search(command):
        return ["/bin/sh", "-c", command]
    try:
        argv = shlex.split(command)
    except ValueError:
        return ["/bin/sh", "-c", command]  # unbalanced quotes: let the shell say what is wrong
    return argv or ["/bin/sh", "-c", command]


# The first line a run writes to its frame's log; `previous_runs` counts them.
LOG_HEADER = "=== cuesched agent "


def previous_runs(log: Path) -> int:
    """How many runs this frame's log already holds: the number of the next run, less one.

    The frame row cannot say: `int_retries` counts only failures the job's retry limit
    charges (a kill or a lost host requeues without one) and the console's retry resets it
    to 0, so a log whose header printed it read `try 0` on its third run. Read in blocks,
    because a renderer's log can be large; a header split across two blocks is found
    because each block keeps the end of the previous one.
    """
    marker = ("\n" + LOG_HEADER).encode()
    count, tail = 0, b"\n"
    try:
        with open(log, "rb") as fh:
            while block := fh.read(1 << 20):
                data = tail + block
                count += data.count(marker)
                tail = data[-(len(marker) - 1) :]
    except FileNotFoundError:
        return 0
    return count


def log_path(root: Path, ctx: RunContext) -> Path:
    """The frame's log: the one rule the console and the API read it by (dispatch.jobs.logs)."""
    return frame_logs.agent_log_path(root, ctx.show, ctx.job, ctx.layer, ctx.number)


def frame_env(ctx: RunContext, chunk: Chunk, log: Path, *, host_basics: bool = True) -> dict[str, str]:
    """The frame's environment, as Cuebot's RunFrame builds it: the job's `env`, the layer's over
    it, then the RQD-style CUE_* variables over both (a job cannot fake its CUE_JOB or threads).

    `host_basics` (the agent) puts them on a few basics of the agent's own (PATH, HOME, ...),
    which a job's or layer's `env` may replace; never the agent's whole environment: it holds
    the database URL and Django's secret key, which a frame's command has no business reading.
    RQD adds its own basics on its side (and appends a RunFrame's PATH to its own), so the rqd
    launcher sends none of the agent's.
    """
    env = {k: v for k, v in os.environ.items() if k in _PASSED_ENV} if host_basics else {}
    env.update(ctx.job_env)
    env.update(ctx.layer_env)
    env.update(
        {
            "CUE3": "1",
            "CUE_JOB": ctx.job,
            "CUE_JOB_ID": ctx.pk_job,
            "CUE_LAYER": ctx.layer,
            "CUE_LAYER_ID": ctx.pk_layer,
            "CUE_FRAME": ctx.frame_name,
            "CUE_FRAME_ID": ctx.pk_frame,
            "CUE_SHOW": ctx.show,
            "CUE_SHOT": ctx.shot,
            "CUE_USER": ctx.user,
            "CUE_RESOURCE_ID": ctx.pk_proc,
            "CUE_IFRAME": str(ctx.number),
            "CUE_RANGE": ctx.range,
            "CUE_CHUNK": str(ctx.chunk_size),
            "CUE_THREADS": str(max(1, ctx.cores // CENTI)),
            "CUE_MEMORY": str(ctx.mem),
            "CUE_GPUS": str(ctx.gpus),
            "CUE_GPU_MEMORY": str(ctx.gpu_mem),
            "CUE_LOG_PATH": str(log.parent),
            "CUE_FRAMESPEC": chunk.spec,
            "CUE_THREADABLE": "1" if ctx.threadable else "0",
            # A Python frame writes its log as it goes, not in 8 KB blocks at exit: the log's
            # mtime is what timeout_llu reads, and the console tails the log.
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _copy_log(pipe: Any, out: Any) -> None:
    """Copy the frame's output to its log line by line, unbuffered, as RQD does: each line
    lands (and moves the log's mtime, which timeout_llu reads) as soon as the frame writes it."""
    try:
        for line in iter(pipe.readline, b""):
            out.write(line)
    except (OSError, ValueError):  # the log closed under a killed run: nothing more to copy
        pass
    finally:
        pipe.close()


def _timed_out(ctx: RunContext, started: float, log: Path) -> tuple[bool, float]:
    """(past the layer's timeout or timeout_llu now, the log's mtime) by the agent's own clock."""
    try:
        mtime = log.stat().st_mtime
    except OSError:
        mtime = 0.0
    now = time.time()
    if ctx.timeout and now - started > ctx.timeout * 60:
        return True, mtime
    if ctx.timeout_llu and mtime and now - mtime > ctx.timeout_llu * 60:
        return True, mtime
    return False, mtime


def _terminate(popen: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the frame's process group, SIGKILL it after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            popen.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _exit_status(returncode: int) -> int:
    """A signal death reads as the shell reports it (128 + signal): what the log and the frame show."""
    return 128 - returncode if returncode < 0 else returncode


def _raw_exit(returncode: int) -> tuple[int, int]:
    """(exit status, signal) as RQD reports them: a signal death is status 1 and the signal apart,
    so the completion path tells a SIGKILL from a command that exited 137 (issue 29)."""
    return (1, -returncode) if returncode < 0 else (returncode, 0)


def run_frame(pk_proc: str, host: str, *, log_root: str | None = None) -> dict[str, Any]:
    """The task both transports run: one frame of one proc, reported through the release path.

    Never raises for a frame's own failure (a missing command is exit 127, written as a
    completion): a raise would make the broker deliver the task again.
    """
    root = Path(log_root or conf.agent_log_root())
    result = RunResult(pk_proc)
    conn = acct_db.connect(autocommit=True, application_name=f"cuesched-agent-{host}")
    try:
        if not conn.execute(LOCK_PROC_SQL, (pk_proc,)).fetchone()[0]:
            result.skipped = "another run of this proc is in progress"
            logger.warning("agent %s: proc %s is already running here; duplicate task ignored", host, pk_proc)
            return result.as_dict()
        row = conn.execute(RUN_CONTEXT_SQL, (pk_proc,)).fetchone()
        if row is None:
            result.skipped = "proc is gone (killed, released or compensated)"
            logger.info("agent %s: proc %s is gone; nothing to run", host, pk_proc)
            return result.as_dict()
        ctx = RunContext(*row)
        if ctx.host != host:
            result.skipped = f"proc is booked on host {ctx.host}, not {host}"
            logger.warning("agent %s: proc %s belongs to host %s; not running it", host, pk_proc, ctx.host)
            return result.as_dict()
        if _kill_state(conn, pk_proc) is not False:
            # Killed before its task ran: nothing starts, and the proc is released as killed.
            result.skipped = "killed before it started"
            result.killed = True
            _report(conn, ctx, EXIT_STATUS_KILLED, result)
            return result.as_dict()
        _run(conn, ctx, root, result)
    finally:
        conn.close()  # also frees the advisory lock
    return result.as_dict()


def _run(conn: psycopg.Connection, ctx: RunContext, root: Path, result: RunResult) -> None:
    chunk = _chunk_of(ctx)
    command = substitute_tokens(ctx.command, job=ctx.job, layer=ctx.layer, chunk=chunk, chunk_size=ctx.chunk_size)
    argv = command_argv(command)
    log = log_path(root, ctx)
    log.parent.mkdir(parents=True, exist_ok=True)
    result.log_path, result.command = str(log), argv
    poll = conf.agent_kill_poll()
    grace = conf.agent_kill_grace()
    run_number = previous_runs(log) + 1
    with open(log, "ab", buffering=0) as out:
        header = (
            f"{LOG_HEADER}{ctx.host}: frame {ctx.frame_name} of job {ctx.job}, proc {ctx.pk_proc}, "
            f"run {run_number}, retries {ctx.retries}, "
            f"started {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
            f"=== command: {shlex.join(argv)}\n"
        )
        out.write(header.encode())
        result.started_at = time.time()
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=frame_env(ctx, chunk, log),
                cwd=str(log.parent),
                start_new_session=True,  # its own process group: a kill reaches every child
            )
        except OSError as exc:
            status = EXIT_COMMAND_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE
            out.write(f"=== cannot start the command: {exc}; exit {status}\n".encode())
            logger.warning("agent %s: frame %s: cannot start %r: %s", ctx.host, ctx.frame_name, argv[0], exc)
            result.stopped_at = time.time()
            _report(conn, ctx, status, result)
            return
        result.ran = True
        copier = threading.Thread(target=_copy_log, args=(popen.stdout, out), name=f"log-{ctx.pk_proc}", daemon=True)
        copier.start()
        logger.info("agent %s: frame %s started (pid %d): %s", ctx.host, ctx.frame_name, popen.pid, command)
        memory_every = conf.agent_memory_interval()
        measured = time.monotonic()
        peak = 0  # the run's max RSS (KB) over its samples: its completion carries it
        while True:
            try:
                returncode = popen.wait(timeout=min(poll, memory_every))
                break
            except subprocess.TimeoutExpired:
                pass
            if ctx.timeout or ctx.timeout_llu:
                due, mtime = _timed_out(ctx, result.started_at, log)
                if due:
                    try:
                        for _p, _f, kill in kills.mark_timeouts(conn, {ctx.pk_proc: mtime}):
                            limit = "timeout" if kill == kills.KILL_TIMEOUT else "timeout_llu"
                            out.write(f"=== killed: past the layer's {limit}\n".encode())
                    except psycopg.Error as exc:
                        logger.warning("agent %s: cannot mark the timeout of %s (%s)", ctx.host, ctx.pk_proc, exc)
            if time.monotonic() - measured >= memory_every:
                measured = time.monotonic()
                peak = max(peak, _follow_memory(conn, ctx, popen.pid))
            state = _kill_state(conn, ctx.pk_proc)
            if state is None:
                _terminate(popen, grace)
                result.killed = True
                result.stopped_at = time.time()
                out.write(f"=== killed: proc {ctx.pk_proc} was released (lost host or a forced release)\n".encode())
                logger.info("agent %s: frame %s killed (its proc was released)", ctx.host, ctx.frame_name)
                return
            if state:
                _terminate(popen, grace)
                result.killed = True
                returncode = popen.wait()
                why = "for memory: the host ran low and this frame was the furthest over its reservation (exit 33)"
                reason = why if _kill_kind(conn, ctx.pk_proc) == KILL_MEMORY else "was requested"
                out.write(f"=== killed: a kill of proc {ctx.pk_proc} {reason}\n".encode())
                logger.info("agent %s: frame %s killed (a kill was requested)", ctx.host, ctx.frame_name)
                break
        copier.join(5)  # the frame's last lines land before the exit line
        result.stopped_at = time.time()
        status = _exit_status(returncode)
        out.write(
            f"=== exit status {status} after {result.stopped_at - result.started_at:.2f}s, "
            f"stopped {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode()
        )
    _report(conn, ctx, status, result, raw=_raw_exit(returncode), max_rss=peak)


def _follow_memory(conn: psycopg.Connection, ctx: RunContext, pid: int) -> int:
    """Report the frame's RSS: its reservation follows it, or the host's memory kill picks it.
    The report also raises the layer's and job's max RSS (dispatch.engine.memory). Returns the RSS."""
    rss = tree_rss_kb(pid)
    try:
        follow_use(conn, ctx.pk_host, [Use(ctx.pk_proc, rss)])
    except psycopg.Error as exc:
        logger.warning("agent %s: memory report of proc %s failed (%s); retried", ctx.host, ctx.pk_proc, exc)
    return rss


def _kill_kind(conn: psycopg.Connection, pk_proc: str) -> str | None:
    """The proc's kill mark (JOB, FRAME, MEMORY), None when gone or unreadable."""
    try:
        row = conn.execute(KILL_STATE_SQL, (pk_proc,)).fetchone()
    except psycopg.Error:
        return None
    return None if row is None else row[1]


def _kill_state(conn: psycopg.Connection, pk_proc: str) -> bool | None:
    """None: the proc is gone (released); True: a kill was asked for; False: run on.

    A database error reads False (the frame runs on; the check is made again at the next poll)."""
    try:
        row = conn.execute(KILL_STATE_SQL, (pk_proc,)).fetchone()
    except psycopg.Error as exc:
        logger.warning("agent: cannot check proc %s (%s); letting the frame run", pk_proc, exc)
        return False
    return None if row is None else bool(row[0])


def _report(
    conn: psycopg.Connection,
    ctx: RunContext,
    status: int,
    result: RunResult,
    *,
    raw: tuple[int, int] | None = None,
    max_rss: int = 0,
) -> None:
    """Write the end through the release path, on a fresh connection if the run's one broke.

    `status` is what the result shows (128 + signal for a signal death); `raw` is (exit status,
    signal) as the completion path classifies them."""
    result.exit_status = status
    exit_status, exit_signal = raw if raw is not None else (status, 0)
    spare: psycopg.Connection | None = None
    try:
        for attempt in range(1, 6):
            try:
                if conn.closed or conn.broken:
                    if spare is not None:
                        spare.close()
                    conn = spare = acct_db.connect(autocommit=True, application_name=f"cuesched-agent-{ctx.host}")
                out = complete(conn, [Completion(ctx.pk_proc, exit_status, exit_signal=exit_signal, max_rss=max_rss)])
                result.states = dict(out.states)
                logger.info("agent %s: frame %s exit %d -> %s", ctx.host, ctx.frame_name, status, out.states or "no-op")
                return
            except psycopg.Error as exc:
                logger.warning(
                    "agent %s: completion of %s failed (%s), attempt %d", ctx.host, ctx.pk_proc, exc, attempt
                )
                time.sleep(min(5.0, 0.2 * 2**attempt))
        logger.error(
            "agent %s: could not report frame %s; the lost-host sweep or the next agent start requeues it",
            ctx.host,
            ctx.frame_name,
        )
    finally:
        if spare is not None:
            spare.close()


def default_host_name() -> str:
    return socket.gethostname().split(".")[0]


def settings_summary() -> str:
    return f"log root {conf.agent_log_root()}, database {settings.DATABASES['default'].get('NAME')}"
