"""The database-enforced path's backstop: unmanaged shows' counters rebuilt from SUM(proc)."""

from __future__ import annotations

import pytest

from accounting.reconcile import reconcile_unmanaged
from tests.integration.runtime_support import autocommit_conn, make_farm

pytestmark = pytest.mark.django_db(transaction=True)


def _counters(conn, farm) -> tuple[int, int, int]:
    sub = conn.execute("SELECT int_cores FROM subscription WHERE pk_show = %s", (farm.show,)).fetchone()[0]
    folder = conn.execute("SELECT int_cores FROM folder_resource WHERE pk_folder = %s", (farm.folder,)).fetchone()[0]
    job = conn.execute("SELECT int_cores FROM job_resource WHERE pk_job = %s", (farm.jobs[0],)).fetchone()[0]
    return sub, folder, job


def test_a_counter_that_slipped_past_the_triggers_is_rebuilt_and_reported_as_drift() -> None:
    with autocommit_conn() as conn:
        farm = make_farm(conn, "recon", managed=False, burst_cores=10)
        for _ in range(3):
            farm.add_proc(conn, cores=2)
        managed = make_farm(conn, "recon-m", managed=True, burst_cores=10)
        managed.add_proc(conn, cores=2)
        assert _counters(conn, farm) == (600, 600, 600)
        # A write the triggers cannot see (a restore of one table, a DBA with triggers off): the
        # subscription reads LOW, and the trigger would admit bookings over the burst.
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute("UPDATE subscription SET int_cores = 0 WHERE pk_show = %s", (farm.show,))
            conn.execute("UPDATE job_resource SET int_cores = 900 WHERE pk_job = %s", (farm.jobs[0],))
        result = reconcile_unmanaged(conn)
        assert _counters(conn, farm) == (600, 600, 600)
        assert result.drift_cores["subscription"] == 6 and result.drift_cores["job_resource"] == 3
        assert result.drift_cores["folder_resource"] == 0
        # The managed show's columns are the recompute's, never the reconcile's.
        assert result.shows >= 1
        sub = conn.execute("SELECT int_cores FROM subscription WHERE pk_show = %s", (managed.show,)).fetchone()[0]
        assert sub == 0
        assert reconcile_unmanaged(conn).drift_cores == dict.fromkeys(result.drift_cores, 0)
