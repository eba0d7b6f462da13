"""The server side of RQD's reporting protocol (`RqdReportInterface`, which Cuebot implements),
and the client calls cuesched makes to an RQD (`RqdInterface`).

An RQD reports to the address it is configured with (OVERRIDE_CUEBOT / CUEBOT_HOSTNAME and
CUEBOT_GRPC_PORT); `manage.py run_rqd_gateway` answers there. Every write goes through the
paths our own agents use, on the gateway's own psycopg connections:

* **ReportRqdStartup** registers or updates the host with `agent.register_host` (name, cores,
  memory, GPUs, tags, OS; a new host joins `CUESCHED_RQD_DEFAULT_ALLOC`), records where its
  daemon answers (`host.str_rqd_address`: the peer's IP and its RQD port), and releases the
  procs booked on it more than `CUESCHED_RQD_ORPHAN_GRACE` ago: a daemon that starts runs
  nothing (Python RQD 1.37 recovers no frame), so they are runs of its previous life. A younger
  proc may be a launch that landed on the new daemon (RQD serves LaunchFrame before it sends
  this report): the status reports' orphan check decides it. They go through `completion.complete` (exit 399, frame
  back to WAITING, no retry counted), so each release is the proc delete's trigger, in the
  same transaction as the delete.
* **ReportStatus** is the heartbeat: host_stat ping and free memory, each reported frame's
  memory (RSS, max RSS) on its proc (never on the RUNNING frame row: see dispatch.engine.memory).
  Then it reconciles: a frame RQD runs whose proc is gone (compensated, lost-host swept) or
  marked for a kill (dispatch.engine.kills) is killed on RQD; a proc of this host RQD no
  longer reports, booked more than `CUESCHED_RQD_ORPHAN_GRACE` seconds ago, is released the
  lost-host way (the grace covers a launch still on its way, not yet in the report).
* **ReportRunningFrameCompletion** writes the end through the completion statements
  (`completion.complete_in_transaction`) and the run's max RSS on its frame, in one transaction,
  keyed by proc (RQD's resource_id): the end of a run whose proc was marked for a kill is
  recorded as killed (the completion path reads the mark); a late report of a run whose proc
  is gone is a no-op; a report from
  a host other than the proc's is refused (INVALID_ARGUMENT). The exit status and signal go to
  the completion path raw, as RQD sent them, which classifies memory failures and NIMBY kills
  from them (the frame records a signal death as 128 + signal).

RQD keys its frames by `frame_id` (our pk_frame) and reports `resource_id` (our pk_proc), as
Cuebot sets them. The report handlers are plain functions of a connection, so the rqd launcher's
active poll (`RqdLauncher.heartbeat`) applies a polled status report exactly as a pushed one.

A database error answers UNAVAILABLE (RQD's client retries that code), and so does a host that
is unknown with no default allocation: it is listed in `cuesched_waiting_host` for an operator to
admit (dispatch.hosts.waiting), since any other answer makes RQD 1.37 exit. Bad input (a report
without a host name, a value the database cannot hold such as a NUL byte) answers
INVALID_ARGUMENT / FAILED_PRECONDITION with the reason, writes nothing, and the server goes on.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import psycopg
from opencue_proto import host_pb2, report_pb2, report_pb2_grpc, rqd_pb2, rqd_pb2_grpc

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine.completion import (
    EXIT_STATUS_DOWN_HOST,
    EXIT_STATUS_NIMBY,
    SIGTERM,
    Completion,
    CompletionResult,
    complete,
    complete_in_transaction,
)
from dispatch.engine.kills import mark_timeouts
from dispatch.engine.memory import Use, follow_use
from dispatch.hosts import waiting
from dispatch.hosts.agent import CENTI, HostSpec, register_host

logger = logging.getLogger(__name__)

PORT_TAG = re.compile(r"^rqdport-(\d{1,5})$")
# host.str_tags is 128 characters: the alloc tag, the host name and the RQD tags must fit.
TAGS_MAX = 128


class ReportError(ValueError):
    """A report that cannot be applied as sent (answered INVALID_ARGUMENT, nothing written)."""


# ---------------------------------------------------------------------------------------
# Addresses and the client side (LaunchFrame, KillRunningFrame, ReportStatus)
# ---------------------------------------------------------------------------------------


def peer_host(peer: str) -> str:
    """The IP of a gRPC peer string (`ipv4:10.0.0.5:51234`, `ipv6:[::1]:51234`)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0]  # keeps the brackets, as a target needs them
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return rest or peer


