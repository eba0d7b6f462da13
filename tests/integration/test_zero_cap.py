"""Issue 20 problem 2 outside the console: one meaning of 0 (books nothing), and every writer
asks before it writes one. The job CLI turned `max-cores JOB 0` into unlimited; the API did too."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from dispatch.jobs.submit import submit_job
from dispatch.models import JobResource
from tests.integration.submit_support import make_spec
from tests.integration.test_api import farm, post, tokens  # noqa: F401  (fixtures and helper)

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command("job", *args, stdout=out)
    return out.getvalue().strip()


def test_the_job_cli_refuses_a_max_of_zero_without_yes_and_then_books_nothing(farm) -> None:  # noqa: F811
    job = submit_job(make_spec(), user="alice").job_id
    before = JobResource.objects.get(job_id=job).int_max_cores
    with pytest.raises(CommandError, match="max cores 0 books nothing for this job"):
        _run("max-cores", job, "0")
    assert JobResource.objects.get(job_id=job).int_max_cores == before
    text = _run("max-cores", job, "0", "--yes")
    assert "max cores 0" in text and "stops every new booking of this job" in text
    assert JobResource.objects.get(job_id=job).int_max_cores == 0
    _run("max-cores", job, "-1")
    assert JobResource.objects.get(job_id=job).int_max_cores == -1
    with pytest.raises(CommandError, match="above the limit of 1,000,000 cores"):
        _run("max-cores", job, "999999999")


def test_the_api_needs_confirm_for_a_max_of_zero(client: Client, tokens) -> None:  # noqa: F811
    job = submit_job(make_spec(), user="alice").job_id
    token = tokens["alice"]
    url = f"/api/jobs/{job}/max-cores"
    before = JobResource.objects.get(job_id=job).int_max_cores
    response = post(client, url, {"max_cores": 0}, token=token)
    assert response.status_code == 400
    assert "books nothing" in response.json()["errors"][0]
    assert post(client, url, {"max_cores": 0, "confirm": "yes"}, token=token).status_code == 400
    assert JobResource.objects.get(job_id=job).int_max_cores == before
    response = post(client, url, {"max_cores": 0, "confirm": True}, token=token)
    assert response.status_code == 200, response.content
    assert response.json()["max_cores"] == 0
    assert JobResource.objects.get(job_id=job).int_max_cores == 0
    shown = client.get(f"/api/jobs/{job}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert shown["max_cores"] == 0  # not reported as unlimited (-1)


@pytest.mark.django_db(transaction=True)
def test_a_managed_folder_max_of_zero_reaches_the_store_as_zero_and_books_nothing() -> None:
    """The Store and the triggers agree: the notified 0 is "nothing" in the running scheduler too."""
    from accounting import actions
    from accounting.store import Applied, BookingDelta, LimitExceeded
    from tests.integration.runtime_support import autocommit_conn, make_farm, running_scheduler, wait_for

    with autocommit_conn() as conn:
        farm = make_farm(conn, "zerostore", managed=True, burst_cores=100, folder_max_cores=50)
    delta = BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], 1, 0)
    with running_scheduler(publish_interval=0.2) as proc:
        store = proc.service.store
        actions.set_folder_caps(farm.folder, max_cores=0, actor="zero-test")
        wait_for(lambda: store.caps().folder.get(farm.folder, (None,))[0] == 0, what="the Store's folder cap of 0")
        wait_for(lambda: farm.jobs[0] in store.caps().job, what="the job's caps in the Store")
        refused = store.book(delta)
        assert isinstance(refused, LimitExceeded) and refused.table == "folder", refused
        actions.set_folder_caps(farm.folder, max_cores=-1, actor="zero-test")
        wait_for(lambda: store.caps().folder.get(farm.folder, (None,))[0] == -1, what="the Store's unlimited cap")
        assert isinstance(store.book(delta), Applied)
        store.book(BookingDelta(farm.show, farm.alloc, farm.folder, farm.jobs[0], -1, 0))  # leave it as found


def test_why_not_booking_says_a_zero_max_never_clears_by_waiting() -> None:
    """A folder max of 0 is not "wait for running frames": nothing books until it is raised."""
    from django.urls import reverse

    from dispatch.models import FolderResource
    from ops import permissions
    from tests.integration.farm_fixtures import tiny_farm
    from tests.integration.ops_support import make_user

    small = tiny_farm(managed=False, int_burst=10_000)
    FolderResource.objects.filter(folder=small.folder).update(int_max_cores=0)
    client = Client()
    client.force_login(make_user("olga", permissions.OPERATORS))
    page = client.get(reverse("admin:ops_job_why", args=[small.job.pk])).content.decode()
    assert "max cores is 0: it books nothing" in page
    assert "waiting does not help" in page
