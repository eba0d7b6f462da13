"""A host's memory report and the proc writers lock the host in modes that do not conflict.

The full suite on the embedded server (2026-12-02) deadlocked a real RQD's memory report
(`dispatch.engine.memory.follow_use`: the proc rows, then the host FOR UPDATE) against the
completion of the frame it had just reported (it holds its host FOR KEY SHARE, as every proc
writer does since the move locks of issue 27, then deletes the proc). FOR UPDATE conflicts with
FOR KEY SHARE; FOR NO KEY UPDATE does not, and it still excludes a booking's write of the host's
idle memory, which is what the report's recount needs.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from dispatch.engine.completion import Completion, complete_in_transaction
from dispatch.engine.memory import Use, follow_use
from tests.integration.dispatch_support import autocommit, wait_for
from tests.integration.farm_fixtures import create_proc, tiny_farm

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_memory_report_does_not_wait_for_a_proc_writers_key_share_on_its_host() -> None:
    farm = tiny_farm(managed=False)
    proc = create_proc(farm.host, farm.frames[0])
    with autocommit() as writer, autocommit() as reporter:
        writer.execute("BEGIN")
        writer.execute("SELECT 1 FROM host WHERE pk_host = %s FOR KEY SHARE", (farm.host.pk,))
        reporter.execute("SET lock_timeout = '3s'")
        try:
            out = follow_use(reporter, farm.host.pk, [Use(proc.pk, rss=512 * 1024, max_rss=512 * 1024)])
        except psycopg.errors.LockNotAvailable:
            pytest.fail("the report waited for the proc writer's KEY SHARE on the host (FOR UPDATE)")
        finally:
            writer.execute("ROLLBACK")
        assert out.recorded == 1
        used = reporter.execute("SELECT int_mem_used FROM proc WHERE pk_proc = %s", (proc.pk,)).fetchone()
        assert used == (512 * 1024,)


def _blocked(conn: psycopg.Connection, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


@pytest.mark.parametrize("reports_the_ending_frame", [False, True], ids=["other-frame", "same-frame"])
def test_a_memory_report_holds_nothing_a_completion_needs_while_it_waits_for_its_host(
    reports_the_ending_frame: bool,
) -> None:
    """CI (stop 34, embedded server): an RQD status report deadlocked with a completion on its
    host. A completion locks its host FOR NO KEY UPDATE first (accounting.keylocks), then deletes
    the proc and raises the layer's and job's max RSS (`layer_mem`, `job_mem`); the report wrote
    the procs it lists and raised the same two rows, then waited for the host. Here the
    completion holds the host, the report waits for it, and the completion must still reach the
    proc and `layer_mem`: of a frame the report does not list (another frame of the same layer),
    and of the frame it lists (RQD's snapshot was taken just before the frame ended)."""
    farm = tiny_farm(managed=False)
    ending = create_proc(farm.host, farm.frames[0], int_mem_max_used=4 * 1024 * 1024)
    running = create_proc(farm.host, farm.frames[1])
    with autocommit() as completer, autocommit() as reporter, autocommit() as watcher:
        reporter_pid = reporter.info.backend_pid
        completer.execute("BEGIN")
        completer.execute("UPDATE host SET ts_last_updated = now() WHERE pk_host = %s", (farm.host.pk,))
        reporter.execute("SET deadlock_timeout = '100ms'")
        outcome: dict[str, object] = {}

        uses = [Use(running.pk, rss=2 * 1024 * 1024, max_rss=2 * 1024 * 1024)]
        if reports_the_ending_frame:
            uses.append(Use(ending.pk, rss=3 * 1024 * 1024, max_rss=3 * 1024 * 1024))

        def report() -> None:
            try:
                outcome["report"] = follow_use(reporter, farm.host.pk, uses)
            except psycopg.Error as exc:
                outcome["report"] = exc

        thread = threading.Thread(target=report)
        thread.start()
        try:
            wait_for(lambda: _blocked(watcher, reporter_pid), 10, "the report to wait for the host row")
            completer.execute("SET lock_timeout = '5s'")
            with completer.cursor() as cur:
                try:
                    complete_in_transaction(cur, [Completion(ending.pk, 0)])
                except psycopg.errors.LockNotAvailable:
                    pytest.fail("the completion waited for a proc or layer_mem row the waiting report held")
            completer.execute("COMMIT")
        finally:
            if completer.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                completer.execute("ROLLBACK")
            thread.join(30)
        assert not isinstance(outcome.get("report"), psycopg.Error), outcome.get("report")
        assert outcome["report"].recorded == 1  # the ended frame's proc is gone when the report writes
        mem = watcher.execute("SELECT int_max_rss FROM layer_mem WHERE pk_layer = %s", (farm.layer.pk,)).fetchone()
        assert mem == (4 * 1024 * 1024,)