def rqd_port_of(tags: Iterable[str]) -> int:
    """The port an RQD answers on: its `rqdport-N` tag, else `CUESCHED_RQD_PORT`."""
    for tag in tags:
        m = PORT_TAG.match(tag)
        if m:
            return int(m.group(1))
    return conf.rqd_port()


class RqdClients:
    """One gRPC channel per RQD address, kept for the process's life (a channel reconnects by
    itself; building one per call would cost a TCP and HTTP/2 handshake every launch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, rqd_pb2_grpc.RqdInterfaceStub]] = {}

    def stub(self, address: str) -> rqd_pb2_grpc.RqdInterfaceStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = grpc.insecure_channel(address)
                entry = (channel, rqd_pb2_grpc.RqdInterfaceStub(channel))
                self._stubs[address] = entry
            return entry[1]

    def kill(self, address: str, frame_id: str, message: str, timeout: float | None = None) -> bool:
        """KillRunningFrame; False when RQD does not run the frame or cannot be reached."""
        try:
            self.stub(address).KillRunningFrame(
                rqd_pb2.RqdStaticKillRunningFrameRequest(frame_id=frame_id, message=message),
                timeout=conf.rqd_timeout() if timeout is None else timeout,
            )
            return True
        except grpc.RpcError as exc:
            logger.info("rqd %s: kill of frame %s: %s", address, frame_id, _rpc_reason(exc))
            return False

    def close(self) -> None:
        with self._lock:
            for channel, _stub in self._stubs.values():
                channel.close()
            self._stubs.clear()


def _rpc_reason(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'error'}: {details}"


# ---------------------------------------------------------------------------------------
# The report handlers (one connection, autocommit; each write its own transaction)
# ---------------------------------------------------------------------------------------

HOST_SQL = "SELECT pk_host, str_rqd_address FROM host WHERE str_name = %s"
HOST_HAS_PROCS_SQL = "SELECT count(*) FROM proc WHERE pk_host = %s"
SET_ADDRESS_SQL = "UPDATE host SET str_rqd_address = %s WHERE pk_host = %s AND str_rqd_address IS DISTINCT FROM %s"
# A proc booked within the grace may be a launch that landed on the new daemon (RQD serves
# LaunchFrame before it sends its startup report): the status reports' orphan check decides it.
HOST_PROCS_SQL = """
SELECT pk_proc FROM proc
WHERE pk_host = %s AND NOT b_local AND ts_dispatched < now() - make_interval(secs => %s)
"""

# The ping: like an agent's, with the free memory RQD measured. A host marked DOWN (a launch
# found its RQD unreachable) comes back UP; an operator's REPAIR is left alone. RQD's own
# non-UP states (REBOOT_WHEN_IDLE, ...) are taken as reported.
PING_SQL = """
UPDATE host_stat SET ts_ping = now(), int_mem_free = %(free)s, int_gpu_mem_free = %(gpu_free)s,
  int_swap_free = %(swap_free)s, int_load = %(load)s,
  str_state = CASE WHEN %(state)s <> 'UP' AND str_state <> 'REPAIR' THEN %(state)s
                   WHEN str_state = 'DOWN' THEN 'UP' ELSE str_state END
WHERE pk_host = %(host)s
"""

# Cuebot's HostReportHandler.changeNimbyState: a host whose RQD reports its NIMBY lock (its owner
# is using it) is NIMBY_LOCKED, so nothing is booked there (placement and the booking guard take
# OPEN hosts only), and OPEN again once RQD reports it unlocked. An operator's LOCKED is left
# alone either way. ts_last_updated moves so the scheduler's incremental host read sees it.
NIMBY_SQL = """
UPDATE host SET str_lock_state = CASE WHEN %(locked)s THEN 'NIMBY_LOCKED' ELSE 'OPEN' END,
  b_nimby = %(enabled)s, ts_last_updated = now()
