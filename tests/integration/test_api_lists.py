"""The JSON API's lists (jobs, a job's layers and frames: filters, pages), and its errors: JSON on
every path under /api/, with or without a trailing slash, 404, 405, 500 and 503 included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import OperationalError, connection
from django.test import Client, RequestFactory, override_settings

from cuesched_project.urls import server_error
from dispatch.jobs import api
from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import issue_token
from dispatch.models import Alloc, Folder, Job, Show
from tests.integration.farm_fixtures import create_subscription
from tests.integration.submit_support import make_spec, simple_spec, submit_farm, table_counts

pytestmark = pytest.mark.django_db

User = get_user_model()


@pytest.fixture
def token() -> str:
    submit_farm()
    return issue_token(User.objects.create(username="alice"))


def get(client: Client, url: str, token: str | None, **params: Any) -> Any:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.get(url, params, **headers)


def names(response: Any) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["name"] for row in response.json()["results"]]


def second_show(name: str) -> None:
    """A show beside submit_farm's 'demo', on the same allocation, with its own root folder."""
    demo = Show.objects.get(str_name="demo")
    show = Show.objects.create(str_name=name, int_default_max_cores=5000)
    create_subscription(show, Alloc.objects.get(), int_burst=100_000)
    Folder.objects.create(show=show, dept=Folder.objects.filter(show=demo).first().dept, str_name=name, b_default=True)


def test_jobs_are_listed_newest_first_and_filtered_by_show_state_user_and_name(client: Client, token) -> None:
    second_show("other")
    ids = {}
    for name, user, show in (("a-light", "alice", "demo"), ("b-comp", "bob", "demo"), ("c-light", "bob", "other")):
        ids[name] = submit_job(simple_spec(name, user=user, show=show), user=user).job_id
    with connection.cursor() as cur:  # a distinct start time each, so "newest first" is checked
        for i, name in enumerate(("a-light", "b-comp", "c-light")):
            cur.execute("UPDATE job SET ts_started = now() + %s * interval '1 min' WHERE pk_job = %s", [i, ids[name]])
    Job.objects.filter(pk=ids["b-comp"]).update(str_state="FINISHED")

    assert names(get(client, "/api/jobs", token)) == ["c-light", "b-comp", "a-light"]
    assert names(get(client, "/api/jobs/", token)) == ["c-light", "b-comp", "a-light"]  # trailing slash
    assert names(get(client, "/api/jobs", token, show="demo")) == ["b-comp", "a-light"]
    assert names(get(client, "/api/jobs", token, user="bob")) == ["c-light", "b-comp"]
    assert names(get(client, "/api/jobs", token, state="pending")) == ["c-light", "a-light"]
    assert names(get(client, "/api/jobs", token, state="FINISHED,PENDING", show="demo")) == ["b-comp", "a-light"]
    assert names(get(client, "/api/jobs", token, name="LIGHT")) == ["c-light", "a-light"]
    assert names(get(client, "/api/jobs", token, user="nobody")) == []

    row = get(client, "/api/jobs", token, name="a-light").json()["results"][0]
    assert row == {
        "job": ids["a-light"],
        "name": "a-light",
        "show": "demo",
        "user": "alice",
        "state": "PENDING",
        "paused": False,
        "auto_eat": False,
        "priority": 1,
        "max_cores": 50,
        "max_gpus": row["max_gpus"],
        "frames": {"waiting": 4, "running": 0, "dead": 0, "depend": 0, "eaten": 0, "succeeded": 0, "total": 4},
        "killing": 0,
        "started": row["started"],
        "stopped": None,
    }
    assert row["started"]


def test_a_job_list_pages_through_every_job_once(client: Client, token) -> None:
    for i in range(7):
        submit_job(simple_spec(f"paged-{i}", frames=1), user="alice")
    seen: list[str] = []
    url: str | None = "/api/jobs?limit=3"
    pages = 0
    while url is not None:
        body = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").json()
        assert body["count"] == 7 and body["limit"] == 3
        seen += [row["name"] for row in body["results"]]
        url, pages = body["next"], pages + 1
    assert pages == 3 and sorted(seen) == [f"paged-{i}" for i in range(7)] and len(set(seen)) == 7
    last = get(client, "/api/jobs", token, limit=3, offset=6).json()
    assert last["next"] is None and last["previous"] == "/api/jobs?limit=3&offset=3"
    assert get(client, "/api/jobs", token, offset=50).json()["results"] == []


def test_a_jobs_layers_and_frames_are_listed_with_filters_and_pages(client: Client, token) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    body = get(client, f"/api/jobs/{job}/layers", token).json()
    assert body["count"] == 3 and body["next"] is None
    assert [(row["name"], row["cores"], row["frames"]["total"]) for row in body["results"]] == [
        ("sim", 1, 2),
        ("render", 2, 10),
        ("movie", 1, 1),
    ]
    assert names(get(client, "/api/jobs/demo-sh010-light_v1/layers/", token, limit=1, offset=1)) == ["render"]

    body = get(client, f"/api/jobs/{job}/frames", token).json()
    assert body["count"] == 13
    assert [row["name"] for row in body["results"][:3]] == ["0001-sim", "0006-sim", "0001-render"]
    frame = body["results"][0]
    assert set(frame) == {"frame", "name", "layer", "number", "state", "exit_status", "retries", "host", "started",
                          "stopped", "killing"}  # fmt: skip
    assert (frame["layer"], frame["number"], frame["state"], frame["exit_status"]) == ("sim", 1, "WAITING", -1)
    render = get(client, f"/api/jobs/{job}/frames/", token, layer="render", limit=4, offset=8).json()
    assert render["count"] == 10 and names_of(render) == ["0009-render", "0010-render"]
    assert render["previous"] == f"/api/jobs/{job}/frames/?layer=render&limit=4&offset=4"
    assert names_of(get(client, f"/api/jobs/{job}/frames", token, state="depend", layer="movie").json()) == [
        "0001-movie"
    ]
    assert get(client, f"/api/jobs/{job}/frames", token, state="waiting,running").json()["count"] == 2


