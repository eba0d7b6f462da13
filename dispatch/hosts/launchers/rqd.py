"""The rqd launcher: each booking goes to the booked host's RQD as `RqdInterface.LaunchFrame`.

The host's daemon answers at `host.str_rqd_address`, which its startup report recorded through
the gateway (`dispatch.hosts.rqd_gateway`); one channel per address is kept (`RqdClients`).
The RunFrame carries what Cuebot's would: resource_id = pk_proc, frame_id = pk_frame, the
command with its `#...#` tokens substituted, the job's and the layer's `env` under the RQD-style
CUE_* environment (dispatch.hosts.agent.frame_env), the cores in centicores, and the job's uid
when it has one (`uid` in the spec): RQD switches to it only with RQD_BECOME_JOB_USER on a Linux
RQD running as root, and otherwise runs the frame as its own user (docs/jobs.md).

Launch failures - a host with no RQD address, an RQD that refuses (not UP, no idle cores, the
frame already running there) or cannot be reached - are returned for the loop to compensate in
the same cycle. A host whose RQD does not answer is marked DOWN, so it is not booked again
until its RQD reports (its next status report sets it UP). A launch that timed out
(DEADLINE_EXCEEDED) is not a failure: RQD may have started the frame, so its proc stays booked
(reads high, never low) and the host's status reports decide it (kept while RQD reports the run,
released after CUESCHED_RQD_ORPHAN_GRACE if not), or the lost-host sweep if RQD stays silent.

Completions come back through the gateway (RQD's ReportRunningFrameCompletion), so nothing
comes back here: `poll_completions` is empty and `running` is 0. `kill` sends
KillRunningFrame to the host's RQD at its recorded address (`host.str_rqd_address`, so any
scheduler process can send it, not only the one that launched), off the caller's thread; the
proc stays booked until RQD's completion report of the killed run reaches the gateway. A
booking whose proc is already marked for a kill when its launch comes is not launched: nothing
ran, so the launcher ends it killed itself (`completion.complete`).

`heartbeat`, called before each lost-host sweep, asks every UP RQD host for its status
(`RqdInterface.ReportStatus`) and applies the answer as a pushed report: RQD pushes only every
5 to 30 seconds (not configurable), so this is what lets a silent RQD be found DOWN and its
procs swept at `CUESCHED_LOST_HOST_TIMEOUT` without a false loss between two pushes. It runs
on the loop's thread (a poll answers in a few ms; an unreachable host costs at most the poll
timeout, once, as it is then DOWN and no longer polled); `CUESCHED_RQD_POLL=0` turns it off,
leaving RQD's own pushes, which then need a lost-host timeout well above their 30 s.
"""

from __future__ import annotations

import getpass
import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import psycopg
from opencue_proto import rqd_pb2

from accounting import db as acct_db
from dispatch import conf
from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, complete
from dispatch.engine.launcher import register
from dispatch.engine.memory import hard_memory_limit, soft_memory_limit
from dispatch.hosts.agent import CENTI, RUN_CONTEXT_SQL, RunContext, _chunk_of, frame_env
from dispatch.hosts.rqd_gateway import ReportError, RqdClients, _rpc_reason, report_status
from dispatch.jobs.frameset import substitute_tokens

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking
    from dispatch.engine.launcher import RunKill

logger = logging.getLogger(__name__)

ADDRESSES_SQL = "SELECT pk_host, str_rqd_address FROM host WHERE pk_host = ANY(%s::text[])"
RUN_CONTEXTS_SQL = RUN_CONTEXT_SQL.replace("WHERE p.pk_proc = %s", "WHERE p.pk_proc = ANY(%s::text[])")
MARK_DOWN_SQL = "UPDATE host_stat SET str_state = 'DOWN' WHERE pk_host = ANY(%s::text[]) AND str_state = 'UP'"
RQD_HOSTS_SQL = """
SELECT h.pk_host, h.str_name, h.str_rqd_address FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host
WHERE h.str_rqd_address IS NOT NULL AND hs.str_state = 'UP'
"""
KILLED_BEFORE_LAUNCH_SQL = "SELECT pk_proc FROM proc WHERE pk_proc = ANY(%s::text[]) AND ts_kill IS NOT NULL"

