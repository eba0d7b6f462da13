"""Licence limits from the outside: the job spec's layer `limits`, the JSON API, the audit (issue 19)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.test import Client

from accounting import actions as cap_actions
from dispatch.jobs.plan import SpecError
from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import issue_token
from dispatch.models import LayerLimit, LimitRecord
from ops.models import LimitRecordEvent
from tests.integration.submit_support import simple_spec, submit_farm, table_counts

pytestmark = pytest.mark.django_db

User = get_user_model()


def _post(client: Client, url: str, body: Any, token: str) -> Any:
    return client.post(url, data=json.dumps(body).encode(), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip


def test_spec_limits_tag_the_layers_and_an_unknown_name_writes_nothing() -> None:
    submit_farm()
    arnold = LimitRecord.objects.create(str_name="arnold", int_max_value=10)
    spec = simple_spec("lim-job")
    spec["layers"][0]["limits"] = ["arnold", "arnold"]
    result = submit_job(spec, user="alice")
    assert list(LayerLimit.objects.filter(layer__job_id=result.job_id).values_list("limit_id", flat=True)) == [
        arnold.pk
    ]
    before = table_counts()
    bad = simple_spec("lim-job2")
    bad["layers"][0]["limits"] = ["arnold", "nuke"]
    with pytest.raises(SpecError) as err:
        submit_job(bad, user="alice")
    assert any("unknown limit 'nuke'" in e for e in err.value.errors)
    bad["layers"][0]["limits"] = "arnold"
    with pytest.raises(SpecError) as err:
        submit_job(bad, user="alice")
    assert any("must be a list of limit names" in e for e in err.value.errors)
    assert table_counts() == before


def test_actions_validate_audit_and_warn_when_lowering_below_use() -> None:
    result = cap_actions.create_limit("katana", 5, actor="ops1")
    limit = result.target
    with pytest.raises(ValidationError):
        cap_actions.create_limit("katana", 5, actor="ops1")
    with pytest.raises(ValidationError):
        cap_actions.create_limit("x", -2, actor="ops1")
    with pytest.raises(ValidationError):
        cap_actions.set_limit(limit, max_value="many", actor="ops1")
    changed = cap_actions.set_limit(limit, max_value=2, actor="ops2")
    assert changed.changed and not changed.warnings
    same = cap_actions.set_limit(limit, max_value=2, actor="ops2")
    assert not same.changed
    events = list(LimitRecordEvent.objects.filter(pk_limit_record=limit).order_by("pgh_id"))
    assert [e.pgh_label for e in events] == ["limit_create", "limit_change"]
    assert (events[1].old_int_max_value, events[1].int_max_value) == (5, 2)
    assert events[1].pgh_context.metadata["username"] == "ops2"
    assert events[1].pgh_context.metadata["action"] == "set_limit"


def test_api_lists_creates_and_changes_limits_for_cap_editors_only(client: Client) -> None:
    submit_farm()
    alice = User.objects.create(username="alice")
    ed = User.objects.create(username="ed")
    ed.user_permissions.add(Permission.objects.get(codename="edit_caps", content_type__app_label="ops"))
    alice_token, ed_token = issue_token(alice), issue_token(ed)
    denied = _post(client, "/api/limits", {"name": "arnold", "max": 3}, alice_token)
    assert denied.status_code == 403
    created = _post(client, "/api/limits", {"name": "arnold", "max": 3, "host_limit": True}, ed_token)
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["name"], body["max"], body["host_limit"], body["running"]) == ("arnold", 3, True, 0)
    bad = _post(client, "/api/limits", {"name": "", "max": 3}, ed_token)
    assert bad.status_code == 400 and bad.json()["errors"]
    listed = client.get("/api/limits", HTTP_AUTHORIZATION=f"Bearer {alice_token}")
    assert [row["name"] for row in listed.json()["limits"]] == ["arnold"]
    changed = _post(client, "/api/limits/arnold", {"max": 7}, ed_token)
    assert changed.status_code == 200 and changed.json()["changed"] and changed.json()["max"] == 7
    assert _post(client, "/api/limits/arnold", {"max": 7, "colour": 1}, ed_token).status_code == 400
    assert _post(client, "/api/limits/nope", {"max": 7}, ed_token).status_code == 404
    assert _post(client, "/api/limits/arnold", {"max": 1}, alice_token).status_code == 403
    assert LimitRecord.objects.get(str_name="arnold").int_max_value == 7
    assert LimitRecordEvent.objects.filter(str_name="arnold").count() == 2


def test_console_creates_changes_and_shows_limits_audited(client: Client) -> None:
    admin_user = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin_user)
    add = client.post(
        "/admin/dispatch/limitrecord/add/", {"str_name": "houdini", "int_max_value": "4", "b_host_limit": ""}
    )
    assert add.status_code == 302, add.content[:2000]
    row = LimitRecord.objects.get(str_name="houdini")
    assert (row.int_max_value, row.b_host_limit, row.int_running) == (4, False, 0)
    change = client.post(
        f"/admin/dispatch/limitrecord/{row.pk}/change/", {"int_max_value": "2", "b_host_limit": "on"}
    )
    assert change.status_code == 302, change.content[:2000]
    row.refresh_from_db()
    assert (row.int_max_value, row.b_host_limit) == (2, True)
    listing = client.get("/admin/dispatch/limitrecord/")
    assert listing.status_code == 200 and b"houdini" in listing.content
    events = client.get("/admin/ops/limitrecordevent/")
    assert events.status_code == 200 and b"root" in events.content
    labels = list(LimitRecordEvent.objects.filter(str_name="houdini").values_list("pgh_label", flat=True))
    assert sorted(labels) == ["limit_change", "limit_create"]
    # The merged audit trail has it, old -> new, beside the cap changes.
    from ops.admin_views import audit_events

    entries = [e for e in audit_events(kind="limit") if e["object"] == "limit houdini"]
    changes = {(e["field"], e["old"], e["new"], e["user"]) for e in entries}
    assert ("licence max", "4 licences", "2 licences", "root") in changes
    assert ("per host", "no", "yes", "root") in changes
    trail = client.get("/admin/ops/console/audit/", {"kind": "limit"})
    assert trail.status_code == 200 and b"limit houdini" in trail.content
