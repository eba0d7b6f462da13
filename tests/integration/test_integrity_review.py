"""Holes an adversarial review found in the first cut of the every-writer rule, each as a test.

Each one failed on the code before the integrity work (a counter read low, a booking went over
a cap, or a change reached nobody) and passes now.
"""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection, transaction

from accounting.models import AccountingSettings
from accounting.notify import RELEASE_CHANNEL
from dispatch.engine.booking import compensate, write_batch
from dispatch.models import Proc, Subscription
from tests.integration import farm_fixtures as ff
from tests.integration.dispatch_support import plan, seed
from tests.integration.notify_listener import as_json, database_conninfo, listening

pytestmark = pytest.mark.django_db(transaction=True)


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
