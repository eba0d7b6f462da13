"""The cap pages' other core and memory columns name their unit: on the job-resource form, a
centicore "min cores" beside the whole-core "max cores" cap must not read as 100 cores."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from dispatch.models import JobResource
from ops import permissions
from ops.caps_admin import shown_with_unit
from tests.integration.farm_fixtures import tiny_farm
from tests.integration.ops_support import make_user

pytestmark = pytest.mark.django_db


def page_of(user_name: str, *, superuser: bool) -> str:
    farm = tiny_farm(managed=False, int_burst=10_000)
    row = JobResource.objects.get(job=farm.job)
    JobResource.objects.filter(pk=row.pk).update(int_max_cores=4000, int_min_cores=100, int_max_rss=4 * 1024**2)
    client = Client()
    client.force_login(make_user(user_name, permissions.OPERATORS, superuser=superuser))
    response = client.get(reverse("admin:dispatch_jobresource_change", args=[row.pk]))
    assert response.status_code == 200
    return response.content.decode()


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_an_operator_sees_every_core_and_memory_column_with_its_unit() -> None:
    html = page_of("olga", superuser=False)
    text = text_of(html)
    assert 'name="int_max_cores"' in html and 'value="40"' in html  # the cap, editable, in cores
    assert "Min cores (centicores): 1 core (100 centicores)" in text
    assert "Booked cores (centicores): 0 cores (0 centicores)" in text
    assert "Max RSS (KB): 4 GB (4194304 KB)" in text
    assert "Int min cores" not in text and "Int cores" not in text and "Int max rss" not in text
    assert 'name="int_min_cores"' not in html  # still read-only for an operator


def test_a_superuser_edits_min_cores_in_centicores_said_so() -> None:
    html = page_of("sue", superuser=True)
    text = text_of(html)
    assert 'name="int_min_cores"' in html  # editable, in the column's own unit, labelled with it
    assert "min cores (centicores):" in text.lower() and "100 centicores = 1 core." in text
    assert "booked cores (centicores): 0 cores (0 centicores)" in text.lower()
    assert "Int min cores" not in text


def test_values_are_shown_in_both_units() -> None:
    assert shown_with_unit(100, "centicores") == "1 core (100 centicores)"
    assert shown_with_unit(250, "centicores") == "2.5 cores (250 centicores)"
    assert shown_with_unit(-250, "centicores") == "-2.5 cores (-250 centicores)"
    assert shown_with_unit(4000, "centicores") == "40 cores (4000 centicores)"
    assert shown_with_unit(1536 * 1024, "KB") == "1.5 GB (1572864 KB)"
    assert shown_with_unit(0, "KB") == "0 KB"
    assert shown_with_unit(None, "KB") == "-"
