"""Cuebot's services on cuesched's own database (issue 29, "Services on every database").

A plain cuesched database has Cuebot's `service` and `show_service` tables with Cuebot's default
services; a layer that names a service gets its defaults from the show's override, else the
service, else Cuebot's `default` service, and what the spec gives wins; operators change them in
the console and through the API, each change one audited action, and bad input writes nothing.
(The memory-failure increase on a plain database: tests/integration/test_frame_life.py. Beside a
Cuebot database: test_cuebot_usage.py and test_cuebot_adoption.py.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import Client

from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import issue_token
from dispatch.models import FarmAction, Layer, Service, ShowService
from ops import service_actions
from ops.setup_actions import NotFound
from tests.integration.submit_support import submit_farm

pytestmark = pytest.mark.django_db

User = get_user_model()
GB = 1024 * 1024  # KB

# Cuebot's seed_data.sql: (name, threadable, centicores, KB, tags), but `default`: cuesched's
# (what a layer naming no service booked before services; no tags = the allocations' tags).
CUEBOT_SEED = {
    ("default", True, 100, 4 * GB, ""),
    ("prman", False, 100, 3355443, "general | desktop"),
    ("arnold", True, 100, 3355443, "general | desktop"),
    ("shell", False, 100, 3355443, "general | util"),
    ("maya", False, 100, 2097152, "general | desktop"),
    ("houdini", False, 100, 3355443, "general | desktop"),
    ("katana", True, 100, 2097152, "general | desktop | util"),
    ("nuke", False, 100, 2097152, "general | desktop"),
    ("preprocess", False, 10, 393216, "util"),
    ("postprocess", False, 10, 524288, "util"),
}


def _layer(job: str, name: str) -> tuple[Any, ...]:
    return tuple(
        Layer.objects.filter(job_id=job, str_name=name)
        .values_list(
            "int_cores_min", "int_mem_min", "str_tags", "b_threadable", "int_timeout", "int_timeout_llu", "str_services"
        )
        .get()
    )


def _spec(name: str, *layers: dict[str, Any]) -> dict[str, Any]:
    return {
        "show": "demo",
        "name": name,
        "user": "alice",
        "layers": [{"command": "true", "range": "1", **layer} for layer in layers],
    }


def _snapshot() -> tuple[Any, ...]:
    rows = sorted(Service.objects.values_list(*service_actions.COLUMNS))
    overrides = sorted(ShowService.objects.values_list("show_id", *service_actions.COLUMNS))
    return rows, overrides, FarmAction.objects.count()


def test_a_plain_database_has_cuebots_tables_and_default_services() -> None:
    got = set(Service.objects.values_list("str_name", "b_threadable", "int_cores_min", "int_mem_min", "str_tags"))
    assert got == CUEBOT_SEED
    # The columns Cuebot's seed leaves out have V7/V11/V15's defaults.
    assert set(
        Service.objects.values_list(
            "int_cores_max", "int_gpus_min", "int_gpus_max", "int_gpu_mem_min", "int_timeout", "int_timeout_llu"
        )
    ) == {(0, 0, 0, 0, 0, 0)}
    assert set(Service.objects.values_list("int_min_memory_increase", flat=True)) == {2 * GB}
    assert Service.objects.get(str_name="default").pk == "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0"
    with connection.cursor() as cur:
        cur.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns "
            "WHERE table_name IN ('service', 'show_service') AND column_name IN "
            "('int_mem_min', 'int_gpu_mem_min', 'int_min_memory_increase', 'pk_show') ORDER BY 1, 2"
        )
        assert cur.fetchall() == [
            ("service", "int_gpu_mem_min", "bigint", "NO", "0"),
            ("service", "int_mem_min", "integer", "NO", None),
            ("service", "int_min_memory_increase", "integer", "NO", "2097152"),
            ("show_service", "int_gpu_mem_min", "bigint", "NO", "0"),
            ("show_service", "int_mem_min", "integer", "NO", None),
            ("show_service", "int_min_memory_increase", "integer", "NO", "2097152"),
            ("show_service", "pk_show", "character varying", "NO", None),
        ]


def test_a_service_max_gpus_does_not_break_a_submit_on_cuesched_s_own_database() -> None:
    """Review of the merge: a service's max GPUs went to `layer.int_gpus_max`, a column only
    Cuebot's layer has, so one edit of `default` made every submit on a plain database fail with
    UndefinedColumn (this test failed so). A frame here books the GPUs it asks; the max stays on
    the service, for an adopted database."""
    submit_farm(hosts=1)
    service_actions.update_service("default", {"int_gpus_max": 1}, actor="ops")
    result = submit_job(_spec("demo-sh010-gpumax_v1", {"name": "plain"}), user="alice")
    assert _layer(result.job_id, "plain")[-1] == "default"


def test_a_layer_gets_its_services_defaults_the_show_override_wins_and_the_spec_wins_over_both() -> None:
    farm = submit_farm(hosts=1)
    service_actions.update_service(
        "arnold", {"int_cores_min": 400, "int_mem_min": 12 * GB, "int_timeout": 90, "int_timeout_llu": 20},
        actor="ops",
    )  # fmt: skip
    first = submit_job(
        _spec(
            "demo-sh010-svc_v1",
            {"name": "arnold", "services": ["arnold"]},
            {"name": "mine", "services": ["arnold"], "cores": 2, "memory": "2GB", "timeout": 5, "threadable": False},
            {"name": "unknown", "services": ["nosuch"]},
            {"name": "first-resolving", "services": ["nosuch", "maya", "arnold"]},
            {"name": "plain"},
        ),
        user="alice",
    )
    assert _layer(first.job_id, "arnold") == (400, 12 * GB, "general | desktop", True, 90, 20, "arnold")
    # What the spec gives wins; what it does not (timeout_llu) is still the service's.
    assert _layer(first.job_id, "mine") == (200, 2 * GB, "general | desktop", False, 5, 20, "arnold")
    # No named service resolves: `default`, appended to the layer's services; its empty tags
    # leave the layer the tags of the allocation the show subscribes to.
    assert _layer(first.job_id, "unknown") == (100, 4 * GB, "general", True, 0, 0, "nosuch,default")
    assert _layer(first.job_id, "first-resolving") == (100, 2 * GB, "general | desktop", False, 0, 0,
                                                        "nosuch,maya,arnold")  # fmt: skip
    # No service named at all: `default` too, as beside Cuebot.
    assert _layer(first.job_id, "plain") == (100, 4 * GB, "general", True, 0, 0, "default")

    service_actions.create_show_service(
        "demo", {"str_name": "arnold", "int_mem_min": 24 * GB, "int_timeout": 30, "str_tags": "general"}, actor="ops"
    )
    second = submit_job(
        _spec("demo-sh010-svc_v2", {"name": "arnold", "services": ["arnold"]}, {"name": "mine", "services": ["arnold"],
              "memory": "1GB"}),
        user="alice",
    )  # fmt: skip
    # The show's override, a copy of the service with its own fields over it.
    assert _layer(second.job_id, "arnold") == (400, 24 * GB, "general", True, 30, 20, "arnold")
    assert _layer(second.job_id, "mine") == (400, 1 * GB, "general", True, 30, 20, "arnold")
    # Another show has no override: the service itself.
    assert ShowService.objects.filter(show=farm.show).count() == 1


def test_each_change_is_one_audited_action_and_bad_input_writes_nothing() -> None:
    submit_farm()
    created = service_actions.create_service(
        {"str_name": "blender", "b_threadable": True, "int_cores_min": 200, "int_mem_min": 8 * GB,
         "str_tags": ["general", "gpu"], "int_timeout": 60},
        actor="ops1",
    )  # fmt: skip
    row = Service.objects.get(str_name="blender")
    assert (row.int_cores_min, row.int_mem_min, row.str_tags, row.int_timeout) == (200, 8 * GB, "general | gpu", 60)
    same = service_actions.update_service("blender", {"int_mem_min": 8 * GB}, actor="ops1")
    assert not same.changed
    changed = service_actions.update_service("blender", {"int_mem_min": 16 * GB}, actor="ops2")
    assert changed.changes == {"int_mem_min": [8 * GB, 16 * GB]}
    service_actions.create_show_service("demo", {"str_name": "blender", "int_cores_min": 800}, actor="ops2")
    service_actions.update_show_service("demo", "blender", {"int_timeout_llu": 15}, actor="ops3")
    service_actions.delete_show_service("demo", "blender", actor="ops3")
    service_actions.delete_service("blender", actor="ops3")
    actions = list(
        FarmAction.objects.filter(str_target_kind__in=("service", "show_svc"))
        .order_by("id")
        .values_list("str_action", "str_target_kind", "str_target_name", "str_username")
    )
    assert actions == [
        ("create_service", "service", "blender", "ops1"),
        ("update_service", "service", "blender", "ops2"),
        ("create_show_service", "show_svc", "demo/blender", "ops2"),
        ("update_show_service", "show_svc", "demo/blender", "ops3"),
        ("delete_show_service", "show_svc", "demo/blender", "ops3"),
        ("delete_service", "service", "blender", "ops3"),
    ]
    update = FarmAction.objects.get(str_action="update_service")
    assert update.str_target == created.pk and update.detail == {"changes": {"int_mem_min": [8 * GB, 16 * GB]}}

    before = _snapshot()
    refused = [
        lambda: service_actions.update_service("arnold", {"int_mem_min": -1}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"int_cores_min": 0}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"int_cores_min": 400, "int_cores_max": 200}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"int_timeout": -5}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"int_min_memory_increase": 0}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"str_tags": "general | no tags"}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"colour": "red"}, actor="ops"),
        lambda: service_actions.update_service("default", {"str_name": "fallback"}, actor="ops"),
        lambda: service_actions.update_service("arnold", {"str_name": "maya"}, actor="ops"),
        lambda: service_actions.delete_service("default", actor="ops"),
        lambda: service_actions.create_service({"str_name": "x", "int_mem_min": GB}, actor="ops"),
        lambda: service_actions.create_service(
            {"str_name": "arnold", "b_threadable": True, "int_cores_min": 100, "int_mem_min": GB, "str_tags": "a"},
            actor="ops",
        ),
        lambda: service_actions.create_show_service("demo", {"str_name": "arnold", "int_mem_min": -GB}, actor="ops"),
        lambda: service_actions.create_show_service("demo", {"str_name": "arnold", "str_name_x": 1}, actor="ops"),
    ]
    for call in refused:
        with pytest.raises(ValidationError):
            call()
    with pytest.raises(NotFound, match="no show 'nosuchshow'"):
        service_actions.create_show_service("nosuchshow", {"str_name": "arnold"}, actor="ops")
    with pytest.raises(NotFound, match="no service 'arnlod' to override"):
        service_actions.create_show_service("demo", {"str_name": "arnlod"}, actor="ops")
    with pytest.raises(NotFound):
        service_actions.update_service("nosuch", {"int_timeout": 1}, actor="ops")
    with pytest.raises(NotFound):
        service_actions.delete_show_service("demo", "arnold", actor="ops")
    assert _snapshot() == before
    with pytest.raises(ValidationError) as err:
        service_actions.update_service("arnold", {"int_mem_min": -1, "int_timeout": -5}, actor="ops")
    assert err.value.messages == [
        "memory: -1 KB is out of range: more than 0 and at most 2147483647 KB (2 TB)",
        "timeout: -5 minutes must be 0 (none) to 43200",
    ]


def _post(client: Client, url: str, body: Any, token: str, method: str = "post") -> Any:
    return getattr(client, method)(url, data=json.dumps(body).encode(), content_type="application/json",
                                   HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip


def test_the_api_lists_creates_changes_and_deletes_services_and_overrides_audited(client: Client) -> None:
    submit_farm()
    alice = User.objects.create(username="alice")
    ed = User.objects.create(username="ed")
    ed.user_permissions.add(Permission.objects.get(codename="edit_caps", content_type__app_label="ops"))
    alice_token, ed_token = issue_token(alice), issue_token(ed)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {alice_token}"}

    listed = client.get("/api/services", **auth)
    assert listed.status_code == 200
    names = [s["name"] for s in listed.json()["services"]]
    assert names == sorted(n for n, *_ in CUEBOT_SEED)
    pre = client.get("/api/services/preprocess", **auth).json()
    assert (pre["cores"], pre["memory"], pre["memory_kb"], pre["tags"]) == (0.1, "384 MB", 393216, ["util"])

    body = {"name": "blender", "threadable": True, "cores": 2, "memory": "8GB", "tags": ["general", "gpu"],
            "timeout": 120, "min_memory_increase": "4GB"}  # fmt: skip
    assert _post(client, "/api/services", body, alice_token).status_code == 403
    created = _post(client, "/api/services", body, ed_token)
    assert created.status_code == 201, created.json()
    got = created.json()
    assert (got["cores"], got["memory_kb"], got["tags"], got["timeout"], got["min_memory_increase_kb"]) == (
        2, 8 * GB, ["general", "gpu"], 120, 4 * GB)  # fmt: skip

    changed = _post(client, "/api/services/blender", {"memory": "12GB", "timeout_llu": 10}, ed_token)
    assert changed.status_code == 200 and changed.json()["changed"]
    assert (changed.json()["memory"], changed.json()["timeout_llu"]) == ("12 GB", 10)

    before = _snapshot()
    bad = _post(client, "/api/services/blender", {"memory": "-1GB", "cores": -2, "colour": 1}, ed_token)
    assert bad.status_code == 400
    errors = bad.json()["errors"]
    assert any(e.startswith("memory: '-1GB' is not a memory size") for e in errors), errors
    assert "cores: -2 must not be negative" in errors and any("unknown fields ['colour']" in e for e in errors)
    assert _post(client, "/api/services/blender", {"memory": 8}, ed_token).json()["errors"] == [
        "memory: 8 has no unit: write e.g. '4GB' or '512MB'"
    ]
    missing = _post(client, "/api/shows/nosuchshow/services", {"name": "blender"}, ed_token)
    assert missing.status_code == 404 and missing.json()["errors"] == ["no show 'nosuchshow'"]
    assert _post(client, "/api/services/nosuch", {"timeout": 1}, ed_token).status_code == 404
    assert _post(client, "/api/services/default", {}, ed_token, "delete").status_code == 400
    assert _snapshot() == before

    over = _post(client, "/api/shows/demo/services", {"name": "blender", "memory": "32GB"}, ed_token)
    assert over.status_code == 201, over.json()
    assert (over.json()["show"], over.json()["memory_kb"], over.json()["cores"]) == ("demo", 32 * GB, 2)
    assert [s["name"] for s in client.get("/api/shows/demo/services", **auth).json()["services"]] == ["blender"]
    assert _post(client, "/api/shows/demo/services/blender", {"cores": 4}, ed_token).json()["cores"] == 4
    assert client.get("/api/shows/demo/services/blender", **auth).json()["cores"] == 4
    assert _post(client, "/api/shows/demo/services/blender", {}, ed_token, "delete").json()["deleted"]
    assert client.get("/api/shows/demo/services/blender", **auth).status_code == 404
    assert _post(client, "/api/services/blender", {}, ed_token, "delete").json()["deleted"]
    assert not Service.objects.filter(str_name="blender").exists()
    assert list(
        FarmAction.objects.filter(str_target_kind__in=("service", "show_svc")).order_by("id").values_list(
            "str_action", "str_username")
    ) == [
        ("create_service", "ed"),
        ("update_service", "ed"),
        ("create_show_service", "ed"),
        ("update_show_service", "ed"),
        ("delete_show_service", "ed"),
        ("delete_service", "ed"),
    ]  # fmt: skip


def test_the_console_edits_services_in_readable_units_audited(client: Client) -> None:
    farm = submit_farm()
    root = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    arnold = Service.objects.get(str_name="arnold")
    page = client.get(f"/admin/dispatch/service/{arnold.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert 'type="text" name="int_mem_min" value="3.2 GB"' in text and 'name="int_cores_min" value="1"' in text
    assert 'name="int_min_memory_increase" value="2 GB"' in text
    listing = client.get("/admin/dispatch/service/")
    assert listing.status_code == 200 and "3.2 GB" in listing.content.decode()

    form = {
        "str_name": "arnold",
        "b_threadable": "on",
        "int_cores_min": "4",
        "int_cores_max": "0",
        "int_mem_min": "3.2 GB",  # as shown: unchanged
        "int_gpus_min": "0",
        "int_gpus_max": "0",
        "int_gpu_mem_min": "0 MB",
        "str_tags": "general | desktop",
        "int_timeout": "45",
        "int_timeout_llu": "0",
        "int_min_memory_increase": "3GB",
    }
    saved = client.post(f"/admin/dispatch/service/{arnold.pk}/change/", form)
    assert saved.status_code == 302, saved.content.decode()[:3000]
    arnold.refresh_from_db()
    assert (arnold.int_cores_min, arnold.int_mem_min, arnold.int_timeout, arnold.int_min_memory_increase) == (
        400, 3355443, 45, 3 * GB)  # fmt: skip
    action = FarmAction.objects.get(str_action="update_service")
    assert action.str_username == "root" and set(action.detail["changes"]) == {
        "int_cores_min", "int_timeout", "int_min_memory_increase"}  # fmt: skip

    before = _snapshot()
    bad = client.post(f"/admin/dispatch/service/{arnold.pk}/change/", {**form, "int_mem_min": "-8GB"})
    assert bad.status_code == 200 and "is not a memory size" in bad.content.decode()
    bad = client.post(f"/admin/dispatch/service/{arnold.pk}/change/", {**form, "int_cores_min": "-1"})
    assert bad.status_code == 200 and "Cores must not be negative" in bad.content.decode()
    bad = client.post(f"/admin/dispatch/service/{arnold.pk}/change/", {**form, "int_cores_max": "2"})
    assert bad.status_code == 200 and "max cores: 200 centicores is below the cores (400)" in bad.content.decode()
    assert _snapshot() == before

    added = client.post("/admin/dispatch/showservice/add/", {**form, "show": farm.show.pk, "int_mem_min": "16GB"})
    assert added.status_code == 302, added.content.decode()[:3000]
    override = ShowService.objects.get(show=farm.show, str_name="arnold")
    assert (override.int_mem_min, override.int_cores_min) == (16 * GB, 400)
    deleted = client.post(f"/admin/dispatch/showservice/{override.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert not ShowService.objects.exists()
    assert list(
        FarmAction.objects.filter(str_target_kind="show_svc").order_by("id").values_list("str_action", "str_username")
    ) == [("create_show_service", "root"), ("delete_show_service", "root")]
