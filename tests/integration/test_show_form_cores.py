"""The show form's job defaults are typed and shown in cores, stored in centicores (issue 31, units)."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import RequestFactory

from dispatch.models import Show

pytestmark = pytest.mark.django_db


def _form_class(show: Show):  # type: ignore[no-untyped-def]
    request = RequestFactory().get("/")
    request.user = get_user_model().objects.create_superuser("su", "su@example.com", "pw")
    return admin.site._registry[Show].get_form(request, show, change=True)


def test_the_show_form_reads_and_writes_job_defaults_in_cores() -> None:
    show = Show.objects.create(
        pk="show-cores", str_name="cores", int_default_min_cores=100, int_default_max_cores=10000
    )
    form_class = _form_class(show)
    form = form_class(instance=show)
    assert form["int_default_max_cores"].value() == 100  # 10000 centicores read as 100 cores
    assert "cores" in str(form["int_default_max_cores"].label)
    assert "centicores" not in form.as_p()

    data = {name: form[name].value() for name in form.fields}
    data.update({"int_default_max_cores": "50", "int_default_min_cores": "0.5"})
    data = {k: ("" if v is None else v) for k, v in data.items()}
    bound = form_class(data, instance=show)
    assert bound.is_valid(), bound.errors
    assert bound.cleaned_data["int_default_max_cores"] == 5000
    assert bound.cleaned_data["int_default_min_cores"] == 50
    assert set(bound.changed_data) >= {"int_default_max_cores", "int_default_min_cores"}

    data["int_default_max_cores"] = "-1"  # unlimited stays Cuebot's -1, not -100 centicores
    bound = form_class(data, instance=show)
    assert bound.is_valid(), bound.errors
    assert bound.cleaned_data["int_default_max_cores"] == -1
    fresh = Show.objects.get(pk=show.pk)  # is_valid() wrote the cleaned values into `show` itself
    unchanged = form_class({**data, "int_default_max_cores": "100", "int_default_min_cores": "1"}, instance=fresh)
    assert unchanged.is_valid(), unchanged.errors
    assert "int_default_max_cores" not in unchanged.changed_data
