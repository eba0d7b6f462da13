"""Every farm table has a working admin, edits write only what changed, and `demo` prints a valid login."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command
from django.db import connection
from django.test import Client, RequestFactory
from django.urls import reverse

from dispatch.lab.seeding import FarmSpec, farm_counts, seed_farm
from dispatch.models import JobStat, Show, Subscription

pytestmark = pytest.mark.django_db

FARM_MODELS = list(apps.get_app_config("dispatch").get_models())


@pytest.fixture
def farm_admin(client: Client) -> Client:
    """A logged-in superuser without a password (hashing one costs ~0.3 s per test)."""
    seed_farm(FarmSpec(prefix="adm", hosts=3, jobs=2, layers=2, frames_per_layer=2))
    user = get_user_model().objects.create(username="ops", is_staff=True, is_superuser=True)
    client.force_login(user)
    return client


def test_every_farm_model_is_registered() -> None:
    # The 19 Cuebot tables, depend, the API tokens, OpenCue's limit_record and layer_limit (issue 19)
    # the farm-action audit rows (issue 20), the RQD hosts waiting to be admitted, Cuebot's
    # service and show_service, and its job_mem, layer_mem, job_env and layer_env (issue 29), its
    # comments (issue 30).
    assert len(FARM_MODELS) == 32
    assert [m.__name__ for m in FARM_MODELS if m not in admin.site._registry] == []


@pytest.mark.parametrize("model", FARM_MODELS, ids=lambda m: m._meta.model_name)
def test_changelist_search_and_change_pages_render(farm_admin: Client, model: type) -> None:
    opts = model._meta
    changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    assert farm_admin.get(changelist).status_code == 200
    assert farm_admin.get(changelist, {"q": "adm"}).status_code == 200
    obj = model.objects.first()
    if obj is not None:  # proc is empty in a fresh seed
        change = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
        response = farm_admin.get(change, follow=True)
        assert response.status_code == 200
        # The text key is shown read-only, or the row's console page (jobs, layers, frames:
        # issue 31, no raw forms for farm tables) is where the change URL leads, by its id.
        assert str(obj.pk) in response.content.decode() or str(obj.pk) in response.redirect_chain[-1][0]
    add = farm_admin.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_add")).status_code
    # Tables only the system writes (depend, API tokens) have no add page.
    request = RequestFactory().get("/")
    request.user = get_user_model().objects.get(username="ops")
    assert add == (200 if admin.site._registry[model].has_add_permission(request) else 403)


def test_edit_writes_only_the_changed_field(farm_admin: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A booking that lands while the admin saves must not be overwritten by the form's copy."""
    sub = Subscription.objects.first()
    assert sub is not None
    url = reverse("admin:dispatch_subscription_change", args=[sub.pk])
    form = farm_admin.get(url).context["adminform"].form
    data = {name: form[name].value() for name in form.fields}
    data["int_burst"] = 1234  # whole cores on screen (the ops console's cap field), 123_400 centicores stored
    data["_ops_confirmed"] = "1"  # above the test farm's hosts: the console's confirmation, given (issue 20)

    model_admin = admin.site._registry[Subscription]
    save_form = model_admin.save_form

    def booking_lands_meanwhile(request: object, form: object, change: bool) -> object:
        # The POST has loaded the row; now a booking moves the live counter before the save.
        with connection.cursor() as cur:
            cur.execute("UPDATE subscription SET int_cores = 4200 WHERE pk_subscription = %s", [sub.pk])
        return save_form(request, form, change)

    monkeypatch.setattr(model_admin, "save_form", booking_lands_meanwhile)
    response = farm_admin.post(url, data)
    assert response.status_code == 302, response.content.decode()[:2000]
    sub.refresh_from_db()
    assert (sub.int_burst, sub.int_cores) == (123_400, 4200)


def test_stat_counters_are_read_only(farm_admin: Client) -> None:
    stat = JobStat.objects.first()
    assert stat is not None
    form = farm_admin.get(reverse("admin:dispatch_jobstat_change", args=[stat.pk])).context["adminform"].form
    assert "int_waiting_count" not in form.fields


def test_demo_migrates_seeds_once_and_prints_a_working_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUESCHED_DEMO_PASSWORD_FILE", str(tmp_path / "admin-password"))
    out = StringIO()
    call_command("demo", "--no-serve", stdout=out)
    text = out.getvalue()
    assert "seeded demo farm" in text
    assert "http://127.0.0.1:8000/admin/" in text
    password = text.split("admin login: admin / ")[1].split()[0]
    assert authenticate(username="admin", password=password) is not None
    counts = farm_counts("demo")
    assert (counts["show"], counts["host"], counts["job"]) == (2, 20, 10)
    assert Show.objects.filter(b_scheduler_managed=True).count() == 1

    out = StringIO()
    call_command("demo", "--no-serve", "--addr", "127.0.0.1:8123", stdout=out)
    text = out.getvalue()
    assert "not seeding" in text and farm_counts("demo") == counts
    again = text.split("admin login: admin / ")[1].split()[0]
    assert "http://127.0.0.1:8123/admin/" in text
    # Issue 21: a second run keeps the first run's password (it used to reset it silently).
    assert again == password and "kept from the first run" in text
    assert authenticate(username="admin", password=password) is not None


