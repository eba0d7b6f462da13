"""Auto-eat (issue 30), as Cuebot's FrameCompleteHandler.determineFrameState has it: a failed frame
of an auto-eat job is EATEN, not retried and never DEAD, and what waits for it is released as for
an operator's eat; a kill, a requeue, a NIMBY kill and a memory failure (its free retry with more
memory) are not failures of the frame and are not eaten. `set_auto_eat` is the audited control,
and zeroes the job's max retries when it turns auto-eat on, as Cuebot's JobDao.updateAutoEat."""

from __future__ import annotations

import io
import json
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.test import Client

from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, complete
from dispatch.engine.kills import KILL_FRAME, KILL_LLU, KILL_NIMBY, KILL_TIMEOUT
from dispatch.jobs.controls import set_auto_eat
from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import issue_token
from dispatch.lab.seeding import FarmSpec, seed_farm, show_name
from dispatch.models import FarmAction, Job
from tests.integration.dispatch_support import autocommit, drain, fast_launcher, make_loop, scalar, seed, violations
from tests.integration.runtime_support import running_scheduler
from tests.integration.submit_support import simple_spec, submit_farm
from tests.integration.test_stat_triggers import JOB_MISMATCH, LAYER_MISMATCH

GB = 1024 * 1024  # KB
ONE_HOST = {
    "hosts": 1,
    "jobs": 1,
    "layers": 1,
    "frames_per_layer": 1,
    "allocs": 1,
    "layer_cores_choices": (1,),
    "layer_mem_gb_choices": (2,),
    "host_cores_choices": (8,),
}


def _counters_match(conn: psycopg.Connection) -> bool:
    return not conn.execute(JOB_MISMATCH).fetchall() and not conn.execute(LAYER_MISMATCH).fetchall()


def _farm(prefix: str) -> str:
    seed_farm(
        FarmSpec(
            prefix=prefix,
            jobs=0,
            hosts=2,
            allocs=1,
            manual_tags=0,
            host_cores_choices=(8,),
            host_mem_gb_choices=(32,),
        )
    )
    return show_name(prefix, 0)


@pytest.mark.django_db(transaction=True)
def test_a_failed_frame_of_an_auto_eat_job_is_eaten_not_retried_and_what_waits_for_it_runs() -> None:
    show = _farm("aeat")
    spec = {
        "show": show,
        "name": "aeat-shot-v1",
        "user": "alice",
        "max_retries": 3,  # an ordinary job would run the failing frame 4 times, then DEAD
        "auto_eat": True,
        "layers": [
            {"name": "sim", "command": "sim #IFRAME#", "range": "1-2", "memory": "1GB"},
            {"name": "render", "command": "render #IFRAME#", "range": "1-2", "memory": "1GB",
             "depends": [{"layer": "sim", "type": "frame"}]},
            {"name": "movie", "command": "movie", "range": "1", "memory": "1GB",
             "depends": [{"layer": "render", "type": "layer"}]},
        ],
    }  # fmt: skip
    with running_scheduler() as proc, autocommit() as conn:
        job = submit_job(spec, user="alice").job_id
        assert conn.execute("SELECT b_autoeat, int_max_retries FROM job WHERE pk_job = %s", (job,)).fetchone() == (
            True,
            3,
        )
        launches: list[tuple[str, int, str | None]] = []

        def exit_status(booking: Any) -> int:
            layer, number = booking.layer.name, booking.frame.number
            # The state of the sim frame this one waits for, when it starts (None: waits for none).
            sim = None
            if layer == "render":
                sim = scalar(
                    conn, "SELECT str_state FROM frame WHERE pk_job = %s AND str_name = %s", (job, f"{number:04d}-sim")
                )
            launches.append((layer, number, sim))
            return 1 if (layer, number) == ("sim", 1) else 0

        totals = drain(make_loop(proc.service, fast_launcher(exit_status=exit_status), max_jobs=5))

        # The failing frame ran once; the render frame waiting for it started after it was eaten.
        assert sorted(launches) == [
            ("movie", 1, None),
            ("render", 1, "EATEN"),
            ("render", 2, "SUCCEEDED"),
            ("sim", 1, None),
            ("sim", 2, None),
        ]
        assert launches[-1][0] == "movie"
        rows = conn.execute(
            "SELECT str_name, str_state, int_exit_status, int_retries FROM frame WHERE pk_job = %s", (job,)
        ).fetchall()
        frames = {name: (state, exit_status, retries) for name, state, exit_status, retries in rows}
        assert frames["0001-sim"] == ("EATEN", 1, 0)
        assert {state for name, (state, _e, _r) in frames.items() if name != "0001-sim"} == {"SUCCEEDED"}
        reason = scalar(conn, "SELECT str_reason FROM frame WHERE pk_job = %s AND str_name = '0001-sim'", (job,))
        assert reason.startswith("auto-eat:")
        assert scalar(conn, "SELECT str_state FROM job WHERE pk_job = %s", (job,)) == "FINISHED"
        assert totals.booked == totals.completed == 5 and totals.jobs_finished == 1
        assert conn.execute(
            "SELECT int_eaten_count, int_succeeded_count, int_dead_count, int_waiting_count, int_depend_count"
            " FROM job_stat WHERE pk_job = %s",
            (job,),
        ).fetchone() == (1, 4, 0, 0, 0)
        assert _counters_match(conn)
        assert scalar(conn, "SELECT count(*) FROM depend WHERE b_active OR ts_satisfied IS NULL") == 0
        assert violations(conn) == []


