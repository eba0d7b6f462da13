"""The RunFrame cuesched sends RQD carries the ids Cuebot's report handlers look up.

Beside Cuebot, RQD reports a managed show's frames to Cuebot, as in OpenCue's own deployment.
Cuebot's FrameCompleteHandler finds the proc by `resource_id` (hostManager.getVirtualProc), the
frame by `frame_id` (jobManager.getDispatchFrame), and logs and routes by job, layer and frame
names; HostReportHandler matches running frames by `resource_id` and `frame_id`. cuesched's ids
are Cuebot's own rows (proc.pk_proc, frame.pk_frame, ...), so the values must be exactly those.
"""

from __future__ import annotations

import uuid

from dispatch.hosts.agent import RunContext
from dispatch.hosts.launchers.rqd import run_frame_message


def test_run_frame_carries_the_ids_cuebots_report_handler_needs() -> None:
    ids = {k: str(uuid.uuid4()) for k in ("pk_proc", "pk_frame", "pk_layer", "pk_job")}
    ctx = RunContext(
        **ids,
        cores=200,
        mem=1_048_576,
        gpus=0,
        gpu_mem=0,
        frame_name="0001-render",
        number=1,
        dispatch_order=0,
        retries=0,
        layer="render",
        command="echo #IFRAME#",
        range="1-4",
        chunk_size=1,
        job="testing-shot-job",
        shot="shot",
        user="artist",
        show="testing",
        host="node1",
    )
    msg = run_frame_message(ctx, "/tmp/logs", "rqd")
    assert msg.resource_id == ids["pk_proc"]
    assert msg.frame_id == ids["pk_frame"]
    assert msg.job_id == ids["pk_job"]
    assert msg.layer_id == ids["pk_layer"]
    assert (msg.frame_name, msg.job_name, msg.show) == ("0001-render", "testing-shot-job", "testing")
    assert msg.num_cores == 200  # centicores, as Cuebot sends them
    # Cuebot's DispatchFrame.setMinMemory: soft 1.6x, hard 2x the booked memory (it sent no hard limit before).
    assert (msg.soft_memory_limit, msg.hard_memory_limit) == (1_677_721, 2_097_152)
