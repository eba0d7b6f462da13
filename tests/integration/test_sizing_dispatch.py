"""Cores from memory through the spec, the dispatch loop and real PostgreSQL (issue 28).

A job submitted through the spec is booked by the dispatch loop against the real Store (a
managed show) or the database triggers (an unmanaged one). Each layer is tagged to its own idle
32-core, 128 GB host, so every frame meets the host of Cuebot's table. What is booked (proc,
frame.int_cores, the host's idle cores) and what is charged (the Store's or the triggers'
subscription, folder and job counters) must both be Cuebot's numbers, and equal SUM(proc).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import psycopg
import pytest

from dispatch.engine.completion import Completion, complete
from dispatch.jobs.submit import submit_job
from dispatch.models import HostTag, Layer, Service
from ops import service_actions
from ops.why import explain_job
from tests.integration.dispatch_support import autocommit, fast_launcher, make_loop, violations, wait_for
from tests.integration.farm_fixtures import create_host
from tests.integration.runtime_support import running_scheduler
from tests.integration.submit_support import GB, submit_farm

pytestmark = pytest.mark.django_db(transaction=True)

# (layer name, spec fields, host cores, host GB) -> cores Cuebot's VirtualProc.build books. The
# layers say threadable: one naming no service gets Cuebot's `default` service, which is not.
TABLE: list[tuple[str, dict[str, Any], int, int, int]] = [
    ("c1m32", {"cores": 1, "memory": "32GB", "threadable": True}, 32, 128, 8),
    ("c4m64", {"cores": 4, "memory": "64GB", "threadable": True}, 32, 128, 16),
    ("c1m127", {"cores": 1, "memory": "127GB", "threadable": True}, 32, 128, 32),
    ("c1m4", {"cores": 1, "memory": "4GB", "threadable": True}, 32, 128, 1),
    ("whole", {"cores": 0, "memory": "4GB", "threadable": True}, 16, 64, 16),
    ("allbut2", {"cores": -2, "memory": "4GB", "threadable": True}, 8, 32, 6),
    ("capped", {"cores": 1, "memory": "64GB", "max_cores": 10, "threadable": True}, 32, 128, 10),
    ("single", {"cores": 4, "memory": "127GB", "threadable": False}, 32, 128, 1),
]


def _farm(managed: bool) -> dict[str, str]:
    """The submit farm with one host per TABLE row, each carrying only that row's tag."""
    farm = submit_farm(managed=managed)
    hosts = {}
    for name, _fields, cores, gb, _books in TABLE:
        host = create_host(farm.alloc, f"h-{name}", int_cores=cores * 100, int_mem=gb * GB)
        HostTag.objects.filter(host=host).delete()
        HostTag.objects.create(host=host, str_tag=f"t-{name}", str_tag_type="MANUAL")
        hosts[name] = host.pk
    return hosts


def _spec(name: str, layers: list[dict[str, Any]], **job: Any) -> dict[str, Any]:
    return {"show": "demo", "name": name, "user": "alice", "layers": layers, **job}


