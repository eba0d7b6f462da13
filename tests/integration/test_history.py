"""The scheduler's history sampler against real PostgreSQL and a running scheduler: what one
sample holds (booked against burst per subscription, pending frames, bookings and completions
per minute, per show), and retention."""

from __future__ import annotations

import pytest

from ops.models import HistorySample
from tests.integration.runtime_support import autocommit_conn, make_farm, running_scheduler, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_samples_hold_one_snapshot_of_the_farm_and_old_ones_are_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUESCHED_HISTORY_INTERVAL", "0.2")
    monkeypatch.setenv("CUESCHED_HISTORY_RETENTION_HOURS", "1")
    with autocommit_conn() as conn:
        farm = make_farm(conn, "hist", managed=False, burst_cores=50, jobs=1, frames=10)
        farm.add_proc(conn, cores=3)
        farm.add_proc(conn, cores=4)
        # One frame started and one finished within the last minute, one finished long ago.
        conn.execute("UPDATE frame SET ts_started = now() WHERE pk_frame = %s", (farm.frames[farm.jobs[0]][0],))
        conn.execute(
            "UPDATE frame SET str_state = 'SUCCEEDED', ts_stopped = now() WHERE pk_frame = %s",
            (farm.frames[farm.jobs[0]][1],),
        )
        conn.execute(
            "UPDATE frame SET str_state = 'SUCCEEDED', ts_stopped = now() - interval '5 minutes' WHERE pk_frame = %s",
            (farm.frames[farm.jobs[0]][2],),
        )
        conn.execute(
            "INSERT INTO ops_history_sample (ts, pending_frames, running_procs, booked_cc, bookings_per_min,"
            " completions_per_min, drift_cores, subs, shows) VALUES (now() - interval '2 hours', 0, 0, 0, 0, 0, 0,"
            " '{}', '{}')"
        )
        row = conn.execute("SELECT int_waiting_count FROM job_stat WHERE pk_job = %s", (farm.jobs[0],)).fetchone()
    waiting = int(row[0])
    assert waiting > 0
    with running_scheduler(publish_interval=0.5):
        wait_for(lambda: HistorySample.objects.count() >= 3, timeout=20, what="three samples")
    assert not HistorySample.objects.filter(booked_cc=0, running_procs=0, pending_frames=0).exists(), "not pruned"
    sample = HistorySample.objects.order_by("-ts").first()
    assert sample is not None
    assert sample.booked_cc == 700 and sample.running_procs == 2
    assert sample.pending_frames == waiting
    assert sample.bookings_per_min == 1 and sample.completions_per_min == 1
    assert sample.subs == {f"{farm.show}:{farm.alloc}": [700, 5000, 5000]}
    assert sample.shows[farm.show][:3] == [waiting, 2, 700]