# gRPC codes that mean the daemon is not there (as opposed to one that answered no).
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def run_frame_message(ctx: RunContext, log_dir: str, user: str) -> rqd_pb2.RunFrame:
    """The RunFrame of one booked proc, as Cuebot's dispatcher fills it."""
    chunk = _chunk_of(ctx)
    command = substitute_tokens(ctx.command, job=ctx.job, layer=ctx.layer, chunk=chunk, chunk_size=ctx.chunk_size)
    env = frame_env(ctx, chunk, Path(log_dir) / "x", host_basics=False)
    env["CUE_LOG_PATH"] = log_dir
    # Cuebot's `frame.uid.ifPresent(builder::setUid)`. RQD 1.37 refuses a uid <= 0 (and the spec
    # takes none), and runs the frame as that user only with RQD_BECOME_JOB_USER on a Linux RQD
    # run as root; otherwise it runs the frame as itself (docs/jobs.md).
    uid = {"uid": ctx.uid} if ctx.uid is not None and ctx.uid > 0 else {}
    return rqd_pb2.RunFrame(
        resource_id=ctx.pk_proc,
        job_id=ctx.pk_job,
        job_name=ctx.job,
        frame_id=ctx.pk_frame,
        frame_name=ctx.frame_name,
        layer_id=ctx.pk_layer,
        command=command,
        user_name=ctx.user or user,
        log_dir=log_dir,
        show=ctx.show,
        shot=ctx.shot,
        start_time=int(time.time() * 1000),
        num_cores=max(CENTI, ctx.cores),
        num_gpus=ctx.gpus,
        ignore_nimby=False,
        environment=env,
        os="linux",
        # Cuebot's DispatchFrame.setMinMemory: 1.6 and 2 times what the frame booked.
        soft_memory_limit=soft_memory_limit(ctx.mem),
        hard_memory_limit=hard_memory_limit(ctx.mem),
        **uid,
    )


