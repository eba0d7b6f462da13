"""The recompute against real PostgreSQL: one read of proc feeds the Store and the display columns."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from accounting import db
from accounting.limits import reseed_limits
from accounting.recompute import Recomputer
from accounting.store import Store
from accounting.triggers import COUNTER_REBUILD_SQL
from dispatch.models import JobResource, LayerResource, Point, Show, Subscription
from tests.integration import farm_fixtures as ff
from tests.integration.test_db_accounting import expect, totals

pytestmark = pytest.mark.django_db(transaction=True)


def recompute() -> tuple[Store, Recomputer]:
    store = Store()
    recomputer = Recomputer(store)
    with db.connect() as conn:
        reseed_limits(store, conn)
        result = recomputer.run_once(conn)
    assert result.pg_error is None
    return store, recomputer


def test_one_pass_sets_the_store_and_the_five_tables_of_managed_shows_to_sum_proc() -> None:
    farm = ff.tiny_farm(managed=True)
    second_layer = ff.create_layer(farm.job)
    ff.create_proc(farm.host, farm.frames[0], cores=300, gpus=1)
    ff.create_proc(farm.host, ff.create_frames(second_layer, 1)[0], cores=250)
    ff.create_proc(farm.host, farm.frames[1], cores=700, local=True)  # local: never counted
    drained_layer = ff.create_layer(farm.job)
    # Display values a missed release (or a crash) could have left behind.
    Subscription.objects.filter(pk=farm.subscription.pk).update(int_cores=9900, int_gpus=7)
    JobResource.objects.filter(job=farm.job).update(int_cores=1, int_gpus=1)
    LayerResource.objects.filter(layer=drained_layer).update(int_cores=800)
    Point.objects.create(show=farm.show, dept=farm.dept, int_cores=4000)

    store, _ = recompute()

    # 550 centicores are 6 cores in the Store: summed per key first, converted once, rounded up
    # (truncating to 5 read the counter half a core LOW).
    assert store.job_cores_in_use(farm.job.pk) == 6
    assert store.sub_counters(farm.show.pk, farm.alloc.pk)[0] == 6
    assert totals(farm) == {**expect(550, 1, 3), "layer": (300, 1)}
    assert LayerResource.objects.get(layer=second_layer).int_cores == 250
    assert LayerResource.objects.get(layer=drained_layer).int_cores == 0  # no procs left: zero


def test_an_unmanaged_show_is_never_written() -> None:
    farm = ff.tiny_farm(managed=False)
    ff.create_proc(farm.host, farm.frames[0], cores=400)
    # A value only the database path may change (a client needs the rebuild marker even to write
    # it here); the recompute must leave it as it is.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(COUNTER_REBUILD_SQL)
        JobResource.objects.filter(job=farm.job).update(int_cores=12345)

    recompute()

    assert farm.job_resource().int_cores == 12345
    assert totals(farm)["subscription"] == (400, 0)


def test_a_show_flipped_to_unmanaged_after_the_read_keeps_the_database_paths_values() -> None:
    farm = ff.tiny_farm(managed=True)
    ff.create_proc(farm.host, farm.frames[0], cores=300)
    store = Store()
    recomputer = Recomputer(store)
    with db.connect() as conn:
        reseed_limits(store, conn)
        result, usage = recomputer.store_pass(conn)
        assert usage.job[farm.job.pk] == (300, 0)
        # Between the read and the write the show goes back to the database path, which
        # rewrites its five tables from SUM(proc) and then counts a new booking itself.
        Show.objects.filter(pk=farm.show.pk).update(b_scheduler_managed=False)
        ff.create_proc(farm.host, farm.frames[1], cores=200)
        recomputer.pg_pass(conn, usage, result)

    assert result.pg_error is None
    assert sum(result.pg_rows_updated.values()) == 0
    assert totals(farm) == expect(500, 0, 2)  # the stale 300 was not written back
