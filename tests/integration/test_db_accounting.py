"""Database-enforced accounting for shows the Store does not manage, and the managed -> unmanaged flip."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction

from accounting import triggers
from accounting.notify import mark_store_accounted
from dispatch.models import FolderResource, JobResource, LayerResource, Point, Proc, Show, Subscription
from tests.integration import farm_fixtures as ff
from tests.integration.notify_listener import database_conninfo

Totals = dict[str, tuple[int, int]]


def totals(farm: ff.Farm) -> Totals:
    """(int_cores, int_gpus) of the five accounting rows of the farm, plus the proc count."""
    sub = Subscription.objects.get(pk=farm.subscription.pk)
    point = farm.point()
    layer = LayerResource.objects.get(layer=farm.layer)
    return {
        "subscription": (sub.int_cores, sub.int_gpus),
        "folder": (farm.folder_resource().int_cores, farm.folder_resource().int_gpus),
        "job": (farm.job_resource().int_cores, farm.job_resource().int_gpus),
        "layer": (layer.int_cores, layer.int_gpus),
        "point": (point.int_cores, point.int_gpus) if point else (0, 0),
        "procs": (Proc.objects.filter(show=farm.show).count(), 0),
    }


def expect(cores: int, gpus: int, procs: int) -> Totals:
    five = dict.fromkeys(("subscription", "folder", "job", "layer", "point"), (cores, gpus))
    return {**five, "procs": (procs, 0)}


def rejected(action: Callable[[], object], constraint: str, message: str) -> None:
    """The action fails as one statement, with the cap's constraint name and message."""
    with pytest.raises(IntegrityError, match=message) as info, transaction.atomic():
        action()
    assert info.value.__cause__.diag.constraint_name == constraint


@pytest.mark.django_db
class TestUnmanagedShowBookkeeping:
    def test_insert_update_and_delete_move_all_five_tables(self) -> None:
        farm = ff.tiny_farm(managed=False)
        assert farm.point() is None
        proc = ff.create_proc(farm.host, farm.frames[0], cores=250, gpus=1)
        assert totals(farm) == expect(250, 1, 1)  # the point row was created
        Proc.objects.filter(pk=proc.pk).update(int_cores_reserved=400, int_gpus_reserved=2)
        assert totals(farm) == expect(400, 2, 1)
        Proc.objects.filter(pk=proc.pk).update(int_mem_used=123)  # not a reservation: no change
        assert totals(farm) == expect(400, 2, 1)
        proc.delete()
        assert totals(farm) == expect(0, 0, 0)

    def test_bulk_statements_are_aggregated(self) -> None:
        farm = ff.tiny_farm(managed=False)
        for frame in farm.frames[:4]:
            ff.create_proc(farm.host, frame, cores=100, gpus=1)
        assert totals(farm) == expect(400, 4, 4)
        Proc.objects.filter(show=farm.show).update(int_cores_reserved=200)
        assert totals(farm) == expect(800, 4, 4)
        Proc.objects.filter(show=farm.show).delete()
        assert totals(farm) == expect(0, 0, 0)

    def test_local_procs_are_not_counted(self) -> None:
        farm = ff.tiny_farm(managed=False, int_burst=0)
        proc = ff.create_proc(farm.host, farm.frames[0], cores=800, local=True)  # burst 0 not consulted
        assert totals(farm) == expect(0, 0, 1)
        proc.delete()
        assert totals(farm) == expect(0, 0, 0)

    def test_moving_a_proc_to_another_job_moves_its_cores(self) -> None:
        farm = ff.tiny_farm(managed=False)
        other_job = ff.create_job(farm.show, farm.folder, farm.dept, farm.facility)
        other_layer = ff.create_layer(other_job)
        proc = ff.create_proc(farm.host, farm.frames[0], cores=300)
        Proc.objects.filter(pk=proc.pk).update(job=other_job, layer=other_layer)
        assert farm.job_resource().int_cores == 0
        assert JobResource.objects.get(job=other_job).int_cores == 300
        assert totals(farm)["subscription"] == (300, 0)  # same show and alloc: unchanged

    def test_the_release_suppression_marker_does_not_skip_the_bookkeeping(self) -> None:
        farm = ff.tiny_farm(managed=False)
        proc = ff.create_proc(farm.host, farm.frames[0], cores=300)
        with transaction.atomic():
            mark_store_accounted(connection)
            proc.delete()
        assert totals(farm) == expect(0, 0, 0)

    def test_managed_show_leaves_the_tables_alone(self) -> None:
        farm = ff.tiny_farm(managed=True, int_burst=0)  # the Store enforces, not the database
        proc = ff.create_proc(farm.host, farm.frames[0], cores=500, gpus=1)
        assert totals(farm) == expect(0, 0, 1)
        proc.delete()
        assert totals(farm) == expect(0, 0, 0)


