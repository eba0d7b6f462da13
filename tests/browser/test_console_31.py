"""Issue 31 in a real browser (headless Chromium against the live server), as the operator, the
superuser and a viewer: the cap lists' select-all header is a checkbox, not markup; farm tables
have no raw add, change or delete forms; the job list puts active jobs first; a flip's pre-seed
recompute raises no false drift while a real one goes red; cores in cores and labels in words;
the job page, the frame page with its log tailed live, and the log API. Each test failed on the
code before issue 31."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from playwright.sync_api import Page, expect

from accounting import live
from dispatch.jobs import tokens
from dispatch.models import Frame, Job, JobResource, Layer, Show
from ops import permissions
from tests.integration.farm_fixtures import create_frames, create_job, create_layer, create_proc, tiny_farm

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "ops-browser-test-31"
TIMEOUT_MS = 15_000
WIDTH = 1400
ROLES = ("operator", "superuser", "viewer")


def _login(role: str) -> tuple[str, str]:
    permissions.ensure_groups()
    name = {"operator": "olga", "superuser": "sam", "viewer": "vera"}[role]
    users = get_user_model().objects
    if role == "superuser":
        users.create_superuser(name, password=PASSWORD)
    else:
        user = users.create_user(name, password=PASSWORD, is_staff=True)
        group = permissions.OPERATORS if role == "operator" else permissions.VIEWERS
        user.groups.add(Group.objects.get(name=group))
    return name, PASSWORD


def log_in(page: Page, live_server: Any, role: str) -> str:
    name, password = _login(role)
    page.goto(f"{live_server.url}/admin/")
    page.fill("#id_username", name)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(name)
    return name


def _right_edge(page: Page, selector: str) -> float:
    box = page.locator(selector).first.bounding_box()
    assert box is not None, f"{selector} is not rendered"
    return box["x"] + box["width"]


@pytest.mark.parametrize("role", ROLES)
def test_the_cap_lists_header_is_a_checkbox_and_every_column_fits_at_1400_px(
    page: Page, live_server: Any, role: str
) -> None:
    farm = tiny_farm(managed=False)
    log_in(page, live_server, role)
    for path in ("subscription", "folderresource", "jobresource"):
        page.goto(f"{live_server.url}/admin/dispatch/{path}/")
        head = page.locator("#result_list thead")
        expect(head).to_be_visible()
        expect(head).not_to_contain_text("<input")
        expect(head).not_to_contain_text("&lt;")
        if role == "superuser":  # the only role with an action here (delete): its select-all is a checkbox
            expect(page.locator("#result_list thead input#action-toggle")).to_have_count(1)
        # The cap columns and the scheduler column are on screen at 1400 px.
        last = page.locator("#result_list thead th").last
        box = last.bounding_box()
        assert box is not None and box["x"] + box["width"] <= WIDTH, f"{path}: last column at {box}"
        expect(head).to_contain_text(re.compile("max cores|burst", re.I))
    assert farm.job.pk


@pytest.mark.parametrize("role", ROLES)
def test_farm_tables_have_no_raw_add_change_or_delete_forms(page: Page, live_server: Any, role: str) -> None:
    farm = tiny_farm(managed=False, frames=3)
    running = farm.frames[0]
    Frame.objects.filter(pk=running.pk).update(str_state="RUNNING", str_host=farm.host.str_name)
    proc_id = create_proc(farm.host, running, cores=200).pk
    log_in(page, live_server, role)
    rows = {
        "job": farm.job.pk,
        "layer": farm.layer.pk,
        "frame": running.pk,
        "host": farm.host.pk,
        "proc": proc_id,
    }
    for model, pk in rows.items():
        page.goto(f"{live_server.url}/admin/dispatch/{model}/")
        # Neither the list's "Add job" button nor the sidebar's add link of the table.
        expect(page.locator(f".object-tools a.addlink, #nav-sidebar .model-{model} a.addlink")).to_have_count(0)
        expect(page.locator("select[name=action] option[value=delete_selected]")).to_have_count(0)
        answer = page.goto(f"{live_server.url}/admin/dispatch/{model}/add/")
        assert answer is not None and answer.status < 500
        expect(page.locator("input[name=_save]")).to_have_count(0)
        if pk is None:
            continue
        answer = page.goto(f"{live_server.url}/admin/dispatch/{model}/{pk}/change/")
        assert answer is not None and answer.status < 500, f"{model} change page: {answer.status}"
        expect(page.locator("input[name=_save]")).to_have_count(0)
        answer = page.goto(f"{live_server.url}/admin/dispatch/{model}/{pk}/delete/")
        assert answer is not None and answer.status < 500, f"{model} delete page: {answer.status}"
        expect(page.locator("input[type=submit][value*='sure' i]")).to_have_count(0)
    job = Job.objects.get(pk=farm.job.pk)
    assert job.str_state == "PENDING"
    assert Frame.objects.filter(pk=running.pk, str_state="RUNNING").exists()


@pytest.mark.parametrize("role", ROLES)
def test_the_job_list_puts_active_jobs_first_then_by_priority(page: Page, live_server: Any, role: str) -> None:
    farm = tiny_farm(managed=False, frames=1)
    done = create_job(farm.show, farm.folder, farm.dept, farm.facility, name="aaa_done", str_state="FINISHED")
    high = create_job(farm.show, farm.folder, farm.dept, farm.facility, name="zzz_high")
    low = create_job(farm.show, farm.folder, farm.dept, farm.facility, name="mmm_low")
    JobResource.objects.filter(job=high).update(int_priority=90)
    JobResource.objects.filter(job=low).update(int_priority=5)
    JobResource.objects.filter(job=farm.job).update(int_priority=50)
    log_in(page, live_server, role)
    page.goto(f"{live_server.url}/admin/dispatch/job/")
    names = page.locator("#result_list tbody tr th, #result_list tbody tr td.field-str_name").all_inner_texts()
    order = [n for n in names if n in {done.str_name, high.str_name, low.str_name, farm.job.str_name}]
    assert order == [high.str_name, farm.job.str_name, low.str_name, done.str_name], order


def _publish(view: dict[str, Any]) -> None:
    with connection.cursor() as cur:
        cur.execute(live.PUBLISH_SQL, {"pid": 1, "hostname": "test", "payload": json.dumps(view), "generation": None})


def _view(show: str, alloc: str, job: str, folder: str, published_at: float | None, drift_at: float) -> dict[str, Any]:
    drift = {
        "sub": {f"{show}:{alloc}": [-21, drift_at]},
        "folder": {folder: [-21, drift_at]},
        "job": {job: [-21, drift_at]},
    }
    return {
        "managed_shows": {} if published_at is None else {show: published_at},
        "recompute": {"at": drift_at, "drift_cores": {"sub": -21}, "drift_keys": drift},
        "sub": {f"{show}:{alloc}": {"cores": 0 if published_at is None else 21, "gpus": 0}},
        "folder": {folder: {"cores": 0, "gpus": 0}},
        "job": {job: {"cores": 0, "gpus": 0}},
        "recent_caps": [],
        "loops": {},
    }


@pytest.mark.parametrize("role", ROLES)
def test_a_flip_before_its_seed_shows_no_false_drift_and_a_real_one_goes_red(
    page: Page, live_server: Any, role: str
) -> None:
    farm = tiny_farm(managed=True, frames=21)
    for frame in farm.frames:
        create_proc(farm.host, frame, cores=100)
    # The flip committed; a recompute ran before the seed: the Store held nothing for the show.
    now = time.time()
    _publish(_view(farm.show.pk, farm.alloc.pk, farm.job.pk, farm.folder.pk, None, now))
    log_in(page, live_server, role)
    page.goto(f"{live_server.url}/admin/ops/console/")
    row = page.locator(f'tr[data-show="{farm.show.pk}"]')
    expect(row).to_be_visible()
    expect(row.locator("span.drift-bad")).to_have_count(0)
    expect(row).not_to_contain_text("-21")
    page.goto(f"{live_server.url}/admin/ops/console/show/{farm.show.pk}/")
    for table in ("#subs-table", "#folders-table", "#jobs-table"):
        expect(page.locator(f"{table} span.drift-bad")).to_have_count(0)
        expect(page.locator(table)).to_contain_text("seeding")
    # Seeded at `now`; a recompute after the seed measures a real -21: red at once.
    _publish(_view(farm.show.pk, farm.alloc.pk, farm.job.pk, farm.folder.pk, now, now + 1))
    page.goto(f"{live_server.url}/admin/ops/console/")
    expect(page.locator(f'tr[data-show="{farm.show.pk}"] span.drift-bad')).to_have_text("-21")
    page.goto(f"{live_server.url}/admin/ops/console/show/{farm.show.pk}/")
    expect(page.locator("#subs-table span.drift-bad")).to_have_text("-21")
    expect(page.locator("#jobs-table span.drift-bad")).to_have_text("-21")


RAW = re.compile(r"\b(str|int|b|ts|pk) [a-z]", re.I)


@pytest.mark.parametrize("role", ROLES)
def test_cores_in_cores_and_labels_in_words(page: Page, live_server: Any, role: str) -> None:
    farm = tiny_farm(managed=False, frames=2)
    Show.objects.filter(pk=farm.show.pk).update(int_default_max_cores=10000)
    create_proc(farm.host, farm.frames[0], cores=150)
    log_in(page, live_server, role)
    for path in ("show", "job", "frame", "layer", "host", "proc", "subscription", "folderresource", "jobresource"):
        page.goto(f"{live_server.url}/admin/dispatch/{path}/")
        head = page.locator("#result_list thead").inner_text()
        assert not RAW.search(head), f"{path}: raw column name in {head!r}"
        filters = page.locator("#changelist-filter").all_inner_texts()
        assert not any(RAW.search(t) for t in filters), f"{path}: raw filter title in {filters!r}"
    page.goto(f"{live_server.url}/admin/dispatch/show/")
    row = page.locator("#result_list tbody tr", has_text=farm.show.str_name)
    expect(row).not_to_contain_text("10000")
    expect(page.locator("#result_list thead")).to_contain_text(re.compile("cores", re.I))
    page.goto(f"{live_server.url}/admin/dispatch/layer/")
    row = page.locator("#result_list tbody tr", has_text=farm.layer.str_name)
    expect(row).not_to_contain_text("4194304")


def _write_log(root: Path, farm: Any, frame: Frame, text: str) -> Path:
    path = root / farm.show.str_name / farm.job.str_name / f"{farm.layer.str_name}.{frame.int_number:04d}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_frame_log_api_reads_text_from_an_offset_and_404s_in_json(
    live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: Page
) -> None:
    monkeypatch.setenv("CUESCHED_AGENT_LOG_ROOT", str(tmp_path))
    farm = tiny_farm(managed=False, frames=2)
    user = get_user_model().objects.create_user("alice", is_staff=True)
    token = tokens.issue_token(user)
    _write_log(tmp_path, farm, farm.frames[0], "=== cuesched run 1\nhello\n")
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{live_server.url}/api/jobs/{farm.job.str_name}/frames/{farm.frames[0].str_name}/log"
    answer = page.request.get(url, headers=headers)
    assert answer.status == 200, answer.text()
    assert answer.headers["content-type"].startswith("text/plain")
    assert answer.text() == "=== cuesched run 1\nhello\n"
    tail = page.request.get(url + "?offset=19", headers=headers)
    assert tail.status == 200 and tail.text() == "hello\n"
    none = page.request.get(
        f"{live_server.url}/api/jobs/{farm.job.str_name}/frames/{farm.frames[1].str_name}/log", headers=headers
    )
    assert none.status == 404
    assert "errors" in none.json()


@pytest.mark.parametrize("role", ROLES)
def test_a_wrangler_opens_a_job_its_layer_and_tails_a_running_frames_log(
    page: Page, live_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    monkeypatch.setenv("CUESCHED_AGENT_LOG_ROOT", str(tmp_path))
    monkeypatch.setenv("CUESCHED_OPS_REFRESH_SECONDS", "1")
    farm = tiny_farm(managed=False, frames=4)
    second = create_layer(farm.job, name="comp")
    create_frames(second, 2, state="DEAD")
    running = farm.frames[0]
    Frame.objects.filter(pk=running.pk).update(
        str_state="RUNNING", str_host=farm.host.str_name, int_mem_reserved=2097152, int_cores=200
    )
    create_proc(farm.host, running, cores=200)
    log = _write_log(tmp_path, farm, running, "=== cuesched run 1\nrendering tile 1\n")
    log_in(page, live_server, role)
    page.goto(f"{live_server.url}/admin/dispatch/job/")
    page.locator("#result_list a", has_text=farm.job.str_name).first.click()
    expect(page).to_have_url(re.compile(r"/admin/ops/console/job/"))
    layers = page.locator("#layers-table")
    expect(layers).to_contain_text(farm.layer.str_name)
    expect(layers).to_contain_text("comp")
    expect(layers.locator(".progress").first).to_be_visible()
    # Frames filterable by state.
    page.locator("#frame-filter a", has_text=re.compile("dead", re.I)).first.click()
    frames = page.locator("#frames-table tbody tr")
    expect(frames).to_have_count(2)
    page.locator("#frame-filter a", has_text=re.compile("running", re.I)).first.click()
    expect(frames).to_have_count(1)
    expect(frames.first).to_contain_text("2 GB")  # reserved 2097152 KB
    expect(frames.first).not_to_contain_text("2097152")
    frames.first.locator("a", has_text=running.str_name).click()
    expect(page).to_have_url(re.compile(r"/admin/ops/console/frame/"))
    expect(page.locator("body")).not_to_contain_text("2097152")
    logbox = page.locator("#frame-log")
    expect(logbox).to_contain_text("rendering tile 1")
    with log.open("a") as fh:
        fh.write("rendering tile 2\n")
    expect(logbox).to_contain_text("rendering tile 2", timeout=TIMEOUT_MS)
    assert Layer.objects.filter(job=farm.job).count() == 2


def test_login_lands_on_the_farm_overview(page: Page, live_server: Any) -> None:
    name, password = _login("superuser")
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", name)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(r"/admin/ops/console/$"))


def test_a_wrangler_retries_dead_frames_lowers_max_cores_and_sees_the_audit(page: Page, live_server: Any) -> None:
    farm = tiny_farm(managed=False, frames=2)
    comp = create_layer(farm.job, name="comp")
    dead = create_frames(comp, 3, state="DEAD")
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}/admin/ops/console/job/{farm.job.pk}/")
    page.on("dialog", lambda dialog: dialog.accept())
    page.locator(f'#layers-table tr[data-layer="{comp.pk}"] button', has_text="Retry dead").click()
    expect(page.locator(".messagelist")).to_contain_text("Dead frames back to waiting: 3 frames")
    assert Frame.objects.filter(pk__in=[f.pk for f in dead], str_state="WAITING").count() == 3
    page.fill("#max-cores-form input[name=max_cores]", "5")
    page.locator("#max-cores-form button").click()
    expect(page.locator(".messagelist")).to_contain_text("Max cores set to 5 cores")
    expect(page.locator("#job-max-cores")).to_have_text("5 cores")
    assert JobResource.objects.get(job=farm.job).int_max_cores == 500
    page.goto(f"{live_server.url}/admin/ops/console/audit/")
    audit = page.locator("#content")
    expect(audit).to_contain_text(farm.job.str_name)
    expect(audit).to_contain_text(re.compile("retry", re.I))
    expect(audit).to_contain_text(re.compile("max cores", re.I))


def test_a_viewer_sees_no_controls_and_a_posted_one_is_refused(page: Page, live_server: Any) -> None:
    farm = tiny_farm(managed=False, frames=2)
    Frame.objects.filter(pk=farm.frames[0].pk).update(str_state="DEAD")
    log_in(page, live_server, "viewer")
    page.goto(f"{live_server.url}/admin/ops/console/job/{farm.job.pk}/")
    expect(page.locator("#layers-table")).to_be_visible()
    expect(page.locator("#job-controls")).to_have_count(0)
    expect(page.locator("#frames-table button")).to_have_count(0)
    token = page.context.cookies()
    csrf = next(c["value"] for c in token if c["name"] == "csrftoken")
    answer = page.request.post(
        f"{live_server.url}/admin/ops/console/job/{farm.job.pk}/act/",
        form={"action": "retry", "csrfmiddlewaretoken": csrf},
        headers={"Referer": live_server.url + "/admin/", "X-CSRFToken": csrf},
    )
    assert answer.status == 403
    assert Frame.objects.get(pk=farm.frames[0].pk).str_state == "DEAD"
    # The kill switch reads for a viewer (it was a 403), with no form to change it.
    switch = page.goto(f"{live_server.url}/admin/ops/console/notifications/")
    assert switch is not None and switch.status == 200
    expect(page.locator("#kill-switch-read-only")).to_contain_text("Notifications are on")
    expect(page.locator("#confirm-kill-switch")).to_have_count(0)


@pytest.mark.parametrize("role", ROLES)
def test_the_farm_lists_and_the_job_page_fit_1400_px(
    page: Page, live_server: Any, role: str, screenshot_dir: Path
) -> None:
    farm = tiny_farm(managed=False, frames=3)
    Frame.objects.filter(pk=farm.frames[0].pk).update(str_state="RUNNING", str_host=farm.host.str_name)
    create_proc(farm.host, farm.frames[0], cores=100)
    log_in(page, live_server, role)
    pages = {
        "job": "/admin/dispatch/job/",
        "frame": "/admin/dispatch/frame/",
        "host": "/admin/dispatch/host/",
        "proc": "/admin/dispatch/proc/",
        "job-page": f"/admin/ops/console/job/{farm.job.pk}/",
    }
    for name, path in pages.items():
        page.goto(live_server.url + path)
        table = "#frames-table" if name == "job-page" else "#result_list"
        right = _right_edge(page, f"{table} thead th:last-child")
        width = page.evaluate("document.documentElement.scrollWidth")
        page.screenshot(path=str(screenshot_dir / f"31-{name}-{role}.png"), full_page=True)
        assert right <= WIDTH and width <= WIDTH, f"{name}: last column ends at {right:.0f} px, page {width} px wide"
