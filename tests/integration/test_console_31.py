"""Issue 31 on the test client and real PostgreSQL: the job list's reason column at the burst."""

from __future__ import annotations

import pytest

from dispatch.models import Layer, Subscription
from ops.farm_admin import page_reasons
from tests.integration.farm_fixtures import create_proc, tiny_farm

pytestmark = pytest.mark.django_db


def test_the_reason_is_show_at_burst_when_the_room_left_is_less_than_a_frame_needs() -> None:
    """4 cores of burst, 3 booked, frames of 2 cores: the show is at its burst for this job (the
    column used to check for one core of room and read "ready")."""
    farm = tiny_farm(managed=False, int_burst=400)
    Layer.objects.filter(pk=farm.layer.pk).update(str_tags=farm.alloc.str_tag, int_cores_min=200)
    create_proc(farm.host, farm.frames[0], cores=300)
    assert page_reasons([farm.job.pk])[farm.job.pk]["reason"] == "show at burst"
    Subscription.objects.filter(pk=farm.subscription.pk).update(int_burst=500)
    assert page_reasons([farm.job.pk])[farm.job.pk]["reason"] == "ready"


def test_the_overviews_applied_cap_changes_are_named_and_in_cores() -> None:
    import time

    from django.urls import reverse

    from ops import permissions
    from tests.integration.ops_support import base_view, make_user, publish_view
    from tests.integration.test_ops_console import client_for

    farm = tiny_farm(managed=True)
    publish_view(
        base_view(
            recent_caps=[
                ["job", farm.job.pk, "max_cores", 5, time.time() - 2],
                ["sub", f"{farm.show.pk}:{farm.alloc.pk}", "burst", 40, time.time() - 1],
            ]
        )
    )
    page = client_for(make_user("olga", permissions.OPERATORS)).get(reverse("admin:ops_console_overview"))
    recent = page.content.decode().split('id="ops-recent"', 1)[1].split("</table>", 1)[0]
    assert farm.job.str_name in recent and f"{farm.show.str_name} @ {farm.alloc.str_name}" in recent
    assert "5 cores" in recent and "40 cores" in recent
    assert f">{farm.job.pk}<" not in recent  # the id only in the title, not as the text


def test_a_max_cores_of_zero_unconfirmed_says_how_to_confirm_in_the_api_and_the_cli() -> None:
    import json

    from django.contrib.auth import get_user_model
    from django.core.management import CommandError, call_command
    from django.test import Client

    from dispatch.jobs import tokens

    farm = tiny_farm(managed=False)
    user = get_user_model().objects.create_user("alice", is_staff=True)
    token = tokens.issue_token(user)
    answer = Client().post(
        f"/api/jobs/{farm.job.str_name}/max-cores",
        json.dumps({"max_cores": 0}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert answer.status_code == 400
    assert any('"confirm": true' in e for e in answer.json()["errors"]), answer.json()
    with pytest.raises(CommandError, match="--yes"):
        call_command("job", "max-cores", farm.job.str_name, "0")
