"""The console's farm lists (hosts, jobs, frames, procs) through the test client: titles and
units, the job reason column, every control from the lists with its permission and its audit
row, a fixed query count whatever the page size, and why-not-booking's "never" reasons."""

from __future__ import annotations

import pytest
from django.contrib import admin as django_admin
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatch.models import FarmAction, Frame, Host, Job, JobResource, Layer, Proc
from ops import permissions
from tests.integration.farm_fixtures import (
    Farm,
    create_frames,
    create_host,
    create_job,
    create_layer,
    create_proc,
    tiny_farm,
)
from tests.integration.ops_support import make_user

pytestmark = pytest.mark.django_db

GB = 1024 * 1024


def client_for(user: AbstractBaseUser) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    return client_for(make_user("olga", permissions.OPERATORS))


@pytest.fixture
def viewer() -> Client:
    return client_for(make_user("vic", permissions.VIEWERS))


@pytest.fixture
def farm() -> Farm:
    farm = tiny_farm(managed=False, int_burst=100_000)
    Layer.objects.filter(pk=farm.layer.pk).update(str_tags=farm.alloc.str_tag)  # the host's ALLOC tag
    return farm


def act(client: Client, url: str, action: str, ids: list[str], **extra: str) -> str:
    data = {"action": action, "_selected_action": ids, "index": "0", **extra}
    return client.post(url, data, follow=True).content.decode()


# --- the lists read in words, cores and GB ----------------------------------------------------


def test_host_list_titles_units_and_state(operator: Client, farm: Farm) -> None:
    Host.objects.filter(pk=farm.host.pk).update(
        int_cores=6400, int_cores_idle=6000, int_mem=64 * GB, int_mem_idle=60 * GB
    )
    page = operator.get(reverse("admin:dispatch_host_changelist")).content.decode()
    assert "Idle / total cores" in page and "60 / 64" in page
    assert "Idle / total memory (GB)" in page and "60 / 64" in page
    assert "up · open" in page
    assert "INT CORES IDLE" not in page.upper().replace("IDLE / TOTAL CORES", "")
    assert "int_cores_idle" not in page.split('id="result_list"')[1].split("</thead>")[0]


def test_job_frame_proc_lists_in_cores_and_gb(operator: Client, farm: Farm) -> None:
    create_proc(farm.host, farm.frames[0], cores=250, int_mem_reserved=4 * GB)
    jobs = operator.get(reverse("admin:dispatch_job_changelist")).content.decode()
    assert "Booked cores" in jobs and ">2.5<" in jobs
    procs = operator.get(reverse("admin:dispatch_proc_changelist")).content.decode()
    assert "Memory reserved (GB)" in procs and ">4<" in procs and ">2.5<" in procs
    frames = operator.get(reverse("admin:dispatch_frame_changelist")).content.decode()
    assert "Memory used (GB)" in frames and "waiting" in frames


# --- the reason column ---------------------------------------------------------------------


def reason_of(client: Client, job: Job) -> str:
    page = client.get(reverse("admin:dispatch_job_changelist")).content.decode()
    row = page.split(f'/admin/ops/console/job/{job.pk}/why/"')[1]
    return row.split(">", 1)[1].split("<", 1)[0]


def test_job_reason_column(operator: Client, farm: Farm) -> None:
    assert reason_of(operator, farm.job) == "ready"
    Job.objects.filter(pk=farm.job.pk).update(b_paused=True)
    assert reason_of(operator, farm.job) == "paused"
    Job.objects.filter(pk=farm.job.pk).update(b_paused=False)
    JobResource.objects.filter(job=farm.job).update(int_max_cores=200)
    create_proc(farm.host, farm.frames[0], cores=200)
    assert reason_of(operator, farm.job) == "at job cap (2/2 cores)"
    JobResource.objects.filter(job=farm.job).update(int_max_cores=-1)
    Layer.objects.filter(pk=farm.layer.pk).update(int_gpus_min=1)
    assert reason_of(operator, farm.job) == "no host can ever run it"
    Layer.objects.filter(pk=farm.layer.pk).update(int_gpus_min=0)
    Host.objects.filter(pk=farm.host.pk).update(str_lock_state="LOCKED")
    assert reason_of(operator, farm.job) == "no host fits now"
    Frame.objects.filter(job=farm.job, str_state="WAITING").update(str_state="DEPEND", int_depend_count=1)
    assert reason_of(operator, farm.job) == "waiting on dependency"


# --- a fixed number of queries whatever the page size ---------------------------------------


def many_rows(farm: Farm, n: int) -> None:
    for i in range(n):
        job = create_job(farm.show, farm.folder, farm.dept, farm.facility)
        layer = create_layer(job, str_tags=farm.alloc.str_tag)
        frames = create_frames(layer, 3)
        host = create_host(farm.alloc, int_cores=800)
        create_proc(host, frames[0], cores=100)
        if i % 2:
            Frame.objects.filter(pk=frames[1].pk).update(str_state="DEAD")


