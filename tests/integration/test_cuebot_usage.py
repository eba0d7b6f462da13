"""Cuebot's stat tables and service defaults for cuesched's own work on an adopted Cuebot database.

CueGUI and pycue read show_stats, job_usage and layer_usage, which Cuebot's Java writes: a show
flipped to cuesched looked idle there, and its layers did not get the show's service defaults.
The expected numbers are Cuebot's own, from the stand-in running Cuebot's SQL
(tests/integration/cuebot_standin.py) on frames like cuesched's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from accounting.db import with_writer_option
from dispatch.engine.completion import Completion, complete
from tests.integration import cuebot_support as cb
from tests.integration.cuebot_standin import CuebotStandIn
from tests.integration.test_cuebot_mode import ALLOC, SHOW, Farm

USAGE_COLUMNS = (
    "int_core_time_success, int_core_time_fail, int_gpu_time_success, int_gpu_time_fail, int_frame_success_count, "
    "int_frame_fail_count, int_clock_time_success, int_clock_time_fail, int_clock_time_high"
)
SHOW_STATS = (
    "SELECT int_frame_insert_count, int_job_insert_count, int_frame_success_count, int_frame_fail_count "
    "FROM show_stats WHERE pk_show = %s"
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    name = cb.cuebot_db_name("usage")
    url = cb.build_cuebot_db(name)
    cb.manage(url, "adopt_cuebot_db", "--apply")
    try:
        yield url
    finally:
        cb.drop_database(name)


def _submit(url: str, tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    cb.manage(url, "submit_job", str(path))
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT pk_job FROM job WHERE str_name = %s", [spec["name"]]).fetchone()[0]


def test_submit_counts_the_job_and_its_frames_in_show_stats(url: str, tmp_path: Path) -> None:
    """JobDaoJdbc.activateJob: int_job_insert_count + 1, int_frame_insert_count + the frames."""
    with psycopg.connect(url) as conn:
        before = conn.execute(SHOW_STATS, [SHOW]).fetchone()
    spec = {
        "show": "testing",
        "name": "testing-sh030-usage_v1",
        "user": "alice",
        "layers": [
            {"name": "sim", "command": "sim", "range": "1-4", "chunk_size": 2},
            {"name": "render", "command": "render", "range": "1-3", "depends": [{"layer": "sim", "type": "layer"}]},
        ],
    }
    job = _submit(url, tmp_path, spec)
    with psycopg.connect(url) as conn:
        after = conn.execute(SHOW_STATS, [SHOW]).fetchone()
        assert (after[0] - before[0], after[1] - before[1]) == (5, 1)
        assert after[2:] == before[2:]
        assert conn.execute("SELECT count(*) FROM job_usage WHERE pk_job = %s", [job]).fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM layer_usage WHERE pk_job = %s", [job]).fetchone()[0] == 2


# (clock seconds since the frame started, exit status): two successes of different lengths (the
# layer's high and low clock), a failure, and a negative status: a failure to job and layer usage
# (status != 0) but a success to show_stats (Cuebot counts a failure there only for status > 0).
RUNS = [(100, 0), (250, 0), (40, 1), (70, -1)]
CORES = 150  # centicores: core time = clock * 1.5


def _booked(conn: psycopg.Connection, url: str) -> tuple[Farm, list]:
    """A job whose frames Cuebot's dispatch started, each with its ts_started set back by its run."""
    farm = Farm(conn, frames=len(RUNS), url=url)
    standin = CuebotStandIn(url)
    try:
        procs = [
            standin.dispatch_one(host=farm.host, host_name=farm.host_name, alloc=ALLOC, job=farm.job, cores=CORES)
            for _ in RUNS
        ]
    finally:
        standin.close()
    assert all(procs)
    for proc, (clock, _status) in zip(procs, RUNS, strict=True):
        # .3 s over: the whole second survives the few milliseconds between here and the completion.
        conn.execute(
            "UPDATE frame SET ts_started = current_timestamp - make_interval(secs => %s) WHERE pk_frame = %s",
            (clock + 0.3, proc.frame),
        )
    return farm, procs


def _usage(conn: psycopg.Connection, farm: Farm) -> tuple[tuple, tuple]:
    job = conn.execute(f"SELECT {USAGE_COLUMNS} FROM job_usage WHERE pk_job = %s", [farm.job]).fetchone()
    layer = conn.execute(
        f"SELECT {USAGE_COLUMNS}, int_clock_time_low FROM layer_usage WHERE pk_layer = %s", [farm.layer]
    ).fetchone()
    return job, layer


