"""Issue 29, a frame's life: max RSS on frame, layer and job, and the job's and layer's `env`.

Before, max RSS was kept on the frame only, and only from RQD's completion report: the simulated
launcher and the agents (`run_agent`, behind q2 and celery) recorded none at the end, and Cuebot's
`layer_mem` / `job_mem` did not exist. Now every launcher's figure reaches the frame (this run's
max), and its layer's and job's (the largest of their frames), from each memory report and from
each completion, in the statements that already write the proc's use and the frame's end.

The spec had no `env` and no `uid`: now a job's and a layer's environment (Cuebot's job_env and
layer_env) reach the frame on every launcher, the layer's over the job's and Cuebot's CUE_* over
both, CUE_THREADABLE included, and the job's uid goes into RQD's RunFrame.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import psycopg
import pytest

from dispatch.engine.launcher import get_launcher
from dispatch.jobs.plan import SpecError
from dispatch.jobs.submit import submit_job
from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from tests.integration.agent_support import agent_process
from tests.integration.dispatch_support import (
    ONE_CORE,
    autocommit,
    drain,
    fast_launcher,
    make_loop,
    scalar,
    seed,
    violations,
    wait_for,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)

MB = 1024  # KB
MEMORY_ENV = {"CUESCHED_AGENT_MEMORY_INTERVAL": "0.2"}


def _mem_rows(conn: psycopg.Connection) -> tuple[dict[str, int], dict[str, int]]:
    layers = dict(conn.execute("SELECT pk_layer, int_max_rss FROM layer_mem").fetchall())
    jobs = dict(conn.execute("SELECT pk_job, int_max_rss FROM job_mem").fetchall())
    return layers, jobs


def _farm(prefix: str) -> tuple[str, str, str]:
    """A managed show with one allocation and no host: (show, alloc, alloc tag)."""
    seed_farm(FarmSpec(prefix=prefix, managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
    with autocommit() as conn:
        alloc, tag = conn.execute("SELECT str_name, str_tag FROM alloc").fetchone()
    return show_name(prefix, 0), alloc, tag


def _book_one(transport: str) -> None:
    with running_scheduler() as proc:
        launcher = get_launcher(transport)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        launcher.close()


def _python(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


# A frame command: print its environment (one NAME=value a line), take `mb` MB, hold it until
# `until` exists (or 60 s), exit 0.
def _env_and_memory(mb: int, until: Path) -> str:
    return _python(
        "import os, sys, time\n"
        "for k in sorted(os.environ):\n"
        "    print('ENV ' + k + '=' + os.environ[k])\n"
        "sys.stdout.flush()\n"
        f"held = bytearray(b'\\x01') * ({mb} << 20)\n"
        "deadline = time.time() + 60\n"
        f"while not os.path.exists({str(until)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
    )


def _printed_env(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV ") and "=" in line:
            key, _, value = line[4:].partition("=")
            out[key] = value
    return out


ENV_SPEC = {
    "env": {"JOB_ONLY": "from the job", "SHARED": "job", "CUE_JOB": "a job cannot fake this"},
    "layer_env": {"SHARED": "layer", "LAYER_ONLY": "from the layer", "CUE_THREADABLE": "nor this"},
}


def _env_spec(show: str, name: str, command: str, *, threadable: bool = False, uid: int | None = None) -> dict:
    layer = {
        "name": "main",
        "command": command,
        "range": "1",
        "cores": 1,
        "memory": "64MB",
        "threadable": threadable,
        "env": ENV_SPEC["layer_env"],
    }
    spec = {"show": show, "name": name, "user": "alice", "env": ENV_SPEC["env"], "layers": [layer]}
    if uid is not None:
        spec["uid"] = uid
    return spec


def _assert_env(env: dict[str, str], job: str, *, threadable: str) -> None:
    assert env["JOB_ONLY"] == "from the job"
    assert env["LAYER_ONLY"] == "from the layer"
    assert env["SHARED"] == "layer"  # the layer's over the job's
    assert env["CUE_JOB"] == job  # Cuebot's CUE_* over both
    assert env["CUE_THREADABLE"] == threadable
    assert env["CUE3"] == "1"


# --- max RSS ----------------------------------------------------------------------------------


def test_simulated_frames_keep_their_max_rss_and_layer_and_job_mem_the_largest() -> None:
    """Each simulated run's max RSS is on its frame (succeeded or failed), and layer_mem / job_mem
    hold the largest of their frames'."""
    seed("rss", **{**ONE_CORE, "jobs": 2, "layers": 2, "frames_per_layer": 3})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE job SET int_max_retries = 0")
        frames = conn.execute("SELECT pk_frame FROM frame ORDER BY pk_frame").fetchall()
        rss = {pk: (i + 1) * 37 * MB for i, (pk,) in enumerate(frames)}
        failing = frames[0][0]
        launcher = fast_launcher(rss=lambda b: rss[b.frame.pk], exit_status=lambda b: 1 if b.frame.pk == failing else 0)
        drain(make_loop(proc.service, launcher))
        recorded = dict(conn.execute("SELECT pk_frame, int_mem_max_used FROM frame").fetchall())
        assert recorded == rss
        assert scalar(conn, "SELECT str_state FROM frame WHERE pk_frame = %s", (failing,)) == "DEAD"
        per_layer = dict(conn.execute("SELECT pk_layer, MAX(int_mem_max_used) FROM frame GROUP BY pk_layer").fetchall())
        per_job = dict(conn.execute("SELECT pk_job, MAX(int_mem_max_used) FROM frame GROUP BY pk_job").fetchall())
        assert _mem_rows(conn) == (per_layer, per_job)
        assert violations(conn) == []


