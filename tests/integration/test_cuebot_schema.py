"""The Cuebot fixture loader builds OpenCue's schema as Flyway leaves it (issue 22)."""

from __future__ import annotations

import psycopg
import pytest

from tests.integration import cuebot_support as cb


def _has_column(conn: psycopg.Connection, table: str, column: str) -> bool:
    q = "SELECT count(*) FROM information_schema.columns WHERE table_name = %s AND column_name = %s"
    return conn.execute(q, (table, column)).fetchone()[0] == 1


@pytest.fixture
def cuebot_v46():
    name = cb.cuebot_db_name("loader")
    url = cb.build_cuebot_db(name, stop_at=46)
    yield url
    cb.drop_database(name)


def test_loader_builds_v46_with_history_and_seed_then_v47_applies(cuebot_v46: str) -> None:
    with psycopg.connect(cuebot_v46) as conn:
        rows = conn.execute("SELECT version FROM flyway_schema_history ORDER BY installed_rank")
        versions = [int(r[0]) for r in rows]
        assert versions == sorted(versions) and versions[0] == 1 and versions[-1] == 46
        assert 47 not in versions and 2 in versions and versions.index(2) < versions.index(10)
        assert conn.execute("SELECT count(*) FROM show WHERE str_name = 'testing'").fetchone()[0] == 1
        locks = {r[0] for r in conn.execute("SELECT str_name FROM task_lock")}
        assert {"LOCK_SUBSCRIPTION_RECALCULATION", "LOCK_ORPHANED_FRAME_CHECK", "LOCK_HISTORICAL_TRANSFER"} <= locks
        assert _has_column(conn, "show", "b_scheduler_managed")
        assert not _has_column(conn, "layer", "ts_start_after")
    cb.apply_migration(cuebot_v46, cb.migration(47))
    with psycopg.connect(cuebot_v46) as conn:
        assert conn.execute("SELECT max(version::int) FROM flyway_schema_history").fetchone()[0] == 47
        assert _has_column(conn, "layer", "ts_start_after")
