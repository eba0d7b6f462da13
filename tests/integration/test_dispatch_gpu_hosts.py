"""GPU hosts kept for GPU work, through the real dispatch loop on PostgreSQL (issue 28).

One host with 8 cores, 32 GB and 2 GPUs (16 GB of GPU memory), no other host: every CPU frame
that books there is one a GPU frame may lack. Frames run for a minute (nothing completes while
the test looks) unless the test says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dispatch.models import Host, HostStat
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, scalar, violations, wait_for
from tests.integration.farm_fixtures import (
    create_alloc,
    create_dept,
    create_facility,
    create_folder,
    create_frames,
    create_host,
    create_job,
    create_layer,
    create_show,
    create_subscription,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

GB = 1024 * 1024  # KB
LONG = {"runtime_min": 60.0, "runtime_max": 60.0}


@dataclass
class GpuFarm:
    show: object
    folder: object
    dept: object
    facility: object
    alloc: object
    host: Host

    def job(self, name: str, frames: int, *, gpus: int = 0, priority: int = 1) -> str:
        job = create_job(self.show, self.folder, self.dept, self.facility, name=name)
        job.resource.int_priority = priority
        job.resource.save(update_fields=["int_priority"])
        layer = create_layer(
            job,
            str_tags=self.alloc.str_tag or self.alloc.str_name,
            int_cores_min=100,
            int_mem_min=GB,
            int_gpus_min=gpus,
            int_gpu_mem_min=4 * GB if gpus else 0,
            b_threadable=False,
        )
        create_frames(layer, frames)
        return job.pk


def gpu_farm(managed: bool) -> GpuFarm:
    facility, dept = create_facility(), create_dept()
    show = create_show(managed=managed)
    alloc = create_alloc(facility)
    create_subscription(show, alloc, int_burst=100_000)
    folder = create_folder(show, dept)
    host = create_host(alloc, int_cores=800, int_mem=32 * GB, int_gpus=2)
    Host.objects.filter(pk=host.pk).update(int_gpu_mem=16 * GB, int_gpu_mem_idle=16 * GB)
    HostStat.objects.filter(host=host).update(int_gpu_mem_total=16 * GB, int_gpu_mem_free=16 * GB)
    return GpuFarm(show, folder, dept, facility, alloc, host)


def running(conn, job: str) -> int:
    return scalar(conn, "SELECT count(*) FROM proc WHERE pk_job = %s", (job,))


@pytest.mark.parametrize("managed", [False, True], ids=["unmanaged", "managed"])
def test_a_cpu_frame_is_declined_by_an_idle_gpu_host_while_gpu_work_waits(managed: bool) -> None:
    farm = gpu_farm(managed)
    # The CPU job comes first in dispatch order: without the rule it would take the host's cores.
    cpu = farm.job("cpu", 6, priority=100)
    gpu = farm.job("gpu", 1, gpus=1, priority=1)
    with running_scheduler() as proc, autocommit() as conn:
        with make_loop(proc.service, fast_launcher(**LONG)) as loop:
            stats = loop.run_once()
            assert running(conn, gpu) == 1
            assert running(conn, cpu) == 0  # declined: a GPU frame of the cycle could use the host
            assert stats.gpu_declined >= 1
            why = loop.why[cpu]
            assert why["reason"] == "gpu_host_kept"
            assert "GPU frames wait for them" in why["message"]
            # Now no GPU frame waits: CPU frames may use the host up to Cuebot's reserve, which
            # leaves 1 core (and 4 GB) beside the GPU still idle: 8 - 1 (GPU frame) - 1 = 6 cores.
            loop.run_once()
            assert running(conn, cpu) == 6
            assert scalar(conn, "SELECT int_cores_idle FROM host WHERE pk_host = %s", (farm.host.pk,)) == 100
        assert violations(conn) == []


def test_cpu_frames_leave_the_reserve_on_a_gpu_host_unless_backfill_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    farm = gpu_farm(False)
    cpu = farm.job("cpu", 10)
    with running_scheduler() as proc, autocommit() as conn:
        with make_loop(proc.service, fast_launcher(**LONG)) as loop:
            loop.run_once()
            assert running(conn, cpu) == 7  # one core kept for GPU work
            loop.run_once()
            assert running(conn, cpu) == 7
            why = loop.why[cpu]
            assert why["reason"] == "gpu_host_kept"
            assert "must leave 1 GPU, 1 core, 4 GB of memory and 4 GB of GPU memory" in why["message"]
            assert "CUESCHED_GPU_BACKFILL" in why["unblock"]
        monkeypatch.setenv("CUESCHED_GPU_BACKFILL", "1")
        with make_loop(proc.service, fast_launcher(**LONG)) as loop:
            loop.run_once()
            assert running(conn, cpu) == 8  # all of it
        assert violations(conn) == []


def test_with_backfill_a_gpu_host_drains_back_to_gpu_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU frames fill the GPU host; GPU work arrives: no new CPU frame goes there, the GPU frames
    get the cores the CPU frames free, and only then do CPU frames take what is left (OpenCue #991)."""
    monkeypatch.setenv("CUESCHED_GPU_BACKFILL", "1")
    farm = gpu_farm(False)
    cpu = farm.job("cpu", 40, priority=100)
    short = {"runtime_min": 0.2, "runtime_max": 0.4}
    with running_scheduler() as proc, autocommit() as conn:
        with make_loop(proc.service, fast_launcher(**short)) as loop:
            loop.run_once()
            assert running(conn, cpu) == 8  # all of the host, backfill is on
            gpu = farm.job("gpu", 2, gpus=1, priority=1)
            cpu_counts: list[int] = []

            def gpu_frames_running() -> bool:
                loop.run_once()
                cpu_counts.append(running(conn, cpu))
                return running(conn, gpu) == 2

            wait_for(gpu_frames_running, 30, "both GPU frames to get the host")
            # From the GPU job's arrival until both its frames ran, the CPU frames only ever went down.
            assert cpu_counts == sorted(cpu_counts, reverse=True), cpu_counts
            assert cpu_counts[-1] <= 6
        assert violations(conn) == []