@register("rqd")
class RqdLauncher:
    name = "rqd"

    def __init__(
        self,
        *,
        timeout: float | None = None,
        threads: int = 16,
        poll_hosts: bool | None = None,
        poll_timeout: float | None = None,
    ) -> None:
        self.timeout = conf.rqd_timeout() if timeout is None else timeout
        # The poll runs on the loop's thread: a black-holed host must not hold it for long.
        self.poll_timeout = min(1.0, self.timeout) if poll_timeout is None else poll_timeout
        self.clients = RqdClients()
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rqd-launch")
        # Kills (the kill sender's and the status poll's strays) have their own threads, one call
        # per (address, frame) at a time: a wedged RQD must not queue ahead of launches.
        self._kill_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rqd-kill")
        self._stray_kills: set[tuple[str, str]] = set()
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self.kills_sent = 0
        self._user = getpass.getuser()
        self.poll_hosts = conf.rqd_poll_hosts() if poll_hosts is None else poll_hosts
        self.launched = 0
        self.launch_failures = 0

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = acct_db.connect(autocommit=True, application_name="cuesched-launcher-rqd")
        return self._conn

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        if not bookings:
            return []
        try:
            conn = self._connection()
            hosts = sorted({b.host.pk for b in bookings})
            addresses = dict(conn.execute(ADDRESSES_SQL, (hosts,)).fetchall())
            rows = conn.execute(RUN_CONTEXTS_SQL, ([b.pk_proc for b in bookings],)).fetchall()
            killed = {r[0] for r in conn.execute(KILLED_BEFORE_LAUNCH_SQL, ([b.pk_proc for b in bookings],))}
            if killed:
                # Killed between the booking's commit and its launch: nothing runs, so it ends here,
                # recorded killed by its mark. A kill that commits after this read is sent by the
                # kill sender, again until RQD has the run.
                complete(conn, [Completion(pk, EXIT_STATUS_KILLED) for pk in sorted(killed)])
                bookings = [b for b in bookings if b.pk_proc not in killed]
        except psycopg.Error as exc:
            self.close_connection()
            failures = [(b, f"cannot read the launch context ({exc})") for b in bookings]
            self.launch_failures += len(failures)
            return failures
        contexts = {r[0]: RunContext(*r) for r in rows}
        failures: list[tuple[Booking, str]] = []
        calls: list[tuple[Booking, str, futures.Future[None]]] = []
        for b in bookings:
            address = addresses.get(b.host.pk)
            ctx = contexts.get(b.pk_proc)
            if not address:
                failures.append((b, f"host {b.host.name} has no RQD address (no startup report yet)"))
                continue
            if ctx is None:
                failures.append((b, "proc is gone before its launch"))
                continue
            log_dir = conf.rqd_log_dir().format(show=ctx.show, job=ctx.job)
            message = run_frame_message(ctx, log_dir, self._user)
            calls.append((b, address, self._pool.submit(self._launch_one, address, message)))
        unreachable: set[str] = set()
        for b, address, fut in calls:
            try:
                fut.result()
            except grpc.RpcError as exc:
                reason = f"RQD {address} of host {b.host.name}: {_rpc_reason(exc)}"
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Ambiguous: RQD may have started the frame. Releasing the proc would let it
                    # run uncounted (a counter reading low); kept booked, the host's status
                    # reports decide it (orphan grace), or the lost-host sweep if it stays silent.
                    unreachable.add(b.host.pk)
                    logger.warning("rqd launcher: launch of proc %s timed out (%s); kept booked", b.pk_proc, reason)
                    continue
                if exc.code() in UNREACHABLE:
                    unreachable.add(b.host.pk)
                    reason += "; host marked DOWN"
                failures.append((b, reason))
                continue
            except Exception as exc:  # a bad message or a client bug: that booking fails, not the loop
                failures.append((b, f"RQD {address}: {exc}"))
                continue
        if unreachable:
            try:
                self._connection().execute(MARK_DOWN_SQL, (sorted(unreachable),))
            except psycopg.Error as exc:
                logger.warning("rqd launcher: cannot mark %d host(s) DOWN (%s)", len(unreachable), exc)
                self.close_connection()
        for b, reason in failures:
            logger.warning("rqd launcher: launch of proc %s failed: %s", b.pk_proc, reason)
        self.launched += len(bookings) - len(failures)
        self.launch_failures += len(failures)
        return failures

    def _launch_one(self, address: str, message: rqd_pb2.RunFrame) -> None:
        self.clients.stub(address).LaunchFrame(
            rqd_pb2.RqdStaticLaunchFrameRequest(run_frame=message), timeout=self.timeout
        )

    def poll_completions(self) -> list[Completion]:
        return []  # RQD reports completions to the gateway

    def next_due(self) -> float | None:
        return None

    def running(self) -> int:
        return 0  # the database's RUNNING frames are the truth

    def kill(self, runs: Sequence[RunKill]) -> None:
        """KillRunningFrame on each run's RQD, from the kill threads (the caller does not wait)."""
        for run in runs:
            if not run.rqd_address:
                logger.warning("rqd launcher: host %s has no RQD address; kill of proc %s not sent", run.host,
                               run.pk_proc)  # fmt: skip
                continue
            self._send_kill(run.rqd_address, run.pk_frame, f"cuesched: kill of proc {run.pk_proc} ({run.kind})")

    def heartbeat(self, conn: psycopg.Connection) -> None:
        if not self.poll_hosts:
            return
        hosts = conn.execute(RQD_HOSTS_SQL).fetchall()
        polls = [
            (pk, name, address, self._pool.submit(self._status, address)) for pk, name, address in hosts if address
        ]
        silent: list[str] = []
        for pk, name, address, fut in polls:
            try:
                report = fut.result()
            except grpc.RpcError as exc:
                logger.warning("rqd host %s (%s) does not answer: %s", name, address, _rpc_reason(exc))
                if exc.code() in UNREACHABLE:
                    silent.append(pk)
                continue
            try:
                result = report_status(conn, report, address)
            except (ReportError, ValueError, psycopg.DataError) as exc:
                # One RQD's bad report must not fail the cycle: the loop would poll again every
                # cycle and never book nor sweep, farm-wide.
                logger.warning("rqd host %s (%s): status not applied: %s", name, address, exc)
                continue
            for frame_id, resource_id in result.to_kill:
                logger.warning("rqd host %s runs frame %s with no proc or a killed one (%s): killing it", name,
                               frame_id, resource_id)  # fmt: skip
                # Not on the loop's thread: a wedged RQD would hold it for the timeout per stray.
                self._send_kill(address, frame_id, "cuesched: this run has no proc, or was killed")
        if silent:
            conn.execute(MARK_DOWN_SQL, (silent,))

    def _send_kill(self, address: str, frame_id: str, message: str) -> None:
        key = (address, frame_id)
        with self._lock:
            if key in self._stray_kills:
                return  # the previous poll's kill is still on its way
            self._stray_kills.add(key)

        def send() -> None:
            try:
                if self.clients.kill(address, frame_id, message, self.timeout):
                    self.kills_sent += 1
            finally:
                with self._lock:
                    self._stray_kills.discard(key)

        try:
            self._kill_pool.submit(send)
        except RuntimeError:  # the launcher is closing
            with self._lock:
                self._stray_kills.discard(key)

    def _status(self, address: str) -> rqd_pb2.RqdStaticReportStatusResponse:
        return (
            self.clients.stub(address)
            .ReportStatus(rqd_pb2.RqdStaticReportStatusRequest(), timeout=self.poll_timeout)
            .host_report
        )

    def abandon(self) -> list[str]:
        return []  # the frames run on RQD, which reports their end to the gateway

    def close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.close_connection()
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rqd-launch")
        self._kill_pool.shutdown(wait=True, cancel_futures=False)
        self._kill_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rqd-kill")
        self.clients.close()
