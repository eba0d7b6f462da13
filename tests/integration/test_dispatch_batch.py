"""The booking transaction on its own: every guard drops only its own booking, never the batch."""

from __future__ import annotations

import uuid

import pytest

from dispatch.engine import loop as loop_module
from dispatch.engine.booking import write_batch
from tests.integration.dispatch_support import (
    ONE_CORE,
    autocommit,
    fast_launcher,
    make_loop,
    plan,
    scalar,
    seed,
    violations,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_over_cap_unmanaged_booking_is_rejected_alone() -> None:
    seed("bcap", managed=False, job_max_cores=200, jobs=3, **ONE_CORE)
    with autocommit() as conn:
        jobs, bookings = plan(conn, {0: 3, 1: 2, 2: 2}, managed=False)
        result = write_batch(conn, bookings, mem_used=256_000)
        assert [table for _b, table in result.rejected] == ["job"]
        assert result.rejected[0][0].layer.job.pk == jobs[0].pk
        assert len(result.written) == 6
        assert all(b.post_version == b.frame.version + 1 for b in result.written)
        # The database-enforced totals hold exactly what was written.
        cores = dict(conn.execute("SELECT pk_job, int_cores FROM job_resource").fetchall())
        assert [cores[j.pk] for j in jobs] == [200, 200, 200]
        assert scalar(conn, "SELECT count(*) FROM proc") == 6
        assert scalar(conn, "SELECT count(*) FROM frame WHERE str_state = 'RUNNING'") == 6
        assert violations(conn) == []


def test_guards_drop_only_their_own_bookings() -> None:
    seed("bgrd", jobs=5, **ONE_CORE)
    with autocommit() as conn:
        _jobs, bookings = plan(conn, {0: 2, 1: 2, 2: 2, 3: 2, 4: 2}, managed=True)
        stale, conflict, exhausted, flipped = bookings[0], bookings[2], bookings[4], bookings[6]
        # A frame changed since it was read: its version moved on.
        conn.execute("UPDATE frame SET int_version = int_version + 1 WHERE pk_frame = %s", (stale.frame.pk,))
        # A WAITING frame that somehow already has a proc.
        conn.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
            " int_mem_reserved) SELECT %s, %s, pk_show, pk_job, %s, %s, 100, 1 FROM job WHERE pk_job = %s",
            (str(uuid.uuid4()), conflict.host.pk, conflict.layer.pk, conflict.frame.pk, conflict.layer.job.pk),
        )
        conn.execute(
            "UPDATE host SET int_cores_idle = int_cores_idle - 100, int_mem_idle = int_mem_idle - 1 WHERE pk_host = %s",
            (conflict.host.pk,),
        )
        # A host another writer filled up since the view was loaded.
        conn.execute("UPDATE host SET int_cores_idle = 0 WHERE pk_host = %s", (exhausted.host.pk,))
        flipped.managed = False  # decided unmanaged, but the show is managed in the database
        # The outside proc above bumped the show's accounting generation (a positive outside
        # delta); these bookings are decided as by a Store that has applied it, so only the
        # guards under test refuse them (test_generation covers the generation check).
        (acct,) = conn.execute(
            "SELECT int_generation FROM cuesched_show_generation WHERE pk_show = %s", (conflict.layer.job.show,)
        ).fetchone()
        for b in bookings:
            if b.managed:
                b.acct_generation = acct
        before_idle = dict(conn.execute("SELECT pk_host, int_cores_idle FROM host").fetchall())

        result = write_batch(conn, bookings, mem_used=256_000)

        rejected = {b.pk_proc: table for b, table in result.rejected}
        assert rejected[stale.pk_proc] == "frame"
        assert rejected[conflict.pk_proc] == "proc"
        assert rejected[exhausted.pk_proc] == "host"
        assert rejected[flipped.pk_proc] == "managed_flip"
        on_exhausted = [b for b in bookings if b.host.pk == exhausted.host.pk]
        assert all(b.pk_proc in rejected for b in on_exhausted)
        written = {b.pk_proc for b in result.written}
        assert written == {b.pk_proc for b in bookings} - set(rejected)
        assert written and result.failed_hosts == {exhausted.host.pk}
        procs = {r[0] for r in conn.execute("SELECT pk_proc FROM proc").fetchall()}
        assert written <= procs and not (set(rejected) & procs)
        # Hosts were charged exactly for what was written on them.
        after_idle = dict(conn.execute("SELECT pk_host, int_cores_idle FROM host").fetchall())
        for host in before_idle:
            charged = sum(b.cores for b in result.written if b.host.pk == host)
            assert before_idle[host] - after_idle[host] == charged
        returned = {row[0]: row[1] for row in result.host_rows}
        assert all(returned[h] == after_idle[h] for h in returned)
        started = {r[0] for r in conn.execute("SELECT pk_frame FROM frame WHERE str_state = 'RUNNING'").fetchall()}
        assert started == {b.frame.pk for b in result.written}


def test_a_folder_the_trigger_refused_gets_no_more_bookings_that_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Database-enforced: the pre-check read the folder's room before another writer took it.

    The first booking of the cycle is refused by the trigger; the cycle must not go on sending
    the folder's other frames (each refused in a transaction of its own, under the show's lock).
    """
    seed("bref", managed=False, jobs=3, frames_per_layer=4, folder_max_cores=400, job_max_cores=-1, **ONE_CORE)
    real_fetch = loop_module.fetch_pending

    def fetch_then_another_writer_fills_the_folder(conn, **kw):
        jobs = real_fetch(conn, **kw)
        with autocommit() as other:
            _jobs, theirs = plan(other, {2: 4}, managed=False)
            assert len(write_batch(other, theirs, mem_used=256_000).written) == 4
        return jobs

    monkeypatch.setattr(loop_module, "fetch_pending", fetch_then_another_writer_fills_the_folder)
    with running_scheduler() as proc, autocommit() as conn:
        loop = make_loop(proc.service, fast_launcher(), batch_size=1)
        try:
            stats = loop.run_once()
        finally:
            loop.close()
        # The feed showed 8 frames of jobs 0 and 1 with room for 4: one refusal, then nothing.
        assert stats.booked == 0
        assert dict(stats.rejected) == {"folder": 1}
        assert stats.batches == 1
        assert scalar(conn, "SELECT count(*) FROM proc") == 4
        assert violations(conn) == []