def _charged(conn: psycopg.Connection, service: Any, managed: bool, job: str) -> tuple[int, int, int]:
    """(subscription, folder, job) cores the show is charged: the Store's or the triggers'."""
    show, alloc, folder = conn.execute(
        "SELECT j.pk_show, s.pk_alloc, j.pk_folder FROM job j JOIN subscription s ON s.pk_show = j.pk_show"
        " WHERE j.pk_job = %s",
        (job,),
    ).fetchone()
    if managed:
        snap = service.store.audit_snapshot()
        return (
            snap.sub.get((show, alloc), (0, 0))[0],
            snap.folder.get(folder, (0, 0))[0],
            snap.job.get(job, (0, 0))[0],
        )
    row = conn.execute(
        "SELECT (SELECT int_cores FROM subscription WHERE pk_show = %s AND pk_alloc = %s),"
        " (SELECT int_cores FROM folder_resource WHERE pk_folder = %s),"
        " (SELECT int_cores FROM job_resource WHERE pk_job = %s)",
        (show, alloc, folder, job),
    ).fetchone()
    return tuple(int(v) // 100 for v in row)  # type: ignore[return-value]


def _booked(conn: psycopg.Connection, job: str) -> dict[str, int]:
    """Whole cores per layer name from proc, checked against the frame's and the host's record."""
    rows = conn.execute(
        "SELECT l.str_name, p.int_cores_reserved, f.int_cores, h.int_cores - h.int_cores_idle"
        " FROM proc p JOIN layer l ON l.pk_layer = p.pk_layer JOIN frame f ON f.pk_frame = p.pk_frame"
        " JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = %s",
        (job,),
    ).fetchall()
    for name, proc_cc, frame_cc, host_used in rows:
        assert proc_cc == frame_cc == host_used, (name, proc_cc, frame_cc, host_used)
    return {name: cc // 100 for name, cc, _f, _h in rows}


@pytest.mark.parametrize("managed", [True, False], ids=["store", "database"])
def test_cuebots_table_is_booked_and_charged(managed: bool) -> None:
    _farm(managed)
    layers = [
        {"name": name, "command": "true", "range": "1", "tags": [f"t-{name}"], **fields}
        for name, fields, _c, _g, _b in TABLE
    ]
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(_spec("sizing-table", layers, max_cores=-1), user="alice").job_id
        assert dict(Layer.objects.filter(job_id=job).values_list("str_name", "int_cores_min")) == {
            name: int(fields["cores"]) * 100 for name, fields, _c, _g, _b in TABLE
        }
        assert Layer.objects.get(job_id=job, str_name="capped").int_cores_max == 1000
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        for _ in range(10):  # each cycle commits its bookings before it returns
            loop.run_once()
            if len(_booked(conn, job)) == len(TABLE):
                break
        booked = _booked(conn, job)
        assert booked == {name: books for name, _f, _c, _g, books in TABLE}
        total = sum(booked.values())
        wait_for(lambda: _charged(conn, service, managed, job) == (total, total, total), what="charged = booked")
        assert violations(conn) == []


@pytest.mark.parametrize("managed", [True, False], ids=["store", "database"])
def test_a_job_cap_refuses_the_sized_frame_and_the_why_says_so(managed: bool) -> None:
    """Job max 10 cores, frames asking 1 core and 32 GB: each books 8 on a 128 GB host. The second
    would pass the cap: it is refused (never shrunk to 2), and the reason names the sizing."""
    _farm(managed)
    layer = {"name": "big", "command": "true", "range": "1-3", "memory": "32GB", "tags": ["t-c1m32"],
             "threadable": True}  # fmt: skip
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(_spec("sizing-cap", [layer], max_cores=10), user="alice").job_id
        if managed:
            wait_for(lambda: service.store.job_cap(job) is not None, what="the job's cap in the Store")
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        for _ in range(4):
            loop.run_once()
        assert _booked(conn, job) == {"big": 8}
        assert _charged(conn, service, managed, job) == (8, 8, 8)
        why = loop.why[job]
        assert why["reason"] == "job_max_cores", why
        # The second frame meets a host with 96 GB idle: 32 GB is 11 cores there (Cuebot sizes on idle memory).
        assert "needs 11: asks 1 core, books 11 on h-c1m32: its 32 GB are 11 cores' share of the host's 96 GB" in str(
            why["message"]
        ), why
        # The why-not page, computed from the database now, sizes the frame on its host too.
        computed = explain_job(job, None)
        assert computed.primary is not None and computed.primary.code == "job_max_cores", computed.reasons
        assert "has 2 core(s) left under its max cores (8/10 cores); a frame needs 11 (Layer big: asks 1 core, " in (
            computed.primary.message
        ), computed.primary.message
        assert computed.sizing == [
            "Layer big: asks 1 core, books 11 on h-c1m32: its 32 GB are 11 cores' share of the host's 96 GB idle "
            "memory over 32 cores."
        ]
        assert violations(conn) == []


def test_a_whole_host_frame_waits_for_an_idle_host() -> None:
    hosts = _farm(True)
    layers = [
        {"name": "small", "command": "true", "range": "1", "memory": "4GB", "tags": ["t-whole"], "threadable": True},
        {
            "name": "whole",
            "command": "true",
            "range": "1",
            "cores": 0,
            "memory": "4GB",
            "tags": ["t-whole"],
            "threadable": True,
        },
    ]
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(_spec("sizing-whole", layers, max_cores=-1), user="alice").job_id
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        for _ in range(3):
            loop.run_once()
        # The small frame took 1 core (4 GB of 64 is 1 core's share); the whole-host frame waits.
        assert _booked(conn, job) == {"small": 1}
        state = conn.execute(
            "SELECT f.str_state FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer"
            " WHERE l.pk_job = %s AND l.str_name = 'whole'",
            (job,),
        ).fetchone()
        assert state == ("WAITING",)
        assert conn.execute("SELECT int_cores_idle FROM host WHERE pk_host = %s", (hosts["whole"],)).fetchone() == (
            1500,
        )
        assert violations(conn) == []


def test_a_layer_naming_no_service_books_what_the_default_service_says() -> None:
    """Issue 29: a layer naming no service gets the `default` service on a plain database too (it
    is recorded as `default`, and the console shows what `default` sets), so the dispatch loop
    books what that row says, and an operator's edit of it changes the booking of jobs submitted
    afterwards. Under the patch, such a layer kept the spec's 4 GB here whatever `default` said:
    after the edit it still booked 1 core, not 8 (this test failed on that code)."""
    _farm(False)
    # A transactional test before this one may have flushed the seeded rows: the seed row, written here.
    Service.objects.update_or_create(
        str_name="default",
        defaults={"b_threadable": True, "int_cores_min": 100, "int_mem_min": 4 * GB, "str_tags": ""},
    )
    layer = {"name": "plain", "command": "true", "range": "1", "tags": ["t-c1m32"]}
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        loop = stack.enter_context(make_loop(proc.service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        first = submit_job(_spec("svc-default-v1", [layer]), user="alice").job_id
        assert Layer.objects.filter(job_id=first).values_list(
            "int_cores_min", "int_mem_min", "b_threadable", "str_services"
        ).get() == (100, 4 * GB, True, "default")
        for _ in range(3):
            loop.run_once()
        # 4 GB of a 128 GB, 32-core host: 1 core's share.
        assert _booked(conn, first) == {"plain": 1}
        assert conn.execute("SELECT int_mem_reserved FROM proc WHERE pk_job = %s", (first,)).fetchone() == (4 * GB,)

        service_actions.update_service("default", {"int_mem_min": 32 * GB}, actor="ops")
        # On another idle 32-core, 128 GB host (_booked checks the host's use is this job's alone).
        second = submit_job(_spec("svc-default-v2", [{**layer, "tags": ["t-c1m4"]}]), user="alice").job_id
        for _ in range(3):
            loop.run_once()
        # 32 GB of its 128 GB idle over 32 cores: 8 cores' share (Cuebot's core span).
        assert _booked(conn, second) == {"plain": 8}
        assert conn.execute("SELECT int_mem_reserved FROM proc WHERE pk_job = %s", (second,)).fetchone() == (32 * GB,)
        # The first job's layer keeps what it was submitted with.
        assert Layer.objects.get(job_id=first).int_mem_min == 4 * GB
        assert violations(conn) == []


@pytest.mark.parametrize("managed", [True, False], ids=["store", "database"])
def test_a_sized_frame_over_its_jobs_cores_left_books_on_a_host_that_fits_them(managed: bool) -> None:
    """A threadable frame whose memory grew (1 core, 10 GB, as memory failures leave a layer) under
    a job max of 8: placement's best host, 32 cores and 32 GB, sizes it to 10 cores, over the cap;
    an 8-core, 32 GB host books it at 3. It is booked there, not left WAITING behind the cap (the
    loop used to skip the layer on the first host's figure, job_precheck, and never ask again)."""
    farm = submit_farm(managed=managed)
    hosts = {}
    for name, cores, gb in (("wide", 32, 32), ("deep", 8, 32)):
        host = create_host(farm.alloc, f"h-{name}", int_cores=cores * 100, int_mem=gb * GB)
        HostTag.objects.filter(host=host).delete()
        HostTag.objects.create(host=host, str_tag="t-grown", str_tag_type="MANUAL")
        hosts[host.pk] = name
    layer = {"name": "grown", "command": "true", "range": "1", "memory": "10GB", "tags": ["t-grown"]}
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(_spec("sizing-grown", [layer], max_cores=8), user="alice").job_id
        if managed:
            wait_for(lambda: service.store.job_cap(job) is not None, what="the job's cap in the Store")
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        for _ in range(4):
            loop.run_once()
        assert _booked(conn, job) == {"grown": 3}
        (host,) = conn.execute("SELECT pk_host FROM proc WHERE pk_job = %s", (job,)).fetchone()
        assert hosts[host] == "deep"
        assert _charged(conn, service, managed, job) == (3, 3, 3)
        assert violations(conn) == []


def test_a_job_blocked_at_its_cap_wakes_for_the_least_its_frame_can_book() -> None:
    """Stress `frame_life`, threadable layers, --seed 5: a job at its max cores (8 of 8) skips a
    threadable 10 GB frame, which the best host (32 cores, 32 GB) sizes to 10 cores; the loop kept
    the job blocked until its cores in use plus those 10 fit under 8, which never happens, so the
    frame waited out the block's 60 s even after the job's other frame ended and an 8-core host
    that books it at 3 stood idle. A blocked job waits for the least its frame can book anywhere
    (the layer's minimum), and placement sizes it on the host that fits once it is retried."""
    farm = submit_farm(managed=True)
    hosts = {}
    for name, cores, gb in (("wide", 32, 32), ("deep", 8, 32)):
        host = create_host(farm.alloc, f"h-{name}", int_cores=cores * 100, int_mem=gb * GB)
        HostTag.objects.filter(host=host).delete()
        HostTag.objects.create(host=host, str_tag="t-grown", str_tag_type="MANUAL")
        hosts[host.pk] = name
    layers = [
        {"name": "first", "command": "true", "range": "1", "cores": 8, "memory": "1GB", "tags": ["t-grown"]},
        {"name": "grown", "command": "true", "range": "1", "memory": "10GB", "tags": ["t-grown"]},
    ]
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(_spec("sizing-blocked", layers, max_cores=8), user="alice").job_id
        wait_for(lambda: service.store.job_cap(job) is not None, what="the job's cap in the Store")
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        loop.run_once()
        assert _booked(conn, job) == {"first": 8}
        loop.run_once()  # the grown frame: the job is at its cap, and the job is blocked
        assert _booked(conn, job) == {"first": 8}
        (first,) = conn.execute("SELECT pk_proc FROM proc WHERE pk_job = %s", (job,)).fetchone()
        complete(conn, [Completion(first, 0)])
        wait_for(lambda: service.store.job_cores_in_use(job) == 0, what="the Store to see the first frame end")
        for _ in range(3):
            loop.run_once()
        assert _booked(conn, job) == {"grown": 3}
        (host,) = conn.execute("SELECT pk_host FROM proc WHERE pk_job = %s", (job,)).fetchone()
        assert hosts[host] == "deep"
        assert violations(conn) == []


def test_a_whole_host_job_blocked_at_its_cap_stays_blocked_while_no_host_fits_its_room() -> None:
    """A whole-host layer (cores 0; all-but-N alike) asks 1 core by `asked_cores` but books a
    whole host wherever it runs: a job at its cap that waited for 1 core woke every cycle while
    its room was under a host's size, to be placed again (two searches) and refused."""
    farm = submit_farm(managed=True)
    for name in ("a", "b"):
        host = create_host(farm.alloc, f"h-whole-{name}", int_cores=16 * 100, int_mem=64 * GB)
        HostTag.objects.filter(host=host).delete()
        HostTag.objects.create(host=host, str_tag="t-whole", str_tag_type="MANUAL")
    spec = {
        "show": "demo",
        "name": "whole-capped",
        "user": "alice",
        "max_cores": 20,
        "layers": [
            {"name": "whole", "command": "true", "range": "1-2", "cores": 0, "memory": "4GB",
             "threadable": True, "tags": ["t-whole"]},
        ],
    }  # fmt: skip
    with running_scheduler() as proc, autocommit() as conn, ExitStack() as stack:
        service = proc.service
        job = submit_job(spec, user="alice").job_id
        wait_for(lambda: service.store.job_cap(job) is not None, what="the job's cap in the Store")
        loop = stack.enter_context(make_loop(service, fast_launcher(runtime_min=3600, runtime_max=3600)))
        first = loop.run_once()
        assert first.booked == 1  # 16 of 20: the second frame books 16 on any host, past the cap
        wait_for(lambda: service.store.job_cores_in_use(job) == 16, what="the Store to see the first frame")
        loop.run_once()  # the first cycle to see its booking: the job is placed, refused and blocked
        retried = sum(loop.run_once().rejected["job_precheck"] for _ in range(3))
        # 4 cores of room can never take a 16-core whole-host frame: the job stays blocked
        # (until a frame of it ends or the block's 60 s pass) instead of being placed each cycle.
        assert retried == 0, f"the capped job was placed and refused again in {retried} of 3 cycles"
        assert violations(conn) == []
