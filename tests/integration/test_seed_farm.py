"""seed_farm writes exactly the requested farm, the same one for the same spec, and purge undoes it."""

from __future__ import annotations

from dataclasses import replace
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from dispatch.lab.seeding import (
    PURGE_ORDER,
    FarmExistsError,
    FarmSpec,
    farm_counts,
    farm_digest,
    plan_farm,
    purge_farm,
    seed_farm,
)
from dispatch.models import (
    Alloc,
    Folder,
    FolderResource,
    Frame,
    Host,
    HostTag,
    Job,
    JobResource,
    JobStat,
    Layer,
    LayerStat,
    Proc,
    Show,
    Subscription,
)

pytestmark = pytest.mark.django_db

SMALL = FarmSpec(
    prefix="sf",
    seed=7,
    facilities=2,
    depts=2,
    shows=3,
    managed_shows=2,
    allocs=2,
    folders_per_show=3,
    hosts=11,
    jobs=6,
    layers=3,
    frames_per_layer=4,
    manual_tags=3,
    host_gpus_choices=(0, 2),
    sub_burst=50_000,
    sub_size=20_000,
    folder_max_cores=30_000,
    folder_max_gpus=4,
    job_max_cores=2_000,
    job_max_gpus=1,
    layer_gpus_choices=(0, 1),
)


def expected_counts(spec: FarmSpec, host_tags: int) -> dict[str, int]:
    folders = spec.shows * spec.folders_per_show
    layers = spec.jobs * spec.layers
    return {
        "proc": 0,
        "frame": layers * spec.frames_per_layer,
        "layer_stat": layers,
        "layer_resource": layers,
        "layer_mem": layers,
        "layer_env": 0,
        "layer": layers,
        "job_stat": spec.jobs,
        "job_resource": spec.jobs,
        "job_mem": spec.jobs,
        "job_env": 0,
        "job": spec.jobs,
        "folder_resource": folders,
        "folder": folders,
        "host_tag": host_tags,
        "host_stat": spec.hosts,
        "host": spec.hosts,
        "subscription": spec.shows * spec.allocs,
        "point": spec.shows * spec.depts,
        "alloc": spec.allocs,
        "show": spec.shows,
        "dept": spec.depts,
        "facility": spec.facilities,
    }


def table_count(table: str) -> int:
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {table}")
        return cur.fetchone()[0]


def test_exact_requested_counts() -> None:
    seed = seed_farm(SMALL)
    # Every host has its ALLOC tag plus 0-2 MANUAL ones; host i < #tags has manual tag i.
    manual = HostTag.objects.filter(str_tag_type="MANUAL").count()
    assert seed.rows == expected_counts(SMALL, SMALL.hosts + manual)
    assert farm_counts("sf") == seed.rows
    # Nothing else in the database: the scopes miss no row the seed wrote.
    assert {table: table_count(table) for table in PURGE_ORDER} == seed.rows


