"""pyoutline 1.37 launches jobs on cuesched: `outline.cuerun.launch` sends Cuebot's XML job spec to
JobInterface.LaunchSpecAndWait, which submits it through dispatch.jobs.submit.submit_jobs (issue 30).

The outline scripts run as users run them, with the clients' own python (tests/opencue-clients.txt),
as a user that is not root (pyoutline sends the process's uid, and Cuebot, like cuesched, refuses
to launch as root). Every job is checked against the database and its audit row; every refused
spec leaves the database as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dispatch.lab.seeding import FarmSpec, facility_name, seed_farm, show_name
from dispatch.models import Depend, FarmAction, Frame, Host, HostTag, Job, Layer, LimitRecord
from dispatch.models.base import new_id
from tests.integration.dispatch_support import autocommit, drain, fast_launcher, make_loop, scalar, wait_for
from tests.integration.opencue_clients import Clients, ok
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)
NOBODY = 65534


def farm(prefix: str) -> tuple[str, str]:
    """A show subscribed to one allocation (its tag and general on three 8-core hosts); its name and facility's."""
    seed_farm(
        FarmSpec(
            prefix=prefix,
            jobs=0,
            hosts=3,
            allocs=1,
            manual_tags=0,
            host_cores_choices=(8,),
            host_mem_gb_choices=(32,),
        )
    )
    # pyoutline's Shell layers take the shell service's tags (general | util), as in Cuebot, where
    # a farm's hosts carry general: so do these.
    HostTag.objects.bulk_create(
        HostTag(pk_host_tag=new_id(), host=host, str_tag="general", str_tag_type="MANUAL")
        for host in Host.objects.filter(str_name__startswith=f"{prefix}_h")
    )
    return show_name(prefix, 0), facility_name(prefix, 0)


