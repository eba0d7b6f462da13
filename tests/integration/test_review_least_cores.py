"""Review of 6de0ea1 (a job blocked at its max cores waits for its layer's least cores).

`_least_cores` is `min(cores, sizing.asked_cores(demand))`, and `asked_cores` is 1 for a
whole-host layer (cores 0) and for all-but-N (cores -N): such a frame books the whole host (or
all but N) wherever it runs, so a job at its cap that waits for 1 core wakes every cycle while
its room is under a host's size, and every cycle it is placed again (two searches) and refused.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from dispatch.jobs.submit import submit_job
from dispatch.models import HostTag
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, violations, wait_for
from tests.integration.farm_fixtures import create_host
from tests.integration.runtime_support import running_scheduler
from tests.integration.submit_support import GB, submit_farm

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_whole_host_job_blocked_at_its_cap_stays_blocked_while_no_host_fits_its_room() -> None:
    farm = submit_farm(managed=True)
    for name in ("a", "b"):
        host = create_host(farm.alloc, f"h-whole-{name}", int_cores=16 * 100, int_mem=64 * GB)
        HostTag.objects.filter(host=host).delete()
        HostTag.objects.create(host=host, str_tag="t-whole", str_tag_type="MANUAL")
    spec = {
        "show": "demo",
        "name": "whole-capped",
        "user": "alice",
        "max_cores": 20,
        "layers": [
            {"name": "whole", "command": "true", "range": "1-2", "cores": 0, "memory": "4GB",
             "threadable": True, "tags": ["t-whole"]},
        ],
    }  # fmt: skip
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(spec, user="alice").job_id
        wait_for(lambda: service.store.job_cap(job) is not None, what="the job's cap in the Store")
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        first = loop.run_once()
        assert first.booked == 1  # 16 of 20: the second frame books 16 on any host, past the cap
        wait_for(lambda: service.store.job_cores_in_use(job) == 16, what="the Store to see the first frame")
        loop.run_once()  # the first cycle to see its booking: the job is placed, refused and blocked
        retried = sum(loop.run_once().rejected["job_precheck"] for _ in range(3))
        # 4 cores of room can never take a 16-core whole-host frame: the job stays blocked
        # (until a frame of it ends or the block's 60 s pass) instead of being placed each cycle.
        assert retried == 0, f"the capped job was placed and refused again in {retried} of 3 cycles"
        assert violations(conn) == []
