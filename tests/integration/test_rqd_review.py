"""Adversarial review of the RQD gateway (issue 18): reports a buggy or hostile RQD could send.

The reports go through the real gateway (gRPC server in this process, real PostgreSQL), the
procs are booked by the real dispatch loop; the runs themselves are simulated, since what is
under test is what the gateway writes, not what RQD runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from opencue_proto import report_pb2, report_pb2_grpc

from dispatch.hosts.rqd_gateway import report_startup
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, scalar, seed, violations
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
