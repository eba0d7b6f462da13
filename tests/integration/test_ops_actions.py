"""accounting.actions and the audit trail on real PostgreSQL: validation, changed columns only,
warnings with their numbers, who and what the triggers record (from the console or any writer),
and the groups the data migration makes."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.db import connection

from accounting import actions
from accounting.models import AccountingSettings
from accounting.triggers import COUNTER_REBUILD_SQL
from dispatch.models import FolderResource, JobResource, Show, Subscription
from ops import admin_views, permissions
from ops.models import FolderCapEvent, JobCapEvent, KillSwitchEvent, ShowManagedEvent, SubscriptionCapEvent
from tests.integration.farm_fixtures import create_proc, tiny_farm
from tests.integration.ops_support import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> object:
    return make_user("olga", permissions.OPERATORS)


def test_set_subscription_writes_whole_cores_as_centicores_and_records_who(operator: object) -> None:
    farm = tiny_farm(managed=False, int_burst=10_000)
    result = actions.set_subscription(farm.subscription.pk, burst_cores=150, actor=operator)
    sub = Subscription.objects.get(pk=farm.subscription.pk)
    assert (sub.int_burst, sub.int_size) == (15_000, 0)
    assert [(c.column, c.old, c.new) for c in result.changes] == [("int_burst", 10_000, 15_000)]
    (event,) = SubscriptionCapEvent.objects.filter(pk_subscription=sub.pk)
    assert (event.old_int_burst, event.int_burst, event.old_int_size, event.int_size) == (10_000, 15_000, 0, 0)
    assert event.pgh_context.metadata["username"] == "olga"
    assert event.pgh_context.metadata["action"] == "set_subscription"
    assert event.db_role == connection.settings_dict["USER"]


def test_an_unchanged_value_writes_nothing_and_records_nothing(operator: object) -> None:
    farm = tiny_farm(managed=False, int_burst=10_000)
    result = actions.set_subscription(farm.subscription.pk, burst_cores=100, actor=operator)
    assert not result.changed
    assert not SubscriptionCapEvent.objects.exists()


def test_actions_write_only_the_cap_columns_never_live_counters(operator: object) -> None:
    """A booked counter moved by a booking after the operator loaded the page is never written back."""
    farm = tiny_farm(managed=False)
    with connection.cursor() as cur:
        # Stand in for bookings: only the triggers (or a rebuild) may write an unmanaged show's usage.
        cur.execute(COUNTER_REBUILD_SQL)
        cur.execute("UPDATE job_resource SET int_cores = 4200 WHERE pk_job = %s", [farm.job.pk])
        cur.execute("UPDATE folder_resource SET int_cores = 4300 WHERE pk_folder = %s", [farm.folder.pk])
    actions.set_job_caps(farm.job.pk, max_cores=20, max_gpus=-1, actor=operator)
    actions.set_folder_caps(farm.folder.pk, max_cores=-1, max_gpus=4, actor=operator)
    job = JobResource.objects.get(job=farm.job)
    folder = FolderResource.objects.get(folder=farm.folder)
    assert (job.int_max_cores, job.int_max_gpus, job.int_cores) == (2000, -1, 4200)
    assert (folder.int_max_cores, folder.int_max_gpus, folder.int_cores) == (-1, 4, 4300)
    (job_event,) = JobCapEvent.objects.all()
    assert (job_event.old_int_max_cores, job_event.int_max_cores) == (10_000, 2000)
    assert (job_event.old_int_max_gpus, job_event.int_max_gpus) == (100, -1)
    (folder_event,) = FolderCapEvent.objects.all()
    assert (folder_event.old_int_max_gpus, folder_event.int_max_gpus) == (-1, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f, a: actions.set_subscription(f.subscription.pk, burst_cores=-1, actor=a), "cannot be negative"),
        (lambda f, a: actions.set_subscription(f.subscription.pk, size_cores=-5, actor=a), "cannot be negative"),
        (lambda f, a: actions.set_subscription(f.subscription.pk, burst_cores=1.5, actor=a), "whole number"),
        (lambda f, a: actions.set_job_caps(f.job.pk, max_cores=-2, actor=a), "use -1 for unlimited"),
        (lambda f, a: actions.set_job_caps(f.job.pk, max_cores=2.25, actor=a), "whole number"),
        (lambda f, a: actions.set_folder_caps(f.folder.pk, max_gpus=-3, actor=a), "use -1 for unlimited"),
        (lambda f, a: actions.set_folder_caps(f.folder.pk, max_cores=True, actor=a), "whole number"),
        (lambda f, a: actions.flip_show(f.show.pk, "yes", actor=a), "true or false"),
    ],
    ids=["neg-burst", "neg-size", "fraction-burst", "neg-max", "fraction-max", "neg-gpus", "bool", "flip-str"],
)
def test_validation_refuses_and_changes_nothing(operator: object, call: object, message: str) -> None:
    farm = tiny_farm(managed=False)
    before = (
        list(Subscription.objects.values_list("int_burst", "int_size")),
        list(JobResource.objects.values_list("int_max_cores", "int_max_gpus")),
        list(FolderResource.objects.values_list("int_max_cores", "int_max_gpus")),
        list(Show.objects.values_list("b_scheduler_managed")),
    )
    with pytest.raises(ValidationError, match=message):
        call(farm, operator)  # type: ignore[operator]
    after = (
        list(Subscription.objects.values_list("int_burst", "int_size")),
        list(JobResource.objects.values_list("int_max_cores", "int_max_gpus")),
        list(FolderResource.objects.values_list("int_max_cores", "int_max_gpus")),
        list(Show.objects.values_list("b_scheduler_managed")),
    )
    assert after == before


def test_whole_values_given_as_floats_are_accepted(operator: object) -> None:
    farm = tiny_farm(managed=False)
    actions.set_job_caps(farm.job.pk, max_cores=12.0, actor=operator)
    assert JobResource.objects.get(job=farm.job).int_max_cores == 1200


def test_burst_below_what_is_booked_is_saved_with_the_consequence(operator: object) -> None:
    farm = tiny_farm(managed=False, int_burst=10_000)
    for frame in farm.frames[:3]:
        create_proc(farm.host, frame, cores=500)  # 3 x 5 cores = 15 booked
    result = actions.set_subscription(farm.subscription.pk, burst_cores=10, actor=operator)
    assert Subscription.objects.get(pk=farm.subscription.pk).int_burst == 1000
    (warning,) = result.warnings
    assert "books 15 cores" in warning and "new burst of 10" in warning and "until 5 cores" in warning
    assert "Nothing running is stopped" in warning
    zero = actions.set_subscription(farm.subscription.pk, burst_cores=0, actor=operator)
    assert "stops every new booking" in zero.warnings[0]


def test_job_max_below_booked_warns_and_zero_stops_booking(operator: object) -> None:
    farm = tiny_farm(managed=False)
    for frame in farm.frames[:2]:
        create_proc(farm.host, frame, cores=1000)
    result = actions.set_job_caps(farm.job.pk, max_cores=15, actor=operator)
    assert any("books 20 cores" in w and "max of 15" in w for w in result.warnings)
    zero = actions.set_job_caps(farm.job.pk, max_cores=0, actor=operator)
    assert any("max cores of 0 stops every new booking of this job" in w for w in zero.warnings)
    assert JobResource.objects.get(job=farm.job).int_max_cores == 0


def test_flip_show_both_ways_is_audited(operator: object) -> None:
    farm = tiny_farm(managed=False)
    assert actions.flip_show(farm.show.pk, True, actor=operator).changed
    assert Show.objects.get(pk=farm.show.pk).b_scheduler_managed
    assert not actions.flip_show(farm.show.pk, True, actor=operator).changed
    assert actions.flip_show(farm.show.pk, False, actor="nightly-script").changed
    events = list(ShowManagedEvent.objects.order_by("pgh_id"))
    assert [(e.old_b_scheduler_managed, e.b_scheduler_managed) for e in events] == [(False, True), (True, False)]
    assert [e.pgh_context.metadata["username"] for e in events] == ["olga", "nightly-script"]


def test_changes_from_outside_the_console_are_recorded_with_the_database_role() -> None:
    farm = tiny_farm(managed=False)
    with connection.cursor() as cur:
        cur.execute("UPDATE job_resource SET int_max_cores = 700 WHERE pk_job = %s", [farm.job.pk])
        cur.execute(COUNTER_REBUILD_SQL)  # a booking's counter update, as the triggers write it
        cur.execute("UPDATE subscription SET int_cores = 300 WHERE pk_subscription = %s", [farm.subscription.pk])
        cur.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", [farm.show.pk])
    (event,) = JobCapEvent.objects.all()
    assert (event.old_int_max_cores, event.int_max_cores, event.pgh_context_id) == (10_000, 700, None)
    assert event.db_role == connection.settings_dict["USER"]
    # A booking's counter update is not a cap change: no subscription event.
    assert not SubscriptionCapEvent.objects.exists()
    assert ShowManagedEvent.objects.get().b_scheduler_managed


def test_kill_switch_action(operator: object) -> None:
    result = actions.set_notifications(False, actor=operator)
    assert not AccountingSettings.notifications_enabled()
    assert result.changed and "OFF" in result.warnings[0]
    assert not actions.set_notifications(False, actor=operator).changed
    actions.set_notifications(True, actor=operator)
    assert AccountingSettings.notifications_enabled()


def test_every_kill_switch_change_is_in_the_audit_trail_with_who_made_it(operator: object) -> None:
    actions.set_notifications(False, actor=operator)
    # And one outside the console, straight in SQL: recorded too, under its database role.
    with connection.cursor() as cur:
        cur.execute("UPDATE cuesched_accounting_settings SET notify_enabled = true")
    first, second = KillSwitchEvent.objects.order_by("pgh_id")
    assert (first.old_notify_enabled, first.notify_enabled) == (True, False)
    assert first.pgh_context.metadata["username"] == operator.get_username()
    assert (second.old_notify_enabled, second.notify_enabled) == (False, True)
    assert second.db_role == first.db_role != ""
    entries = admin_views.audit_events(kind="kill_switch")
    assert [(e["object"], e["old"], e["new"]) for e in entries] == [
        ("accounting notifications", "OFF", "on"),
        ("accounting notifications", "on", "OFF"),
    ]
    assert admin_views.audit_events(kind="kill_switch", q="kill") == entries
    assert admin_views.audit_events(kind="kill_switch", q="some job") == []


def test_a_kill_switch_row_written_by_insert_is_in_the_audit_trail(operator: object) -> None:
    """The row cannot be deleted, but TRUNCATE bypasses row triggers: the INSERT after it is recorded."""
    with connection.cursor() as cur:
        cur.execute("TRUNCATE cuesched_accounting_settings")
        cur.execute(
            "INSERT INTO cuesched_accounting_settings (id, notify_enabled, ts_updated) VALUES (1, false, now())"
        )
    assert not AccountingSettings.notifications_enabled()
    (event,) = KillSwitchEvent.objects.all()
    assert (event.old_notify_enabled, event.notify_enabled) == (None, False)
    assert event.db_role == connection.settings_dict["USER"]
    entries = admin_views.audit_events(kind="kill_switch")
    assert [(e["object"], e["old"], e["new"]) for e in entries] == [("accounting notifications", "—", "OFF")]
    # The console's own path when the row is missing (it creates it) says who, too.
    with connection.cursor() as cur:
        cur.execute("TRUNCATE cuesched_accounting_settings")
    actions.set_notifications(False, actor=operator)
    latest = KillSwitchEvent.objects.order_by("-pgh_id").first()
    assert (latest.old_notify_enabled, latest.notify_enabled) == (None, False)
    assert latest.pgh_context.metadata["username"] == operator.get_username()


def test_audit_triggers_are_installed() -> None:
    with connection.cursor() as cur:
        cur.execute("SELECT tgname FROM pg_trigger WHERE tgname LIKE 'pgtrigger_%%' AND NOT tgisinternal")
        names = {row[0] for row in cur.fetchall()}
    stems = (
        "sub_caps_update",
        "folder_caps_update",
        "job_caps_update",
        "managed_flip_update",
        "kill_switch_update",
        "kill_switch_insert",
    )
    for stem in stems:
        assert any(name.startswith(f"pgtrigger_{stem}_") for name in names), stem


def test_the_migrations_make_the_groups_of_ops_permissions() -> None:
    # 0002 made the groups; later migrations add what later models need. Together they must
    # give exactly ops.permissions.GROUP_PERMISSIONS (a group's permissions have no order).
    migration = importlib.import_module("ops.migrations.0002_groups")
    added = importlib.import_module("ops.migrations.0004_kill_switch_audit_permission")
    console_c = importlib.import_module("ops.migrations.0009_farm_permissions")
    frozen = {
        k: set(v) | set(added.ADDED.get(k, [])) | set(console_c.ADDED.get(k, []))
        for k, v in migration.GROUP_PERMISSIONS.items()
    }
    assert frozen == {k: set(v) for k, v in permissions.GROUP_PERMISSIONS.items()}
    Group.objects.filter(name__in=[permissions.OPERATORS, permissions.VIEWERS]).delete()
    migration.create_groups(django_apps, None)
    added.add_permissions(django_apps, None)
    console_c.add_permissions(django_apps, None)
    for name, perms in permissions.GROUP_PERMISSIONS.items():
        got = set(Group.objects.get(name=name).permissions.values_list("content_type__app_label", "codename"))
        assert got == set(perms)
    viewer = set(permissions.GROUP_PERMISSIONS[permissions.VIEWERS])
    assert all(code.startswith("view_") for _app, code in viewer)