# --- the host form: allocation and tags only through the audited host controls (issue 30) -------


def _host_form_post(model_admin: admin.ModelAdmin, host: object, changes: dict[str, object]) -> tuple[object, object]:
    """POST the host's change form, as loaded, with `changes`, through `model_admin` as the
    superuser `ops`; (response, the form the admin rendered or None after a redirect)."""
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.contrib.sessions.backends.db import SessionStore

    def request(method: str, data: dict[str, object] | None = None) -> object:
        factory = RequestFactory()
        req = factory.get("/") if method == "GET" else factory.post("/", data)
        req.user = get_user_model().objects.get(username="ops")
        req.session = SessionStore()
        req._messages = FallbackStorage(req)
        req._dont_enforce_csrf_checks = True
        return req

    from django import forms

    form = model_admin.get_form(request("GET"), host, change=True)(instance=host)
    data: dict[str, object] = {}
    for name, field in form.fields.items():
        value = form[name].value()
        if isinstance(field.widget, forms.MultiWidget):  # a date and a time (ts_created)
            data.update({f"{name}_{i}": str(v) for i, v in enumerate(field.widget.decompress(value))})
        else:
            data[name] = "" if value is None else value
    data.update(changes)
    data["_save"] = "Save"
    response = model_admin.changeform_view(request("POST", data), str(host.pk))
    rendered = response.context_data["adminform"].form if getattr(response, "context_data", None) else None
    return response, rendered


def _raw_host_admin() -> admin.ModelAdmin:
    """dispatch.admin's own host admin, the form with the allocation and tags fields (the served
    site puts the console's farm list in its place, which has no form at all)."""
    from dispatch.admin import HostAdmin
    from dispatch.models import Host

    return HostAdmin(Host, admin.AdminSite(name="raw_hosts"))


def test_the_host_form_moves_the_allocation_through_the_audited_action(farm_admin: Client) -> None:
    from dispatch.models import Alloc, FarmAction, Host, HostTag

    host = Host.objects.select_related("alloc").order_by("str_name").first()
    target = Alloc.objects.exclude(pk=host.alloc_id).order_by("str_name").first()
    response, form = _host_form_post(_raw_host_admin(), host, {"alloc": target.pk})
    assert response.status_code == 302, form.errors if form is not None else response
    host.refresh_from_db()
    assert host.alloc_id == target.pk
    # The action ran: its audit row by the admin user, the ALLOC tag and str_tags moved with it.
    (row,) = FarmAction.objects.filter(str_action="set_allocation", str_target=host.pk)
    assert (row.str_username, row.int_changed) == ("ops", 1)
    assert list(HostTag.objects.filter(host=host, str_tag_type="ALLOC").values_list("str_tag", flat=True)) == [
        target.str_tag or target.str_name
    ]
    assert (target.str_tag or target.str_name) in host.str_tags.split()


def test_the_host_form_edits_tags_through_the_audited_actions_and_shows_a_refusal_as_a_form_error(
    farm_admin: Client,
) -> None:
    from dispatch.models import FarmAction, Host, HostTag

    host = Host.objects.select_related("alloc").order_by("str_name").first()
    tags = host.str_tags.split()
    response, form = _host_form_post(_raw_host_admin(), host, {"str_tags": " ".join([*tags, "fastdisk"])})
    assert response.status_code == 302, form.errors if form is not None else response
    host.refresh_from_db()
    assert "fastdisk" in host.str_tags.split()
    assert HostTag.objects.filter(host=host, str_tag="fastdisk", str_tag_type="MANUAL").exists()
    (row,) = FarmAction.objects.filter(str_action="add_tags", str_target=host.pk)
    assert (row.str_username, row.int_changed) == ("ops", 1)

    # Its allocation's tag is the registration's: the action refuses, the form says why, nothing moves.
    alloc_tag = HostTag.objects.get(host=host, str_tag_type="ALLOC").str_tag
    before = (host.str_tags, FarmAction.objects.count(), HostTag.objects.filter(host=host).count())
    kept = [t for t in host.str_tags.split() if t != alloc_tag]
    response, form = _host_form_post(_raw_host_admin(), host, {"str_tags": " ".join(kept)})
    assert response.status_code == 200 and form is not None
    assert "allocation, name or a constant tag" in " ".join(form.errors.get("str_tags", [])), form.errors
    host.refresh_from_db()
    assert (host.str_tags, FarmAction.objects.count(), HostTag.objects.filter(host=host).count()) == before


def test_the_served_host_page_has_no_form_that_saves(farm_admin: Client) -> None:
    """The admin site serves the console's host list in place of the raw host admin: its change
    page saves nothing (403), so no allocation or tag can change there by a plain save."""
    from dispatch.models import Alloc, FarmAction, Host

    host = Host.objects.order_by("str_name").first()
    target = Alloc.objects.exclude(pk=host.alloc_id).order_by("str_name").first()
    url = reverse("admin:dispatch_host_change", args=[host.pk])
    response = farm_admin.post(url, {"alloc": target.pk, "str_name": host.str_name, "str_tags": "x"})
    assert response.status_code == 403
    host.refresh_from_db()
    assert host.alloc_id != target.pk and FarmAction.objects.count() == 0