def test_rows_follow_the_spec() -> None:
    seed = seed_farm(SMALL)
    assert Show.objects.filter(b_scheduler_managed=True).count() == 2
    assert set(seed.managed_show_ids) == set(Show.objects.filter(b_scheduler_managed=True).values_list("pk", flat=True))
    for alloc in Alloc.objects.all():
        assert alloc.str_tag == alloc.str_name and len(alloc.str_tag) <= 24
    assert {(s.int_size, s.int_burst) for s in Subscription.objects.all()} == {(20_000, 50_000)}
    assert {(r.int_max_cores, r.int_max_gpus) for r in FolderResource.objects.all()} == {(30_000, 4)}
    assert Folder.objects.filter(parent_folder__isnull=True).count() == SMALL.shows
    assert {(r.int_max_cores, r.int_max_gpus) for r in JobResource.objects.all()} == {(2_000, 1)}
    assert all(1 <= r.int_priority <= 200 for r in JobResource.objects.all())
    assert set(Job.objects.values_list("str_state", "str_os")) == {("PENDING", "linux")}

    for host in Host.objects.select_related("alloc", "stat"):
        assert host.str_lock_state == "OPEN"
        assert host.int_cores in {c * 100 for c in SMALL.host_cores_choices}
        assert host.int_mem in {g * 1024 * 1024 for g in SMALL.host_mem_gb_choices}
        assert (host.int_cores_idle, host.int_mem_idle, host.int_gpus_idle) == (
            host.int_cores,
            host.int_mem,
            host.int_gpus,
        )
        assert (host.stat.str_state, host.stat.str_os) == ("UP", "linux")
        assert host.stat.int_mem_free == host.stat.int_mem_total == host.int_mem
        tags = list(HostTag.objects.filter(host=host).values_list("str_tag_type", "str_tag"))
        assert [t for t in tags if t[0] == "ALLOC"] == [("ALLOC", host.alloc.str_tag)]
        assert len([t for t in tags if t[0] == "MANUAL"]) <= 2
    for i in range(SMALL.manual_tags):
        assert HostTag.objects.filter(host__str_name=f"sf_h{i}", str_tag=f"sf_t{i}", str_tag_type="MANUAL").exists()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM host_stat WHERE ts_ping < now() - interval '1 minute'")
        assert cur.fetchone()[0] == 0

    for layer in Layer.objects.all():
        tags = [t.strip() for t in layer.str_tags.split("|")]
        assert 1 <= len(tags) <= 3 and set(tags) <= set(seed.tags)
        assert layer.int_cores_min in {c * 100 for c in SMALL.layer_cores_choices}
    frames = SMALL.layers * SMALL.frames_per_layer
    assert set(JobStat.objects.values_list("int_waiting_count", "int_total_count")) == {(frames, frames)}
    counts = {(SMALL.frames_per_layer, SMALL.frames_per_layer)}
    assert set(LayerStat.objects.values_list("int_waiting_count", "int_total_count")) == counts
    assert set(Frame.objects.values_list("str_state", flat=True)) == {"WAITING"}
    frame = Frame.objects.select_related("layer").get(job_id=seed.job_ids[0], int_number=3, layer__str_name="sf_l1")
    assert frame.str_name == "0003-sf_l1"


def test_same_spec_seeds_identical_rows() -> None:
    seed_farm(SMALL)
    first = farm_digest("sf")
    purge_farm("sf")
    assert farm_counts("sf") == dict.fromkeys(PURGE_ORDER, 0)
    seed_farm(SMALL)
    assert farm_digest("sf") == first


def test_a_different_seed_differs() -> None:
    seed_farm(SMALL)
    first = farm_digest("sf")
    first_hosts = list(Host.objects.order_by("str_name").values_list("str_name", "int_cores", "int_mem"))
    purge_farm("sf")
    other = replace(SMALL, seed=8)
    seed_farm(other)
    second = farm_digest("sf")
    assert first["frame"].split(":")[0] == second["frame"].split(":")[0]  # same counts ...
    assert {t for t in PURGE_ORDER if first[t] != second[t] and first[t] != "0:"} >= {"host", "job", "frame"}
    assert list(Host.objects.order_by("str_name").values_list("str_name", "int_cores", "int_mem")) != first_hosts


def test_plan_is_deterministic_without_a_database() -> None:
    a, b = plan_farm(SMALL), plan_farm(SMALL)
    assert (a.host, a.job, a.layer, list(a.frames())) == (b.host, b.job, b.layer, list(b.frames()))
    # Adding jobs does not change the hosts a seed draws (one RNG stream per family).
    bigger = plan_farm(replace(SMALL, jobs=20))
    assert bigger.host == a.host and bigger.job[: SMALL.jobs] == a.job


def test_seeding_an_existing_prefix_is_refused() -> None:
    seed_farm(SMALL)
    before = farm_digest("sf")
    with pytest.raises(FarmExistsError):
        seed_farm(SMALL)
    assert farm_digest("sf") == before


