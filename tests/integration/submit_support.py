"""A small farm to submit jobs to, and job specs to submit, for the submit / API / control tests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from django.db import connection

from dispatch.models import Alloc, Dept, Facility, Folder, Show
from tests.integration.farm_fixtures import create_alloc, create_folder, create_host, create_subscription
from tests.integration.test_stat_triggers import JOB_MISMATCH, LAYER_MISMATCH

GB = 1024 * 1024  # KB


@dataclass
class SubmitFarm:
    facility: Facility
    dept: Dept
    show: Show
    alloc: Alloc
    root: Folder
    lighting: Folder


def submit_farm(*, show_name: str = "demo", managed: bool = False, hosts: int = 0) -> SubmitFarm:
    """One default facility and dept, a show subscribed to one allocation tagged 'general',
    its root folder (default) and a child folder 'lighting' (job priority 50)."""
    facility = Facility.objects.create(str_name="local", b_default=True)
    dept = Dept.objects.create(str_name="pipeline", b_default=True)
    show = Show.objects.create(str_name=show_name, b_scheduler_managed=managed, int_default_max_cores=5000)
    alloc = create_alloc(facility, name="local.general", tag="general")
    create_subscription(show, alloc, int_burst=100_000)
    root = Folder.objects.create(show=show, dept=dept, str_name=show_name, b_default=True)
    lighting = create_folder(show, dept, name="lighting", parent=root)
    Folder.objects.filter(pk=lighting.pk).update(int_job_priority=50)
    lighting.refresh_from_db()
    for i in range(hosts):
        create_host(alloc, f"{show_name}-h{i}", int_cores=1600, int_mem=64 * GB)
    return SubmitFarm(facility, dept, show, alloc, root, lighting)


BASE_SPEC: dict[str, Any] = {
    "show": "demo",
    "name": "demo-sh010-light_v1",
    "user": "alice",
    "layers": [
        {"name": "sim", "command": "sim -s #FRAME_START# -e #FRAME_END#", "range": "1-10", "chunk_size": 5},
        {
            "name": "render",
            "command": "render -f #IFRAME#",
            "range": "1-10",
            "cores": 2,
            "memory": "8GB",
            "depends": [{"layer": "sim", "type": "frame"}],
        },
        {
            "name": "movie",
            "command": "movie",
            "range": "1",
            "memory": "512MB",
            "depends": [{"layer": "render", "type": "layer"}],
        },
    ],
}


def make_spec(**overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(overrides)
    return spec


def simple_spec(name: str, *, frames: int = 4, cores: int = 1, **overrides: Any) -> dict[str, Any]:
    return {
        "show": "demo",
        "name": name,
        "user": "alice",
        "layers": [{"name": "main", "command": "true", "range": f"1-{frames}", "cores": cores, "memory": "1GB"}],
        **overrides,
    }


def counters_mismatch() -> list[tuple[Any, ...]]:
    """Rows where job_stat / layer_stat differ from COUNT(*) of frames (empty when right)."""
    with connection.cursor() as cur:
        cur.execute(JOB_MISMATCH)
        rows = cur.fetchall()
        cur.execute(LAYER_MISMATCH)
        return rows + cur.fetchall()


def frame_states(job_id: str) -> dict[str, str]:
    with connection.cursor() as cur:
        cur.execute("SELECT str_name, str_state FROM frame WHERE pk_job = %s", [job_id])
        return dict(cur.fetchall())


def table_counts() -> dict[str, int]:
    with connection.cursor() as cur:
        out = {}
        for table in ("job", "layer", "frame", "depend", "job_resource", "layer_stat"):
            cur.execute(f"SELECT count(*) FROM {table}")
            out[table] = cur.fetchone()[0]
    return out