@pytest.mark.django_db
class TestUnmanagedShowCaps:
    def test_over_burst_fails_and_changes_nothing(self) -> None:
        farm = ff.tiny_farm(managed=False, int_burst=1000)
        ff.create_proc(farm.host, farm.frames[0], cores=800)
        before = totals(farm)
        rejected(
            lambda: ff.create_proc(farm.host, farm.frames[1], cores=300),
            triggers.CAP_SUBSCRIPTION_BURST,
            f"subscription has exceeded burst size: show={farm.show.pk} alloc={farm.alloc.pk} "
            r"cores=1100 burst=1000 \(centicores\)",
        )
        assert totals(farm) == before
        ff.create_proc(farm.host, farm.frames[1], cores=200)  # reaching the burst exactly is allowed
        assert totals(farm) == expect(1000, 0, 2)

    def test_burst_zero_rejects_any_booking(self) -> None:
        farm = ff.tiny_farm(managed=False, int_burst=0)
        rejected(
            lambda: ff.create_proc(farm.host, farm.frames[0], cores=100),
            triggers.CAP_SUBSCRIPTION_BURST,
            "subscription has exceeded burst size",
        )
        assert totals(farm) == expect(0, 0, 0)

    def test_missing_subscription_rejects(self) -> None:
        farm = ff.tiny_farm(managed=False)
        elsewhere = ff.create_host(ff.create_alloc(farm.facility))  # no subscription for this alloc
        rejected(
            lambda: ff.create_proc(elsewhere, farm.frames[0], cores=100),
            triggers.CAP_SUBSCRIPTION_MISSING,
            f"no subscription for show={farm.show.pk} alloc={elsewhere.alloc_id}",
        )
        assert totals(farm) == expect(0, 0, 0)

    @pytest.mark.parametrize(
        ("table", "column", "constraint", "message"),
        [
            ("folder", "int_max_cores", triggers.CAP_FOLDER_MAX_CORES, "folder has exceeded max cores"),
            ("job", "int_max_cores", triggers.CAP_JOB_MAX_CORES, "job has exceeded max cores"),
            ("folder", "int_max_gpus", triggers.CAP_FOLDER_MAX_GPUS, "folder has exceeded max GPUs"),
            ("job", "int_max_gpus", triggers.CAP_JOB_MAX_GPUS, "job has exceeded max GPUs"),
        ],
    )
    def test_over_max_fails_and_changes_nothing(self, table: str, column: str, constraint: str, message: str) -> None:
        farm = ff.tiny_farm(managed=False)
        model = FolderResource if table == "folder" else JobResource
        owner = {"folder": farm.folder} if table == "folder" else {"job": farm.job}
        cap = 300 if column == "int_max_cores" else 2
        model.objects.filter(**owner).update(**{column: cap})
        ff.create_proc(farm.host, farm.frames[0], cores=200, gpus=1)
        before = totals(farm)
        rejected(lambda: ff.create_proc(farm.host, farm.frames[1], cores=200, gpus=2), constraint, message)
        assert totals(farm) == before
        # The bulk form: two procs in one INSERT that together cross the cap.
        rejected(
            lambda: Proc.objects.bulk_create(
                [
                    Proc(
                        host=farm.host,
                        show=farm.show,
                        job=farm.job,
                        layer=farm.layer,
                        frame=frame,
                        int_cores_reserved=100,
                        int_mem_reserved=1,
                        int_gpus_reserved=1,
                    )
                    for frame in farm.frames[1:3]
                ]
            ),
            constraint,
            message,
        )
        assert totals(farm) == before

    def test_raising_a_reservation_is_checked(self) -> None:
        farm = ff.tiny_farm(managed=False)
        JobResource.objects.filter(job=farm.job).update(int_max_cores=500)
        proc = ff.create_proc(farm.host, farm.frames[0], cores=400)
        rejected(
            lambda: Proc.objects.filter(pk=proc.pk).update(int_cores_reserved=600),
            triggers.CAP_JOB_MAX_CORES,
            "job has exceeded max cores",
        )
        assert totals(farm) == expect(400, 0, 1)

    def test_negative_max_is_unlimited(self) -> None:
        farm = ff.tiny_farm(managed=False)
        JobResource.objects.filter(job=farm.job).update(int_max_cores=-1, int_max_gpus=-1)
        FolderResource.objects.filter(folder=farm.folder).update(int_max_cores=-100, int_max_gpus=-1)
        ff.create_proc(farm.host, farm.frames[0], cores=5000, gpus=8)
        assert totals(farm) == expect(5000, 8, 1)

    def test_zero_max_books_nothing(self) -> None:
        """Issue 20 problem 2: 0 used to be unlimited here and 'nothing' for a burst; now 0 books nothing."""
        farm = ff.tiny_farm(managed=False)
        FolderResource.objects.filter(folder=farm.folder).update(int_max_cores=0)
        rejected(
            lambda: ff.create_proc(farm.host, farm.frames[0], cores=100),
            triggers.CAP_FOLDER_MAX_CORES,
            "folder has exceeded max cores",
        )
        FolderResource.objects.filter(folder=farm.folder).update(int_max_cores=-1)
        JobResource.objects.filter(job=farm.job).update(int_max_gpus=0)
        rejected(
            lambda: ff.create_proc(farm.host, farm.frames[0], cores=100, gpus=1),
            triggers.CAP_JOB_MAX_GPUS,
            "job has exceeded max GPUs",
        )
        assert totals(farm) == expect(0, 0, 0)

    def test_a_release_always_succeeds_even_over_a_lowered_cap(self) -> None:
        farm = ff.tiny_farm(managed=False, int_burst=2000)
        procs = [ff.create_proc(farm.host, f, cores=500, gpus=1) for f in farm.frames[:3]]
        Subscription.objects.filter(pk=farm.subscription.pk).update(int_burst=100)
        JobResource.objects.filter(job=farm.job).update(int_max_cores=100, int_max_gpus=1)
        procs[0].delete()
        Proc.objects.filter(pk=procs[1].pk).update(int_cores_reserved=400)  # shrinking is a release
        assert totals(farm) == expect(900, 2, 2)


