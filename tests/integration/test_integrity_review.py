"""Holes an adversarial review found in the first cut of the every-writer rule, each as a test.

Each one failed on the code before the integrity work (a counter read low, a booking went over
a cap, or a change reached nobody) and passes now.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection, transaction

from accounting import actions as accounting_actions
from accounting.models import AccountingSettings
from accounting.notify import RELEASE_CHANNEL
from dispatch.engine.booking import compensate, write_batch
from dispatch.hosts.agent import HostSpec, register_host
from dispatch.models import Job, Proc, Subscription
from tests.integration import farm_fixtures as ff
from tests.integration.dispatch_support import plan, seed
from tests.integration.notify_listener import as_json, database_conninfo, listening
from tests.integration.test_db_accounting import wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True)


def wait_for_waiting_backend(application: str) -> None:
    """Until another backend of this database waits for a lock (since issue 27 a flip waits on its
    show's row, `wait_event_type = 'Lock'`; before, it polled an advisory lock with pg_sleep), or 10 s.

    From a connection of its own, outside any transaction: a transaction sees pg_stat_activity
    as it was when it first looked.
    """
    deadline = time.monotonic() + 10
    with psycopg.connect(database_conninfo(), autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND (wait_event_type = 'Lock' OR wait_event = 'PgSleep')"
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.01)
    raise AssertionError(f"{application} never waited")


def _sub_cores(farm: ff.Farm) -> int:
    return Subscription.objects.get(pk=farm.subscription.pk).int_cores


def test_a_proc_whose_host_is_not_visible_yet_is_refused_not_left_uncounted() -> None:
    # The proc's foreign keys are deferred: a host inserted later in the same transaction passes
    # them at COMMIT, but the trigger could not key the proc when it was written, and its delta
    # was lost (the subscription read 0 against 800 centicores booked).
    farm = ff.tiny_farm(managed=False, int_burst=1000)
    with psycopg.connect(database_conninfo()) as conn:
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="cannot see"):
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
                " int_mem_reserved) VALUES (gen_random_uuid()::text, 'not-yet-a-host', %s, %s, %s, %s, 800, 1)",
                (farm.show.pk, farm.job.pk, farm.layer.pk, farm.frames[0].pk),
            )
    assert _sub_cores(farm) == 0 and not Proc.objects.exists()


def test_a_cap_row_inserted_again_under_running_procs_starts_at_their_sum() -> None:
    # DELETE and INSERT of a subscription used to restart its counter at 0 under running procs,
    # so the database path admitted a second burst's worth of bookings.
    farm = ff.tiny_farm(managed=False, int_burst=1000)
    ff.create_proc(farm.host, farm.frames[0], cores=800)
    sub = farm.subscription
    with transaction.atomic():
        Subscription.objects.filter(pk=sub.pk).delete()
        Subscription.objects.create(pk=sub.pk, show=farm.show, alloc=farm.alloc, int_burst=1000, int_size=0)
    assert _sub_cores(farm) == 800
    with pytest.raises(Exception, match="exceeded burst"), transaction.atomic():
        ff.create_proc(farm.host, farm.frames[1], cores=300)


def test_a_client_write_of_an_unmanaged_shows_usage_is_refused() -> None:
    farm = ff.tiny_farm(managed=False, int_burst=1000)
    ff.create_proc(farm.host, farm.frames[0], cores=800)
    with pytest.raises(Exception, match="kept by the proc triggers"), transaction.atomic():
        Subscription.objects.filter(pk=farm.subscription.pk).update(int_cores=0)
    assert _sub_cores(farm) == 800
    # The managed side's display columns are the recompute's to write.
    managed = ff.tiny_farm(managed=True)
    Subscription.objects.filter(pk=managed.subscription.pk).update(int_cores=123)


def test_the_kill_switch_never_silences_a_positive_delta_or_a_cap() -> None:
    # Off, the switch used to silence every message. A lost positive delta (a proc written
    # outside the scheduler) or a lost cap decrease leaves the Store LOW or too permissive; only
    # releases (which read high when lost) are silenced now.
    farm = ff.tiny_farm(managed=True)
    with listening() as listener:
        AccountingSettings.set_notifications_enabled(False)
        try:
            proc = ff.create_proc(farm.host, farm.frames[0], cores=200)
            assert [m["cores"] for m in as_json(listener.sent_before_sentinel(RELEASE_CHANNEL))] == [2]
            Subscription.objects.filter(pk=farm.subscription.pk).update(int_burst=500)
            assert [m["burst"] for m in as_json(listener.sent_before_sentinel("acct_limit_change"))] == [5]
            proc.delete()
            assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []
        finally:
            AccountingSettings.set_notifications_enabled(True)


def test_a_compensation_releases_the_procs_current_keys_after_an_outside_move() -> None:
    # The compensating delete used to be silent while the Store rolled back the booked key; a
    # host moved to another allocation in between had already moved the booking there, so the
    # old allocation read LOW by it. The delete now sends an ordinary release, keyed as the proc
    # is when it goes.
    seed("cmv", jobs=1, frames_per_layer=1)
    with psycopg.connect(database_conninfo(), autocommit=True) as conn, listening() as listener:
        _jobs, bookings = plan(conn, {0: 1}, managed=True)
        [booking] = bookings
        write_batch(conn, bookings, mem_used=256_000)
        assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []  # the Store booked it itself
        other = conn.execute(
            "INSERT INTO alloc (pk_alloc, pk_facility, str_name, str_tag)"
            " SELECT gen_random_uuid()::text, pk_facility, 'cmv_other', 'cmv_other' FROM alloc"
            " WHERE pk_alloc = %s RETURNING pk_alloc",
            (booking.host.alloc,),
        ).fetchone()[0]
        conn.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst)"
            " VALUES (gen_random_uuid()::text, %s, %s, 0, 100000)",
            (other, booking.layer.job.show),
        )
        conn.execute("UPDATE host SET pk_alloc = %s WHERE pk_host = %s", (other, booking.host.pk))
        moved = as_json(listener.sent_before_sentinel(RELEASE_CHANNEL))
        assert sorted((m["alloc"], m["cores"]) for m in moved) == sorted(
            [(booking.host.alloc, -booking.cores // 100), (other, booking.cores // 100)]
        )
        compensate(conn, bookings)
        [release] = as_json(listener.sent_before_sentinel(RELEASE_CHANNEL))
        assert (release["alloc"], release["cores"]) == (other, -booking.cores // 100)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM proc")
        assert cursor.fetchone()[0] == 0


# --- the second review -------------------------------------------------------------------------


def test_a_proc_of_another_show_than_its_job_is_refused_and_so_is_a_job_moved_to_another_shows_folder() -> None:
    # A proc is accounted by its own show, its job's counters belong to the job's show: mixed, the
    # rebuild of either show read the job's counter LOW (a reconcile then admitted 16 cores on a
    # max of 10).
    farm = ff.tiny_farm(managed=False, int_burst=1000)
    other = ff.tiny_farm(managed=False, int_burst=1000)
    with psycopg.connect(database_conninfo()) as conn:
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="other than its job"):
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
                " int_mem_reserved) VALUES (gen_random_uuid()::text, %s, %s, %s, %s, %s, 800, 1)",
                (farm.host.pk, other.show.pk, farm.job.pk, farm.layer.pk, farm.frames[0].pk),
            )
    proc = ff.create_proc(farm.host, farm.frames[1], cores=300)
    with pytest.raises(Exception, match="other than its job"), transaction.atomic():
        Proc.objects.filter(pk=proc.pk).update(show=other.show)
    with pytest.raises(Exception, match="belongs to another show"), transaction.atomic():
        Job.objects.filter(pk=farm.job.pk).update(folder=other.folder)
    with pytest.raises(Exception, match="cannot move to another show"), transaction.atomic():
        Job.objects.filter(pk=farm.job.pk).update(show=other.show, folder=other.folder)
    assert _sub_cores(farm) == 300


def test_a_cap_row_moved_to_another_key_starts_there_at_that_keys_sum() -> None:
    # The subscription row of an idle allocation moved onto an allocation with running procs
    # carried its own 0 there: a second burst's worth of bookings went through.
    farm = ff.tiny_farm(managed=False, int_burst=1000)
    ff.create_proc(farm.host, farm.frames[0], cores=800)
    idle_alloc = ff.create_alloc(farm.facility)
    idle = ff.create_subscription(farm.show, idle_alloc, int_burst=1000)
    with transaction.atomic():
        Subscription.objects.filter(pk=farm.subscription.pk).delete()
        Subscription.objects.filter(pk=idle.pk).update(alloc=farm.alloc)
    assert Subscription.objects.get(pk=idle.pk).int_cores == 800
    with pytest.raises(Exception, match="exceeded burst"), transaction.atomic():
        ff.create_proc(farm.host, farm.frames[1], cores=300)


def test_a_cap_row_inserted_while_a_flip_to_unmanaged_commits_is_seeded_after_it() -> None:
    # The row's seed read the show as managed (no seed) while a flip to unmanaged committed, whose
    # rebuild could not see the uncommitted row: it read 0 under running procs until the reconcile.
    farm = ff.tiny_farm(managed=True, int_burst=1000)
    alloc = ff.create_alloc(farm.facility)
    host = ff.create_host(alloc)
    ff.create_proc(host, farm.frames[0], cores=600)  # a managed show books without a subscription check
    with psycopg.connect(database_conninfo()) as writer, psycopg.connect(database_conninfo()) as flipper:
        writer.execute(
            "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst, int_cores)"
            " VALUES (gen_random_uuid()::text, %s, %s, 0, 1000, 0)",
            (alloc.pk, farm.show.pk),
        )
        flip = threading.Thread(
            target=lambda: (
                flipper.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (farm.show.pk,)),
                flipper.commit(),
            )
        )
        flip.start()
        wait_until_blocked(writer, flipper.info.backend_pid, "the flip")
        writer.commit()
        flip.join(15)
        assert not flip.is_alive()
    assert Subscription.objects.get(show=farm.show, alloc=alloc).int_cores == 600


def test_a_flip_from_the_console_does_not_block_a_booking_in_flight_for_the_show() -> None:
    # The action locked the show row, then its trigger waited for the in-flight booking, whose
    # COMMIT needed a key-share lock on that row: the booking stalled 10 s and the flip failed.
    farm = ff.tiny_farm(managed=False, int_burst=100_000)
    outcome: list[object] = []
    with psycopg.connect(database_conninfo()) as booker:
        booker.execute("SET application_name = 'in-flight-booking'")
        booker.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
            " int_mem_reserved) VALUES (gen_random_uuid()::text, %s, %s, %s, %s, %s, 100, 1)",
            (farm.host.pk, farm.show.pk, farm.job.pk, farm.layer.pk, farm.frames[0].pk),
        )

        def flip() -> None:
            try:
                outcome.append(accounting_actions.flip_show(farm.show.pk, True, actor=None).changes)
            except Exception as exc:  # reported below
                outcome.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=flip)
        thread.start()
        wait_for_waiting_backend("flip_show")
        started = time.monotonic()
        booker.commit()
        committed_in = time.monotonic() - started
        thread.join(15)
    assert committed_in < 2, f"the booking's COMMIT waited {committed_in:.1f}s behind the flip"
    assert outcome and not isinstance(outcome[0], Exception), outcome


def test_an_agent_registering_again_takes_no_farm_wide_lock() -> None:
    # Its upsert named pk_alloc even when the allocation was unchanged, which took the exclusive
    # accounting-keys lock: with any proc write open, registration failed after 10 s.
    farm = ff.tiny_farm(managed=False, int_burst=100_000)
    spec = HostSpec(name=farm.host.str_name, cores=8, memory_kb=32 * 1024 * 1024)
    with psycopg.connect(database_conninfo()) as open_writer:
        open_writer.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,"
            " int_mem_reserved) VALUES (gen_random_uuid()::text, %s, %s, %s, %s, %s, 100, 1)",
            (farm.host.pk, farm.show.pk, farm.job.pk, farm.layer.pk, farm.frames[0].pk),
        )
        started = time.monotonic()
        with psycopg.connect(database_conninfo(), autocommit=True) as conn:
            assert register_host(spec, conn) == farm.host.pk
        assert time.monotonic() - started < 2
        open_writer.rollback()
