"""Issue 20 part A in a real browser (headless Chromium against the live server): what a viewer
reads, the one meaning of 0, cap bounds and the confirmation of cap saves, the kill switch's
plain admin form, and the paged audit trail. Each test failed on the code before issue 20A."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from playwright.sync_api import Page, expect

from accounting import actions
from accounting.models import AccountingSettings
from dispatch.models import FolderResource, JobResource, Show, Subscription
from ops import permissions
from tests.integration.runtime_support import autocommit_conn, make_farm, running_scheduler

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "ops-browser-test-a"


def _user(name: str, group: str) -> tuple[str, str]:
    permissions.ensure_groups()
    user = get_user_model().objects.create_user(name, password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    return name, PASSWORD


@pytest.fixture
def operator_login() -> tuple[str, str]:
    return _user("olga", permissions.OPERATORS)


@pytest.fixture
def viewer_login() -> tuple[str, str]:
    return _user("vera", permissions.VIEWERS)


def log_in(page: Page, live_server: Any, login: tuple[str, str]) -> None:
    page.goto(f"{live_server.url}/admin/")
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    page.fill("#id_username", login[0])
    page.fill("#id_password", login[1])
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(login[0])


def test_a_viewer_reads_caps_in_whole_cores_as_an_operator_does(
    page: Page, live_server: Any, viewer_login: tuple[str, str]
) -> None:
    """Problem 1: the read-only path showed raw centicores (150000 for a 1500-core burst)."""
    with autocommit_conn() as conn:
        farm = make_farm(conn, "brview", managed=False, burst_cores=1500, job_max_cores=50, folder_max_cores=-1)
    log_in(page, live_server, viewer_login)

    page.goto(f"{live_server.url}/admin/dispatch/subscription/?q=brview_show")
    row = page.locator("#result_list tbody tr").first
    expect(row).to_contain_text("1500")
    expect(row).not_to_contain_text("150000")
    expect(page.locator("input[name$=int_burst]")).to_have_count(0)  # still read-only

    page.goto(f"{live_server.url}/admin/dispatch/jobresource/?job__pk_job={farm.jobs[0]}")
    row = page.locator("#result_list tbody tr").first
    expect(row).to_contain_text("50")
    expect(row).not_to_contain_text("5000")
    row.locator("th a").first.click()
    content = page.locator("#content")
    # The record is titled by the job's name, not "resources of <uuid>" (the "Smaller" list).
    expect(content.locator("h2").first).to_contain_text("caps of job brview_job0")
    max_cores = page.locator(".field-int_max_cores_shown .readonly")
    expect(max_cores).to_have_text("50")
    expect(page.locator(".field-int_max_gpus_shown .readonly")).to_have_text("100")
    expect(content).not_to_contain_text("5000")


def test_a_folder_max_of_zero_is_confirmed_first_and_then_books_nothing(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """Problem 2: 0 removed the folder's cap, and the console warned only after saving."""
    with autocommit_conn() as conn:
        farm = make_farm(conn, "brzero", managed=False, burst_cores=1000, folder_max_cores=1000)
        farm.add_proc(conn, cores=4)
    row = FolderResource.objects.get(folder_id=farm.folder)
    log_in(page, live_server, operator_login)
    page.goto(f"{live_server.url}/admin/dispatch/folderresource/{row.pk}/change/")
    field = page.locator("input[name=int_max_cores]")
    expect(field).to_have_value("1000")
    expect(page.locator("#content")).to_contain_text("0 = book nothing")  # the help says it before
    field.fill("0")
    page.click("input[name=_save]")

    confirm = page.locator("#cap-confirm")
    expect(confirm).to_contain_text("0 books nothing: the folder starts no new frame")
    expect(page.locator("#cap-confirm-table")).to_contain_text("1000")
    assert FolderResource.objects.get(pk=row.pk).int_max_cores == 100_000  # nothing saved yet
    page.click("#confirm-caps")

    expect(page.locator(".messagelist")).to_contain_text("stops every new booking of this folder")
    assert FolderResource.objects.get(pk=row.pk).int_max_cores == 0
    expect(page.locator(".field-scheduler")).to_be_visible()
    # The database enforces this show: a new proc of the folder is refused, the running one stays.
    with autocommit_conn() as conn, pytest.raises(psycopg.errors.CheckViolation, match="folder has exceeded max cores"):
        farm.add_proc(conn, cores=1)
    with autocommit_conn() as conn:
        (procs,) = conn.execute("SELECT count(*) FROM proc WHERE pk_show = %s", (farm.show,)).fetchone()
    assert procs == 1