def test_purge_leaves_other_prefixes_untouched() -> None:
    # `sf_h1` starts like `sf`'s own host names; its rows must survive purging `sf`.
    neighbours = [replace(SMALL, prefix=p) for p in ("sf_h1", "sfx", "s")]
    for spec in neighbours:
        seed_farm(spec)
    before = {spec.prefix: farm_digest(spec.prefix) for spec in neighbours}
    seed = seed_farm(SMALL)

    # A running frame: its proc must go first, whatever triggers proc deletes fire.
    host = Host.objects.get(pk=seed.host_ids[0])
    frame = Frame.objects.get(job_id=seed.job_ids[0], int_number=1, layer__str_name="sf_l0")
    Proc.objects.create(
        host=host,
        show_id=Job.objects.get(pk=frame.job_id).show_id,
        job_id=frame.job_id,
        layer_id=frame.layer_id,
        frame=frame,
        int_cores_reserved=100,
        int_mem_reserved=1024,
    )

    deleted = purge_farm("sf")
    assert deleted["proc"] == 1
    assert {t: n for t, n in deleted.items() if t != "proc"} == {t: n for t, n in seed.rows.items() if t != "proc"}
    assert farm_counts("sf") == dict.fromkeys(PURGE_ORDER, 0)
    assert {spec.prefix: farm_digest(spec.prefix) for spec in neighbours} == before
    assert not Host.objects.filter(str_name__regex=r"^sf_h[0-9]+$").exists()
    assert Host.objects.filter(str_name__startswith="sf_h1_h").count() == SMALL.hosts


def test_purge_of_an_unknown_prefix_deletes_nothing() -> None:
    seed_farm(SMALL)
    assert sum(purge_farm("nothing_here").values()) == 0
    assert farm_counts("sf") == expected_counts(SMALL, farm_counts("sf")["host_tag"])


@pytest.mark.parametrize(
    "change",
    [
        {"prefix": "Bad-Prefix"},
        {"prefix": "a_very_long_prefix_name"},
        {"hosts": 3, "allocs": 0},
        {"jobs": 2, "shows": 0},
        {"managed_shows": 9},
        {"host_cores_choices": ()},
        {"os": ""},
    ],
)
def test_invalid_specs_are_refused_before_writing(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        seed_farm(replace(SMALL, **change))
    assert table_count("host") == 0 and table_count("facility") == 0


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("seed_farm", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_command_seeds_summarises_and_purges() -> None:
    args = ["--prefix", "cmd", "--seed", "0x2a", "--hosts", "9", "--jobs", "4", "--layers", "2"]
    args += ["--frames-per-layer", "3", "--shows", "2", "--managed-shows", "1", "--allocs", "2"]
    args += ["--sub-burst", "12300", "--job-max-cores", "700", "--host-cores", "8,16", "--no-progress"]
    out, err = run(*args)
    counts = farm_counts("cmd")
    assert (counts["host"], counts["job"], counts["layer"], counts["frame"]) == (9, 4, 8, 24)
    assert counts["subscription"] == 4
    assert "seeded 'cmd' (seed 0x2a)" in out and "24 WAITING frames" in out
    assert err == ""
    assert set(Subscription.objects.values_list("int_burst", flat=True)) == {12300}
    assert set(JobResource.objects.values_list("int_max_cores", flat=True)) == {700}
    assert set(Host.objects.values_list("int_cores", flat=True)) <= {800, 1600}
    assert Show.objects.filter(b_scheduler_managed=True).count() == 1

    with pytest.raises(CommandError, match="already has rows"):
        run(*args)
    out, _ = run(*args, "--replace")
    assert "purged 'cmd'" in out and farm_counts("cmd")["frame"] == 24

    out, _ = run("--purge", "cmd")
    assert out.startswith("purged 'cmd': ")
    assert farm_counts("cmd") == dict.fromkeys(PURGE_ORDER, 0)


def test_command_unmanaged_and_progress_bar() -> None:
    _, err = run("--prefix", "big", "--unmanaged", "--hosts", "50", "--jobs", "50", "--layers", "4", "--progress")
    assert Show.objects.filter(b_scheduler_managed=True).count() == 0
    assert "100% frame" in err  # the bar reaches the end on stderr
    assert farm_counts("big")["frame"] == 50 * 4 * 5


def test_command_rejects_bad_options() -> None:
    with pytest.raises(CommandError, match="prefix"):
        run("--prefix", "No Spaces")
    with pytest.raises(CommandError, match="must match"):
        run("--purge", "x;drop")