@pytest.mark.django_db
class TestManagedToUnmanagedFlip:
    def test_flip_rewrites_the_five_tables_from_the_procs(self) -> None:
        farm = ff.tiny_farm(managed=True)
        second_layer = ff.create_layer(farm.job)
        ff.create_proc(farm.host, farm.frames[0], cores=300, gpus=1)
        ff.create_proc(farm.host, ff.create_frames(second_layer, 1)[0], cores=200)
        ff.create_proc(farm.host, farm.frames[1], cores=700, local=True)
        # What a scheduler's approximate recompute might have left behind:
        Subscription.objects.filter(pk=farm.subscription.pk).update(int_cores=9900, int_gpus=7)
        FolderResource.objects.filter(folder=farm.folder).update(int_cores=-5)
        JobResource.objects.filter(job=farm.job).update(int_cores=1, int_gpus=1)
        stale_dept = ff.create_dept()
        Point.objects.create(show=farm.show, dept=stale_dept, int_cores=4000)

        Show.objects.filter(pk=farm.show.pk).update(b_scheduler_managed=False)

        assert totals(farm) == {**expect(500, 1, 3), "layer": (300, 1)}
        assert LayerResource.objects.get(layer=second_layer).int_cores == 200
        assert Point.objects.get(show=farm.show, dept=stale_dept).int_cores == 0
        # From the truth on, the database path adds and checks as usual.
        ff.create_proc(farm.host, farm.frames[2], cores=100)
        assert totals(farm)["subscription"] == (600, 1)

    def test_other_show_updates_rewrite_nothing(self) -> None:
        farm = ff.tiny_farm(managed=True)
        ff.create_proc(farm.host, farm.frames[0], cores=300)
        Show.objects.filter(pk=farm.show.pk).update(b_paused=True)
        Show.objects.filter(pk=farm.show.pk).update(b_scheduler_managed=True)
        assert totals(farm) == expect(0, 0, 1)


# --- concurrency: real second connections ----------------------------------------------------


def wait_until_blocked(conn: psycopg.Connection, pid: int, what: str) -> None:
    """Poll pg_stat_activity until backend `pid` waits on a lock (a deadline, not a sleep).

    A flip or key move polls the exclusive accounting-keys lock (it never queues for it, so it
    cannot hold later proc writes behind it): blocked, it sleeps between tries (PgSleep).
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        if row and (row[0] == "Lock" or row[1] == "PgSleep"):
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} never waited on a lock")


def in_thread(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


INSERT_PROC = """
    INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved,
                      int_mem_reserved, int_gpus_reserved)
    VALUES (gen_random_uuid()::text, %s, %s, %s, %s, %s, %s, 1, 0)