def names_of(body: dict[str, Any]) -> list[str]:
    return [row["name"] for row in body["results"]]


def test_a_bad_query_is_refused_with_every_reason(client: Client, token) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    response = get(client, "/api/jobs", token, limit="0", offset="x", colour="red")
    assert response.status_code == 400
    assert response.json() == {
        "errors": [
            "unknown query parameter 'colour' (known: show, state, user, name, limit, offset)",
            "limit must be a whole number from 1 to 1000, not '0'",
            "offset must be a whole number from 0 to 1000000000, not 'x'",
        ]
    }
    response = get(client, "/api/jobs", token, state="RUNNING")
    assert response.status_code == 400
    assert "'RUNNING' is not a state (states: PENDING, FINISHED" in response.json()["errors"][0]
    response = get(client, f"/api/jobs/{job}/frames", token, layer="nope", state="LOST")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        "state: 'LOST' is not a state (states: WAITING, SETUP, RUNNING, SUCCEEDED, DEPEND, DEAD, EATEN, CHECKPOINT)",
        "layer: the job has no layer 'nope'",
    ]
    assert get(client, f"/api/jobs/{job}/layers", token, limit="5000").status_code == 400
    assert get(client, "/api/jobs/ghost/frames", token).status_code == 404
    assert get(client, "/api/jobs", None).status_code == 401


def test_every_path_under_api_answers_json_with_or_without_its_slash(client: Client, token) -> None:
    job = submit_job(simple_spec("slashes"), user="alice").job_id
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    cases = [
        ("get", f"/api/jobs/{job}", 200),
        ("get", f"/api/jobs/{job}/", 200),
        ("post", f"/api/jobs/{job}/pause/", 200),
        ("post", f"/api/jobs/{job}/resume", 200),
        ("get", f"/api/jobs/{job}/pause", 405),
        ("post", f"/api/jobs/{job}/", 405),
        ("delete", "/api/jobs/", 405),
        ("post", f"/api/jobs/{job}/layers", 405),
        ("post", f"/api/jobs/{job}/explode/", 404),
        ("get", "/api/jobs/ghost/", 404),
        ("get", "/api", 404),
        ("get", "/api/", 404),
        ("get", "/api/hosts", 404),
        ("post", "/api/jobs/a/b/c", 404),
        ("get", "/api/jobs/a/b/c/", 404),
    ]
    for method, url, status in cases:
        response = getattr(client, method)(url, content_type="application/json", **auth)
        assert response.status_code == status, (method, url, response.content[:200])
        assert response["Content-Type"] == "application/json", (method, url)
        assert response.json()["errors" if status >= 400 else next(iter(response.json()))]
    unknown = client.get("/api/hosts").json()["errors"][0]
    assert unknown.startswith("no API route '/api/hosts'; routes: GET /api/jobs, POST /api/jobs,")
    assert all(route in unknown for route in api.ROUTES)
    post = client.post("/api/jobs/", data=json.dumps(simple_spec("with-slash")), content_type="application/json",
                       **auth)  # fmt: skip
    assert post.status_code == 201


def test_a_bug_or_a_lost_database_answers_json_without_a_traceback(
    client: Client, token, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = submit_job(simple_spec("faulty"), user="alice").job_id

    def boom(job: Job) -> dict[str, Any]:
        raise KeyError("secret-internal-detail")

    monkeypatch.setattr(api, "describe_job", boom)
    response = get(client, f"/api/jobs/{job}", token)
    assert response.status_code == 500
    assert response.json() == {"errors": ["internal error (KeyError); the server log has the details"]}
    assert b"secret-internal-detail" not in response.content

    def lost(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("server closed the connection unexpectedly")

    before = table_counts()
    monkeypatch.setattr(api, "submit_job", lost)
    response = client.post("/api/jobs", data=json.dumps(simple_spec("x")), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip
    assert response.status_code == 503
    assert response.json() == {"errors": ["the database is unavailable: try again shortly"]}
    assert table_counts() == before

    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=100):  # too big a body: the client's error, not a bug
        response = client.post("/api/jobs", data=json.dumps(simple_spec("big" * 50)), content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip
    assert response.status_code == 400
    assert response.json()["errors"][0].startswith("the request was refused: Request body exceeded")
    assert table_counts() == before

    # An error outside the API's views (Django's own 500 handler, DEBUG off) is JSON under /api/ too.
    factory = RequestFactory()
    assert server_error(factory.get("/api/jobs")).status_code == 500
    assert json.loads(server_error(factory.get("/api/jobs")).content)["errors"]
    assert server_error(factory.get("/admin/"))["Content-Type"].startswith("text/html")


def test_a_token_in_the_wrong_scheme_is_named_as_such(client: Client, token) -> None:
    def errors(header: str | None) -> list[str]:
        headers = {"HTTP_AUTHORIZATION": header} if header is not None else {}
        response = client.get("/api/jobs", **headers)
        assert response.status_code == 401
        return response.json()["errors"]

    assert errors(f"Token {token}") == [
        "the Authorization header uses the 'Token' scheme: send 'Authorization: Bearer <token>'"
    ]
    assert errors(token) == ["the Authorization header uses no scheme: send 'Authorization: Bearer <token>'"]
    assert errors("Bearer ") == ["the Authorization header has no token after 'Bearer'"]
    assert errors(None) == ["an API token is required: send 'Authorization: Bearer <token>'"]
    assert errors("Bearer cst_nope") == ["the API token is not valid"]
