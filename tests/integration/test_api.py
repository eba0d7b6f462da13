"""The JSON API: bearer tokens, who may control which job, malformed requests refused with
nothing written, and every route; plus `api_token`, `submit_job` and `job` on the command line."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client

from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import digest, issue_token
from dispatch.models import ApiToken, Job, JobResource
from tests.integration.submit_support import frame_states, make_spec, simple_spec, submit_farm, table_counts

pytestmark = pytest.mark.django_db

User = get_user_model()


@pytest.fixture
def farm():
    return submit_farm()


@pytest.fixture
def tokens(farm) -> dict[str, str]:
    """alice and bob (plain users), carol (staff), dave (holds dispatch.change_job)."""
    users = {name: User.objects.create(username=name) for name in ("alice", "bob", "carol", "dave")}
    User.objects.filter(username="carol").update(is_staff=True)
    change_job = Permission.objects.get(codename="change_job", content_type__app_label="dispatch")
    users["dave"].user_permissions.add(change_job)
    return {name: issue_token(User.objects.get(username=name)) for name in users}


def post(client: Client, url: str, body: Any = None, token: str | None = None, raw: bytes | None = None) -> Any:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    return client.post(url, data=data, content_type="application/json", **headers)


def test_submit_needs_a_valid_token_and_writes_nothing_without_one(client: Client, tokens) -> None:
    before = table_counts()
    for token in (None, "cst_not-a-real-token", tokens["alice"] + "x", "Basic abc"):
        response = post(client, "/api/jobs", make_spec(), token=token)
        assert response.status_code == 401
        assert response["WWW-Authenticate"] == 'Bearer realm="cuesched"'
        assert response.json()["errors"]
    response = client.post("/api/jobs", data=make_spec(), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Token {tokens['alice']}")  # fmt: skip
    assert response.status_code == 401
    User.objects.filter(username="alice").update(is_active=False)
    assert post(client, "/api/jobs", make_spec(), token=tokens["alice"]).status_code == 401
    assert table_counts() == before


def test_submit_returns_the_job_and_its_frame_count(client: Client, tokens) -> None:
    response = post(client, "/api/jobs", make_spec(), token=tokens["alice"])
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["frames"] == 13 and body["name"] == "demo-sh010-light_v1"
    job = Job.objects.get(pk=body["job"])
    assert job.str_user == "alice"
    # Without a user in the spec, the job belongs to the token's user.
    spec = simple_spec("bobs")
    del spec["user"]
    response = post(client, "/api/jobs", spec, token=tokens["bob"])
    assert response.status_code == 201
    assert Job.objects.get(pk=response.json()["job"]).str_user == "bob"


def test_a_malformed_body_or_a_bad_spec_is_refused_with_every_reason(client: Client, tokens) -> None:
    before = table_counts()
    for raw, expected in (
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "body is empty"),
        (b"\xff\xfe", "not UTF-8"),
    ):
        response = post(client, "/api/jobs", token=tokens["alice"], raw=raw)
        assert response.status_code == 400
        assert expected in response.json()["errors"][0]
    bad = make_spec(show="nope", layers=[{"name": "a", "command": "x", "range": "1-3", "memory": "512"}])
    response = post(client, "/api/jobs", bad, token=tokens["alice"])
    assert response.status_code == 400
    assert response.json()["errors"] == [
        "layer 'a'.memory: '512' has no unit: write e.g. '4GB' or '512MB'",
        "show: unknown show 'nope'",
    ]
    assert table_counts() == before


def test_submitting_as_another_user_needs_the_right_to_control_any_job(client: Client, tokens) -> None:
    before = table_counts()
    response = post(client, "/api/jobs", simple_spec("for-bob", user="bob"), token=tokens["alice"])
    assert response.status_code == 403
    assert response.json() == {"errors": ["user 'alice' may not submit jobs as 'bob'"]}
    assert table_counts() == before
    response = post(client, "/api/jobs", simple_spec("for-bob", user=42), token=tokens["alice"])
    assert response.status_code == 400  # not a user name at all: a spec error, not a permission one
    assert response.json() == {"errors": ["job.user: must be a string, not 42"]}
    assert table_counts() == before
    response = post(client, "/api/jobs", simple_spec("for-bob", user="bob"), token=tokens["carol"])
    assert response.status_code == 201
    assert Job.objects.get(pk=response.json()["job"]).str_user == "bob"


def test_a_user_controls_only_their_own_jobs_unless_staff_or_permitted(client: Client, tokens) -> None:
    job = submit_job(simple_spec("alices"), user="alice").job_id
    url = f"/api/jobs/{job}"
    for action, body in (("pause", None), ("kill", None), ("priority", {"priority": 9}), ("eat", {})):
        response = post(client, f"{url}/{action}", body, token=tokens["bob"])
        assert response.status_code == 403, action
        assert response.json() == {"errors": [f"user 'bob' may not {action} job 'alices' of 'alice'"]}
    job_row = Job.objects.get(pk=job)
    assert (job_row.b_paused, job_row.str_state) == (False, "PENDING")
    assert JobResource.objects.get(job_id=job).int_priority == 1
    assert set(frame_states(job).values()) == {"WAITING"}

    response = post(client, f"{url}/pause", token=tokens["alice"])
    assert response.status_code == 200
    assert response.json() == {"job": job, "action": "pause", "changed": 1}
    assert post(client, f"{url}/resume", token=tokens["carol"]).json()["changed"] == 1  # staff
    assert post(client, "/api/jobs/alices/priority", {"priority": 7}, token=tokens["dave"]).status_code == 200
    assert JobResource.objects.get(job_id=job).int_priority == 7


def test_every_control_route(client: Client, tokens) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    token = tokens["alice"]
    url = f"/api/jobs/{job}"

    response = post(client, f"{url}/max-cores", {"max_cores": 12}, token=token)
    assert response.status_code == 200 and response.json()["changed"] == 1
    assert JobResource.objects.get(job_id=job).int_max_cores == 1200
    response = post(client, f"{url}/eat", {"layer": "sim"}, token=token)
    assert response.json() == {"job": job, "action": "eat", "changed": 2, "finished": False}
    response = post(client, f"{url}/eat", {"frames": ["0001-render", "0002-render"]}, token=token)
    assert response.json()["changed"] == 2
    Job.objects.filter(pk=job).update(str_state="PENDING")
    with connection.cursor() as cur:
        cur.execute("UPDATE frame SET str_state = 'DEAD' WHERE pk_job = %s AND str_name = '0003-render'", [job])
    response = post(client, f"{url}/retry", {"frames": ["0003-render"]}, token=token)
    assert response.json() == {"job": job, "action": "retry", "changed": 1, "reopened": False}
    response = post(client, f"{url}/retry", token=token)  # no body: every dead frame (none left)
    assert response.json() == {"job": job, "action": "retry", "changed": 0, "reopened": False}

    detail = client.get(url, HTTP_AUTHORIZATION=f"Bearer {tokens['bob']}")  # anyone may read
    assert detail.status_code == 200
    body = detail.json()
    assert (body["name"], body["user"], body["state"], body["max_cores"]) == ("demo-sh010-light_v1", "alice",
                                                                              "PENDING", 12)  # fmt: skip
    assert body["frames"]["eaten"] == 4 and body["frames"]["total"] == 13
    assert [layer["name"] for layer in body["layers"]] == ["sim", "render", "movie"]
    assert body["layers"][0]["frames"]["eaten"] == 2

    response = post(client, f"{url}/kill", token=token)
    assert response.status_code == 200
    assert response.json()["finished"] is True
    assert Job.objects.get(pk=job).str_state == "FINISHED"


def test_bad_control_requests_change_nothing(client: Client, tokens) -> None:
    job = submit_job(simple_spec("steady"), user="alice").job_id
    token = tokens["alice"]
    url = f"/api/jobs/{job}"
    cases = [
        ("priority", {"priority": "high"}, 400, "priority must be a whole number"),
        ("priority", {"prio": 3}, 400, 'send {"priority": <whole number>}'),
        ("priority", None, 400, "body is empty"),
        ("max-cores", {"max_cores": -7}, 400, "cannot be negative"),
        ("eat", {"frames": "0001-main"}, 400, "frames must be a list"),
        ("eat", {"frames": ["0099-main"]}, 400, "the job has no frame '0099-main'"),
        ("retry", {"layer": "nope"}, 400, "the job has no layer 'nope'"),
        ("eat", {"everything": True}, 400, "unknown field(s) everything"),
        ("pause", {"now": True}, 400, "pause takes no fields"),
        ("explode", None, 404, "unknown action 'explode'"),
    ]
    for action, body, status, message in cases:
        response = post(client, f"{url}/{action}", body, token=token)
        assert response.status_code == status, (action, response.content)
        assert message in response.json()["errors"][0], (action, response.json())
    response = post(client, f"{url}/pause", token=token, raw=b"{oops")
    assert response.status_code == 400
    assert post(client, "/api/jobs/no-such-job/pause", token=token).status_code == 404
    assert client.put("/api/jobs", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405  # GET lists now
    assert client.delete(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405
    row = Job.objects.get(pk=job)
    assert (row.b_paused, row.str_state) == (False, "PENDING")
    resource = JobResource.objects.get(job_id=job)
    assert (resource.int_priority, resource.int_max_cores) == (1, 5000)
    assert set(frame_states(job).values()) == {"WAITING"}


def test_token_auth_needs_no_csrf_token(tokens) -> None:
    client = Client(enforce_csrf_checks=True)
    assert post(client, "/api/jobs", simple_spec("csrf"), token=tokens["alice"]).status_code == 201


# --- the commands -----------------------------------------------------------------------------


def test_api_token_stores_only_a_digest_and_rotates(client: Client, farm) -> None:
    User.objects.create(username="erin")
    out = io.StringIO()
    call_command("api_token", "erin", stdout=out)
    first = out.getvalue().strip()
    row = ApiToken.objects.get(user__username="erin")
    assert row.digest == digest(first) and first not in (row.digest, row.prefix)
    assert first.startswith(row.prefix)
    assert post(client, "/api/jobs", simple_spec("e1", user="erin"), token=first).status_code == 201
    out = io.StringIO()
    call_command("api_token", "erin", stdout=out)
    second = out.getvalue().strip()
    assert second != first and ApiToken.objects.filter(user__username="erin").count() == 1
    assert post(client, "/api/jobs", simple_spec("e2", user="erin"), token=first).status_code == 401
    assert post(client, "/api/jobs", simple_spec("e2", user="erin"), token=second).status_code == 201
    call_command("api_token", "erin", "--revoke", stdout=io.StringIO())
    assert post(client, "/api/jobs", simple_spec("e3", user="erin"), token=second).status_code == 401
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("api_token", "nobody")


def test_submit_job_command_from_a_file_and_from_stdin(farm, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(make_spec()))
    out = io.StringIO()
    call_command("submit_job", str(path), stdout=out)
    job = Job.objects.get(str_name="demo-sh010-light_v1")
    assert out.getvalue().strip() == f"{job.pk} demo-sh010-light_v1: 13 frames in 3 layers"

    spec = simple_spec("from-stdin")
    del spec["user"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(spec).encode())))
    out = io.StringIO()
    call_command("submit_job", "-", "--user", "frank", stdout=out)
    assert out.getvalue().strip().endswith("from-stdin: 4 frames in 1 layers")
    assert Job.objects.get(str_name="from-stdin").str_user == "frank"


def test_submit_job_command_lists_every_error_and_fails(farm, tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(make_spec(show="nope", priority="high")))
    err = io.StringIO()
    before = table_counts()
    with pytest.raises(CommandError, match=r"refused \(2 error\(s\)\); nothing was submitted"):
        call_command("submit_job", str(path), stderr=err)
    assert err.getvalue().splitlines() == [
        "error: job.priority: must be a whole number, not 'high'",
        "error: show: unknown show 'nope'",
    ]
    assert table_counts() == before
    with pytest.raises(CommandError, match="cannot read"):
        call_command("submit_job", str(tmp_path / "missing.json"))


def test_job_command_controls_a_job_by_name(farm) -> None:
    job = submit_job(make_spec(), user="alice").job_id

    def run(*args: str) -> str:
        out = io.StringIO()
        call_command("job", *args, stdout=out)
        return out.getvalue().strip()

    name = "demo-sh010-light_v1"
    assert run("pause", name) == f"{name}: paused"
    assert run("pause", job) == f"{name}: already paused"
    assert run("resume", name) == f"{name}: resumed"
    assert run("priority", name, "40") == f"{name}: priority 40"
    assert run("max-cores", name, "8") == f"{name}: max cores 8"
    assert run("eat", name, "0001-sim", "--layer", "sim") == f"{name}: 1 frames eaten"
    assert run("retry", name) == f"{name}: 0 frames to retry"
    assert json.loads(run("show", name))["priority"] == 40
    assert run("kill", name) == f"{name}: killed (no frame was running, 12 frames eaten)"
    with pytest.raises(CommandError, match="no job with id or name 'ghost'"):
        run("pause", "ghost")
    with pytest.raises(CommandError, match="priority must be a whole number"):
        run("priority", name, "-3")


def test_admin_job_actions_call_the_actions(admin_client: Client, farm) -> None:
    job = submit_job(simple_spec("admin-job"), user="alice").job_id
    url = "/admin/dispatch/job/"
    response = admin_client.post(url, {"action": "pause_job_selected", "_selected_action": [job]}, follow=True)
    assert response.status_code == 200
    assert Job.objects.get(pk=job).b_paused is True
    assert "Jobs paused: 1" in response.content.decode()
    # Kill asks first (issue 20: the console's destructive actions confirm); nothing before that.
    admin_client.post(url, {"action": "kill_job_selected", "_selected_action": [job]})
    assert Job.objects.get(pk=job).str_state != "FINISHED"
    admin_client.post(url, {"action": "kill_job_selected", "_selected_action": [job], "confirm": "yes"})
    assert Job.objects.get(pk=job).str_state == "FINISHED"
    assert set(frame_states(job).values()) == {"EATEN"}