WHERE pk_host = %(host)s
  AND ((%(locked)s AND str_lock_state = 'OPEN') OR (NOT %(locked)s AND str_lock_state = 'NIMBY_LOCKED'))
RETURNING str_lock_state
"""
# The change's audit row (dispatch.models.farm_actions), as an operator's host lock writes one.
NIMBY_AUDIT_SQL = """
INSERT INTO cuesched_farm_action (str_action, str_target_kind, str_target, str_target_name, int_changed, detail,
                                  str_username)
VALUES (%(action)s, 'host', %(host)s, %(name)s, 1, '{"source": "RQD NIMBY"}'::jsonb, 'rqd')
"""
# Procs of the host that RQD did not report, booked long enough ago that their launch has landed.
ORPHAN_PROCS_SQL = """
SELECT pk_proc FROM proc
WHERE pk_host = %(host)s AND NOT b_local AND NOT (pk_proc = ANY(%(reported)s::text[]))
  AND ts_dispatched < now() - make_interval(secs => %(grace)s)
"""
# The host's procs of the reported runs, or of the reported frames: RQD kills by frame id, so a
# stale report's run must not be killed when the frame has a newer run booked on the host.
KNOWN_PROCS_SQL = """
SELECT pk_proc, pk_frame, ts_kill IS NOT NULL FROM proc
WHERE pk_host = %(host)s AND (pk_proc = ANY(%(procs)s::text[]) OR pk_frame = ANY(%(frames)s::text[]))
"""

# The run's max GPU memory on the frame, after the release ended it, in the same transaction (the
# frame row is already this transaction's: no version race with another completion). Its max RSS
# travels in the Completion: the release writes it on the frame, layer_mem and job_mem.
FRAME_OF_PROC_SQL = (
    "SELECT p.pk_frame, h.str_name, h.str_rqd_address FROM proc p JOIN host h ON h.pk_host = p.pk_host"
    " WHERE p.pk_proc = %s"
)
COMPLETION_MEMORY_SQL = """
UPDATE frame SET int_gpu_mem_max_used = GREATEST(int_gpu_mem_max_used, %(max_gpu)s)
WHERE pk_frame = %(frame)s
"""


@dataclass
class StatusResult:
    pk_host: str
    memory_rows: int = 0
    to_kill: list[tuple[str, str]] = field(default_factory=list)  # (frame_id, resource_id)
    orphans_released: int = 0
    completion: CompletionResult | None = None
    timed_out: list[tuple[str, str, str]] = field(default_factory=list)  # (pk_proc, pk_frame, kill)


def _state_name(state: int) -> str:
    try:
        return host_pb2.HardwareState.Name(state)
    except ValueError:
        return "UP"


def _spec(host: report_pb2.RenderHost, core: report_pb2.CoreDetail, alloc: str | None) -> HostSpec:
    if not host.name:
        raise ReportError("the report has no host name (RQD's OVERRIDE_HOSTNAME or its IP)")
    cores = (
        max(1, core.total_cores // CENTI) if core.total_cores else max(1, host.num_procs * host.cores_per_proc // CENTI)
    )
    room = TAGS_MAX - len(host.name) - 1 - 46  # the alloc tag is at most 45 characters and a space
    tags: list[str] = []
    for tag in host.tags:
        if not tag or tag in tags:
            continue
        if len(tag) + 1 > room:
            logger.warning("rqd host %s: tag %r left out (host.str_tags holds %d characters)", host.name, tag, TAGS_MAX)
            continue
        tags.append(tag)
        room -= len(tag) + 1
    return HostSpec(
        name=host.name,
        alloc=alloc,
        cores=cores,
        memory_kb=max(1, host.total_mem),
        gpus=max(0, host.num_gpus),
        gpu_memory_kb=max(0, host.total_gpu_mem),
        os=(host.attributes.get("SP_OS") or "linux").lower()[:32],
        tags=tuple(tags),
    )


def _register(
    conn: psycopg.Connection, host: report_pb2.RenderHost, core: report_pb2.CoreDetail, address: str | None
) -> str:
    existing = conn.execute(HOST_SQL, (host.name,)).fetchone()
    alloc = None
    if existing is None:
        alloc = conf.rqd_default_alloc() or None
        if alloc is None:
            # Never an answer that makes RQD exit: UNAVAILABLE, and listed for an operator.
            waiting.record(conn, _spec(host, core, None), address)
            raise waiting.HostWaiting(
                f"host {host.name!r} is unknown and CUESCHED_RQD_DEFAULT_ALLOC is not set: it waits for an "
                f"operator (manage.py rqd_hosts admit {host.name} --alloc ALLOC); RQD retries meanwhile"
            )
    pk_host = register_host(_spec(host, core, alloc), conn)
    if address is not None:
        conn.execute(SET_ADDRESS_SQL, (address, pk_host, address))
    _ping(conn, pk_host, host)
    return pk_host


def _check_sender(conn: psycopg.Connection, pk_host: str, name: str, recorded: str | None, address: str | None) -> None:
    """Refuse a report from another address than the one the host's RQD answers at while the
    host has frames booked.

    A report names its host, and RQD cannot prove it is that host: a cloned image with the
    same name, or any client reaching the gateway, would otherwise release the real host's
    procs while its frames run (counters LOW), kill them as strays, and take its launches.
    With nothing booked there is nothing to lose, and a node that changed address is followed
    (a host that moved with frames booked is released by the lost-host sweep first, counters
    reading high meanwhile)."""
    if recorded is None or address is None or recorded == address:
        return
    booked = conn.execute(HOST_HAS_PROCS_SQL, (pk_host,)).fetchone()[0]
    if booked:
        raise ReportError(
            f"host {name!r} reports from {address}, but its RQD answers at {recorded} and runs {booked} "
            "booked frame(s): refused (two RQDs with one host name?). It is followed once nothing is booked "
            "there; or set host.str_rqd_address"
        )


def _ping(conn: psycopg.Connection, pk_host: str, host: report_pb2.RenderHost) -> None:
    conn.execute(
        PING_SQL,
        {
            "host": pk_host,
            "free": max(0, host.free_mem),
            "gpu_free": max(0, host.free_gpu_mem),
            "swap_free": max(0, host.free_swap),
            "load": max(0, host.load),
            "state": _state_name(host.state),
        },
    )
    with conn.transaction():
        row = conn.execute(
            NIMBY_SQL, {"host": pk_host, "locked": bool(host.nimby_locked), "enabled": bool(host.nimby_enabled)}
        ).fetchone()
        if row is not None:
            action = "nimby_lock" if host.nimby_locked else "nimby_unlock"
            conn.execute(NIMBY_AUDIT_SQL, {"action": action, "host": pk_host, "name": host.name})
    if row is not None:
        logger.warning(
            "rqd host %s: NIMBY %s; host %s", host.name, "locked" if host.nimby_locked else "unlocked", row[0]
        )


def report_startup(conn: psycopg.Connection, boot: report_pb2.BootReport, address: str | None) -> StatusResult:
    """ReportRqdStartup: register or update the host, release what its previous life left booked."""
    known = conn.execute(HOST_SQL, (boot.host.name,)).fetchone() if boot.host.name else None
    if known is not None:
        _check_sender(conn, known[0], boot.host.name, known[1], address)
    pk_host = _register(conn, boot.host, boot.core_info, address)
    out = StatusResult(pk_host)
    procs = [r[0] for r in conn.execute(HOST_PROCS_SQL, (pk_host, conf.rqd_orphan_grace())).fetchall()]
    if procs:
        out.completion = complete(conn, [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk in procs])
        out.orphans_released = out.completion.released
        logger.warning(
            "rqd host %s started: %d frame(s) of its previous life back to WAITING",
            boot.host.name,
            out.orphans_released,
        )
    else:
        logger.info("rqd host %s started (%s)", boot.host.name, address)
    return out


def report_status(
    conn: psycopg.Connection, report: report_pb2.HostReport, address: str | None, *, grace: float | None = None
) -> StatusResult:
    """ReportStatus: ping, memory per frame, then reconcile RQD's frames with our procs."""
    host = report.host
    row = conn.execute(HOST_SQL, (host.name,)).fetchone() if host.name else None
    if row is None:
        pk_host = _register(conn, host, report.core_info, address)  # Cuebot registers a host it hears first here
    else:
        pk_host = row[0]
        _check_sender(conn, pk_host, host.name, row[1], address)
        with conn.transaction():
            if address is not None and row[1] != address:
                conn.execute(SET_ADDRESS_SQL, (address, pk_host, address))
            _ping(conn, pk_host, host)
    out = StatusResult(pk_host)
    frames = list(report.frames)
    reported = [f.resource_id for f in frames if f.resource_id]
    if frames:
        # Memory per running frame, KB, on its proc only (never on the RUNNING frame row: the
        # completion finds that row by its version); the reservations follow it, and a host
        # running out of memory loses the frame furthest over its reservation.
        followed = follow_use(
            conn,
            pk_host,
            [
                Use(f.resource_id, f.rss, f.max_rss, f.vsize, f.max_vsize, f.used_gpu_memory, f.max_used_gpu_memory)
                for f in frames
            ],
        )
        out.memory_rows = followed.recorded
        # Timeouts from this report: run time from the booking, silence from RQD's llu_time (the
        # log's mtime, epoch seconds). A run marked here is killed below with the marked ones.
        llu = {f.resource_id: max(0, f.llu_time) for f in frames if f.resource_id}
        out.timed_out = mark_timeouts(conn, llu, host=pk_host)
        rows = conn.execute(
            KNOWN_PROCS_SQL, {"host": pk_host, "procs": reported, "frames": [f.frame_id for f in frames]}
        ).fetchall()
        known_procs, known_frames = {r[0] for r in rows}, {r[1] for r in rows}
        killing = {r[0] for r in rows if r[2]}
        # A report is a snapshot: a run that ended after RQD took it (its completion already
        # released the proc) is listed too; killing it is a no-op on RQD (it is gone there).
        # A run whose proc is marked for a kill is killed again: the report proves it still
        # runs, and this reaches RQD even while no scheduler is sending kills.
        out.to_kill = [
            (f.frame_id, f.resource_id)
            for f in frames
            if (f.resource_id not in known_procs and f.frame_id not in known_frames) or f.resource_id in killing
        ]
    grace = conf.rqd_orphan_grace() if grace is None else grace
    orphans = [
        r[0] for r in conn.execute(ORPHAN_PROCS_SQL, {"host": pk_host, "reported": reported, "grace": grace}).fetchall()
    ]
    if orphans:
        out.completion = complete(conn, [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk in orphans])
        out.orphans_released = out.completion.released
        logger.warning(
            "rqd host %s no longer runs %d booked frame(s); released, frames back to WAITING",
            host.name,
            out.orphans_released,
        )
    return out