# (exit status, exit signal, kill mark, requeue) -> (state, recorded exit status). The run's RSS
# is below its reservation throughout, so a SIGKILL is somebody's kill, not a memory failure.
CASES = [
    pytest.param(1, 0, None, False, ("EATEN", 1), id="failed"),
    pytest.param(1, 9, None, False, ("EATEN", 137), id="sigkill-below-reservation"),
    pytest.param(0, 0, None, False, ("SUCCEEDED", 0), id="succeeded"),
    pytest.param(33, 0, None, False, ("WAITING", 33), id="memory-failure-free-retry"),
    pytest.param(286, 0, None, False, ("WAITING", 286), id="nimby-exit"),
    pytest.param(1, 15, KILL_NIMBY, False, ("WAITING", 286), id="nimby-kill"),
    pytest.param(1, 9, KILL_FRAME, False, ("WAITING", EXIT_STATUS_KILLED), id="frame-kill"),
    pytest.param(399, 0, None, True, ("WAITING", 399), id="lost-host-requeue"),
    # Cuebot eats a timed-out frame of an auto-eat job (its autoEat test comes before the timeouts).
    pytest.param(1, 9, KILL_TIMEOUT, False, ("EATEN", EXIT_STATUS_KILLED), id="timeout"),
    pytest.param(1, 9, KILL_LLU, False, ("EATEN", EXIT_STATUS_KILLED), id="timeout-llu"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("status", "signal", "kill", "requeue", "expected"), CASES)
def test_only_a_failure_of_the_frame_itself_is_eaten(
    status: int, signal: int, kill: str | None, requeue: bool, expected: tuple[str, int]
) -> None:
    seed("aecase", **{**ONE_HOST, "host_mem_gb_choices": (32,)})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE job SET b_autoeat = true, int_max_retries = 3")
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        pk_proc, pk_frame = conn.execute("SELECT pk_proc, pk_frame FROM proc").fetchone()
        conn.execute(
            "UPDATE proc SET int_mem_used = %s, str_kill = %s::text,"
            " ts_kill = CASE WHEN %s::text IS NULL THEN NULL ELSE now() END WHERE pk_proc = %s",
            (GB, kill, kill, pk_proc),
        )
        result = complete(conn, [Completion(pk_proc, status, requeue=requeue, exit_signal=signal)])
        state, exit_status, retries = conn.execute(
            "SELECT str_state, int_exit_status, int_retries FROM frame WHERE pk_frame = %s", (pk_frame,)
        ).fetchone()
        assert (state, exit_status, retries) == (*expected, 0)
        assert result.states == {expected[0]: 1}
        # The only frame done (SUCCEEDED or EATEN): the job is finished; requeued: it is not.
        assert bool(result.finished_jobs) == (expected[0] in ("SUCCEEDED", "EATEN"))
        if kill in (KILL_TIMEOUT, KILL_LLU):
            assert "EATEN (auto-eat)" in scalar(conn, "SELECT str_reason FROM frame")
        assert _counters_match(conn)
        launcher.close()
        assert violations(conn) == []


@pytest.mark.django_db(transaction=True)
def test_a_memory_failure_no_host_can_fit_is_eaten_in_an_auto_eat_job_and_the_job_finishes() -> None:
    """Where an ordinary job's frame is DEAD (test_frame_life), an auto-eat job's is EATEN: as in
    Cuebot, no frame of an auto-eat job ends DEAD and keeps the job from finishing."""
    seed("aememdead", **{**ONE_HOST, "host_mem_gb_choices": (4,)})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE layer SET b_threadable = false")
        conn.execute("UPDATE job SET b_autoeat = true, int_max_retries = 0")
        launcher = fast_launcher(runtime_min=600, runtime_max=600)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        pk_proc = scalar(conn, "SELECT pk_proc FROM proc")
        assert complete(conn, [Completion(pk_proc, 33)]).states == {"WAITING": 1}  # 4 GB still fits
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 1
        pk_proc = scalar(conn, "SELECT pk_proc FROM proc")
        result = complete(conn, [Completion(pk_proc, 1, exit_signal=33)])  # 6 GB: no host has it
        assert result.states == {"EATEN": 1} and result.finished_jobs
        state, exit_status, reason = conn.execute("SELECT str_state, int_exit_status, str_reason FROM frame").fetchone()
        assert (state, exit_status) == ("EATEN", 33)
        assert "more than any host of the show's allocations has" in reason and reason.endswith("EATEN (auto-eat)")
        assert scalar(conn, "SELECT str_state FROM job") == "FINISHED"
        assert _counters_match(conn)
        launcher.close()
        assert violations(conn) == []


# --- the control ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_set_auto_eat_writes_the_flag_and_max_retries_with_its_audit_row() -> None:
    submit_farm()
    job = submit_job(simple_spec("ae-control", max_retries=4), user="alice").job_id

    def row() -> tuple[bool, int]:
        j = Job.objects.get(pk=job)
        return j.b_autoeat, j.int_max_retries

    def audits() -> list[tuple[str, int, dict[str, Any], str]]:
        rows = FarmAction.objects.filter(str_target=job, str_action="auto_eat").order_by("id")
        return list(rows.values_list("str_action", "int_changed", "detail", "str_username"))

    on = set_auto_eat(job, True, actor="ops")
    assert (on.action, on.changed, on.detail) == ("auto_eat", 1, {"auto_eat": True, "max_retries": 0, "was": 4})
    assert row() == (True, 0)
    # Again: nothing to change, still one audit row saying so.
    assert set_auto_eat(job, True, actor="ops").changed == 0
    assert row() == (True, 0)
    # Off, as Cuebot: max retries 1.
    off = set_auto_eat(job, False, actor="ops")
    assert (off.changed, off.detail) == (1, {"auto_eat": False, "max_retries": 1, "was": 0})
    assert row() == (False, 1)
    # Off on a job that is not auto-eating changes nothing (its max retries are kept).
    Job.objects.filter(pk=job).update(int_max_retries=5)
    assert set_auto_eat(job, False, actor="ops").changed == 0
    assert row() == (False, 5)
    assert [(a, c, u) for a, c, _d, u in audits()] == [
        ("auto_eat", 1, "ops"),
        ("auto_eat", 0, "ops"),
        ("auto_eat", 1, "ops"),
        ("auto_eat", 0, "ops"),
    ]
    assert audits()[3][2] == {"auto_eat": False}
    with pytest.raises(ValidationError, match="auto-eat is true or false"):
        set_auto_eat(job, "yes", actor="ops")  # type: ignore[arg-type]
    assert len(audits()) == 4


@pytest.mark.django_db
def test_auto_eat_from_the_api_and_the_command_line(client: Client) -> None:
    submit_farm()
    job = submit_job(simple_spec("ae-routes"), user="alice").job_id
    alice = get_user_model().objects.create(username="alice")
    bob = get_user_model().objects.create(username="bob")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {issue_token(alice)}"}

    def post(body: Any, **h: str) -> Any:
        return client.post(
            f"/api/jobs/{job}/auto-eat", data=json.dumps(body), content_type="application/json", **(h or headers)
        )

    response = post({"auto_eat": True})
    assert response.status_code == 200, response.content
    assert response.json() == {
        "job": job,
        "action": "auto-eat",
        "changed": 1,
        "auto_eat": True,
        "max_retries": 0,
        "was": 3,
    }
    assert client.get(f"/api/jobs/{job}", **headers).json()["auto_eat"] is True
    for body in ({"auto_eat": "on"}, {"on": True}, {}):
        response = post(body)
        assert response.status_code == 400, body
        assert response.json()["errors"]
    response = post({"auto_eat": False}, HTTP_AUTHORIZATION=f"Bearer {issue_token(bob)}")
    assert response.status_code == 403
    assert Job.objects.get(pk=job).b_autoeat is True

    out = io.StringIO()
    call_command("job", "auto-eat", "ae-routes", "off", stdout=out)
    assert out.getvalue().strip() == "ae-routes: auto-eat off (max retries 1)"
    out = io.StringIO()
    call_command("job", "auto-eat", "ae-routes", "off", stdout=out)
    assert out.getvalue().strip() == "ae-routes: auto-eat off (unchanged)"
    out = io.StringIO()
    call_command("job", "auto-eat", "ae-routes", "on", stdout=out)
    assert out.getvalue().strip() == "ae-routes: auto-eat on (max retries 0): its failed frames are eaten"
    cli = FarmAction.objects.filter(str_target=job, str_action="auto_eat", str_username__startswith="cli:")
    assert cli.count() == 3


@pytest.mark.django_db
def test_the_console_job_page_turns_auto_eat_on_and_off(admin_client: Client) -> None:
    submit_farm()
    job = submit_job(simple_spec("ae-console"), user="alice").job_id
    page = admin_client.get(f"/admin/ops/console/job/{job}/").content.decode()
    assert 'value="auto_eat_on"' in page and 'value="auto_eat_off"' not in page
    url = f"/admin/ops/console/job/{job}/act/"
    response = admin_client.post(url, {"action": "auto_eat_on"}, follow=True)
    assert "Auto-eat on (failed frames are eaten, max retries 0): 1 row changed" in response.content.decode()
    assert Job.objects.filter(pk=job).values_list("b_autoeat", "int_max_retries").get() == (True, 0)
    page = admin_client.get(f"/admin/ops/console/job/{job}/").content.decode()
    assert 'value="auto_eat_off"' in page and 'value="auto_eat_on"' not in page
    admin_client.post(url, {"action": "auto_eat_off"}, follow=True)
    assert Job.objects.filter(pk=job).values_list("b_autoeat", "int_max_retries").get() == (False, 1)
    assert [a.detail["auto_eat"] for a in FarmAction.objects.filter(str_target=job, str_action="auto_eat")] == [
        False,
        True,
    ]  # newest first