def test_cap_bounds_in_cores_and_every_inline_save_is_confirmed(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """Problem 3: no bounds (999,999,999 cores saved), limits given in centicores, inline saves
    committed every changed row without a confirmation."""
    with autocommit_conn() as conn:
        farm = make_farm(conn, "brbound", managed=False, burst_cores=100, jobs=2, job_max_cores=40, hosts=2)
    sub = Subscription.objects.get(show_id=farm.show)
    log_in(page, live_server, operator_login)

    page.goto(f"{live_server.url}/admin/dispatch/subscription/{sub.pk}/change/")
    page.fill("input[name=int_burst]", "999999999")
    page.click("input[name=_save]")
    errors = page.locator(".errorlist")
    expect(errors).to_contain_text("above the limit of 1,000,000 cores")
    expect(page.locator("#content")).not_to_contain_text("2147483647")
    assert Subscription.objects.get(pk=sub.pk).int_burst == 10_000

    # Above the 128 cores of the allocation's two hosts: a typo is asked about, not saved.
    page.fill("input[name=int_burst]", "5000")
    page.click("input[name=_save]")
    expect(page.locator("#cap-confirm")).to_contain_text("5,000 cores is more than the 128 cores of the hosts")
    page.click("#cancel-caps")
    assert Subscription.objects.get(pk=sub.pk).int_burst == 10_000

    # Two job rows changed on the inline list: one confirmation lists both; nothing before it.
    page.goto(f"{live_server.url}/admin/dispatch/jobresource/?q=brbound_job")
    inputs = page.locator("input[name$=-int_max_cores]")
    expect(inputs).to_have_count(2)
    inputs.nth(0).fill("12")
    inputs.nth(1).fill("13")
    page.click("input[name=_save]")
    table = page.locator("#cap-confirm-table")
    expect(page.locator("#cap-confirm")).to_contain_text("Save 2 cap changes?")
    expect(table.locator("tbody tr")).to_have_count(2)
    expect(table).to_contain_text("brbound_job0")
    expect(table).to_contain_text("brbound_job1")
    assert sorted(JobResource.objects.filter(job_id__in=farm.jobs).values_list("int_max_cores", flat=True)) == [
        4000,
        4000,
    ]
    page.click("#confirm-caps")
    expect(page.locator(".messagelist")).to_contain_text("2 job resources were changed successfully")
    assert sorted(JobResource.objects.filter(job_id__in=farm.jobs).values_list("int_max_cores", flat=True)) == [
        1200,
        1300,
    ]


def test_the_kill_switch_changes_only_through_its_confirmation(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """Problem 5: the plain "Accounting settings" change form turned it off with no confirmation."""
    AccountingSettings.set_notifications_enabled(True)
    log_in(page, live_server, operator_login)
    page.goto(f"{live_server.url}/admin/accounting/accountingsettings/1/change/")
    expect(page.locator("#content")).to_contain_text("Off stops every release notification")
    expect(page.locator("input[name=notify_enabled]")).to_have_count(0)
    page.click("#kill-switch-confirm-link")
    expect(page.locator(".ops-confirm")).to_contain_text("Turn accounting notifications OFF?")
    assert AccountingSettings.notifications_enabled() is True  # nothing before the click
    page.click("#confirm-kill-switch")
    expect(page.locator(".messagelist")).to_contain_text("Accounting notifications are OFF.")
    assert AccountingSettings.notifications_enabled() is False
    AccountingSettings.set_notifications_enabled(True)


def test_the_audit_trail_pages_back_to_the_oldest_entry(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """Problem 10: only the newest 200 rows, no paging, no notice; seeding pushed people off."""
    with autocommit_conn() as conn:
        farm = make_farm(conn, "braudit", managed=False, jobs=1)
    job = farm.jobs[0]
    actions.set_job_caps(job, max_cores=7, actor="first-operator")  # the oldest change by a person
    with autocommit_conn() as conn:  # a seeder: 230 changes straight to the table, no person named
        for i in range(230):
            conn.execute("UPDATE job_resource SET int_max_cores = %s WHERE pk_job = %s", ((i + 10) * 100, job))
    log_in(page, live_server, operator_login)
    page.goto(f"{live_server.url}/admin/ops/console/audit/")
    rows = page.locator("#audit-table tbody tr")
    expect(rows).to_have_count(200)
    expect(page.locator("#audit-range")).to_contain_text(
        "Entries 1 to 200, newest first; older entries on the next page"
    )
    expect(page.locator("#audit-table")).not_to_contain_text("first-operator")
    page.click("#audit-older")
    expect(page.locator("#audit-range")).to_contain_text("Entries 201 to ")
    expect(page.locator("#audit-table")).to_contain_text("first-operator")
    expect(page.locator("#audit-older")).to_have_count(0)
    page.click("#audit-newer")
    expect(rows).to_have_count(200)

    # Only what people asked for: the seeder's 230 changes are left out.
    page.check("input[name=people]")
    page.click("#audit-filter button[type=submit]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("first-operator")
    expect(rows.first).to_contain_text("7 cores")


def test_a_finished_jobs_cap_is_not_left_pending(
    page: Page, live_server: Any, operator_login: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "Smaller" list: a FINISHED job's cap stayed "pending" forever (the Store drops it)."""
    monkeypatch.setenv("CUESCHED_OPS_REFRESH_SECONDS", "1")
    monkeypatch.setenv("CUESCHED_MANAGED_SHOWS_TTL", "0.5")
    with autocommit_conn() as conn:
        farm = make_farm(conn, "brdone", managed=True, jobs=2)
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.jobs[0],))
    with running_scheduler(publish_interval=0.2):
        log_in(page, live_server, operator_login)
        page.goto(f"{live_server.url}/admin/dispatch/jobresource/?q=brdone_job")
        done = page.locator("#result_list tbody tr", has_text="brdone_job0").locator('[id^="cap-status-"]')
        live = page.locator("#result_list tbody tr", has_text="brdone_job1").locator('[id^="cap-status-"]')
        expect(live).to_contain_text("max cores: enforces 10000", timeout=15_000)  # the scheduler is up
        expect(done).to_contain_text("max cores: job finished")
        expect(done.locator(".badge.pending")).to_have_count(0)


def test_the_403_page_is_the_consoles_and_says_which_role_is_needed(
    page: Page, live_server: Any, viewer_login: tuple[str, str]
) -> None:
    """The "Smaller" list: the 403 page was Django's bare "403 Forbidden".

    (Issue 31: a viewer now reads the kill-switch page, so the refused page here is a show's
    flip confirmation, which only operators may open; the kill switch is still unchanged.)
    """
    show = Show.objects.create(str_name="forbidden-show")
    log_in(page, live_server, viewer_login)
    response = page.goto(f"{live_server.url}/admin/ops/console/show/{show.pk}/flip/")
    assert response is not None and response.status == 403
    expect(page.locator("#site-name")).to_contain_text("cuesched ops")
    forbidden = page.locator("#ops-forbidden")
    expect(forbidden).to_contain_text("vera may not do this here")
    expect(forbidden).to_contain_text("operators")
    assert AccountingSettings.notifications_enabled() is True


def test_the_overview_shows_a_full_folder_beside_the_burst_bars(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """The "Smaller" list: the utilization bars showed only the burst while a folder was at 100 %."""
    with autocommit_conn() as conn:
        farm = make_farm(conn, "brfull", managed=False, burst_cores=100, folder_max_cores=8)
        farm.add_proc(conn, cores=4)
        farm.add_proc(conn, cores=4)
    log_in(page, live_server, operator_login)
    page.goto(f"{live_server.url}/admin/ops/console/")
    cell = page.locator(f'tr[data-show="{farm.show}"] td').nth(7)
    expect(cell).to_contain_text("8%")  # 8 of the 100-core burst
    fullest = cell.locator(".ops-fullest")
    expect(fullest).to_contain_text("folder brfull_folder")
    expect(fullest).to_contain_text("100%")


def test_the_dispatch_card_counts_frame_ends_written_by_agents(
    page: Page, live_server: Any, operator_login: tuple[str, str]
) -> None:
    """The "Smaller" list: with the q2 launcher the agents write each frame's end, and the card,
    which counted only what the loop's launcher handed back, read "0 completed"."""
    from dispatch.engine.completion import Completion, complete

    with autocommit_conn() as conn:
        farm = make_farm(conn, "brends", managed=False)
        procs = [farm.add_proc(conn, cores=1) for _ in range(3)]
        complete(conn, [Completion(p, 0) for p in procs])  # what an agent does at each frame's end
    log_in(page, live_server, operator_login)
    page.goto(f"{live_server.url}/admin/ops/console/")
    expect(page.locator("#ops-frames-ended")).to_have_text("3 frame runs ended in the last 5 min")
