"""Submitting a job spec: every validation error, everything written in one transaction with the
counters right at once, and the defaults (folder, facility, dept, caps, tags, priority)."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from dispatch.jobs import depends
from dispatch.jobs.action_base import JobNotFound
from dispatch.jobs.controls import (
    eat_frames,
    kill_job,
    pause_job,
    resume_job,
    retry_frames,
    set_max_cores,
    set_priority,
)
from dispatch.jobs.plan import SpecError
from dispatch.jobs.spec import load_spec, parse_memory
from dispatch.jobs.submit import submit_job
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm, show_name
from dispatch.models import Depend, Frame, Job, JobResource, JobStat, Layer, LayerStat
from dispatch.models.depends import FRAME_BY_FRAME, LAYER_ON_LAYER
from tests.integration.submit_support import (
    GB,
    counters_mismatch,
    frame_states,
    make_spec,
    simple_spec,
    submit_farm,
    table_counts,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def farm():
    return submit_farm()


def test_submit_writes_job_caps_layers_frames_and_depends_with_counters_right_at_once(
    farm, django_assert_max_num_queries
) -> None:
    spec = make_spec(os="linux", max_cores=20, max_gpus=2, priority=70, max_retries=5, shot="sh010")
    with django_assert_max_num_queries(20):  # set-based: the same for 10 frames or 100,000
        result = submit_job(spec, user="ignored-spec-names-alice")
    assert (result.frames, result.layers, result.depends) == (13, 3, 11)

    job = Job.objects.get(pk=result.job_id)
    assert (job.str_name, job.str_user, job.str_show, job.str_shot, job.str_os) == (
        "demo-sh010-light_v1",
        "alice",
        "demo",
        "sh010",
        "linux",
    )
    assert (job.str_state, job.b_paused, job.int_max_retries, job.int_frame_count, job.int_layer_count) == (
        "PENDING",
        False,
        5,
        13,
        3,
    )
    assert (job.folder_id, job.facility_id, job.dept_id) == (farm.root.pk, farm.facility.pk, farm.dept.pk)
    resource = JobResource.objects.get(job=job)
    assert (resource.int_priority, resource.int_max_cores, resource.int_max_gpus) == (70, 2000, 2)

    layers = {layer.str_name: layer for layer in Layer.objects.filter(job=job)}
    sim, render, movie = layers["sim"], layers["render"], layers["movie"]
    assert (sim.int_dispatch_order, sim.int_chunk_size, sim.int_cores_min, sim.int_mem_min) == (1, 5, 100, 4 * GB)
    assert (render.int_cores_min, render.int_mem_min, render.str_tags, render.b_threadable) == (
        200,
        8 * GB,
        "general",  # the tag of the allocation the show subscribes to
        True,
    )
    # A layer naming no service gets the `default` service, which holds these defaults.
    assert {layer.str_services for layer in layers.values()} == {"default"}
    assert movie.int_mem_min == 512 * 1024
    assert render.str_cmd == "render -f #IFRAME#" and render.str_range == "1-10"

    states = frame_states(job.pk)
    assert states == {
        "0001-sim": "WAITING",
        "0006-sim": "WAITING",  # chunk 5: one row per five frames
        **{f"{n:04d}-render": "DEPEND" for n in range(1, 11)},
        "0001-movie": "DEPEND",
    }
    waits = dict(Frame.objects.filter(job=job).values_list("str_name", "int_depend_count"))
    assert {waits[f"{n:04d}-render"] for n in range(1, 11)} == {1} and waits["0001-movie"] == 1
    order = dict(Frame.objects.filter(layer=sim).values_list("str_name", "int_dispatch_order"))
    assert order == {"0001-sim": 0, "0006-sim": 1}

    # Frame by frame: render n waits for the sim chunk that covers n; movie waits for all of render.
    by_frame = Depend.objects.filter(job_depend_er=job, str_type=FRAME_BY_FRAME)
    pairs = {(d.frame_depend_er.str_name, d.frame_depend_on.str_name) for d in by_frame}
    assert pairs == {(f"{n:04d}-render", "0001-sim" if n <= 5 else "0006-sim") for n in range(1, 11)}
    whole = Depend.objects.get(job_depend_er=job, str_type=LAYER_ON_LAYER)
    assert (whole.layer_depend_er_id, whole.layer_depend_on_id, whole.b_active) == (movie.pk, render.pk, True)

    stat = JobStat.objects.get(job=job)
    assert (stat.int_waiting_count, stat.int_depend_count, stat.int_total_count) == (2, 11, 13)
    assert LayerStat.objects.get(layer=render).int_depend_count == 10
    assert counters_mismatch() == []


def test_submit_is_one_transaction(farm, monkeypatch: pytest.MonkeyPatch) -> None:
    before = table_counts()
    monkeypatch.setattr(depends, "INSERT_DEPENDS_SQL", "SELECT 1 / 0")  # fails after everything else
    with pytest.raises(Exception, match="division by zero"):
        submit_job(make_spec(), user="alice")
    assert table_counts() == before


def _errors(spec: Any, user: str | None = "alice") -> list[str]:
    before = table_counts()
    with pytest.raises(SpecError) as info:
        submit_job(spec, user=user)
    assert table_counts() == before  # nothing written
    return info.value.errors


def _layer(**fields: Any) -> dict[str, Any]:
    return {"name": "main", "command": "true", "range": "1-3", **fields}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (make_spec(show="nope"), "show: unknown show 'nope'"),
        (make_spec(facility="mars"), "facility: unknown facility 'mars' (known: local)"),
        (make_spec(dept="nope"), "dept: unknown dept 'nope' (known: pipeline)"),
        (make_spec(folder="nope"), "folder: show 'demo' has no folder 'nope' (folders: demo, lighting)"),
        (make_spec(layers=[_layer(range="")]), "layer 'main'.range: must not be empty"),
        (make_spec(layers=[_layer(range="10-1x1")]), "layer 'main'.range: '10-1x1' has no frames"),
        (make_spec(layers=[_layer(range="1-10x0")]), "the step cannot be 0"),
        (make_spec(layers=[_layer(range="frames")]), "'frames' is not a frame range"),
        # 0 is the whole host and -N all but N since issue 28; past the range is still refused.
        (make_spec(layers=[_layer(cores=-100_000)]), "layer 'main'.cores: must be a whole number of cores from 1"),
        (make_spec(layers=[_layer(cores=100_001)]), "0 (the whole host) or -N (all but N)"),
        (make_spec(layers=[_layer(cores=1.5)]), "layer 'main'.cores: 1.5 is a fraction of a core, which cuesched"),
        (make_spec(layers=[_layer(cores="2")]), "layer 'main'.cores: must be a whole number, not '2'"),
        (make_spec(layers=[_layer(cores=4, max_cores=2)]), "layer 'main'.max_cores: is 2, below the layer's cores (4)"),
        (make_spec(layers=[_layer(max_cores=-1)]), "layer 'main'.max_cores: must be 0 (no max) or a whole number"),
        (make_spec(layers=[_layer(memory="4096")]), "layer 'main'.memory: '4096' has no unit: write e.g. '4GB'"),
        (make_spec(layers=[_layer(memory=4096)]), "layer 'main'.memory: 4096 has no unit"),
        (make_spec(layers=[_layer(memory="4 parsecs")]), "is not a memory size"),
        (make_spec(layers=[_layer(memory="0GB")]), "'0GB' must be more than 0"),
        (
            make_spec(layers=[_layer(depends=[{"layer": "ghost", "type": "layer"}])]),
            "layer 'main'.depends: unknown layer 'ghost' (layers: main)",
        ),
        (
            make_spec(layers=[_layer(depends=[{"layer": "main", "type": "frame"}])]),
            "layer 'main'.depends: a layer cannot depend on itself",
        ),
        (
            make_spec(
                layers=[
                    _layer(name="a", depends=[{"layer": "c", "type": "layer"}]),
                    _layer(name="b", depends=[{"layer": "a", "type": "frame"}]),
                    _layer(name="c", depends=[{"layer": "b", "type": "layer"}]),
                ]
            ),
            "dependency cycle: a -> c -> b -> a",
        ),
        (make_spec(layers=[_layer(), _layer()]), "layers[1]: duplicate layer name 'main' (also layers[0])"),
        (
            make_spec(layers=[_layer(depends=[{"layer": "main", "type": "soon"}])]),
            "must be 'frame' (frame by frame) or 'layer' (the whole layer), not 'soon'",
        ),
        (make_spec(layers=[]), "job.layers: must be a list of at least one layer"),
        (make_spec(layers=[_layer(tags="a b")]), "'a b' is not a tag"),
        (make_spec(layers=[_layer(colour="red")]), "layer 'main': unknown field 'colour'"),
        (make_spec(max_cores=0), "job.max_cores: must be -1 (unlimited) or a number >= 1; 0 would book nothing"),
        (make_spec(priority=-5), "job.priority: must be between 0 and 1000000"),
        (make_spec(paused="yes"), "job.paused: must be true or false"),
        (make_spec(auto_eat="yes"), "job.auto_eat: must be true or false"),
        (make_spec(name="my job"), "job.name: 'my job' may only contain letters, digits and _ . -"),
        (make_spec(nmae="x"), "job: unknown field 'nmae'"),
        ({"layers": [_layer()]}, "job.show: is required"),
    ],
)
def test_every_validation_error_is_reported_and_nothing_is_written(farm, spec: Any, message: str) -> None:
    errors = _errors(spec)
    assert any(message in e for e in errors), errors


def test_an_existing_job_name_is_refused(farm) -> None:
    submit_job(simple_spec("taken"), user="alice")
    assert _errors(simple_spec("taken")) == ["name: a job named 'taken' already exists"]


def test_all_errors_are_reported_at_once(farm) -> None:
    spec = {
        "show": "nope",
        "name": "bad name",
        "layers": [
            {"name": "a", "command": "x", "range": "1-10x0", "cores": 0.5, "memory": "12"},
            {"name": "a", "command": "y", "range": "1", "depends": [{"layer": "zz", "type": "frame"}]},
        ],
    }
    errors = _errors(spec)
    # Seven: the unknown dependency layer 'zz' is one of them (it used to wait for a second pass).
    assert len(errors) == 7, errors
    for part in ("step cannot be 0", "cores", "'12' has no unit", "duplicate layer name 'a'", "unknown show 'nope'",
                 "job.name", "unknown layer 'zz'"):  # fmt: skip
        assert any(part in e for e in errors), (part, errors)


def test_dependency_errors_come_in_the_same_pass_as_field_errors(farm) -> None:
    """An unknown layer, a self-dependency and a cycle are found even when layers (the ones
    depending, and the ones depended on) have field errors of their own, and a dependency with a
    bad type still has its layer checked."""
    spec = make_spec(
        layers=[
            _layer(name="a", memory="12", depends=[{"layer": "ghost", "type": "frame"}]),
            _layer(name="b", cores=0.5, depends=[{"layer": "c", "type": "layer"}, {"layer": "b", "type": "layer"}]),
            _layer(name="c", range="x", depends=[{"layer": "b", "type": "frame"}, {"layer": "spook", "type": "?"}]),
        ]
    )
    errors = _errors(spec)
    assert errors == [
        "layer 'a'.memory: '12' has no unit: write e.g. '4GB' or '512MB'",
        "layer 'b'.cores: 0.5 is a fraction of a core, which cuesched cannot book: give whole cores (N >= 1, 0 for the "
        "whole host, -N for all but N of the host's cores)",
        "layer 'c'.depends[1].type: must be 'frame' (frame by frame) or 'layer' (the whole layer), not '?'",
        "layer 'c'.range: 'x' is not a frame range: use N, A-B, A-BxSTEP, A-BySTEP or A-B:STEP (e.g. '1-100x5')",
        "layer 'a'.depends: unknown layer 'ghost' (layers: a, b, c)",
        "layer 'b'.depends: a layer cannot depend on itself",
        "layer 'c'.depends: unknown layer 'spook' (layers: a, b, c)",
        "dependency cycle: b -> c -> b",
    ], errors


def test_a_layer_without_tags_needs_a_subscription_to_take_them_from(farm) -> None:
    farm.show.subscriptions.all().delete()
    errors = _errors(simple_spec("no-tags"))
    assert errors == [
        "layer 'main'.tags: none given, and show 'demo' subscribes to no allocation in facility 'local' "
        "to take them from"
    ]
    # With tags given, the subscription is not needed to submit.
    layer = {"name": "main", "command": "true", "range": "1", "tags": "gpu | linux"}
    result = submit_job({"show": "demo", "name": "tagged", "layers": [layer]}, user="bob")
    assert Layer.objects.get(job_id=result.job_id).str_tags == "gpu | linux"


def test_defaults_come_from_the_folder_then_the_show(farm) -> None:
    result = submit_job(simple_spec("lit", folder="demo/lighting"), user="alice")
    job = Job.objects.get(pk=result.job_id)
    resource = JobResource.objects.get(job=job)
    assert job.folder_id == farm.lighting.pk
    assert resource.int_priority == 50  # the folder's job priority
    assert (resource.int_max_cores, resource.int_max_gpus) == (5000, 100)  # the show's defaults
    assert (job.int_max_retries, job.b_autoeat) == (3, False)

    theirs = submit_job(simple_spec("theirs", user="carol"), user="alice")
    assert Job.objects.get(pk=theirs.job_id).str_user == "carol"  # the spec's user wins
    spec = simple_spec("owned")
    del spec["user"]
    assert Job.objects.get(pk=submit_job(spec, user="dave").job_id).str_user == "dave"
    assert Job.objects.get(pk=submit_job(simple_spec("nulled", user=None), user="erin").job_id).str_user == "erin"
    nobody = simple_spec("nobody")
    del nobody["user"]
    assert _errors(nobody, user=None) == ["job.user: is required (no submitting user is known)"]
    assert submit_job(simple_spec("unlimited", max_cores=-1), user="x").frames == 4
    assert JobResource.objects.get(job__str_name="unlimited").int_max_cores == -1


def test_a_nested_folder_name_may_be_given_without_its_path(farm) -> None:
    result = submit_job(simple_spec("lit2", folder="lighting"), user="alice")
    assert Job.objects.get(pk=result.job_id).folder_id == farm.lighting.pk


def test_memory_units() -> None:
    assert parse_memory("4GB") == 4 * GB
    assert parse_memory("4gb") == parse_memory("4 GiB") == parse_memory("4G") == 4 * GB
    assert parse_memory("512MB") == 512 * 1024
    assert parse_memory("1.5GB") == 1536 * 1024
    assert parse_memory("100KB") == 100
    assert parse_memory("1TB") == 1024 * GB
    assert parse_memory("0GB", allow_zero=True) == 0
    for bad in ("4096", 4096, 4.0, "4XB", "GB", "-1GB", True):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_bad_json_is_reported() -> None:
    with pytest.raises(SpecError, match="not valid JSON: Expecting"):
        load_spec("{")
    with pytest.raises(SpecError, match="must be a JSON object, not list"):
        load_spec("[]")
    assert load_spec(b'{"show": "x"}') == {"show": "x"}


# --- dependencies, satisfied by the database whoever writes the frames -----------------------


def _set_state(job_id: str, names: list[str], state: str) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE frame SET str_state = %s, int_version = int_version + 1 WHERE pk_job = %s AND str_name = ANY(%s)",
            [state, job_id, names],
        )


def test_frame_by_frame_depends_release_the_frames_their_chunk_covers(farm) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    versions = dict(Frame.objects.filter(job_id=job).values_list("str_name", "int_version"))
    _set_state(job, ["0001-sim"], "SUCCEEDED")  # any writer: here a plain UPDATE
    states = frame_states(job)
    assert [states[f"{n:04d}-render"] for n in range(1, 11)] == ["WAITING"] * 5 + ["DEPEND"] * 5
    frame = Frame.objects.get(job_id=job, str_name="0003-render")
    assert (frame.int_depend_count, frame.int_version) == (0, versions["0003-render"] + 1)
    satisfied = Depend.objects.filter(job_depend_er_id=job, b_active=False)
    assert satisfied.count() == 5 and all(d.ts_satisfied is not None for d in satisfied)
    assert counters_mismatch() == []
    _set_state(job, ["0006-sim"], "EATEN")  # eaten counts as done
    assert {s for n, s in frame_states(job).items() if n.endswith("render")} == {"WAITING"}
    assert frame_states(job)["0001-movie"] == "DEPEND"
    assert counters_mismatch() == []


def test_a_layer_on_layer_depend_waits_for_every_frame_of_the_layer(farm) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    _set_state(job, ["0001-sim", "0006-sim"], "SUCCEEDED")
    _set_state(job, [f"{n:04d}-render" for n in range(1, 10)], "SUCCEEDED")
    assert frame_states(job)["0001-movie"] == "DEPEND"
    _set_state(job, ["0010-render"], "DEAD")
    assert frame_states(job)["0001-movie"] == "DEPEND"  # dead is not done
    _set_state(job, ["0010-render"], "SUCCEEDED")
    assert frame_states(job)["0001-movie"] == "WAITING"
    assert not Depend.objects.filter(job_depend_er_id=job, b_active=True).exists()
    assert counters_mismatch() == []
    # Done is done: running a render frame again does not make the movie wait again.
    _set_state(job, ["0010-render"], "WAITING")
    assert frame_states(job)["0001-movie"] == "WAITING"


def test_a_frame_waits_for_all_its_depends(farm) -> None:
    spec = make_spec(
        layers=[
            _layer(name="a"),
            _layer(name="b"),
            _layer(name="c", depends=[{"layer": "a", "type": "frame"}, {"layer": "b", "type": "layer"}]),
        ]
    )
    job = submit_job(spec, user="alice").job_id
    assert Frame.objects.get(job_id=job, str_name="0001-c").int_depend_count == 2
    _set_state(job, ["0001-a"], "SUCCEEDED")
    assert Frame.objects.get(job_id=job, str_name="0001-c").int_depend_count == 1
    assert frame_states(job)["0001-c"] == "DEPEND"
    _set_state(job, ["0001-b", "0002-b", "0003-b"], "SUCCEEDED")
    assert frame_states(job)["0001-c"] == "WAITING"
    assert frame_states(job)["0002-c"] == "DEPEND"  # still waits for 0002-a


def test_a_frame_without_a_counterpart_does_not_wait(farm) -> None:
    spec = make_spec(
        layers=[_layer(name="a", range="1-3"), _layer(name="b", range="2-5", depends=[{"layer": "a", "type": "frame"}])]
    )
    job = submit_job(spec, user="alice").job_id
    states = frame_states(job)
    assert (states["0002-b"], states["0003-b"], states["0004-b"], states["0005-b"]) == (
        "DEPEND",
        "DEPEND",
        "WAITING",
        "WAITING",
    )


def test_eating_frames_satisfies_their_depends_and_can_finish_the_job(farm) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    result = eat_frames(job, layer="sim")
    assert (result.changed, result.detail) == (2, {"finished": False})
    assert {s for n, s in frame_states(job).items() if n.endswith("render")} == {"WAITING"}
    result = eat_frames(job)
    assert result.changed == 11 and result.detail == {"finished": True}
    assert set(frame_states(job).values()) == {"EATEN"}
    assert Job.objects.get(pk=job).str_state == "FINISHED"
    assert counters_mismatch() == []


def test_the_satisfy_trigger_fires_after_the_stat_trigger() -> None:
    """PostgreSQL fires same-event triggers in name order; the satisfy trigger reads layer_stat."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'frame'::regclass AND NOT tgisinternal"
            " AND tgtype & 16 = 16"  # UPDATE triggers
            " ORDER BY tgname"
        )
        names = [row[0] for row in cur.fetchall()]
    assert [n.rsplit("_", 1)[0] for n in names] == [
        "pgtrigger_frame_stat_update",
        "pgtrigger_frame_when_done_satisfy_depends",
    ]


