"""Adversarial review of issue 19 part 2: the share pass and the job budget of unmanaged shows."""

from __future__ import annotations

import pytest

from tests.integration.dispatch_support import autocommit, violations
from tests.integration.runtime_support import running_scheduler
from tests.integration.test_fairshare import _booked_by_job, _farm, _loop

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_borrowing_pass_counts_what_the_share_pass_booked_against_an_unmanaged_jobs_max_cores() -> None:
    """An unmanaged job's budget is the cycle-start job_resource.int_cores. _book_job runs twice
    per job in a cycle with a show below its size (share pass, then borrowing), and the second
    call started again from that value: it planned past int_max_cores, and the database trigger
    refused the excess at write (no breach, but refused bookings and a wasted write every such
    cycle). The loop's own precheck must stop at the cap."""
    farm = _farm("fsrj", managed=False, jobs=2, hosts=4)
    with autocommit() as conn:
        conn.execute("UPDATE subscription SET int_size = 400")
        # Both shows below their size (4 of 16 free cores each); each job capped at 6 cores.
        conn.execute("UPDATE job_resource SET int_max_cores = 600")
        with running_scheduler() as proc:
            loop = _loop(proc.service)
            try:
                stats = loop.run_once()
            finally:
                loop.close()
        assert _booked_by_job(conn, farm) == dict.fromkeys(farm.job_ids, 6)
        refused = {k: v for k, v in stats.rejected.items() if not k.endswith("_precheck")}
        assert refused == {}, f"the database refused bookings the loop should not have made: {refused}"
        assert violations(conn) == []
