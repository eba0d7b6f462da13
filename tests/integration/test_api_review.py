"""Adversarial review of issue 21's API listing: bad query input answers 400, not 500."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.integration.test_api_lists import get, token  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("url", "param"),
    [("/api/jobs", "name"), ("/api/jobs", "show"), ("/api/jobs", "user"), ("/api/jobs/%s", None)],
)
def test_a_nul_byte_in_a_list_query_is_a_400_naming_it(client: Client, token: str, url: str, param: str | None) -> None:  # noqa: F811
    """PostgreSQL text cannot hold a NUL byte: psycopg refuses the parameter (DataError), which
    the API answered as a 500 "internal error" with a traceback in the log, for a bad query."""
    if param is None:
        response = get(client, url % "de%00mo" + "/frames", token)
    else:
        response = get(client, url, token, **{param: "de\x00mo"})
    assert response.status_code in (400, 404), response.content
    assert response.status_code != 500
    body = response.json()
    assert body["errors"] and all("internal error" not in e for e in body["errors"])
