"""Every trigger a model declares is in the database after `migrate`, current and enabled."""

from __future__ import annotations

import pgtrigger
import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction

from accounting.models import AccountingEpoch, AccountingSettings
from dispatch.models import FolderResource, Host, Job, JobResource, Proc, Show, Subscription

pytestmark = pytest.mark.django_db

INSTALLED_SQL = """
    SELECT t.tgname, obj_description(t.oid, 'pg_trigger'), t.tgenabled
    FROM pg_trigger t
    WHERE NOT t.tgisinternal AND t.tgrelid = %s::regclass
"""


def installed(table: str) -> dict[str, tuple[str, str]]:
    with connection.cursor() as cursor:
        cursor.execute(INSTALLED_SQL, [table])
        return {name: (comment, enabled) for name, comment, enabled in cursor.fetchall()}


def test_every_declared_trigger_is_installed_current_and_enabled() -> None:
    declared = pgtrigger.registered()
    assert declared, "no triggers registered: are the models' Meta.triggers wired?"
    problems = []
    for model, trigger in declared:
        table = model._meta.db_table
        pgid = trigger.get_pgid(model)
        found = installed(table).get(pgid)
        if found is None:
            problems.append(f"{table}: {trigger.name} ({pgid}) is not installed")
        elif found[0] != trigger.compile(model).hash:
            problems.append(f"{table}: {trigger.name} is installed but outdated (missing migration?)")
        elif found[1] != "O":
            problems.append(f"{table}: {trigger.name} is installed but disabled ({found[1]})")
    assert problems == []


def test_the_accounting_triggers_are_declared_on_their_tables() -> None:
    names = {(model, trigger.name) for model, trigger in pgtrigger.registered()}
    expected = {
        (Proc, "acct_proc_insert"),
        (Proc, "acct_proc_delete"),
        (Proc, "acct_proc_update"),
        (Proc, "acct_proc_truncate"),
        (Host, "acct_host_move_wait_bound"),
        (Host, "acct_host_keys_lock"),
        (Host, "acct_host_move"),
        (Host, "acct_host_move_wait_restore"),
        (Job, "acct_job_move_wait_bound"),
        (Job, "acct_job_keys_lock"),
        (Job, "acct_job_move"),
        (Job, "acct_job_move_wait_restore"),
        (Show, "acct_show_flip_lock"),
        (Show, "acct_show_flip"),
        (AccountingSettings, "acct_settings_keep_row"),
        (AccountingEpoch, "acct_epoch_keep_row"),
    }
    for vertex, model in (("sub", Subscription), ("folder", FolderResource), ("job", JobResource)):
        expected |= {(model, f"acct_limit_{vertex}_{op}") for op in ("insert", "update", "delete", "truncate")}
    assert expected <= names


def test_the_kill_switch_row_exists_after_migrate_and_is_on() -> None:
    assert AccountingSettings.objects.get(id=1).notify_enabled is True
    assert AccountingSettings.notifications_enabled() is True


def test_the_kill_switch_row_cannot_be_deleted_or_doubled() -> None:
    AccountingSettings.objects.get_or_create(id=1)
    with pytest.raises(DatabaseError, match="Cannot delete"), transaction.atomic():
        AccountingSettings.objects.all().delete()
    with pytest.raises(IntegrityError, match="single_row"), transaction.atomic():
        AccountingSettings.objects.create(id=2)
    assert AccountingSettings.objects.count() == 1


def test_the_kill_switch_admin_says_what_off_means_and_only_links_to_its_confirmation(admin_client) -> None:
    """Issue 20 problem 5: the plain change form used to turn the switch off with no confirmation
    (an unchecked box posts nothing: off). The switch is read-only there now; the page links to
    the console's confirmation page, the one way to change it."""
    AccountingSettings.objects.get_or_create(id=1)
    url = "/admin/accounting/accountingsettings/1/change/"
    page = admin_client.get(url)
    assert page.status_code == 200
    body = page.content.decode()
    assert "Off stops every release notification" in body
    assert 'name="notify_enabled"' not in body
    assert "/admin/ops/console/notifications/?enabled=false" in body
    admin_client.post(url, {})  # what an unticked box posted before
    assert AccountingSettings.notifications_enabled() is True
    assert admin_client.get("/admin/accounting/accountingsettings/1/delete/").status_code == 403