def completion_of(report: report_pb2.FrameCompleteReport) -> Completion:
    """The raw end as RQD sent it (a signal death is exit 1 and the signal apart; the frame records
    128 + signal). A frame RQD killed with SIGTERM while its host reports the NIMBY lock is a NIMBY
    kill, as Cuebot's determineFrameState reads it: exit 286. `nimby` tells the completion path
    that this RQD runs its NIMBY at all: RQD 1.37 reports the frames its lock kills before it sets
    the lock flag (Nimby.__lock_host_for_rendering), so their reports say only "signal 9"."""
    status, signal_ = report.exit_status, max(0, report.exit_signal)
    if report.host.nimby_locked and signal_ == SIGTERM:
        status = EXIT_STATUS_NIMBY
    nimby = bool(report.host.nimby_enabled or report.host.nimby_locked)
    return Completion(
        report.frame.resource_id, status, exit_signal=signal_, nimby=nimby, max_rss=max(0, report.frame.max_rss)
    )


def report_completion(
    conn: psycopg.Connection, report: report_pb2.FrameCompleteReport, address: str | None = None
) -> CompletionResult:
    """ReportRunningFrameCompletion: the release path, keyed by proc, and the run's max RSS on
    its frame, in one transaction."""
    frame = report.frame
    if not frame.resource_id:
        raise ReportError("the completion report has no resource_id (the proc it ends)")
    with conn.transaction(), conn.cursor() as cur:
        row = cur.execute(FRAME_OF_PROC_SQL, (frame.resource_id,)).fetchone()
        if row is not None and address is not None and row[2] is not None and row[2] != address:
            raise ReportError(
                f"host {report.host.name!r} reports the end of proc {frame.resource_id} from {address}, "
                f"but its RQD answers at {row[2]}: refused (two RQDs with one host name?)"
            )
        if row is not None and row[1] != report.host.name:
            # A host ends only its own runs: releasing another host's proc would leave that
            # run going uncounted until its own RQD's next status report kills it.
            raise ReportError(
                f"host {report.host.name!r} reports the end of proc {frame.resource_id}, which runs on {row[1]!r}"
            )
        result = complete_in_transaction(cur, [completion_of(report)])
        if row is not None and result.released and frame.max_used_gpu_memory > 0:
            cur.execute(
                COMPLETION_MEMORY_SQL,
                {"frame": row[0], "max_gpu": max(0, frame.max_used_gpu_memory)},
            )
    logger.info(
        "rqd host %s: frame %s exit %d signal %d after %ds -> %s",
        report.host.name,
        frame.frame_name,
        report.exit_status,
        report.exit_signal,
        report.run_time,
        dict(result.states) or "no-op (proc already released)",
    )
    return result