@pytest.fixture
def home() -> Iterator[Path]:
    """A HOME the outline's session files go to, writable by the (non-root) user the script runs as."""
    path = Path(tempfile.mkdtemp(prefix="cuesched-pyoutline-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_script(clients: Clients, home: Path, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The script with the clients' packages, as a user script runs: never as root.

    As root (a CI container), the script runs as `nobody`; the clients' venv's interpreter lives
    under /root, which nobody cannot enter, so it runs on the system's python of the same minor
    version with the venv's site-packages on its path (the very packages the venv has).
    """
    path = home / "launch_script.py"
    path.write_text(script)
    path.chmod(0o644)
    env = {**clients.env(), "HOME": str(home), "USER": "alice"}
    python = str(clients.venv / "bin" / "python")
    kwargs: dict[str, Any] = {}
    if os.getuid() == 0:
        python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        if not os.path.exists(python):
            pytest.skip(f"running as root and no {python} to run the outline as a user")
        site = clients.venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        env["PYTHONPATH"] = str(site)
        kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    return subprocess.run(
        [python, str(path)], env=env, cwd=home, capture_output=True, text=True, timeout=timeout, **kwargs
    )


OUTLINE = """
import json
import outline, outline.cuerun
from outline.modules.shell import Shell

ol = outline.Outline("Pyol-V1", show={show!r}, shot="sh-010", user="alice", facility={facility!r})
sim = Shell("sim", command=["echo", "sim", "#IFRAME#"], range="1-4", chunk=2, cores=2, memory="1g", timeout=5)
render = Shell("render", command="echo render #IFRAME#", range="1-4", threadable=False, memory="512m",
               timeout_llu=3)
render.depend_on(sim)
ol.add_layer(sim)
ol.add_layer(render)
jobs = outline.cuerun.launch(ol, use_pycuerun=False)
print(json.dumps([[j.name(), j.id(), j.data.job_stats.total_frames, j.data.state] for j in jobs]))
"""


def launch_outline(clients: Clients, home: Path, show: str, facility: str) -> Job:
    out = ok(run_script(clients, home, OUTLINE.format(show=show, facility=facility)))
    ((name, job_id, total, state),) = json.loads(out.strip().splitlines()[-1])
    job = Job.objects.get(pk=job_id)
    assert (name, total, state) == (job.str_name, 6, 0)  # PENDING
    return job


def check_launched_job(job: Job, show: str) -> None:
    """The job, layers, frames and depends exactly as the outline's XML said, and its audit row."""
    uid = NOBODY if os.getuid() == 0 else os.getuid()
    # Cuebot's names: <show>-<shot>-<user>_<name>, lowercased, dashes in names as underscores.
    assert job.str_name == f"{show}-sh_010-alice_pyol_v1"
    assert (job.str_user, job.str_shot, job.int_uid, job.str_email) == ("alice", "sh_010", uid, "alice@example.com")
    assert (job.int_max_retries, job.b_paused, job.str_state, job.show.str_name) == (2, False, "PENDING", show)
    layers = {
        la.str_name: la
        for la in Layer.objects.filter(job=job)  # type: ignore[misc]
    }
    assert set(layers) == {"sim", "render"}
    sim, render = layers["sim"], layers["render"]
    # sim sends no <threadable>: it takes its service's, and Cuebot's shell service is not threadable.
    assert (sim.str_cmd, sim.str_range, sim.int_chunk_size, sim.int_cores_min, sim.b_threadable) == (
        "echo sim #IFRAME#",
        "1-4",
        2,
        200,
        False,
    )
    assert (sim.int_mem_min, sim.int_timeout, sim.int_timeout_llu, sim.str_services, sim.str_type) == (
        1024 * 1024,
        5,
        0,
        "shell",
        "Render",
    )
    assert (render.str_cmd, render.int_chunk_size, render.int_cores_min, render.b_threadable) == (
        "echo render #IFRAME#",
        1,
        100,
        False,
    )
    assert (render.int_mem_min, render.int_timeout_llu, render.int_dispatch_order) == (512 * 1024, 3, 2)
    frames = sorted(Frame.objects.filter(job=job).values_list("str_name", "str_state"))
    assert frames == [
        ("0001-render", "DEPEND"),
        ("0001-sim", "WAITING"),
        ("0002-render", "DEPEND"),
        ("0003-render", "DEPEND"),
        ("0003-sim", "WAITING"),
        ("0004-render", "DEPEND"),
    ]
    # pyoutline's depend_on is FRAME_BY_FRAME: each render frame waits for the sim chunk with its number.
    depends = Depend.objects.filter(job_depend_er=job).count()
    assert depends == 4
    (audit,) = FarmAction.objects.filter(str_target=job.pk).values_list(
        "str_action", "str_target_name", "str_username", "int_changed", "detail"
    )
    assert audit == ("submit", job.str_name, "opencue-api (as alice)", 6, {"user": "alice", "layers": 2, "depends": 4})


def test_a_pyoutline_shell_outline_launches_exactly_as_its_xml_says_and_runs_to_finished(
    clients: Clients, home: Path
) -> None:
    show, facility = farm("pyol")
    with running_scheduler() as proc, autocommit() as conn:
        job = launch_outline(clients, home, show, facility)
        check_launched_job(job, show)
        wait_for(lambda: proc.service.store.job_cap(job.pk) is not None, what="the job's caps in the Store")
        totals = drain(make_loop(proc.service, fast_launcher(), max_jobs=5, frames_per_layer=4))
        assert totals.booked == totals.completed == 6
        assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (job.pk,)) == "FINISHED"
        states = dict(conn.execute("SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1", (job.pk,)))
        assert states == {"SUCCEEDED": 6}
    # ... and pycue sees it finished, as Cuebot would answer.
    seen = ok(
        clients.pycue(
            "import opencue\n"
            f"j = opencue.api.getJobs(job=[{job.str_name!r}], include_finished=True)[0]\n"
            "print(j.data.state, j.data.job_stats.succeeded_frames)"
        )
    )
    assert seen.split() == ["1", "6"]  # FINISHED, 6 succeeded


TRY_SPECS = """
import json, sys
import opencue
out = []
for xml in json.load(open(sys.argv[1])):
    try:
        opencue.api.launchSpecAndWait(xml)
        out.append(["launched", ""])
    except Exception as exc:  # pycue raises CueException carrying the gRPC status and its details
        out.append([type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


def spec_xml(show: str, facility: str, job: str = "hello", layer: str = "", extra: str = "", version: str = "1.15"):
    return (
        f'<?xml version="1.0"?><!DOCTYPE spec PUBLIC "SPI Cue  Specification Language" '
        f'"http://localhost:8080/spcue/dtd/cjsl-{version}.dtd"><spec><facility>{facility}</facility>'
        f"<show>{show}</show><shot>sh010</shot><user>alice</user><uid>1000</uid>"
        f'<job name="{job}"><layers><layer name="main" type="Render"><cmd>echo #IFRAME#</cmd><range>1-3</range>'
        f"<chunk>1</chunk>{layer}</layer></layers></job>{extra}</spec>"
    )


def try_specs(clients: Clients, home: Path, specs: list[str]) -> list[list[str]]:
    data = home / "specs.json"
    data.write_text(json.dumps(specs))
    data.chmod(0o644)
    script = home / "try_specs.py"
    script.write_text(TRY_SPECS)
    result = clients.run([str(clients.venv / "bin" / "python"), str(script), str(data)], timeout=120)
    return json.loads(ok(result).strip().splitlines()[-1])


def rows() -> tuple[int, ...]:
    return (Job.objects.count(), Layer.objects.count(), Frame.objects.count(), FarmAction.objects.count())


BOMB = (
    '<?xml version="1.0"?><!DOCTYPE spec [<!ENTITY a "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa">'
    + "".join(f'<!ENTITY {c} "{("&" + p + ";") * 10}">' for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    + "]><spec><show>&i;</show><shot>sh010</shot><user>alice</user></spec>"
)


def test_bad_specs_are_refused_with_the_reason_and_write_nothing(clients: Clients, home: Path) -> None:
    show, facility = farm("pyolbad")
    LimitRecord.objects.create(pk_limit_record="00000000-0000-0000-0000-0000000000aa", str_name="arnold")
    before = rows()
    good_layer = "<layer name='two' type='Render'><cmd>true</cmd><range>1</range><chunk>1</chunk></layer>"
    two_jobs = spec_xml(show, facility, job="first").replace(
        "</job>", f"</job><job name='second'><layers>{good_layer}</layers></job>", 1
    )
    bad_second = two_jobs.replace("<range>1</range>", "<range>z</range>")
    cases: list[tuple[str, list[str]]] = [
        (BOMB, ["internal subset"]),
        (spec_xml(show, facility).replace("</spec>", ""), ["not well-formed"]),
        (spec_xml("noshow", facility), ["show: unknown show 'noshow'"]),
        (spec_xml(show, facility, layer="<cores>four</cores>"), ["<cores>", "'four' is not a number of cores"]),
        (spec_xml(show, facility, layer="<memory>8x</memory>"), ["<memory>", "'8x' is not a memory size"]),
        (spec_xml(show, facility, layer="<threadable>perhaps</threadable>"), ["<threadable>"]),
        (spec_xml(show, facility, layer="<gpus>-1</gpus>"), ["<gpus>", "must be 0 or more"]),
        (spec_xml(show, facility, layer="<timeout>soon</timeout>"), ["<timeout>"]),
        (spec_xml(show, facility, layer="<limits><limit>nolimit</limit></limits>"), ["unknown limit 'nolimit'"]),
        (spec_xml(show, facility, layer="<tags>no tag!</tags>"), ["tags"]),
        (spec_xml(show, facility).replace("<range>1-3</range>", "<range>1-x</range>"), ["range"]),
        (
            spec_xml(show, facility, layer="<env><key name='1-BAD'>1</key></env>"),
            ["layer 'main'.env", "'1-BAD' is not an environment variable name"],
        ),
        (
            spec_xml(show, facility).replace(
                "<layers>", "<env><key name='A'>1</key><key name='A'>2</key></env><layers>"
            ),
            ["<env> sets 'A' more than once"],
        ),
        (
            spec_xml(
                show,
                facility,
                extra="<depends><depend type='JOB_ON_JOB'><depjob>hello</depjob><onjob>ghost</onjob></depend>"
                "</depends>",
            ),
            ["unknown job", "ghost"],
        ),
        (
            spec_xml(
                show,
                facility,
                extra="<depends><depend type='LAYER_ON_FRAME'><depjob>hello</depjob><deplayer>main</deplayer>"
                "<onjob>hello</onjob><onframe>0001-main</onframe></depend></depends>",
            ),
            ["depend 1 (LAYER_ON_FRAME)", "no dependency of or on single frames"],
        ),
        (spec_xml(show, facility, version="1.10", layer="<gpus>1</gpus>"), ["<gpus> arrived in cjsl 1.12"]),
        (bad_second, ["second", "range"]),
    ]
    results = try_specs(clients, home, [xml for xml, _ in cases])
    for (xml, words), (code, message) in zip(cases, results, strict=True):
        assert code == "CueException" and "StatusCode.INVALID_ARGUMENT : " in message, (xml, message)
        for word in words:
            assert word in message, (word, message)
    assert rows() == before

    # The same two-job spec, both jobs good: both launched, each with its audit row.
    ((code, _),) = try_specs(clients, home, [two_jobs])
    assert code == "launched"
    names = sorted(Job.objects.values_list("str_name", flat=True))
    assert names == [f"{show}-sh010-alice_first", f"{show}-sh010-alice_second"]
    assert FarmAction.objects.filter(str_action="submit").count() == 2


def test_launch_spec_answers_the_names_and_a_taken_name_is_refused(clients: Clients, home: Path) -> None:
    show, facility = farm("pyolname")
    script = (
        "import opencue, sys\n"
        "print(opencue.api.launchSpec(open(sys.argv[1]).read()))\n"
        "try:\n    opencue.api.launchSpec(open(sys.argv[1]).read())\n"
        "except Exception as exc:\n    print('REFUSED', type(exc).__name__, exc)\n"
    )
    spec = home / "spec.xml"
    spec.write_text(spec_xml(show, facility, job="Named-Job"))
    spec.chmod(0o644)
    path = home / "launch_spec.py"
    path.write_text(script)
    out = ok(clients.run([str(clients.venv / "bin" / "python"), str(path), str(spec)]))
    first, second = out.strip().splitlines()[-2:]
    name = f"{show}-sh010-alice_named_job"
    assert first == f"[{name!r}]"
    assert second.startswith("REFUSED CueException") and "StatusCode.INVALID_ARGUMENT : " in second
    assert f"name: a job named {name!r} already exists" in second
    job: Any = Job.objects.get(str_name=name)
    assert Frame.objects.filter(job=job).count() == 3
    assert FarmAction.objects.filter(str_action="submit").count() == 1


def test_a_spec_with_autoeat_true_launches_an_auto_eat_job(clients: Clients, home: Path) -> None:
    """<autoeat>true</autoeat> (refused before auto-eat was served) is the JSON spec's `auto_eat`:
    b_autoeat on the job, its <maxretries> kept as the spec says (Cuebot's JobSpec and insertJob
    zero nothing at launch; only JobDao.updateAutoEat does), and pycue reads it back."""
    show, facility = farm("pyolae")
    xml = spec_xml(show, facility, job="eater").replace(
        "<layers>", "<maxretries>2</maxretries><autoeat>True</autoeat><layers>", 1
    )
    spec = home / "spec.xml"
    spec.write_text(xml)
    spec.chmod(0o644)
    path = home / "launch_autoeat.py"
    path.write_text(
        "import opencue, sys\n"
        "(name,) = opencue.api.launchSpecAndWait(open(sys.argv[1]).read())\n"
        "j = opencue.api.findJob(name.name())\n"
        "print('autoeat', j.isAutoEating())\n"
    )
    out = ok(clients.run([str(clients.venv / "bin" / "python"), str(path), str(spec)]))
    assert "autoeat True" in out, out
    job: Any = Job.objects.get(str_name=f"{show}-sh010-alice_eater")
    assert (job.b_autoeat, job.int_max_retries) == (True, 2)


def test_a_spec_whose_second_job_loses_a_name_race_launches_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job of one spec is written in one transaction. A racing submit takes the second job's
    name after the spec's checks passed and after its first job was written: the launch is refused
    and the first job is not left launched. (Before, each job was its own submit, and the error
    said which jobs had been launched before it.)"""
    import threading

    from django.db import connection

    from dispatch.jobs import submit
    from opencue_api.launch import launch
    from opencue_api.rpc import BadRequest

    show, facility = farm("pyolrace")
    layer = "<layer name='two' type='Render'><cmd>true</cmd><range>1</range><chunk>1</chunk></layer>"
    xml = spec_xml(show, facility, job="first").replace(
        "</job>", f"</job><job name='second'><layers>{layer}</layers></job>", 1
    )
    second = f"{show}-sh010-alice_second"
    racer = {"show": show, "name": second, "user": "bob", "layers": [{"name": "x", "command": "true", "range": "1"}]}
    write_job = submit._write_job
    written: list[str] = []

    def race() -> None:
        try:
            submit.submit_job(racer, user="bob")
        finally:
            connection.close()  # the thread's own connection

    def write_then_race(plan: Any) -> Any:
        result = write_job(plan)
        written.append(plan.name)
        if len(written) == 1:  # the racer commits the second job's name on its own connection
            thread = threading.Thread(target=race)
            thread.start()
            thread.join()
        return result

    monkeypatch.setattr(submit, "_write_job", write_then_race)
    with pytest.raises(BadRequest, match=f"name: a job named '{second}' already exists"):
        launch(xml)
    assert written[0] == f"{show}-sh010-alice_first"
    assert list(Job.objects.values_list("str_name", "str_user")) == [(second, "bob")]
    assert list(FarmAction.objects.values_list("str_action", "str_username")) == [("submit", "bob")]


# --- env and dependencies on other jobs ------------------------------------------------------------

# pyoutline has no way to say a dependency on another job (its depend_on is between layers of
# the outline), so the script adds Cuebot's <depend> to the XML pyoutline serialises, as a
# pipeline's launcher does; the launch itself is still outline.cuerun.launch's LaunchSpecAndWait.
ENV_OUTLINE = """
import json
import outline, outline.cuerun
from outline.modules.shell import Shell

ol = outline.Outline("Env-Dep", show={show!r}, shot="sh-010", user="alice", facility={facility!r})
ol.set_env("OL_JOB_VAR", "from the outline", pre=True)
main = Shell("main", command='echo "ENV OL_JOB_VAR=$OL_JOB_VAR"; echo "ENV LAYER_VAR=$LAYER_VAR"', range="1-2")
main.set_env("LAYER_VAR", "from the layer")
ol.add_layer(main)
depend = ('<depend type="JOB_ON_JOB" anyframe="False"><depjob>Env-Dep</depjob>'
          '<onjob>{on_job}</onjob></depend>')
serialize = outline.cuerun.OutlineLauncher.serialize

def with_depend(self, *args, **kwargs):
    xml = serialize(self, *args, **kwargs)
    if "<depends />" in xml:
        return xml.replace("<depends />", "<depends>" + depend + "</depends>")
    return xml.replace("</depends>", depend + "</depends>")

outline.cuerun.OutlineLauncher.serialize = with_depend
jobs = outline.cuerun.launch(ol, use_pycuerun=False)
print(json.dumps([[j.name(), j.id()] for j in jobs]))
"""


def _printed_env(text: str) -> dict[str, str]:
    return dict(line[4:].partition("=")[::2] for line in text.splitlines() if line.startswith("ENV "))


def test_a_pyoutline_job_with_env_waiting_for_a_job_on_the_farm_runs_after_it_with_its_env(
    clients: Clients, home: Path, tmp_path: Path
) -> None:
    """The outline's job env and layer env land in job_env and layer_env and reach the frame's
    process; its JOB_ON_JOB depend on a job already launched is a LAYER_ON_JOB row on its one
    layer, its frames wait in DEPEND until that job is FINISHED, then run."""
    from dispatch.engine.launcher import get_launcher
    from dispatch.jobs.submit import submit_job
    from tests.integration.agent_support import agent_process

    seed_farm(FarmSpec(prefix="pyolenv", managed=True, jobs=0, hosts=0, allocs=1, manual_tags=0))
    show, facility = show_name("pyolenv", 0), facility_name("pyolenv", 0)
    on_name = f"{show}-sh_010-alice_base"
    base = submit_job(
        {"show": show, "name": on_name, "user": "alice", "layers": [{"name": "main", "command": "true", "range": "1"}]},
        user="alice",
    ).job_id
    out = ok(run_script(clients, home, ENV_OUTLINE.format(show=show, facility=facility, on_job=on_name)))
    ((name, job_id),) = json.loads(out.strip().splitlines()[-1])
    assert name == f"{show}-sh_010-alice_env_dep"

    def book_and_run(conn: Any, frames: int) -> None:
        with running_scheduler() as proc:
            launcher = get_launcher("q2")
            with make_loop(proc.service, launcher) as loop:
                assert loop.run_once().booked == frames
            launcher.close()
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM proc") == 0, 30, "the frames to end")

    with autocommit() as conn:
        job_env = dict(conn.execute("SELECT str_key, str_value FROM job_env WHERE pk_job = %s", (job_id,)))
        assert job_env["OL_JOB_VAR"] == "from the outline"
        layer_env = conn.execute(
            "SELECT l.str_name, e.str_key, e.str_value FROM layer_env e JOIN layer l USING (pk_layer) "
            "WHERE l.pk_job = %s",
            (job_id,),
        ).fetchall()
        assert layer_env == [("main", "LAYER_VAR", "from the layer")]
        depends = conn.execute(
            "SELECT str_type, pk_job_depend_on, pk_layer_depend_on, b_active FROM depend WHERE pk_job_depend_er = %s",
            (job_id,),
        ).fetchall()
        assert depends == [("LAYER_ON_JOB", base, None, True)]
        states = "SELECT str_state, count(*) FROM frame WHERE pk_job = %s GROUP BY 1"
        assert dict(conn.execute(states, (job_id,))) == {"DEPEND": 2}
        # pyoutline's Shell layer takes the shell service's tags (general | util): the host has general.
        alloc, tag = conn.execute("SELECT str_name, str_tag FROM alloc").fetchone()
        host = {"alloc": alloc, "tags": [tag, "general"]}
        with agent_process("pyolenv-host", host, tmp_path):
            book_and_run(conn, 1)  # the base job's frame, nothing of the waiting job
            assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (base,)) == "FINISHED"
            assert dict(conn.execute(states, (job_id,))) == {"WAITING": 2}
            assert scalar(conn, "SELECT b_active FROM depend WHERE pk_job_depend_er = %s", (job_id,)) is False
            book_and_run(conn, 2)
        assert dict(conn.execute(states, (job_id,))) == {"SUCCEEDED": 2}
    logs = [p.read_text() for p in tmp_path.rglob("*.log")]
    printed = [_printed_env(text) for text in logs if "ENV OL_JOB_VAR=" in text]
    assert printed == [{"OL_JOB_VAR": "from the outline", "LAYER_VAR": "from the layer"}] * 2


