"""Completion: a failing frame is retried until the job's max retries, then DEAD; a job with
nothing left to run is FINISHED; a completion for a proc that is already gone changes nothing."""

from __future__ import annotations

import pytest

from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, complete, kill_frames
from tests.integration.dispatch_support import (
    ONE_CORE,
    autocommit,
    drain,
    fast_launcher,
    make_loop,
    scalar,
    seed,
    violations,
)
from tests.integration.runtime_support import running_scheduler

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_failing_frame_retries_until_max_retries_then_dies_and_the_job_finishes() -> None:
    seed("rty", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 3})
    with running_scheduler() as proc, autocommit() as conn:
        conn.execute("UPDATE job SET int_max_retries = 2")
        failing = scalar(conn, "SELECT pk_frame FROM frame ORDER BY str_name LIMIT 1")
        seen: list[tuple[str, int, int]] = []

        def exit_status(booking) -> int:
            if booking.frame.pk != failing:
                return 0
            # What the database says at each launch of the failing frame.
            seen.append(
                conn.execute(
                    "SELECT str_state, int_retries, int_version FROM frame WHERE pk_frame = %s", (failing,)
                ).fetchone()
            )
            return 1

        loop = make_loop(proc.service, fast_launcher(exit_status=exit_status))
        totals = drain(loop)

        # Started 1 + max_retries times; each start after a failure counts one retry.
        assert [(state, retries) for state, retries, _v in seen] == [("RUNNING", 0), ("RUNNING", 1), ("RUNNING", 2)]
        versions = [v for _s, _r, v in seen]
        assert versions == sorted(set(versions))  # every start and every end moved the version on
        row = conn.execute(
            "SELECT str_state, int_retries, int_exit_status FROM frame WHERE pk_frame = %s", (failing,)
        ).fetchone()
        assert row == ("DEAD", 2, 1)
        assert dict(conn.execute("SELECT str_state, count(*) FROM frame GROUP BY 1").fetchall()) == {
            "DEAD": 1,
            "SUCCEEDED": 2,
        }
        assert scalar(conn, "SELECT str_state FROM job") == "FINISHED"
        assert conn.execute(
            "SELECT int_dead_count, int_succeeded_count, int_waiting_count FROM job_stat"
        ).fetchone() == (
            1,
            2,
            0,
        )
        assert totals.booked == totals.completed == 5
        assert totals.jobs_finished == 1
        assert violations(conn) == []


def test_a_completion_for_a_proc_already_gone_releases_nothing() -> None:
    seed("gone", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 2})
    with running_scheduler() as proc, autocommit() as conn:
        with make_loop(proc.service, fast_launcher(runtime_min=60.0, runtime_max=60.0)) as loop:
            assert loop.run_once().booked == 2
        pk_proc, pk_frame, host = conn.execute("SELECT pk_proc, pk_frame, pk_host FROM proc LIMIT 1").fetchone()
        first = complete(conn, [Completion(pk_proc, 0)])
        assert first.released == 1 and first.states == {"SUCCEEDED": 1}
        idle = scalar(conn, "SELECT int_cores_idle FROM host WHERE pk_host = %s", (host,))
        # The same report again (a retried RPC, a late agent): the proc is gone, nothing moves.
        again = complete(conn, [Completion(pk_proc, 1)])
        assert again.released == 0 and again.missing_procs == [pk_proc]
        assert scalar(conn, "SELECT int_cores_idle FROM host WHERE pk_host = %s", (host,)) == idle
        row = conn.execute("SELECT str_state, int_exit_status FROM frame WHERE pk_frame = %s", (pk_frame,)).fetchone()
        assert row == ("SUCCEEDED", 0)
        # A frame another writer moved out of RUNNING (eaten from the admin) while its proc ran:
        # the proc is released and the host given back, the frame is left as that writer set it.
        other_proc, other_frame, other_host = conn.execute("SELECT pk_proc, pk_frame, pk_host FROM proc").fetchone()
        conn.execute("UPDATE frame SET str_state = 'EATEN' WHERE pk_frame = %s", (other_frame,))
        result = complete(conn, [Completion(other_proc, 0)])
        assert result.released == 1 and result.states == {}
        assert scalar(conn, "SELECT str_state FROM frame WHERE pk_frame = %s", (other_frame,)) == "EATEN"
        assert scalar(conn, "SELECT int_cores - int_cores_idle FROM host WHERE pk_host = %s", (other_host,)) == 0
        assert scalar(conn, "SELECT count(*) FROM proc") == 0


def test_a_killed_frame_is_released_and_waits_again_without_a_retry() -> None:
    seed("kil", **{**ONE_CORE, "jobs": 1, "frames_per_layer": 2})
    with running_scheduler() as proc, autocommit() as conn:
        launcher = fast_launcher(runtime_min=60.0, runtime_max=60.0)
        with make_loop(proc.service, launcher) as loop:
            assert loop.run_once().booked == 2
            frame = scalar(conn, "SELECT pk_frame FROM proc LIMIT 1")
            result = kill_frames(conn, [frame])
            assert result.released == 1 and result.states == {"WAITING": 1}
            row = conn.execute(
                "SELECT str_state, int_exit_status, int_retries FROM frame WHERE pk_frame = %s", (frame,)
            ).fetchone()
            assert row == ("WAITING", EXIT_STATUS_KILLED, 0)
            assert scalar(conn, "SELECT count(*) FROM proc WHERE pk_frame = %s", (frame,)) == 0
            assert violations(conn) == []
            # The loop books it again; the next start counts no retry either.
            assert loop.run_once().booked == 1
            assert scalar(conn, "SELECT int_retries FROM frame WHERE pk_frame = %s", (frame,)) == 0
