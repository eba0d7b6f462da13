"""The examples of docs/jobs.md and docs/api.md, run: the complete spec is accepted and makes the
frames the page says, and every curl line of the API page, in page order, answers what it shows."""

from __future__ import annotations

import re
import shlex

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from dispatch.jobs.spec import load_spec
from dispatch.jobs.tokens import issue_token
from dispatch.models import Job
from tests.integration.submit_support import submit_farm
from tests.unit.test_docs import API_DOC, FENCED, JOBS_DOC

pytestmark = pytest.mark.django_db


def json_examples() -> list[str]:
    return re.findall(r"^```json\n(.*?)^```", JOBS_DOC.read_text(), re.S | re.M)


@pytest.fixture
def token() -> str:
    submit_farm()  # show demo, folder lighting, facility local, dept pipeline, allocation tag general
    return issue_token(get_user_model().objects.create(username="alice"))


def test_the_complete_spec_makes_the_frames_the_page_says(client: Client, token: str) -> None:
    complete, smallest = json_examples()[:2]
    stated = int(re.search(r"This makes (\d+) frames", JOBS_DOC.read_text()).group(1))
    response = client.post("/api/jobs", data=complete, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip
    assert response.status_code == 201, response.content
    assert response.json()["frames"] == stated
    job = Job.objects.get(str_name=load_spec(complete)["name"])
    assert sorted(job.layers.values_list("str_name", flat=True)) == ["movie", "render", "sim"]
    response = client.post("/api/jobs", data=smallest, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip
    assert response.status_code == 201, response.content


def test_every_curl_example_answers_as_the_page_shows(client: Client, token: str) -> None:
    from django.contrib.auth.models import Permission

    spec = json_examples()[0]
    # The page's licence-limit writes use an operator's token (ops.edit_caps), as it says.
    operator = get_user_model().objects.create(username="olga")
    operator.user_permissions.add(Permission.objects.get(codename="edit_caps", content_type__app_label="ops"))
    ops_token = issue_token(operator)
    ran = 0
    for block in FENCED.findall(API_DOC.read_text()):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("curl "):
                continue
            words = shlex.split(line.replace("$OPS_TOKEN", ops_token).replace("$TOKEN", token))
            method = words[words.index("-X") + 1] if "-X" in words else "GET"
            headers = {}
            for j, word in enumerate(words):
                if word == "-H":
                    name, _, value = words[j + 1].partition(": ")
                    headers[f"HTTP_{name.upper().replace('-', '_')}"] = value
            data = words[words.index("--data") + 1] if "--data" in words else ""
            if data == "@job.json":
                data = spec
            url = next(w for w in words if w.startswith("http"))
            path = url.split("://", 1)[1].split("/", 1)[1]
            shown = re.match(r"# (\d{3}) ", lines[i + 1]) if i + 1 < len(lines) else None
            creates = method == "POST" and path in ("api/jobs", "api/limits")
            expected = int(shown.group(1)) if shown else (201 if creates else 200)
            response = client.generic(method, f"/{path}", data=data, content_type="application/json", **headers)
            assert response.status_code == expected, (line, response.content[:300])
            assert response["Content-Type"] == "application/json"
            ran += 1
    assert ran >= 12
