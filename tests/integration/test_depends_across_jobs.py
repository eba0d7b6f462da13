"""Dependencies across jobs (issue 29): in the spec (`{"job": ..., "type": "job" | "layer" | "frame"}`),
added and dropped on running jobs (actions, CLI, API, console), each audited, satisfied in the
transaction that finishes what they wait for: done, already done, FINISHED with dead frames or
killed. No frame is ever left in DEPEND (OpenCue #2219)."""

from __future__ import annotations

import io
import json
import threading
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client

from dispatch.jobs.controls import eat_frames, kill_job
from dispatch.jobs.depends import add_depend, drop_depend
from dispatch.jobs.plan import SpecError
from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import issue_token
from dispatch.models import Depend, FarmAction, Frame, Job
from dispatch.models.depends import FRAME_BY_FRAME, JOB_ON_JOB, JOB_ON_LAYER, LAYER_ON_JOB, LAYER_ON_LAYER
from tests.integration.submit_support import counters_mismatch, frame_states, submit_farm, table_counts

pytestmark = pytest.mark.django_db


@pytest.fixture
def farm():
    return submit_farm()


def _layer(name: str, rng: str = "1-4", **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": "true", "range": rng, "memory": "1GB", **extra}


def _job(name: str, *layers: dict[str, Any]) -> str:
    spec = {"show": "demo", "name": name, "user": "alice", "layers": list(layers) or [_layer("main")]}
    return submit_job(spec, user="alice").job_id


def _set_state(job_id: str, names: list[str], state: str) -> None:
    """Any writer: a plain UPDATE, as the completion path's is."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE frame SET str_state = %s, int_version = int_version + 1 WHERE pk_job = %s AND str_name = ANY(%s)",
            [state, job_id, names],
        )


def _states(job_id: str, layer: str | None = None) -> set[str]:
    return {s for n, s in frame_states(job_id).items() if layer is None or n.endswith(f"-{layer}")}


def _frames(layer: str, numbers: range) -> list[str]:
    return [f"{n:04d}-{layer}" for n in numbers]


def _audit(job_id: str) -> list[FarmAction]:
    """The job's audit rows after its submit (every submit writes a `submit` row of its own)."""
    return list(FarmAction.objects.filter(str_target=job_id).exclude(str_action="submit").order_by("id"))


# --- the spec -------------------------------------------------------------------------------


def test_a_spec_layer_waits_for_another_jobs_layer_and_is_released_when_it_is_done(farm) -> None:
    other = _job("light", _layer("sim"), _layer("render"))
    job = _job("comp", _layer("comp", depends=[{"job": "light", "layer": "render", "type": "layer"}]))
    assert _states(job) == {"DEPEND"}
    depend = Depend.objects.get(job_depend_er_id=job)
    assert (depend.str_type, depend.job_depend_on_id, depend.b_active) == (LAYER_ON_LAYER, other, True)
    _set_state(other, _frames("render", range(1, 4)), "SUCCEEDED")
    assert _states(job) == {"DEPEND"}
    _set_state(other, ["0004-render"], "EATEN")
    assert _states(job) == {"WAITING"}
    assert Frame.objects.filter(job_id=job, int_depend_count__gt=0).count() == 0
    assert not Depend.objects.filter(b_active=True).exists()
    assert counters_mismatch() == []


def test_a_spec_layer_waits_frame_by_frame_for_another_jobs_layer(farm) -> None:
    other = _job("light", _layer("render", "1-4", chunk_size=2))
    job = _job("comp", _layer("comp", "1-4", depends=[{"job": "light", "layer": "render", "type": "frame"}]))
    assert Depend.objects.filter(job_depend_er_id=job, str_type=FRAME_BY_FRAME, job_depend_on_id=other).count() == 4
    _set_state(other, ["0001-render"], "SUCCEEDED")  # the chunk of frames 1 and 2
    assert frame_states(job) == {"0001-comp": "WAITING", "0002-comp": "WAITING", "0003-comp": "DEPEND",
                                 "0004-comp": "DEPEND"}  # fmt: skip
    _set_state(other, ["0003-render"], "SUCCEEDED")
    assert _states(job) == {"WAITING"}
    assert counters_mismatch() == []


def test_a_spec_layer_waits_for_a_whole_other_job(farm) -> None:
    other = _job("light", _layer("sim"), _layer("render"))
    job = _job("comp", _layer("comp"), _layer("free"), _layer("late", depends=[{"job": "light", "type": "job"}]))
    assert Depend.objects.get(job_depend_er_id=job).str_type == LAYER_ON_JOB
    assert (_states(job, "late"), _states(job, "free")) == ({"DEPEND"}, {"WAITING"})
    _set_state(other, _frames("sim", range(1, 5)), "SUCCEEDED")  # a whole layer is not the whole job
    assert _states(job, "late") == {"DEPEND"}
    eat_frames(other)  # the rest eaten: the job is done (and FINISHED)
    assert Job.objects.get(pk=other).str_state == "FINISHED"
    assert _states(job, "late") == {"WAITING"}
    assert counters_mismatch() == []


def test_a_dependency_on_what_is_already_done_or_finished_waits_for_nothing(farm) -> None:
    done = _job("done", _layer("render"))
    _set_state(done, _frames("render", range(1, 5)), "SUCCEEDED")  # done, the job not (yet) FINISHED
    finished = _job("finished", _layer("render"))
    _set_state(finished, ["0001-render"], "DEAD")
    kill_job(finished)  # FINISHED with a dead frame: its layer is never done
    job = _job(
        "comp",
        _layer("a", depends=[{"job": "done", "layer": "render", "type": "layer"}]),
        _layer("b", depends=[{"job": "done", "layer": "render", "type": "frame"}]),
        _layer("c", depends=[{"job": "finished", "layer": "render", "type": "frame"}]),
        _layer("d", depends=[{"job": "finished", "type": "job"}, {"job": "done", "type": "job"}]),
    )
    assert _states(job) == {"WAITING"}
    assert not Frame.objects.filter(job_id=job, int_depend_count__gt=0).exists()
    rows = Depend.objects.filter(job_depend_er_id=job)
    assert rows.count() == 1 + 4 + 4 + 2
    assert all(not d.b_active and d.ts_satisfied is not None for d in rows)
    assert counters_mismatch() == []


def test_a_killed_job_releases_what_waits_on_it_even_with_dead_frames(farm) -> None:
    other = _job("light", _layer("render"))
    job = _job(
        "comp",
        _layer("a", depends=[{"job": "light", "layer": "render", "type": "layer"}]),
        _layer("b", depends=[{"job": "light", "layer": "render", "type": "frame"}]),
        _layer("c", depends=[{"job": "light", "type": "job"}]),
    )
    _set_state(other, ["0001-render"], "DEAD")
    _set_state(other, ["0002-render"], "SUCCEEDED")
    assert frame_states(job)["0002-b"] == "WAITING"
    assert _states(job) == {"DEPEND", "WAITING"}
    kill_job(other)
    assert _states(job) == {"WAITING"}
    assert not Depend.objects.filter(b_active=True).exists()
    assert not Frame.objects.filter(job_id=job, int_depend_count__gt=0).exists()
    assert counters_mismatch() == []


def test_a_job_finishing_with_dead_frames_releases_what_waits_on_it(farm) -> None:
    """FINISHED by the completion path's rule (nothing left to run), a dead frame in it: the
    layer is never done, but the job runs no more, so nothing may wait on it."""
    other = _job("light", _layer("render", "1-2"))
    job = _job("comp", _layer("comp", depends=[{"job": "light", "layer": "render", "type": "layer"}]))
    _set_state(other, ["0001-render"], "DEAD")
    eat_frames(other, ["0002-render"])
    assert Job.objects.get(pk=other).str_state == "FINISHED"
    assert _states(job) == {"WAITING"}


def test_spec_errors_across_jobs_are_clear_and_write_nothing(farm) -> None:
    _job("light", _layer("render"))
    before = table_counts()
    bad = {
        "show": "demo",
        "name": "comp",
        "user": "alice",
        "layers": [
            _layer("a", depends=[{"job": "ghost", "type": "job"}]),
            _layer("b", depends=[{"job": "light", "layer": "nope", "type": "layer"}]),
            _layer("c", depends=[{"job": "comp", "type": "job"}]),
            _layer("d", depends=[{"job": "light", "layer": "render", "type": "job"}]),
            _layer("e", depends=[{"type": "job"}]),
            _layer("f", depends=[{"job": "light", "type": "frame"}]),
            _layer("g", depends=[{"job": "light", "type": "job"}, {"job": "light", "type": "job"}]),
        ],
    }
    with pytest.raises(SpecError) as caught:
        submit_job(bad, user="alice")
    errors = caught.value.errors
    expected = [
        "layer 'a'.depends: unknown job 'ghost'",
        "job 'light' has no layer 'nope' (layers: render)",
        "job 'comp' is this job",
        'layer \'d\'.depends[0].layer: a "type": "job" dependency waits for the whole job',
        'layer \'e\'.depends[0].job: is required with "type": "job"',
        "layer 'f'.depends[0].layer: is required",
        "layer 'g'.depends[1].job: depends on job 'light' more than once",
    ]
    for text in expected:
        assert any(text in e for e in errors), (text, errors)
    assert table_counts() == before


# --- on running jobs: the actions ----------------------------------------------------------


def test_add_depend_moves_waiting_frames_to_depend_and_the_target_finishing_releases_them(farm) -> None:
    other = _job("light", _layer("render"))
    job = _job("comp", _layer("comp"))
    _set_state(job, ["0001-comp"], "RUNNING")
    result = add_depend(job, "light", actor="alice")
    assert result.changed == 3
    assert frame_states(job) == {"0001-comp": "RUNNING", "0002-comp": "DEPEND", "0003-comp": "DEPEND",
                                 "0004-comp": "DEPEND"}  # fmt: skip
    assert Depend.objects.get(job_depend_er_id=job).str_type == JOB_ON_JOB
    (audit,) = _audit(job)
    assert (audit.str_action, audit.str_target_kind, audit.str_username, audit.int_changed) == (
        "depend", "job", "alice", 3)  # fmt: skip
    assert audit.detail["on_job"] == other and audit.detail["type"] == JOB_ON_JOB
    # The running frame fails and comes back: it waits too (its count holds it).
    _set_state(job, ["0001-comp"], "WAITING")
    assert Frame.objects.get(job_id=job, str_name="0001-comp").int_depend_count == 1
    eat_frames(other)
    assert frame_states(job) == dict.fromkeys(_frames("comp", range(1, 5)), "WAITING")
    assert not Frame.objects.filter(job_id=job, int_depend_count__gt=0).exists()
    assert counters_mismatch() == []


def test_add_depend_on_a_layer_frame_by_frame_and_whole_job_on_layer(farm) -> None:
    other = _job("light", _layer("sim"), _layer("render"))
    job = _job("comp", _layer("comp"), _layer("mov"))
    add_depend(job, other, layer="comp", on_layer="render", kind="frame")
    add_depend(job, "light", on_layer="sim")  # the whole job on one layer
    types = sorted(Depend.objects.filter(job_depend_er_id=job).values_list("str_type", flat=True))
    assert types == [FRAME_BY_FRAME] * 4 + [JOB_ON_LAYER]
    assert Frame.objects.get(job_id=job, str_name="0001-comp").int_depend_count == 2
    _set_state(other, _frames("sim", range(1, 5)), "SUCCEEDED")
    assert _states(job, "mov") == {"WAITING"}
    assert _states(job, "comp") == {"DEPEND"}
    _set_state(other, ["0002-render"], "SUCCEEDED")
    assert frame_states(job)["0002-comp"] == "WAITING" and frame_states(job)["0001-comp"] == "DEPEND"
    assert counters_mismatch() == []


def test_add_depend_on_what_is_already_done_leaves_every_frame_waiting(farm) -> None:
    other = _job("light", _layer("render"))
    _set_state(other, _frames("render", range(1, 5)), "SUCCEEDED")
    job = _job("comp", _layer("comp"))
    result = add_depend(job, "light", layer="comp", on_layer="render")
    assert (result.changed, result.detail["satisfied"]) == (0, True)
    assert _states(job) == {"WAITING"}
    assert not Frame.objects.filter(job_id=job, int_depend_count__gt=0).exists()
    assert not Depend.objects.filter(b_active=True).exists()
    assert [a.str_action for a in _audit(job)] == ["depend"]


def test_drop_depend_releases_only_frames_with_no_other_unmet_dependency(farm) -> None:
    _job("light", _layer("render"))
    _job("fx", _layer("sim"))
    job = _job("comp", _layer("comp"), _layer("mov"))
    add_depend(job, "light", layer="comp", on_layer="render")
    add_depend(job, "fx")  # every layer of comp
    result = drop_depend(job, "fx", actor="bob")
    assert result.changed == 4  # mov's frames; comp's still wait for light's render
    assert (_states(job, "mov"), _states(job, "comp")) == ({"WAITING"}, {"DEPEND"})
    assert Frame.objects.get(job_id=job, str_name="0001-comp").int_depend_count == 1
    assert [(a.str_action, a.str_username) for a in _audit(job)][-1] == ("undepend", "bob")
    drop_depend(job, "light", layer="comp", on_layer="render")
    assert _states(job) == {"WAITING"}
    assert not Depend.objects.filter(b_active=True).exists()
    # Dropped is dropped: the same dependency may be added again.
    add_depend(job, "fx")
    assert _states(job) == {"DEPEND"}
    assert counters_mismatch() == []


def test_drop_depend_of_a_spec_dependency_across_jobs(farm) -> None:
    _job("light", _layer("render"))
    job = _job("comp", _layer("comp", depends=[{"job": "light", "layer": "render", "type": "frame"}]))
    assert _states(job) == {"DEPEND"}
    result = drop_depend(job, "light", layer="comp", on_layer="render", kind="frame")
    assert result.changed == 4 and _states(job) == {"WAITING"}


def test_bad_depends_are_refused_with_a_clear_error_and_write_nothing(farm) -> None:
    light = _job("light", _layer("render"))
    job = _job("comp", _layer("comp"), _layer("mov"))
    add_depend(job, "light")
    before = (table_counts(), FarmAction.objects.count(), frame_states(job), frame_states(light))
    cases = [
        (dict(on_job="ghost"), "no job with id or name 'ghost'"),
        (dict(on_job="comp"), "cannot depend on itself"),
        (dict(on_job="comp", layer="comp", on_layer="comp"), "cannot depend on itself"),
        (dict(on_job="light", on_layer="nope"), "job 'light' has no layer 'nope'"),
        (dict(on_job="light", layer="nope"), "job 'comp' has no layer 'nope'"),
        (dict(on_job="light", kind="frame", on_layer="render"), "needs the depending layer"),
        (dict(on_job="light", kind="job", on_layer="render"), "waits for the whole other job"),
        (dict(on_job="light", kind="soon"), "must be job, layer or frame"),
        (dict(on_job="light"), "already there"),
    ]
    for kwargs, text in cases:
        on = kwargs.pop("on_job")
        with pytest.raises(ValidationError) as caught:
            add_depend(job, on, **kwargs)
        assert text in " ".join(caught.value.messages), (kwargs, caught.value.messages)
    with pytest.raises(ValidationError, match="cycle"):
        add_depend(light, "comp", on_layer="mov")  # comp already waits for light
    with pytest.raises(ValidationError, match="no such dependency"):
        drop_depend(job, "light", on_layer="render")
    assert (table_counts(), FarmAction.objects.count(), frame_states(job), frame_states(light)) == before
    kill_job(job)
    with pytest.raises(ValidationError, match="finished"):
        add_depend(job, "light", on_layer="render")


# --- the command line, the API, the console -----------------------------------------------


def _cli(*args: str) -> str:
    out = io.StringIO()
    call_command("job", *args, stdout=out)
    return out.getvalue()


def test_cli_depend_and_undepend(farm) -> None:
    other = _job("light", _layer("render"))
    job = _job("comp", _layer("comp"))
    text = _cli("depend", "comp", "--on-job", "light", "--on-layer", "render", "--layer", "comp", "--type", "frame")
    assert "depends on layer render of job light frame by frame (layer comp); 4 waiting frame(s) now DEPEND" in text
    assert _states(job) == {"DEPEND"}
    assert [a.str_action for a in _audit(job)] == ["depend"]
    assert _audit(job)[0].str_username.startswith("cli:")
    text = _cli("undepend", "comp", "--on-job", "light", "--on-layer", "render", "--layer", "comp", "--type", "frame")
    assert "no longer depends on layer render of job light" in text and "4 frame(s) released" in text
    assert _states(job) == {"WAITING"}
    _set_state(other, _frames("render", range(1, 5)), "SUCCEEDED")
    assert "already satisfied" in _cli("depend", "comp", "--on-job", "light")
    before = table_counts()
    with pytest.raises(CommandError, match="no job with id or name 'ghost'"):
        _cli("depend", "comp", "--on-job", "ghost")
    with pytest.raises(CommandError, match="no such dependency"):
        _cli("undepend", "comp", "--on-job", "light", "--on-layer", "render")
    assert table_counts() == before


def _post(client: Client, url: str, body: Any, token: str) -> Any:
    return client.post(url, data=json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip


def test_api_depend_and_undepend(client: Client, farm) -> None:
    User = get_user_model()
    token = issue_token(User.objects.create(username="alice"))
    bob = issue_token(User.objects.create(username="bob"))
    _job("light", _layer("render"))
    job = _job("comp", _layer("comp"))
    response = _post(client, "/api/jobs/comp/depend", {"on_job": "light", "on_layer": "render"}, token)
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["action"], body["changed"], body["type"], body["active"]) == ("depend", 4, JOB_ON_LAYER, 1)
    assert _states(job) == {"DEPEND"}
    before = table_counts()
    for payload, status, text in (
        ({"on_job": "ghost"}, 400, "no job with id or name 'ghost'"),
        ({"on_job": "comp"}, 400, "cannot depend on itself"),
        ({"on_layer": "render"}, 400, '"on_job"'),
        ({"on_job": "light", "when": "now"}, 400, "unknown field"),
        ({"on_job": "light", "on_layer": "render"}, 400, "already there"),
    ):
        response = _post(client, "/api/jobs/comp/depend", payload, token)
        assert response.status_code == status and text in " ".join(response.json()["errors"]), response.content
    assert _post(client, "/api/jobs/comp/depend", {"on_job": "light"}, bob).status_code == 403
    assert table_counts() == before
    response = _post(client, "/api/jobs/comp/undepend", {"on_job": "light", "on_layer": "render"}, token)
    assert response.status_code == 200 and response.json()["changed"] == 4
    assert _states(job) == {"WAITING"}
    assert [a.str_action for a in _audit(job)] == ["depend", "undepend"]


def test_console_job_page_adds_and_drops_a_dependency(admin_client: Client, farm) -> None:
    _job("light", _layer("render"))
    job = _job("comp", _layer("comp"))
    page = admin_client.get(f"/admin/ops/console/job/{job}/")
    assert page.status_code == 200 and b'id="depend-form"' in page.content
    url = f"/admin/ops/console/job/{job}/act/"
    response = admin_client.post(url, {"action": "depend", "on_job": "light", "layer": "comp"}, follow=True)
    assert "Dependency added: 4 waiting frames now depending" in response.content.decode()
    assert _states(job) == {"DEPEND"}
    response = admin_client.post(url, {"action": "depend", "on_job": "ghost"}, follow=True)
    assert (
        "no job with id or name &#x27;ghost&#x27; to depend on. nothing was changed."
        in response.content.decode().lower()
    )
    response = admin_client.post(url, {"action": "undepend", "on_job": "light", "layer": "comp"}, follow=True)
    assert "Dependency dropped: 4 frames released to waiting" in response.content.decode()
    assert _states(job) == {"WAITING"}
    assert [a.str_action for a in _audit(job)] == ["depend", "undepend"]


# --- the race: a target finishing while the dependency is added -------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_dependency_added_while_its_target_finishes_is_never_left_waiting(farm) -> None:
    """The completion of the target's last frame is in flight (uncommitted) when the depend is
    added: the add waits for it (the target's stat row, FOR SHARE) and then sees it done, so it
    writes the depend satisfied. Without the lock the add reads 'not done', the completion's
    trigger cannot see the uncommitted depend, and the frames wait for ever."""
    other = _job("light", _layer("render", "1-2"))
    job = _job("comp", _layer("comp"))
    _set_state(other, ["0001-render"], "SUCCEEDED")
    dsn = connection.settings_dict
    conn = psycopg.connect(
        dbname=dsn["NAME"], user=dsn["USER"], host=dsn["HOST"], port=dsn["PORT"], password=dsn["PASSWORD"] or None
    )
    errors: list[BaseException] = []
    try:
        conn.execute(
            "UPDATE frame SET str_state = 'SUCCEEDED', int_version = int_version + 1 "
            "WHERE pk_job = %s AND str_name = '0002-render'",
            [other],
        )

        def add() -> None:
            try:
                add_depend(job, "light", layer="comp", on_layer="render")
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
            finally:
                connection.close()

        adder = threading.Thread(target=add)
        adder.start()
        _wait_until_blocked(conn)
        conn.commit()
        adder.join(timeout=30)
        assert not adder.is_alive() and not errors, errors
    finally:
        conn.close()
    assert _states(job) == {"WAITING"}
    assert not Depend.objects.filter(b_active=True).exists()
    assert not Frame.objects.filter(job_id=job, int_depend_count__gt=0).exists()


def _wait_until_blocked(conn: psycopg.Connection) -> None:
    """Until another session waits on a lock this one holds (pg_blocking_pids), at most 30 s."""
    with psycopg.connect(conn.info.dsn, password=conn.info.password or None, autocommit=True) as watch:
        pid = conn.info.backend_pid
        for _ in range(3000):
            waiting = watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [pid]
            ).fetchone()[0]
            if waiting:
                return
            threading.Event().wait(0.01)
    raise AssertionError("the add never waited for the in-flight completion")