@pytest.mark.parametrize("name", ["host", "job", "frame", "proc"])
def test_list_pages_run_a_fixed_number_of_queries(operator: Client, farm: Farm, name: str) -> None:
    many_rows(farm, 40)
    url = reverse(f"admin:dispatch_{name}_changelist")
    # The page size is the admin's list_per_page: compare a small page with a full one.
    model_admin = django_admin.site._registry[{"host": Host, "job": Job, "frame": Frame, "proc": Proc}[name]]
    sizes = []
    for per_page in (5, 100):
        model_admin.list_per_page = per_page
        try:
            with CaptureQueriesContext(connection) as ctx:
                page = operator.get(url).content.decode()
            rows = page.split('id="result_list"')[1].split("<tbody>")[1].split("</tbody>")[0].count("<tr")
            sizes.append((len(ctx.captured_queries), rows))
        finally:
            model_admin.list_per_page = 100
    (small, small_rows), (big, big_rows) = sizes
    assert small_rows == 5 and big_rows >= 40
    assert big == small, f"{name}: {small} queries for 5 rows, {big} for {big_rows}"
    assert big <= 12, f"{name}: {big} queries"


# --- controls from the lists: permission, action layer, audit row ---------------------------


def test_viewer_has_no_controls_and_cannot_post_one(viewer: Client, farm: Farm) -> None:
    for name in ("host", "job", "frame"):
        page = viewer.get(reverse(f"admin:dispatch_{name}_changelist")).content.decode()
        assert 'name="action"' not in page, name
    act(viewer, reverse("admin:dispatch_job_changelist"), "pause_job_selected", [farm.job.pk])
    act(viewer, reverse("admin:dispatch_host_changelist"), "lock_selected", [farm.host.pk])
    assert not Job.objects.get(pk=farm.job.pk).b_paused
    assert Host.objects.get(pk=farm.host.pk).str_lock_state == "OPEN"
    assert not FarmAction.objects.exists()


def test_job_controls_from_the_list(operator: Client, farm: Farm) -> None:
    url = reverse("admin:dispatch_job_changelist")
    assert "Jobs paused: 1" in act(operator, url, "pause_job_selected", [farm.job.pk])
    assert Job.objects.get(pk=farm.job.pk).b_paused
    act(operator, url, "resume_job_selected", [farm.job.pk])
    assert not Job.objects.get(pk=farm.job.pk).b_paused
    page = act(operator, url, "set_priority_selected", [farm.job.pk], priority="abc")
    assert "Give the priority" in page and "Nothing was changed" in page
    act(operator, url, "set_priority_selected", [farm.job.pk], priority="77")
    assert JobResource.objects.get(job=farm.job).int_priority == 77
    Frame.objects.filter(pk=farm.frames[0].pk).update(str_state="DEAD")
    act(operator, url, "retry_frames_selected", [farm.job.pk])
    assert Frame.objects.get(pk=farm.frames[0].pk).str_state == "WAITING"
    actions = list(FarmAction.objects.order_by("id").values_list("str_action", "str_username", "str_target_name"))
    assert [a for a, _u, _n in actions] == ["pause", "resume", "priority", "retry"]
    assert {u for _a, u, _n in actions} == {"olga"} and {n for _a, _u, n in actions} == {farm.job.str_name}


def test_kill_from_the_list_asks_first_then_marks_the_running_frames_killing(operator: Client, farm: Farm) -> None:
    url = reverse("admin:dispatch_job_changelist")
    create_proc(farm.host, farm.frames[0], cores=100)
    page = act(operator, url, "kill_job_selected", [farm.job.pk])
    assert "Kill 1 job(s)?" in page and farm.job.str_name in page
    assert Job.objects.get(pk=farm.job.pk).str_state == "PENDING"  # nothing before the confirmation
    act(operator, url, "kill_job_selected", [farm.job.pk], confirm="yes")
    assert Job.objects.get(pk=farm.job.pk).str_state == "FINISHED"
    # A kill is not a release: the proc stays booked until its run has ended, and the list says so.
    assert Proc.objects.filter(job=farm.job, ts_kill__isnull=False).count() == 1
    assert ">killing<" in operator.get(url).content.decode()
    assert FarmAction.objects.get(str_action="kill").str_username == "olga"


def complete_run(pk_proc: str, status: int) -> None:
    """The run's completion report, in the test's transaction (the completion path's statements)."""
    import psycopg
    from django.db import connection

    from dispatch.engine.completion import Completion, complete_in_transaction

    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cur:
        complete_in_transaction(cur, [Completion(pk_proc, status)])