def test_completion_writes_usage_and_show_stats_as_cuebots_frame_complete_handler(url: str) -> None:
    """The same runs completed by Cuebot (the stand-in's FrameCompleteHandler SQL) and by
    cuesched's completion path give the same job_usage, layer_usage and show_stats numbers."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        theirs, their_procs = _booked(conn, url)
        ours, our_procs = _booked(conn, url)

        stats0 = conn.execute(SHOW_STATS, [SHOW]).fetchone()
        standin = CuebotStandIn(url)
        try:
            for proc, (_clock, status) in zip(their_procs, RUNS, strict=True):
                assert standin.complete_with_usage(proc, status)
        finally:
            standin.close()
        stats1 = conn.execute(SHOW_STATS, [SHOW]).fetchone()

        options = with_writer_option(None).replace(" ", "%20").replace("=", "%3D")
        with psycopg.connect(f"{url}?options={options}", autocommit=True) as writer:
            done = complete(writer, [Completion(p.pk_proc, s) for p, (_c, s) in zip(our_procs, RUNS, strict=True)])
        assert done.released == len(RUNS)
        stats2 = conn.execute(SHOW_STATS, [SHOW]).fetchone()

        expected = _usage(conn, theirs)
        # Cuebot's numbers, by hand: successes 100 s and 250 s at 1.5 cores, failures 40 s and 70 s.
        assert expected[0] == (150 + 375, 60 + 105, 0, 0, 2, 2, 350, 110, 250)
        assert expected[1] == (*expected[0], 100)
        assert _usage(conn, ours) == expected
        their_delta = [b - a for a, b in zip(stats0, stats1, strict=True)]
        our_delta = [b - a for a, b in zip(stats1, stats2, strict=True)]
        assert their_delta == [0, 0, 3, 1]
        assert our_delta == their_delta


def test_a_completion_that_rolls_back_counts_nothing(url: str) -> None:
    """The usage rows are written in the completion's transaction: no release, no usage."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        farm, procs = _booked(conn, url)
        before = _usage(conn, farm), conn.execute(SHOW_STATS, [SHOW]).fetchone()
        options = with_writer_option(None).replace(" ", "%20").replace("=", "%3D")
        with psycopg.connect(f"{url}?options={options}") as writer:
            from dispatch.engine.completion import complete_in_transaction

            with writer.cursor() as cur:
                complete_in_transaction(cur, [Completion(procs[0].pk_proc, 0)])
            assert _usage(conn, farm) == before[0]  # not visible before commit
            writer.rollback()
        assert (_usage(conn, farm), conn.execute(SHOW_STATS, [SHOW]).fetchone()) == before


def _layer(url: str, job: str, name: str) -> tuple:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT int_mem_min, str_tags, int_cores_min, b_threadable, int_cores_max, int_gpus_max, int_timeout, "
            "str_services FROM layer WHERE pk_job = %s AND str_name = %s",
            [job, name],
        ).fetchone()


def test_a_show_service_override_reaches_a_layer_and_an_explicit_value_wins(url: str, tmp_path: Path) -> None:
    """Cuebot's JobSpec: the first named service with a show override (else the service) sets the
    layer's defaults; the spec's own values win; no service named: Cuebot's `default` service."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO show_service (pk_show_service, pk_show, str_name, b_threadable, int_cores_min, int_mem_min,"
            " str_tags, int_cores_max, int_gpus_max, int_timeout) VALUES (%s, %s, 'arnold', true, 200, 12582912,"
            " 'general | gpu', 800, 2, 3600)",
            [str(uuid.uuid4()), SHOW],
        )
    spec = {
        "show": "testing",
        "name": "testing-sh040-services_v1",
        "user": "alice",
        "layers": [
            {"name": "plain", "command": "r", "range": "1", "services": ["nosuch", "arnold"]},
            {
                "name": "mine",
                "command": "r",
                "range": "1",
                "services": ["arnold"],
                "memory": "2GB",
                "tags": ["desktop"],
                "cores": 3,
                "threadable": False,
            },
            {"name": "nothing", "command": "r", "range": "1"},
            {"name": "maya", "command": "r", "range": "1", "services": ["maya"]},
        ],
    }
    job = _submit(url, tmp_path, spec)
    # The override: 12 GB, its tags, 2 cores, threadable, its caps and timeout.
    assert _layer(url, job, "plain") == (12582912, "general | gpu", 200, True, 800, 2, 3600, "nosuch,arnold")
    # Explicit values win; what the spec cannot set is still the override's.
    assert _layer(url, job, "mine") == (2097152, "desktop", 300, False, 800, 2, 3600, "arnold")
    # No service: Cuebot's `default` service (seed: 3355443 KB, general | desktop, not threadable).
    assert _layer(url, job, "nothing") == (3355443, "general | desktop", 100, False, 0, 0, 0, "default")
    # A service with no override for the show: the service itself.
    assert _layer(url, job, "maya") == (2097152, "general | desktop", 100, False, 0, 0, 0, "maya")