# ---------------------------------------------------------------------------------------
# The gRPC servicer and server
# ---------------------------------------------------------------------------------------


class _Connections(threading.local):
    conn: psycopg.Connection | None = None


class ReportServicer(report_pb2_grpc.RqdReportInterfaceServicer):
    """RqdReportInterface on a thread pool; one database connection per worker thread."""

    def __init__(self, clients: RqdClients | None = None) -> None:
        self._local = _Connections()
        self.clients = clients or RqdClients()
        self.counts: dict[str, int] = {
            "startup": 0,
            "status": 0,
            "completion": 0,
            "errors": 0,
            "killed": 0,
            "waiting": 0,
        }
        self._counts_lock = threading.Lock()
        self._all: list[psycopg.Connection] = []  # every worker's, to close them at stop
        # Stray kills leave the report's worker: a wedged RQD would hold it for the timeout per
        # stray, and enough such reports starve every RQD's completions of workers. One call per
        # (address, frame) at a time: the next report does not queue it again.
        self._kill_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rqd-gateway-kill")
        self._pending_kills: set[tuple[str, str]] = set()

    def _conn(self) -> psycopg.Connection:
        conn = self._local.conn
        if conn is None or conn.closed or conn.broken:
            conn = self._local.conn = acct_db.connect(autocommit=True, application_name="cuesched-rqd-gateway")
            with self._counts_lock:
                self._all = [c for c in self._all if not c.closed]
                self._all.append(conn)
        return conn

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    def _run(self, context: grpc.ServicerContext, what: str, fn: Any) -> Any:
        try:
            return fn(self._conn())
        except waiting.HostWaiting as exc:
            self._count("waiting")
            logger.warning("rqd gateway: %s: %s", what, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ReportError as exc:
            self._count("errors")
            logger.warning("rqd gateway: %s refused: %s", what, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ValueError as exc:  # register_host's "no allocation named ..."
            self._count("errors")
            logger.warning("rqd gateway: %s refused: %s", what, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except psycopg.DataError as exc:  # a value the database cannot hold (a NUL, too long): bad input
            self._count("errors")
            logger.warning("rqd gateway: %s refused: the database cannot store it (%s)", what, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the report cannot be stored as sent: {exc}")
        except psycopg.Error as exc:
            self._count("errors")
            conn = self._local.conn
            if conn is not None and (conn.broken or conn.closed):
                self._local.conn = None
            logger.warning("rqd gateway: %s failed on the database (%s); RQD will retry", what, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"database error: {exc}")

    def _kill_strays(self, address: str | None, result: StatusResult) -> None:
        if address is None:
            return
        for frame_id, resource_id in result.to_kill:
            logger.warning(
                "rqd %s runs frame %s (proc %s) that has no proc here: killing it", address, frame_id, resource_id
            )
            key = (address, frame_id)
            with self._counts_lock:
                if key in self._pending_kills:
                    continue
                self._pending_kills.add(key)
            try:
                self._kill_pool.submit(self._kill_one, key)
            except RuntimeError:  # the gateway is stopping
                with self._counts_lock:
                    self._pending_kills.discard(key)

    def _kill_one(self, key: tuple[str, str]) -> None:
        try:
            if self.clients.kill(key[0], key[1], "cuesched: this run has no proc (killed or released)"):
                self._count("killed")
        finally:
            with self._counts_lock:
                self._pending_kills.discard(key)

    def ReportRqdStartup(
        self, request: report_pb2.RqdReportRqdStartupRequest, context: grpc.ServicerContext
    ) -> report_pb2.RqdReportRqdStartupResponse:
        boot = request.boot_report
        address = f"{peer_host(context.peer())}:{rqd_port_of(boot.host.tags)}"
        self._run(context, f"startup of {boot.host.name!r}", lambda c: report_startup(c, boot, address))
        self._count("startup")
        return report_pb2.RqdReportRqdStartupResponse()

    def ReportStatus(
        self, request: report_pb2.RqdReportStatusRequest, context: grpc.ServicerContext
    ) -> report_pb2.RqdReportStatusResponse:
        report = request.host_report
        address = f"{peer_host(context.peer())}:{rqd_port_of(report.host.tags)}"
        result = self._run(context, f"status of {report.host.name!r}", lambda c: report_status(c, report, address))
        self._count("status")
        self._kill_strays(address, result)
        return report_pb2.RqdReportStatusResponse()

    def ReportRunningFrameCompletion(
        self, request: report_pb2.RqdReportRunningFrameCompletionRequest, context: grpc.ServicerContext
    ) -> report_pb2.RqdReportRunningFrameCompletionResponse:
        report = request.frame_complete_report
        address = f"{peer_host(context.peer())}:{rqd_port_of(report.host.tags)}"
        self._run(
            context, f"completion of {report.frame.frame_name!r}", lambda c: report_completion(c, report, address)
        )
        self._count("completion")
        return report_pb2.RqdReportRunningFrameCompletionResponse()

    def close(self) -> None:
        self._kill_pool.shutdown(wait=False, cancel_futures=True)
        self.clients.close()
        with self._counts_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


@dataclass
class Gateway:
    server: grpc.Server
    servicer: ReportServicer
    port: int

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace).wait(grace + 1)
        self.servicer.close()


def start_gateway(
    bind: str | None = None, port: int | None = None, *, workers: int = 16, tls: Sequence[str] | None = None
) -> Gateway:
    """Start the gRPC server (returns at once); port 0 picks a free one (tests)."""
    bind = conf.rqd_gateway_bind() if bind is None else bind
    port = conf.rqd_gateway_port() if port is None else port
    servicer = ReportServicer()
    # No SO_REUSEPORT (grpc's default): a second server on the port would be handed some of the
    # render nodes' connections. The second one fails to start instead.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rqd-gateway"),
        options=[("grpc.so_reuseport", 0)],
    )
    report_pb2_grpc.add_RqdReportInterfaceServicer_to_server(servicer, server)
    target = f"{bind}:{port}"
    cert, key = tls if tls is not None else (conf.rqd_gateway_tls_cert(), conf.rqd_gateway_tls_key())
    if cert or key:
        if not (cert and key):
            raise ValueError("TLS needs both CUESCHED_RQD_GATEWAY_TLS_CERT and CUESCHED_RQD_GATEWAY_TLS_KEY")
        with open(cert, "rb") as c, open(key, "rb") as k:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        add = functools.partial(server.add_secure_port, target, creds)
    else:
        add = functools.partial(server.add_insecure_port, target)
    try:
        bound = add()
    except RuntimeError:  # grpc 1.85 raises where older releases returned 0
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {target}")
    server.start()
    logger.info("rqd gateway listening on %s:%d%s", bind, bound, " (TLS)" if cert else "")
    return Gateway(server, servicer, bound)