def test_a_spec_whose_first_job_waits_for_its_second_launches_both_in_the_order_they_need() -> None:
    """Cuebot makes a spec's depends after all its jobs; here the job waited for is written first,
    in the same transaction, so the waiting job's check finds it. A cycle between the spec's jobs
    is refused and writes nothing."""
    from opencue_api.launch import launch
    from opencue_api.rpc import BadRequest

    show, facility = farm("pyolorder")
    second = "<job name='second'><layers><layer name='two' type='Render'><cmd>true</cmd><range>1-2</range>"
    second += "<chunk>1</chunk></layer></layers></job>"
    depend = (
        "<depends><depend type='JOB_ON_LAYER'><depjob>first</depjob><onjob>second</onjob><onlayer>two</onlayer>"
        "</depend></depends>"
    )
    xml = spec_xml(show, facility, job="first").replace("</job>", "</job>" + second, 1)
    back = "<depend type='LAYER_ON_JOB'><depjob>second</depjob><deplayer>two</deplayer><onjob>first</onjob></depend>"
    before = rows()
    with pytest.raises(BadRequest, match="the jobs of this spec wait for each other"):
        launch(xml.replace("</spec>", depend.replace("</depends>", back + "</depends>") + "</spec>"))
    assert rows() == before

    results = launch(xml.replace("</spec>", depend + "</spec>"))
    first, on = (f"{show}-sh010-alice_{n}" for n in ("first", "second"))
    assert [r.name for r in results] == [first, on]  # the spec's order, whatever the write order
    job = Job.objects.get(str_name=first)
    (dep,) = Depend.objects.filter(job_depend_er=job).values_list(
        "str_type", "job_depend_on__str_name", "layer_depend_on__str_name", "layer_depend_er__str_name"
    )
    assert dep == ("LAYER_ON_LAYER", on, "two", "main")
    assert set(Frame.objects.filter(job=job).values_list("str_state", flat=True)) == {"DEPEND"}
    assert FarmAction.objects.filter(str_action="submit").count() == 2