def test_frame_controls_from_the_list(operator: Client, farm: Farm) -> None:
    url = reverse("admin:dispatch_frame_changelist")
    running, dead, waiting = farm.frames[0], farm.frames[1], farm.frames[2]
    create_proc(farm.host, running, cores=100)
    Frame.objects.filter(pk=running.pk).update(str_state="RUNNING")
    Frame.objects.filter(pk=dead.pk).update(str_state="DEAD")
    act(operator, url, "retry_selected", [dead.pk])
    assert Frame.objects.get(pk=dead.pk).str_state == "WAITING"
    act(operator, url, "kill_selected", [running.pk], confirm="yes")
    # A kill is not a release: the frame reads "killing", its proc booked, until its run ends.
    assert Frame.objects.get(pk=running.pk).str_state == "RUNNING"
    assert Proc.objects.get(frame=running).str_kill == "FRAME"
    assert ">killing<" in operator.get(url).content.decode()
    complete_run(Proc.objects.get(frame=running).pk, 137)  # the run's own end, a signal death
    assert Frame.objects.get(pk=running.pk).str_state == "WAITING"
    assert not Proc.objects.filter(frame=running).exists()
    assert Host.objects.get(pk=farm.host.pk).int_cores_idle == farm.host.int_cores
    act(operator, url, "eat_selected", [waiting.pk], confirm="yes")
    assert Frame.objects.get(pk=waiting.pk).str_state == "EATEN"
    kinds = list(FarmAction.objects.order_by("id").values_list("str_action", "str_target_kind"))
    assert kinds == [("retry", "frame"), ("kill", "frame"), ("eat", "frame")]


def test_host_lock_unlock_drain_from_the_list(operator: Client, farm: Farm) -> None:
    url = reverse("admin:dispatch_host_changelist")
    other = create_host(farm.alloc)
    create_proc(farm.host, farm.frames[0], cores=100)
    assert "Hosts locked: 2" in act(operator, url, "lock_selected", [farm.host.pk, other.pk])
    assert set(Host.objects.filter(pk__in=[farm.host.pk, other.pk]).values_list("str_lock_state", flat=True)) == {
        "LOCKED"
    }
    page = operator.get(url).content.decode()
    assert "locked, draining (1 running)" in page and "locked, drained" in page
    act(operator, url, "unlock_selected", [farm.host.pk, other.pk])
    assert Host.objects.get(pk=farm.host.pk).str_lock_state == "OPEN"
    page = act(operator, url, "drain_selected", [farm.host.pk])
    assert "Drain 1 host(s)?" in page
    page = act(operator, url, "drain_selected", [farm.host.pk], confirm="yes")
    assert "1 frame(s) still running finish there" in page
    assert Host.objects.get(pk=farm.host.pk).str_lock_state == "LOCKED"
    assert FarmAction.objects.filter(str_target_kind="host").count() == 5


# --- why not booking: blockers that never clear ---------------------------------------------


def test_why_says_no_host_can_ever_run_a_gpu_frame(operator: Client, farm: Farm) -> None:
    Layer.objects.filter(pk=farm.layer.pk).update(int_gpus_min=1)
    page = operator.get(reverse("admin:ops_job_why", args=[farm.job.pk])).content.decode()
    assert "No host can ever run a frame of layer" in page
    assert "a frame needs 1 GPU(s) and no host has a GPU" in page
    assert "Wait for running frames" not in page
    assert "Waiting will not help" in page


def test_why_says_no_host_can_ever_run_a_frame_larger_than_every_host(operator: Client, farm: Farm) -> None:
    Layer.objects.filter(pk=farm.layer.pk).update(int_cores_min=12800, b_threadable=True)
    page = operator.get(reverse("admin:ops_frame_why", args=[farm.frames[0].pk])).content.decode()
    assert "No host can ever run a frame of layer" in page
    assert "a frame needs 128 cores and the largest host has 64" in page
    assert "free hosts" not in page.replace("freeing hosts does not make them bigger", "")


def test_why_a_big_enough_busy_host_is_still_a_wait(operator: Client, farm: Farm) -> None:
    Layer.objects.filter(pk=farm.layer.pk).update(int_cores_min=6400, b_threadable=True)
    create_proc(farm.host, farm.frames[0], cores=100)
    Host.objects.filter(pk=farm.host.pk).update(int_cores_idle=6300)  # what the booking path does
    page = operator.get(reverse("admin:ops_job_why", args=[farm.job.pk])).content.decode()
    assert "No host can ever run" not in page
    # Since issue 28 the idle-cores check is the sizing rule's, and it says why the host refuses.
    assert "has the idle cores a frame books there" in page
    assert "asks 64 cores: " in page and "refuses it, it has 63 cores idle" in page


def test_farm_controls_appear_in_the_merged_audit_trail(operator: Client, farm: Farm) -> None:
    """The controls are recorded in the one audit trail operators read after an incident, beside
    the cap changes and flips, filterable by kind and user (not only in a list of their own)."""
    act(operator, reverse("admin:dispatch_job_changelist"), "pause_job_selected", [farm.job.pk])
    act(operator, reverse("admin:dispatch_host_changelist"), "lock_selected", [farm.host.pk])
    page = operator.get(reverse("admin:ops_audit"), {"kind": "farm"}).content.decode()
    assert f"job {farm.job.str_name}" in page and f"host {farm.host.str_name}" in page
    assert "pause" in page and "lock" in page and "olga" in page
    everything = operator.get(reverse("admin:ops_audit")).content.decode()
    assert f"job {farm.job.str_name}" in everything
    nobody = operator.get(reverse("admin:ops_audit"), {"kind": "farm", "who": "nobody-at-all"}).content.decode()
    assert f"job {farm.job.str_name}" not in nobody