# --- controls without a scheduler ----------------------------------------------------------------


def test_pause_resume_priority_and_max_cores_write_only_what_changes(farm) -> None:
    job = submit_job(simple_spec("ctl"), user="alice").job_id
    assert pause_job(job).changed == 1
    assert pause_job("ctl").changed == 0  # by name, already paused
    assert Job.objects.get(pk=job).b_paused is True
    assert resume_job(job).changed == 1
    assert set_priority(job, 300).changed == 1
    assert set_priority(job, 300).changed == 0
    assert JobResource.objects.get(job_id=job).int_priority == 300
    assert set_max_cores(job, 12).changed == 1
    assert JobResource.objects.get(job_id=job).int_max_cores == 1200
    assert set_max_cores(job, -1).changed == 1
    assert JobResource.objects.get(job_id=job).int_max_cores == -1
    with pytest.raises(ValidationError):
        set_priority(job, -1)
    with pytest.raises(JobNotFound):
        pause_job("no-such-job")


def test_retry_gives_dead_frames_a_fresh_budget_and_reopens_a_finished_job(farm) -> None:
    job = submit_job(simple_spec("rty"), user="alice").job_id
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE frame SET str_state = CASE WHEN int_number = 1 THEN 'DEAD' ELSE 'SUCCEEDED' END,"
            " int_retries = 3, int_exit_status = 1 WHERE pk_job = %s",
            [job],
        )
        cur.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", [job])
    assert retry_frames(job, ["0002-main"]).changed == 0  # not dead: nothing to retry
    with pytest.raises(ValidationError, match="no frame '0009-main'"):
        retry_frames(job, ["0009-main"])
    result = retry_frames(job)
    assert (result.changed, result.detail) == (1, {"reopened": True})
    frame = Frame.objects.get(job_id=job, int_number=1)
    assert (frame.str_state, frame.int_retries, frame.int_exit_status) == ("WAITING", 0, -1)
    assert Job.objects.get(pk=job).str_state == "PENDING"
    assert counters_mismatch() == []


def test_kill_without_running_frames_eats_what_could_start_and_finishes_the_job(farm) -> None:
    job = submit_job(make_spec(), user="alice").job_id
    _set_state(job, ["0001-sim"], "DEAD")
    result = kill_job(job)
    assert result.detail == {"finished": True, "eaten": 12, "killing": 0, "procs": []}
    states = frame_states(job)
    assert states["0001-sim"] == "DEAD" and {s for n, s in states.items() if n != "0001-sim"} == {"EATEN"}
    assert Job.objects.get(pk=job).str_state == "FINISHED"
    assert kill_job(job).changed == 0  # again: nothing left to do
    assert counters_mismatch() == []


def test_purging_a_seeded_farm_removes_the_jobs_submitted_into_it_with_their_depends() -> None:
    seed_farm(FarmSpec(prefix="spg", jobs=0, hosts=0, allocs=1, manual_tags=0))
    spec = make_spec(show=show_name("spg", 0))
    submit_job(spec, user="alice")
    deleted = purge_farm("spg")
    assert (deleted["depend"], deleted["frame"], deleted["job"]) == (11, 13, 1)
    assert table_counts() == dict.fromkeys(table_counts(), 0)
