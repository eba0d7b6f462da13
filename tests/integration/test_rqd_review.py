"""Adversarial review of the RQD gateway (issue 18): reports a buggy or hostile RQD could send.

The reports go through the real gateway (gRPC server in this process, real PostgreSQL), the
procs are booked by the real dispatch loop; the runs themselves are simulated, since what is
under test is what the gateway writes, not what RQD runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from opencue_proto import report_pb2, report_pb2_grpc, rqd_pb2, rqd_pb2_grpc

from dispatch.hosts.launchers.rqd import RqdLauncher
from dispatch.hosts.rqd_gateway import ReportError, report_completion, report_startup, report_status
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, scalar, seed, violations, wait_for
from tests.integration.rqd_support import gateway
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def _report_stub() -> Iterator[report_pb2_grpc.RqdReportInterfaceStub]:
    with gateway() as gw, grpc.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        yield report_pb2_grpc.RqdReportInterfaceStub(channel)


def test_a_completion_reported_by_another_host_does_not_release_the_proc() -> None:
    """RQD's completion names its host; the proc it ends (resource_id) runs on another host.
    Releasing it would leave that host's run going uncounted (a cap breach in reality) until the
    real host's next status report kills it. The report must be refused and change nothing."""
    seed("rvx", hosts=2, jobs=1, layers=1, frames_per_layer=1)
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        pk_proc, pk_frame, host = conn.execute(
            "SELECT p.pk_proc, p.pk_frame, h.str_name FROM proc p JOIN host h ON h.pk_host = p.pk_host"
        ).fetchone()
        other = scalar(conn, "SELECT str_name FROM host WHERE str_name <> %s", (host,))
        report = report_pb2.FrameCompleteReport(
            host=report_pb2.RenderHost(name=other),
            frame=report_pb2.RunningFrameInfo(resource_id=pk_proc, frame_id=pk_frame, frame_name="x"),
            exit_status=0,
        )
        with _report_stub() as stub:
            with pytest.raises(grpc.RpcError) as refused:
                stub.ReportRunningFrameCompletion(
                    report_pb2.RqdReportRunningFrameCompletionRequest(frame_complete_report=report), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_proc = %s", (pk_proc,)) == 1
            assert scalar(conn, "SELECT str_state FROM frame WHERE pk_frame = %s", (pk_frame,)) == "RUNNING"
            # The same report from the proc's own host is applied.
            report.host.name = host
            stub.ReportRunningFrameCompletion(
                report_pb2.RqdReportRunningFrameCompletionRequest(frame_complete_report=report), timeout=10
            )
        launcher.close()
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        assert scalar(conn, "SELECT str_state FROM frame WHERE pk_frame = %s", (pk_frame,)) == "SUCCEEDED"
        assert violations(conn) == []


def test_a_startup_report_keeps_a_proc_booked_so_recently_that_its_launch_may_be_on_the_new_daemon() -> None:
    """Python RQD serves LaunchFrame before it sends its startup report (rqnetwork's serve()
    starts the server, then reports), and the report may be retried: a frame booked on the host
    just before the report is processed can already run on the new daemon. Releasing its proc
    there puts the frame back to WAITING (rebookable elsewhere) while it runs here, uncounted,
    until the next status report kills it. A proc booked within CUESCHED_RQD_ORPHAN_GRACE is left
    to the status reports' orphan check (kept if RQD reports it, released after the grace if not);
    an older one is of the previous life and is released at once."""
    seed("rvs", hosts=1, jobs=1, layers=1, frames_per_layer=2)
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 2
        old, fresh = [r[0] for r in conn.execute("SELECT pk_proc FROM proc ORDER BY pk_proc").fetchall()]
        conn.execute("UPDATE proc SET ts_dispatched = now() - interval '1 hour' WHERE pk_proc = %s", (old,))
        host = scalar(conn, "SELECT str_name FROM host")
        boot = report_pb2.BootReport(
            host=report_pb2.RenderHost(name=host, total_mem=1 << 24, free_mem=1 << 23, num_procs=4, cores_per_proc=100),
            core_info=report_pb2.CoreDetail(total_cores=400, idle_cores=400),
        )
        result = report_startup(conn, boot, None)
        launcher.close()
        assert result.orphans_released == 1
        assert [r[0] for r in conn.execute("SELECT pk_proc FROM proc").fetchall()] == [fresh]
        assert violations(conn) == []


class _HostileRqd(rqd_pb2_grpc.RqdInterfaceServicer):
    """An RQD (buggy or hostile) that accepts every launch and answers the scheduler's status
    poll with a report the database cannot store (a NUL byte in a frame's resource_id)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.launched = 0

    def LaunchFrame(self, request: Any, context: Any) -> Any:
        self.launched += 1
        return rqd_pb2.RqdStaticLaunchFrameResponse()

    def ReportStatus(self, request: Any, context: Any) -> Any:
        report = report_pb2.HostReport(
            host=report_pb2.RenderHost(name=self.host, total_mem=1 << 24, free_mem=1 << 23),
            frames=[report_pb2.RunningFrameInfo(resource_id="bad\x00id", frame_id="f\x00")],
        )
        return rqd_pb2.RqdStaticReportStatusResponse(host_report=report)


def test_one_rqd_answering_a_malformed_status_does_not_stop_the_loop_booking() -> None:
    """The rqd launcher's status poll runs on the loop's thread before each lost-host sweep; a
    report the database refuses (psycopg.DataError) propagated out of run_once before the sweep
    time was recorded, so every cycle polled again and failed: one bad RQD stopped all booking
    and every lost-host sweep, farm-wide. Bad input gets a clear error; the scheduler goes on."""
    seed("rvh", hosts=2, jobs=1, layers=1, frames_per_layer=2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    with autocommit() as conn:
        hostile_name, good_name = [r[0] for r in conn.execute("SELECT str_name FROM host ORDER BY 1").fetchall()]
        hostile = _HostileRqd(hostile_name)
        rqd_pb2_grpc.add_RqdInterfaceServicer_to_server(hostile, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            # Both hosts' RQD address is the hostile daemon (it answers for the first only).
            conn.execute("UPDATE host SET str_rqd_address = %s", (f"127.0.0.1:{port}",))
            with running_scheduler() as proc:
                launcher = RqdLauncher(timeout=5, poll_hosts=True, poll_timeout=5)
                try:
                    with make_loop(proc.service, launcher, lost_host_sweep_interval=0.0) as loop:
                        stats = loop.run_once()
                    assert stats.booked == 2 and hostile.launched == 2
                    # The bad report wrote nothing (the good host's ping is separate: no such report).
                    assert scalar(conn, "SELECT count(*) FROM proc") == 2
                finally:
                    launcher.close()
                # Leave nothing booked for a frame nobody runs.
                from dispatch.engine.completion import Completion, complete

                complete(conn, [Completion(pk, 0) for (pk,) in conn.execute("SELECT pk_proc FROM proc").fetchall()])
                assert violations(conn) == []
        finally:
            server.stop(0)
        assert good_name != hostile_name


def test_a_pushed_status_report_the_database_refuses_is_answered_invalid_argument() -> None:
    """A report that cannot be stored as sent is bad input, not a database outage: UNAVAILABLE
    made RQD's client retry the same report (4 attempts) for nothing."""
    seed("rvn", hosts=1, jobs=0)
    with autocommit() as conn, _report_stub() as stub:
        host = scalar(conn, "SELECT str_name FROM host")
        report = report_pb2.HostReport(
            host=report_pb2.RenderHost(name=host, total_mem=1 << 24, free_mem=1 << 23),
            frames=[report_pb2.RunningFrameInfo(resource_id="bad\x00id", frame_id="f")],
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportStatus(report_pb2.RqdReportStatusRequest(host_report=report), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The gateway goes on: a good report from the same host is applied.
        del report.frames[:]
        stub.ReportStatus(report_pb2.RqdReportStatusRequest(host_report=report), timeout=10)
        assert violations(conn) == []


def test_a_status_report_from_another_address_than_the_hosts_rqd_does_not_release_its_procs() -> None:
    """Host h's RQD answers at 10.0.0.1 (its startup recorded it) and runs a frame booked an
    hour ago. A second daemon calling itself h reports from 10.0.0.2 with no frame: the proc
    of the run still going on the real h must not be released on that report's word."""
    seed("rvd", hosts=1, jobs=1, layers=1, frames_per_layer=1)
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()
        conn.execute("UPDATE proc SET ts_dispatched = now() - interval '1 hour'")
        conn.execute("UPDATE host SET str_rqd_address = '10.0.0.1:8444'")
        host = scalar(conn, "SELECT str_name FROM host")
        report = report_pb2.HostReport(host=report_pb2.RenderHost(name=host, total_mem=1 << 24, free_mem=1 << 23))
        with pytest.raises(ReportError, match=r"answers at 10\.0\.0\.1:8444"):
            report_status(conn, report, "10.0.0.2:8444")
        assert scalar(conn, "SELECT count(*) FROM proc") == 1
        assert scalar(conn, "SELECT str_rqd_address FROM host") == "10.0.0.1:8444"
        # A startup from the other address (a cloned image booting) is refused the same way:
        # its release of "the previous life's" procs would release the real host's runs.
        boot = report_pb2.BootReport(host=report_pb2.RenderHost(name=host, total_mem=1 << 24, free_mem=1 << 23))
        with pytest.raises(ReportError, match=r"answers at 10\.0\.0\.1:8444"):
            report_startup(conn, boot, "10.0.0.2:8444")
        assert scalar(conn, "SELECT count(*) FROM proc") == 1
        # And so is its completion of the real host's run.
        pk_proc, pk_frame = conn.execute("SELECT pk_proc, pk_frame FROM proc").fetchone()
        done = report_pb2.FrameCompleteReport(
            host=report_pb2.RenderHost(name=host),
            frame=report_pb2.RunningFrameInfo(resource_id=pk_proc, frame_id=pk_frame, frame_name="x"),
            exit_status=0,
        )
        with pytest.raises(ReportError, match=r"answers at 10\.0\.0\.1:8444"):
            report_completion(conn, done, "10.0.0.2:8444")
        assert scalar(conn, "SELECT count(*) FROM proc") == 1
        # From the recorded address the same completion is applied.
        report_completion(conn, done, "10.0.0.1:8444")
        assert scalar(conn, "SELECT count(*) FROM proc") == 0
        # With nothing booked any more, a host that moved (a re-addressed node) is followed.
        report_startup(conn, boot, "10.0.0.2:8444")
        assert scalar(conn, "SELECT str_rqd_address FROM host") == "10.0.0.2:8444"


class _SlowRqd(rqd_pb2_grpc.RqdInterfaceServicer):
    """An RQD that starts every frame it is sent but answers LaunchFrame after the caller's
    deadline (an overloaded node): the run goes on although the call timed out."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.started: list[str] = []
        self.done = threading.Event()

    def LaunchFrame(self, request: Any, context: Any) -> Any:
        self.started.append(request.run_frame.resource_id)
        self.done.wait(self.delay)
        return rqd_pb2.RqdStaticLaunchFrameResponse()


def test_a_launch_that_timed_out_keeps_its_proc_booked_since_rqd_may_run_it() -> None:
    """DEADLINE_EXCEEDED says nothing about whether RQD started the frame. The launcher returned
    it as a failure, so the loop's compensation deleted the proc (counters down, frame WAITING,
    rebookable) while the frame ran on RQD, uncounted, until a status report killed it: a
    counter reading low. Kept booked, the status reports decide it (kept while RQD reports the
    run, released after CUESCHED_RQD_ORPHAN_GRACE if it does not); a host that never answers
    again is swept the lost-host way."""
    seed("rvt", hosts=1, jobs=1, layers=1, frames_per_layer=1)
    slow = _SlowRqd(delay=5.0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rqd_pb2_grpc.add_RqdInterfaceServicer_to_server(slow, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with running_scheduler() as proc, autocommit() as conn:
            conn.execute("UPDATE host SET str_rqd_address = %s", (f"127.0.0.1:{port}",))
            launcher = RqdLauncher(timeout=0.3, poll_hosts=False)
            try:
                with make_loop(proc.service, launcher) as loop:
                    loop.run_once()
            finally:
                slow.done.set()
                launcher.close()
            assert len(slow.started) == 1  # RQD runs it
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_proc = %s", (slow.started[0],)) == 1
            assert scalar(conn, "SELECT str_state FROM frame") == "RUNNING"
            assert violations(conn) == []
    finally:
        server.stop(0)


class _StrayRqd(rqd_pb2_grpc.RqdInterfaceServicer):
    """An RQD that reports frames cuesched never booked and does not answer KillRunningFrame
    until released (a wedged daemon)."""

    def __init__(self, host: str, strays: int) -> None:
        self.host = host
        self.strays = strays
        self.kills: list[str] = []
        self.release = threading.Event()

    def ReportStatus(self, request: Any, context: Any) -> Any:
        frames = [report_pb2.RunningFrameInfo(resource_id=f"stray-{i}", frame_id=f"sf-{i}") for i in range(self.strays)]
        report = report_pb2.HostReport(
            host=report_pb2.RenderHost(name=self.host, total_mem=1 << 24, free_mem=1 << 23), frames=frames
        )
        return rqd_pb2.RqdStaticReportStatusResponse(host_report=report)

    def KillRunningFrame(self, request: Any, context: Any) -> Any:
        self.kills.append(request.frame_id)
        self.release.wait(60)
        return rqd_pb2.RqdStaticKillRunningFrameResponse()


def test_the_status_poll_does_not_wait_on_the_kills_of_stray_frames() -> None:
    """The rqd launcher's heartbeat runs on the loop's thread and sent each stray's
    KillRunningFrame synchronously, one after the other, each up to CUESCHED_RQD_TIMEOUT: one
    wedged RQD reporting N strays held the whole dispatch loop (no booking, no completion, no
    sweep) for N times the timeout. The kills go to the launcher's pool, as `kill` sends them."""
    seed("rvk", hosts=1, jobs=0)
    with autocommit() as conn:
        host = scalar(conn, "SELECT str_name FROM host")
        wedged = _StrayRqd(host, strays=3)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rqd_pb2_grpc.add_RqdInterfaceServicer_to_server(wedged, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        launcher = RqdLauncher(timeout=60, poll_hosts=True, poll_timeout=5)
        try:
            conn.execute("UPDATE host SET str_rqd_address = %s", (f"127.0.0.1:{port}",))
            poll = threading.Thread(target=launcher.heartbeat, args=(conn,), daemon=True)
            poll.start()
            # The poll must return while the kills are still unanswered.
            wait_for(lambda: not poll.is_alive(), 15, "the status poll to return")
            wait_for(lambda: len(wedged.kills) == 3, 15, "RQD to receive the three kills")
        finally:
            wedged.release.set()
            launcher.close()
            server.stop(0)
        assert sorted(wedged.kills) == ["sf-0", "sf-1", "sf-2"]


def test_a_pushed_status_report_is_answered_without_waiting_on_the_kills_of_its_strays() -> None:
    """The gateway killed a report's strays in the gRPC handler, one synchronous call each (up
    to CUESCHED_RQD_TIMEOUT): a wedged RQD pushing N strays every 5 to 30 s held a gateway
    worker for N times the timeout per report, and enough of them starve every RQD's
    completions of workers. The report is answered first; the kills go on meanwhile."""
    seed("rvg", hosts=1, jobs=0)
    with autocommit() as conn:
        host = scalar(conn, "SELECT str_name FROM host")
        wedged = _StrayRqd(host, strays=3)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rqd_pb2_grpc.add_RqdInterfaceServicer_to_server(wedged, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            frames = [report_pb2.RunningFrameInfo(resource_id=f"stray-{i}", frame_id=f"sf-{i}") for i in range(3)]
            report = report_pb2.HostReport(
                host=report_pb2.RenderHost(
                    name=host, total_mem=1 << 24, free_mem=1 << 23, tags=[f"rqdport-{port}"]
                ),
                frames=frames,
            )
            with _report_stub() as stub:
                # Answered although RQD has not answered a single kill.
                stub.ReportStatus(report_pb2.RqdReportStatusRequest(host_report=report), timeout=10)
                assert wedged.release.is_set() is False
                wait_for(lambda: len(wedged.kills) >= 1, 15, "RQD to receive a kill")
                wedged.release.set()
                wait_for(lambda: len(wedged.kills) == 3, 15, "RQD to receive the three kills")
        finally:
            wedged.release.set()
            server.stop(0)
        assert sorted(wedged.kills) == ["sf-0", "sf-1", "sf-2"]
