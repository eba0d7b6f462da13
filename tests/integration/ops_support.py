"""Helpers for the ops console tests: users in each group, and a hand-made scheduler live view.

`publish_view` writes the same row the scheduler's publisher writes (accounting.live), with
a chosen age, so pages can be tested against a running, stale or absent scheduler without
running one; the tests that need the real thing use runtime_support.running_scheduler().
"""

from __future__ import annotations

import json
import time
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import connection

from ops import permissions

PUBLISH_SQL = """
INSERT INTO cuesched_scheduler_state (id, pid, hostname, heartbeat, payload)
VALUES (1, 4242, 'test-host', now() - make_interval(secs => %s), %s::jsonb)
ON CONFLICT (id) DO UPDATE SET heartbeat = EXCLUDED.heartbeat, payload = EXCLUDED.payload
"""


def make_user(name: str, group: str | None, *, superuser: bool = False) -> AbstractBaseUser:
    """A staff user (no password: tests use force_login) in `group` (None: in no group)."""
    permissions.ensure_groups()
    user = get_user_model().objects.create(username=name, is_staff=True, is_superuser=superuser)
    if group is not None:
        user.groups.add(Group.objects.get(name=group))
    return user


def base_view(**extra: Any) -> dict[str, Any]:
    view: dict[str, Any] = {
        "started_at": time.time() - 60,
        "bootstrapped_at": time.time() - 59,
        "published_at": time.time(),
        "epoch": 3,
        "managed_shows": {},
        "listener": {"state": "listening", "releases_applied": 0, "releases_skipped": 0, "limits_applied": 0,
                     "reconnects": 0, "last_error": None},
        "recent_caps": [],
        "recompute": {"at": time.time() - 5, "store_seconds": 0.01, "pg_seconds": 0.02, "keys": 3, "rows": 3,
                      "drift_cores": {"sub": 0, "folder": 0, "job": 0}, "evicted": 0, "pg_error": None},
        "loops": {},
        "extra": {},
        "sub": {},
        "folder": {},
        "job": {},
    }  # fmt: skip
    view.update(extra)
    return view


def publish_view(view: dict[str, Any], *, age_seconds: float = 0.0) -> None:
    with connection.cursor() as cur:
        cur.execute(PUBLISH_SQL, [age_seconds, json.dumps(view)])


def clear_view() -> None:
    with connection.cursor() as cur:
        cur.execute("DELETE FROM cuesched_scheduler_state")