def test_the_default_simulated_run_reports_half_its_reservation() -> None:
    seed("rssd", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 2})
    with running_scheduler() as proc, autocommit() as conn:
        drain(make_loop(proc.service, fast_launcher()))
        rows = conn.execute("SELECT int_mem_reserved, int_mem_max_used FROM frame").fetchall()
        assert rows and all(used == reserved // 2 > 0 for reserved, used in rows)


def test_the_console_shows_max_rss_beside_the_reservation(client) -> None:
    """The job page: the job's max RSS (job_mem) in its summary, each layer's (layer_mem) beside
    its memory per frame; the frame rows keep theirs beside what they reserved."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    from ops.units import memory_kb

    seed("rssc", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 2})
    with running_scheduler() as proc, autocommit() as conn:
        drain(make_loop(proc.service, fast_launcher(rss=lambda b: 777 * MB)))
        job = scalar(conn, "SELECT pk_job FROM job")
    client.force_login(get_user_model().objects.create(username="ops", is_staff=True, is_superuser=True))
    page = client.get(reverse("admin:ops_job", args=[job])).content.decode()
    shown = memory_kb(777 * MB)
    assert f'id="job-max-rss">{shown}<' in page
    layers = page[page.index('id="layers-table"') : page.index("</table>", page.index('id="layers-table"'))]
    assert f'<td class="num">{shown}</td>' in layers
    layer_list = client.get(reverse("admin:dispatch_layer_changelist")).content.decode()
    assert shown in layer_list


def test_layer_and_job_max_rss_never_go_down() -> None:
    """A later, smaller run leaves layer_mem and job_mem at the larger figure; the frame shows
    its own latest run."""
    seed("rssn", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 1})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE job SET int_max_retries = 1")
        runs = iter([(1, 500 * MB), (0, 100 * MB)])
        drawn: dict[str, tuple[int, int]] = {}

        def draw(b) -> tuple[int, int]:
            if b.pk_proc not in drawn:
                drawn[b.pk_proc] = next(runs)
            return drawn[b.pk_proc]

        launcher = fast_launcher(exit_status=lambda b: draw(b)[0], rss=lambda b: draw(b)[1])
        drain(make_loop(proc.service, launcher))
        assert conn.execute("SELECT str_state, int_mem_max_used FROM frame").fetchone() == ("SUCCEEDED", 100 * MB)
        assert scalar(conn, "SELECT int_max_rss FROM layer_mem") == 500 * MB
        assert scalar(conn, "SELECT int_max_rss FROM job_mem") == 500 * MB


def test_an_agent_frames_max_rss_reaches_layer_and_job_while_it_runs_and_stays_after(tmp_path: Path) -> None:
    """run_agent: the frame takes 200 MB. Its memory reports raise layer_mem and job_mem while it
    runs; at its end (SUCCEEDED) the frame keeps its max RSS too."""
    show, alloc, tag = _farm("rssa")
    release = tmp_path / "release"
    host = "rssa-host"
    with autocommit() as conn:
        job = submit_job(_env_spec(show, "rssa-job", _env_and_memory(200, release)), user="alice").job_id
        with agent_process(host, {"alloc": alloc, "tags": [tag]}, tmp_path, memory="4G", env_extra=MEMORY_ENV):
            _book_one("q2")
            wait_for(
                lambda: scalar(conn, "SELECT int_max_rss FROM job_mem WHERE pk_job = %s", (job,)) >= 200 * MB,
                30,
                "the frame's memory reports to raise job_mem",
            )
            assert scalar(conn, "SELECT int_max_rss FROM layer_mem WHERE pk_job = %s", (job,)) >= 200 * MB
            assert scalar(conn, "SELECT int_mem_max_used FROM frame WHERE pk_job = %s", (job,)) == 0  # not yet
            release.touch()
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 30, "the frame to end")
        state, max_rss = conn.execute(
            "SELECT str_state, int_mem_max_used FROM frame WHERE pk_job = %s", (job,)
        ).fetchone()
        assert state == "SUCCEEDED" and max_rss >= 200 * MB
        layer_max = scalar(conn, "SELECT int_max_rss FROM layer_mem WHERE pk_job = %s", (job,))
        job_max = scalar(conn, "SELECT int_max_rss FROM job_mem WHERE pk_job = %s", (job,))
        assert layer_max == job_max == max_rss
        assert violations(conn) == []


# --- env and uid --------------------------------------------------------------------------------


def test_an_agent_frame_gets_the_job_env_then_the_layer_env_then_cue_variables(tmp_path: Path) -> None:
    show, alloc, tag = _farm("enva")
    release = tmp_path / "release"
    release.touch()  # the frame prints its environment and ends
    with autocommit() as conn:
        job = submit_job(_env_spec(show, "enva-job", _env_and_memory(1, release)), user="alice").job_id
        assert (
            dict(conn.execute("SELECT str_key, str_value FROM job_env WHERE pk_job = %s", (job,)).fetchall())
            == (ENV_SPEC["env"])
        )
        with agent_process("enva-host", {"alloc": alloc, "tags": [tag]}, tmp_path):
            _book_one("q2")
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 30, "the frame to end")
        assert scalar(conn, "SELECT str_state FROM frame WHERE pk_job = %s", (job,)) == "SUCCEEDED"
    env = _printed_env(next(tmp_path.rglob("*.log")).read_text())
    _assert_env(env, "enva-job", threadable="0")
    assert "DATABASE_URL" not in env  # never the agent's own environment


def test_the_run_frame_sent_to_rqd_carries_env_and_uid() -> None:
    """The RunFrame built from the database (what the rqd launcher sends): the job's env, the
    layer's over it, CUE_* over both, and the job's uid; a job without uid sends none."""
    from dispatch.hosts.agent import RunContext
    from dispatch.hosts.launchers.rqd import RUN_CONTEXTS_SQL, run_frame_message
    from dispatch.models import Alloc
    from tests.integration.farm_fixtures import create_host

    show, _alloc, _tag = _farm("envr")
    create_host(Alloc.objects.get(), "envr-h", int_cores=800, int_mem=16 * 1024 * MB)
    with_uid = submit_job(_env_spec(show, "envr-a", "true", threadable=True, uid=4321), user="alice").job_id
    without = submit_job({**_env_spec(show, "envr-b", "true"), "env": {}}, user="alice").job_id
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 2
        procs = dict(conn.execute("SELECT pk_job, pk_proc FROM proc").fetchall())
        rows = conn.execute(RUN_CONTEXTS_SQL, ([procs[with_uid], procs[without]],)).fetchall()
        messages = {ctx.pk_job: run_frame_message(ctx, "/tmp/logs", "rqd") for ctx in (RunContext(*r) for r in rows)}
        a, b = messages[with_uid], messages[without]
        env = dict(a.environment)
        _assert_env(env, "envr-a", threadable="1")
        assert "HOME" not in env and "DATABASE_URL" not in env  # RQD adds its own basics
        assert a.HasField("uid") and a.uid == 4321
        assert not b.HasField("uid")
        assert dict(b.environment)["SHARED"] == "layer" and "JOB_ONLY" not in dict(b.environment)
        assert dict(b.environment)["CUE_THREADABLE"] == "0"
        launcher.close()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"1BAD": "x"}, "'1BAD' is not an environment variable name"),
        ({"A-B": "x"}, "'A-B' is not an environment variable name"),
        ({"N": 3}, "env.N: must be a string, not 3"),
        ({"N": None}, "env.N: must be a string"),
        ({"N": "x" * 2049}, "env.N: is longer than 2048 characters"),
        ({"N": "a\x00b"}, "env.N: contains a NUL character"),
        ({f"V{i}": "x" for i in range(257)}, "has 257 variables; at most 256"),
        ({f"V{i}": "x" * 2000 for i in range(40)}, "bytes of names and values; at most 65536"),
        (["A=1"], "env: must be an object of variable names to strings"),
    ],
)
def test_a_bad_env_is_refused_with_a_clear_error_and_writes_nothing(env: object, needle: str) -> None:
    show, _alloc, _tag = _farm("envbad")
    with autocommit() as conn:
        before = scalar(conn, "SELECT count(*) FROM job") + scalar(conn, "SELECT count(*) FROM job_env")
    good_layer = _env_spec(show, "x", "true")["layers"][0]
    for spec in (
        {**_env_spec(show, "envbad-job", "true"), "env": env},
        {**_env_spec(show, "envbad-job", "true"), "layers": [{**good_layer, "env": env}]},
    ):
        with pytest.raises(SpecError) as err:
            submit_job(spec, user="alice")
        assert any(needle in e for e in err.value.errors), err.value.errors
    with autocommit() as conn:
        after = scalar(conn, "SELECT count(*) FROM job") + scalar(conn, "SELECT count(*) FROM job_env")
        assert after == before and scalar(conn, "SELECT count(*) FROM layer_env") == 0


@pytest.mark.parametrize("uid", [0, -1, 2**31, "1000", True])
def test_a_bad_uid_is_refused(uid: object) -> None:
    show, _alloc, _tag = _farm("uidbad")
    with pytest.raises(SpecError) as err:
        submit_job({**_env_spec(show, "uidbad-job", "true"), "uid": uid}, user="alice")
    assert any(e.startswith("job.uid: ") for e in err.value.errors), err.value.errors


def test_a_real_rqd_runs_the_frame_with_env_and_uid_and_its_max_rss_reaches_layer_and_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real RQD: the RunFrame's environment is the job's env, the layer's over it, CUE_* over
    both (the frame prints it into RQD's log); RQD takes the uid (this RQD, RQD_BECOME_JOB_USER
    off, runs the frame as itself). The frame takes 150 MB: RQD's reports raise layer_mem and
    job_mem, and its completion report's max RSS stays on the SUCCEEDED frame."""
    from tests.integration.rqd_support import gateway, rqd_daemons

    show, alloc, tag = _farm("rssq")
    monkeypatch.setenv("CUESCHED_RQD_DEFAULT_ALLOC", alloc)
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "logs"))
    release = tmp_path / "release"
    spec = _env_spec(show, "rssq-job", _env_and_memory(150, release), uid=4321)
    with autocommit() as conn, gateway() as gw, rqd_daemons(conn, gw, tmp_path, ["rssq-a"], tags=[tag]):
        job = submit_job(spec, user="alice").job_id
        with running_scheduler() as proc:
            launcher = get_launcher("rqd")
            try:
                with make_loop(proc.service, launcher, host_refresh_interval=0.2) as loop:
                    assert loop.run_once().booked == 1
                # RQD samples RSS every few seconds; the launcher's status poll brings it here.
                wait_for(
                    lambda: (
                        (
                            launcher.heartbeat(conn),
                            scalar(conn, "SELECT int_max_rss FROM job_mem WHERE pk_job = %s", (job,)),
                        )[1]
                        >= 150 * MB
                    ),
                    45,
                    "RQD's reports to raise job_mem",
                )
                assert scalar(conn, "SELECT int_max_rss FROM layer_mem WHERE pk_job = %s", (job,)) >= 150 * MB
                release.touch()
                wait_for(
                    lambda: (launcher.heartbeat(conn), scalar(conn, "SELECT count(*) FROM proc"))[1] == 0,
                    45,
                    "RQD to report the frame's end",
                )
            finally:
                launcher.close()
        state, max_rss = conn.execute(
            "SELECT str_state, int_mem_max_used FROM frame WHERE pk_job = %s", (job,)
        ).fetchone()
        assert state == "SUCCEEDED" and max_rss >= 150 * MB
        assert scalar(conn, "SELECT int_max_rss FROM job_mem WHERE pk_job = %s", (job,)) >= max_rss
        assert violations(conn) == []
    log = next((tmp_path / "logs").rglob("*.rqlog")).read_text()
    # RQD's log header lists the environment it started the frame with, one `env NAME=value` a
    # line (RQD's own basics, then the RunFrame's over them).
    started_with = dict(m.groups() for m in re.finditer(r"^env\s+([^=\s]+)=(.*)$", log, re.MULTILINE))
    _assert_env(started_with, "rssq-job", threadable="0")
    assert re.search(r"^uid\s+4321$", log, re.MULTILINE), log[:2000]
