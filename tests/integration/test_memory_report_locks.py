"""A host's memory report and the proc writers lock the host in modes that do not conflict.

The full suite on the embedded server (2026-12-02) deadlocked a real RQD's memory report
(`dispatch.engine.memory.follow_use`: the proc rows, then the host FOR UPDATE) against the
completion of the frame it had just reported (it holds its host FOR KEY SHARE, as every proc
writer does since the move locks of issue 27, then deletes the proc). FOR UPDATE conflicts with
FOR KEY SHARE; FOR NO KEY UPDATE does not, and it still excludes a booking's write of the host's
idle memory, which is what the report's recount needs.
"""

from __future__ import annotations

import psycopg
import pytest

from dispatch.engine.memory import Use, follow_use
from tests.integration.dispatch_support import autocommit
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
