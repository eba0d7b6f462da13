"""Shared test set-up: every test that touches the database runs on real PostgreSQL.

`DATABASE_URL` (or the embedded server) decides which server; pytest-django creates
`test_<name>` on it, so two checkouts can test side by side with different names.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

_SERVICES_SEED = "dispatch.migrations.0041_services_seed"


@pytest.fixture(autouse=True)
def _seeded_services(request: pytest.FixtureRequest) -> None:
    """Every database test starts with the services a migrated database has.

    A transactional test ends with Django's flush, which empties every table, the rows migrations
    seed included: Cuebot's default services went with it, and a later test's layers resolved
    through the spec's fallback instead of the `shell` or `arnold` row (a pass or a failure by
    test order). The seed is the migration's own function, and it only adds missing rows.
    """
    if request.node.get_closest_marker("django_db") is None:
        return
    request.getfixturevalue("_django_db_helper")  # the test's database and transaction first
    from django.apps import apps
    from django.db import connection

    from dispatch.models import Service

    if not Service.objects.filter(str_name="default").exists():
        importlib.import_module(_SERVICES_SEED).seed(apps, SimpleNamespace(connection=connection))
