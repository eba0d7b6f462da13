"""The release path reads only the procs it releases, whatever the planner believes about `proc`.

`proc` churns faster than autovacuum samples it: the statistics may say it is empty while
thousands of frames run (analyzed at a quiet moment). A completion planned on that belief as a
join of `proc` with its input read the whole table for every completion. These tests freeze
exactly that state (ANALYZE on an empty table, then the procs) and read the executed plan:
the rows each node fetched from `proc`, not a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dispatch.engine.booking import write_batch
from dispatch.engine.completion import COMPLETE_SQL, Completion, complete, complete_params
from tests.integration.dispatch_support import ONE_CORE, autocommit, plan, scalar, seed, violations

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = 8
FRAMES = 20  # per job: 160 procs in all


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", ()) for n in _nodes(child))]


def _proc_rows(plan_: dict[str, Any]) -> int:
    """Rows the executed plan fetched from `proc` (every scan node of it, over all its loops)."""
    return sum(
        n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0)
        for n in _nodes(plan_)
        if n.get("Relation Name") == "proc" and n["Node Type"].endswith("Scan")
    )


def _explain_completion(conn, completions: list[Completion]) -> dict[str, Any]:
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + COMPLETE_SQL, complete_params(completions))
            return cur.fetchone()[0][0]["Plan"]
        finally:
            cur.execute("ROLLBACK")


@pytest.fixture
def running_procs() -> Iterator[list[str]]:
    seed(
        "rpl",
        **{**ONE_CORE, "hosts": 40, "jobs": JOBS, "frames_per_layer": FRAMES},
        sub_burst=1_000_000,
        folder_max_cores=-1,
        job_max_cores=-1,
    )
    with autocommit() as conn:
        # Frozen means frozen: autovacuum would analyze proc once the procs are in (160 rows pass
        # its threshold), at a moment of its choosing, and the plan read below would then be the
        # one of true statistics, not of the stale ones these tests are about.
        conn.execute("ALTER TABLE proc SET (autovacuum_enabled = false)")
        try:
            conn.execute("ANALYZE proc")  # the statistics now say: no procs
            _jobs, bookings = plan(conn, {j: FRAMES for j in range(JOBS)}, managed=True)
            assert len(write_batch(conn, bookings, mem_used=256_000).written) == JOBS * FRAMES
            assert scalar(conn, "SELECT reltuples FROM pg_class WHERE relname = 'proc'") <= 0
            yield [b.pk_proc for b in bookings]
        finally:
            conn.execute("ALTER TABLE proc RESET (autovacuum_enabled)")


def test_a_lone_completion_reads_only_its_own_proc(running_procs: list[str]) -> None:
    """What every host agent sends: one proc per transaction, one index probe."""
    with autocommit() as conn:
        assert _proc_rows(_explain_completion(conn, [Completion(running_procs[0], 0)])) == 1


def test_a_batch_is_not_matched_against_the_procs_row_by_row(running_procs: list[str]) -> None:
    """The loop's batches: at most one pass over `proc` (a table this small may be scanned once), no
    join that compares every proc with every completion."""
    with autocommit() as conn:
        executed = _nodes(_explain_completion(conn, [Completion(pk, 0) for pk in running_procs[:50]]))
        # A join over `proc` that filters pairs is a match made row by row. Other joins may filter
        # what they matched on their key: the max RSS update keeps a layer's or job's figure unless
        # the run's is higher (`int_max_rss < r.m`), which is no comparison of procs.
        over_proc = [n for n in executed if n.get("Rows Removed by Join Filter") and _proc_rows(n)]
        assert over_proc == []
        assert _proc_rows(executed[0]) <= len(running_procs)


def test_statuses_reach_their_own_frames(running_procs: list[str]) -> None:
    """The status lookup by proc: each frame ends as its own completion says, duplicates included."""
    ok, failed, requeued, gone = running_procs[:4]
    with autocommit() as conn:
        conn.execute("UPDATE job SET int_max_retries = 0")
        complete(conn, [Completion(gone, 0)])
        frame_of = dict(
            conn.execute("SELECT pk_proc, pk_frame FROM proc WHERE pk_proc = ANY(%s)", ([ok, failed, requeued],))
        )
        result = complete(
            conn,
            [Completion(ok, 0), Completion(failed, 1), Completion(requeued, 1, requeue=True), Completion(ok, 0),
             Completion(gone, 0)],
        )  # fmt: skip
        assert result.released == 3
        assert result.missing_procs == [gone]
        ended = {
            frame: (state, status)
            for frame, state, status in conn.execute(
                "SELECT pk_frame, str_state, int_exit_status FROM frame WHERE pk_frame = ANY(%s)",
                (list(frame_of.values()),),
            )
        }
        assert [ended[frame_of[p]] for p in (ok, failed, requeued)] == [("SUCCEEDED", 0), ("DEAD", 1), ("WAITING", 1)]
        assert violations(conn) == []