"""


@pytest.mark.django_db(transaction=True)
def test_concurrent_bookers_of_one_job_cap_queue_and_the_second_is_rejected() -> None:
    farm = ff.tiny_farm(managed=False)
    JobResource.objects.filter(job=farm.job).update(int_max_cores=1000)
    args = (farm.host.pk, farm.show.pk, farm.job.pk, farm.layer.pk)
    with (
        psycopg.connect(database_conninfo()) as first,
        psycopg.connect(database_conninfo()) as second,
        psycopg.connect(database_conninfo(), autocommit=True) as observer,
    ):
        first.execute(INSERT_PROC, (*args, farm.frames[0].pk, 600))  # not committed yet

        def book_second() -> None:
            try:
                second.execute(INSERT_PROC, (*args, farm.frames[1].pk, 600))
                second.commit()
            finally:
                second.rollback()

        thread, errors = in_thread(book_second)
        wait_until_blocked(observer, second.info.backend_pid, "the second booker")
        first.commit()
        thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], psycopg.errors.CheckViolation)
    assert errors[0].diag.constraint_name == triggers.CAP_JOB_MAX_CORES
    assert "cores=1200 max_cores=1000" in str(errors[0])
    assert farm.job_resource().int_cores == 600


@pytest.mark.django_db(transaction=True)
def test_flip_waits_for_an_in_flight_release_and_counts_the_proc_once() -> None:
    farm = ff.tiny_farm(managed=True)
    kept = ff.create_proc(farm.host, farm.frames[0], cores=300)
    gone = ff.create_proc(farm.host, farm.frames[1], cores=200)
    with (
        psycopg.connect(database_conninfo()) as deleter,
        psycopg.connect(database_conninfo()) as flipper,
        psycopg.connect(database_conninfo(), autocommit=True) as observer,
    ):
        deleter.execute("DELETE FROM proc WHERE pk_proc = %s", (gone.pk,))  # managed: a release, no decrement

        def flip() -> None:
            flipper.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (farm.show.pk,))
            flipper.commit()

        thread, errors = in_thread(flip)
        wait_until_blocked(observer, flipper.info.backend_pid, "the flip")
        deleter.commit()
        thread.join(10)
    assert errors == []
    # Had the flip not waited, its SUM(proc) would still have seen the deleted proc: 500.
    assert totals(farm) == expect(300, 0, 1)
    assert kept.pk in set(Proc.objects.values_list("pk", flat=True))


@pytest.mark.django_db(transaction=True)
def test_flip_to_managed_waits_for_an_in_flight_database_enforced_booking() -> None:
    """The scheduler's managed-flip seed reads SUM(proc) once the flip has committed: every
    database-enforced booking of the show must be committed by then, or the seed misses it and
    the Store reads low (the unsafe direction)."""
    farm = ff.tiny_farm(managed=False)
    args = (farm.host.pk, farm.show.pk, farm.job.pk, farm.layer.pk)
    with (
        psycopg.connect(database_conninfo()) as booker,
        psycopg.connect(database_conninfo()) as flipper,
        psycopg.connect(database_conninfo(), autocommit=True) as observer,
    ):
        booker.execute(INSERT_PROC, (*args, farm.frames[0].pk, 400))  # not committed yet

        def flip() -> None:
            flipper.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (farm.show.pk,))
            flipper.commit()

        thread, errors = in_thread(flip)
        wait_until_blocked(observer, flipper.info.backend_pid, "the flip to managed")
        booker.commit()
        thread.join(10)
        assert errors == []
        # What a seed reading right after the flip sees: the booking, counted by the database path.
        seen = observer.execute(
            "SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_show = %s", (farm.show.pk,)
        ).fetchone()
    assert seen == (400,)
    assert totals(farm) == expect(400, 0, 1)


@pytest.mark.django_db(transaction=True)
def test_writers_of_one_unmanaged_show_queue_on_its_lock_before_touching_a_counter_row() -> None:
    """Bookings and releases of a show update the same subscription, folder and point rows in
    the order their statements' plans reach them; two writers could each hold one and wait for
    the other (seen under two dispatch workers: four deadlocks, a second each). The show's
    exclusive accounting lock, taken before any counter row, makes the second writer wait at the
    door instead, holding no counter row."""
    farm = ff.tiny_farm(managed=False)
    other_job = ff.create_job(farm.show, farm.folder, farm.dept, farm.facility)
    other_layer = ff.create_layer(other_job)
    other_frame = ff.create_frames(other_layer, 1)[0]
    gone = ff.create_proc(farm.host, farm.frames[0], cores=300)
    with (
        psycopg.connect(database_conninfo()) as releaser,
        psycopg.connect(database_conninfo()) as booker,
        psycopg.connect(database_conninfo(), autocommit=True) as observer,
    ):
        releaser.execute("DELETE FROM proc WHERE pk_proc = %s", (gone.pk,))  # not committed yet

        def book() -> None:
            booker.execute(INSERT_PROC, (farm.host.pk, farm.show.pk, other_job.pk, other_layer.pk, other_frame.pk, 200))
            booker.commit()

        thread, errors = in_thread(book)
        wait_until_blocked(observer, booker.info.backend_pid, "the booker")
        waiting_on = observer.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (booker.info.backend_pid,)
        ).fetchone()
        releaser.commit()
        thread.join(10)
    assert errors == []
    assert waiting_on == ("advisory",)  # the show's lock, not a counter row
    assert totals(farm)["subscription"] == (200, 0)
    assert farm.job_resource().int_cores == 0
    assert JobResource.objects.get(job=other_job).int_cores == 200
