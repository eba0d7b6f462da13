"""The farm lists in a real browser (headless Chromium) as an operator: hosts, jobs and frames read
in words, cores and GB, carry a state and a reason, are controlled from the list (one row and in
bulk, through a confirmation for the destructive ones), and refresh by themselves; why-not-booking
says when no host can ever run a frame. Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from playwright.sync_api import Page, expect

from dispatch.models import FarmAction, Frame, Host, Job, Layer, Proc
from ops import permissions
from tests.integration.farm_fixtures import create_host, create_proc, tiny_farm

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "farm-browser-test"
GB = 1024 * 1024
TIMEOUT_MS = 15_000


@pytest.fixture(autouse=True)
def fast_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUESCHED_OPS_REFRESH_SECONDS", "1")


def log_in(page: Page, live_server: Any, group: str, name: str) -> None:
    permissions.ensure_groups()
    user = get_user_model().objects.create_user(name, password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", name)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(name)


def row_of(page: Page, text: str) -> Any:
    return page.locator("#result_list tbody tr", has_text=text)


def run_action(page: Page, label: str, *, value: str | None = None) -> None:
    page.select_option("select[name=action]", label=label)
    if value is not None:
        page.fill("input[name=priority]", value)
    page.click("button[name=index]")


def test_hosts_read_in_words_and_lock_unlock_drain_from_the_list(
    page: Page, live_server: Any, screenshot_dir: Path
) -> None:
    farm = tiny_farm(managed=False)
    other = create_host(farm.alloc, int_cores=3200, int_mem=64 * GB)
    Host.objects.filter(pk=farm.host.pk).update(int_cores_idle=6000)
    # Idle memory is the host memory ledger's (issue 28): int_mem - SUM(proc), whoever writes it.
    create_proc(farm.host, farm.frames[0], cores=400, int_mem_reserved=4 * GB)
    log_in(page, live_server, permissions.OPERATORS, "olga")
    page.goto(f"{live_server.url}/admin/dispatch/host/")
    head = page.locator("#result_list thead")
    expect(head).to_contain_text("Idle / total cores")
    expect(head).to_contain_text("Idle / total memory (GB)")
    expect(head).not_to_contain_text("INT CORES IDLE")
    mine = row_of(page, farm.host.str_name)
    expect(mine).to_contain_text("60 / 64")
    expect(mine).to_contain_text("28 / 32")
    expect(mine).to_contain_text("up · open")

    # Bulk: lock both hosts from the list.
    mine.locator("input.action-select").check()
    row_of(page, other.str_name).locator("input.action-select").check()
    run_action(page, "Lock the selected hosts (nothing new books; running frames go on)")
    expect(page.locator(".messagelist")).to_contain_text("Hosts locked: 2")
    expect(row_of(page, farm.host.str_name)).to_contain_text("locked, draining (1 running)")
    expect(row_of(page, other.str_name)).to_contain_text("locked, drained")
    shoot = screenshot_dir / "20-host-list-locked.png"
    page.screenshot(path=str(shoot), full_page=True)

    row_of(page, other.str_name).locator("input.action-select").check()
    run_action(page, "Unlock the selected hosts")
    expect(row_of(page, other.str_name)).to_contain_text("up · open")

    row_of(page, other.str_name).locator("input.action-select").check()
    run_action(page, "Drain the selected hosts…")
    expect(page.locator("#content")).to_contain_text("Drain 1 host(s)?")
    assert Host.objects.get(pk=other.pk).str_lock_state == "OPEN"  # nothing before the confirmation
    page.click("#farm-confirm-yes")
    expect(page.locator(".messagelist")).to_contain_text("Hosts draining: 1")
    assert Host.objects.get(pk=other.pk).str_lock_state == "LOCKED"
    assert FarmAction.objects.filter(str_target_kind="host", str_username="olga").count() == 4


def test_jobs_have_a_reason_and_are_controlled_from_the_list(
    page: Page, live_server: Any, screenshot_dir: Path
) -> None:
    farm = tiny_farm(managed=False)
    Layer.objects.filter(pk=farm.layer.pk).update(str_tags=farm.alloc.str_tag)
    log_in(page, live_server, permissions.OPERATORS, "olga")
    page.goto(f"{live_server.url}/admin/dispatch/job/")
    row = row_of(page, farm.job.str_name)
    expect(page.locator("#result_list thead")).to_contain_text("Why not booking")
    expect(row.locator("a.job-reason")).to_have_text("ready")

    row.locator("input.action-select").check()
    run_action(page, "Pause the selected jobs")
    expect(page.locator(".messagelist")).to_contain_text("Jobs paused: 1")
    expect(row_of(page, farm.job.str_name).locator("a.job-reason")).to_have_text("paused")

    row_of(page, farm.job.str_name).locator("input.action-select").check()
    run_action(page, "Set the priority of the selected jobs (the value beside)", value="250")
    expect(page.locator(".messagelist")).to_contain_text("Priority set to 250: 1")
    expect(row_of(page, farm.job.str_name)).to_contain_text("250")
    page.screenshot(path=str(screenshot_dir / "21-job-list.png"), full_page=True)

    # The list refreshes by itself: a change made elsewhere shows without a reload.
    page.evaluate("window.__notReloaded = true")
    Job.objects.filter(pk=farm.job.pk).update(b_paused=False)
    Layer.objects.filter(pk=farm.layer.pk).update(int_gpus_min=2)
    expect(row_of(page, farm.job.str_name).locator("a.job-reason")).to_have_text(
        "no host can ever run it", timeout=TIMEOUT_MS
    )
    assert page.evaluate("window.__notReloaded") is True

    row_of(page, farm.job.str_name).locator("input.action-select").check()
    run_action(page, "Kill the selected jobs…")
    expect(page.locator("#content")).to_contain_text("Kill 1 job(s)?")
    page.click("#farm-confirm-yes")
    # Issue 31: said in jobs and frames ("Frames moved: 6" added the job and its frames together).
    expect(page.locator(".messagelist")).to_contain_text("Jobs killed: 1 of 1 selected")
    assert Job.objects.get(pk=farm.job.pk).str_state == "FINISHED"


def test_frames_retry_and_kill_from_the_list_and_viewers_get_no_controls(page: Page, live_server: Any) -> None:
    farm = tiny_farm(managed=False)
    dead, running = farm.frames[0], farm.frames[1]
    Frame.objects.filter(pk=dead.pk).update(str_state="DEAD")
    Frame.objects.filter(pk=running.pk).update(str_state="RUNNING", str_host=farm.host.str_name, int_cores=200)
    create_proc(farm.host, running, cores=200)
    log_in(page, live_server, permissions.OPERATORS, "olga")
    page.goto(f"{live_server.url}/admin/dispatch/frame/?str_state__exact=DEAD")
    row_of(page, dead.str_name).locator("input.action-select").check()
    run_action(page, "Retry the selected frames (dead ones)")
    expect(page.locator(".messagelist")).to_contain_text("Frames to retry: 1")
    assert Frame.objects.get(pk=dead.pk).str_state == "WAITING"

    page.goto(f"{live_server.url}/admin/dispatch/frame/?str_state__exact=RUNNING")
    expect(row_of(page, running.str_name)).to_contain_text("running")
    row_of(page, running.str_name).locator("input.action-select").check()
    run_action(page, "Kill the selected running frames…")
    page.click("#farm-confirm-yes")
    expect(page.locator(".messagelist")).to_contain_text("Frames killed: 1")
    # A kill is not a release: the run stays booked, marked, until its host reports it ended.
    assert Proc.objects.filter(frame_id=running.pk, ts_kill__isnull=False).exists()
    page.goto(f"{live_server.url}/admin/dispatch/frame/?str_state__exact=RUNNING")
    expect(row_of(page, running.str_name)).to_contain_text("killing")

    page.context.clear_cookies()  # log out
    log_in(page, live_server, permissions.VIEWERS, "vic")
    for name in ("frame", "job", "host"):
        page.goto(f"{live_server.url}/admin/dispatch/{name}/")
        expect(page.locator("#result_list")).to_be_visible()
        expect(page.locator("select[name=action]")).to_have_count(0)


def test_why_not_booking_says_no_host_can_ever_run_the_frame(
    page: Page, live_server: Any, screenshot_dir: Path
) -> None:
    farm = tiny_farm(managed=False)  # 64-core hosts without GPUs
    Layer.objects.filter(pk=farm.layer.pk).update(str_tags=farm.alloc.str_tag, int_gpus_min=1)
    log_in(page, live_server, permissions.OPERATORS, "olga")
    page.goto(f"{live_server.url}/admin/ops/console/job/{farm.job.pk}/why/")
    reason = page.locator(".why-computed").first
    expect(reason).to_contain_text("No host can ever run a frame of layer")
    expect(reason).to_contain_text("a frame needs 1 GPU(s) and no host has a GPU")
    expect(reason).not_to_contain_text("Wait for running frames")
    page.screenshot(path=str(screenshot_dir / "22-why-never-gpu.png"), full_page=True)

    Layer.objects.filter(pk=farm.layer.pk).update(int_gpus_min=0, int_cores_min=12800, b_threadable=True)
    page.goto(f"{live_server.url}/admin/ops/console/frame/{farm.frames[0].pk}/why/")
    reason = page.locator(".why-computed").first
    expect(reason).to_contain_text(re.compile(r"a frame needs 128 cores and the largest host has 64"))
    expect(reason).to_contain_text("Waiting will not help")
