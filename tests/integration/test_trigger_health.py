"""cuesched's triggers checked at start-up, on a migrated database and on an adopted Cuebot one.

Review 2 of issue 22: `ALTER TABLE proc DISABLE TRIGGER` on cuesched's proc insert trigger made
an unmarked writer's procs count nowhere (counters LOW) and nothing noticed it; a renamed copy
beside the original counted each proc twice. run_scheduler must refuse to start, and
store_status exit non-zero, naming the trigger and the fix.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from accounting.trigger_health import expected_triggers, trigger_problems
from tests.integration import cuebot_support as cb


def _proc_insert() -> str:
    (name,) = [
        n for t, n in expected_triggers() if t == "proc" and re.fullmatch(r"pgtrigger_acct_proc_insert_\w{5}", n)
    ]
    return name


@pytest.mark.django_db
def test_a_migrated_database_has_every_trigger_firing_once() -> None:
    assert trigger_problems(connection) == []


@pytest.mark.django_db
def test_a_disabled_trigger_stops_run_scheduler_and_fails_store_status() -> None:
    trig = _proc_insert()
    with connection.cursor() as cur:
        cur.execute(f"ALTER TABLE proc DISABLE TRIGGER {trig}")
    problems = trigger_problems(connection)
    assert [(p.table, p.trigger, p.problem) for p in problems] == [("proc", trig, "disabled")]
    assert problems[0].fix == f"ALTER TABLE proc ENABLE TRIGGER {trig}"
    with pytest.raises(CommandError, match=f"{trig} disabled.*ENABLE TRIGGER {trig}"):
        call_command("run_scheduler", "--no-dispatch", "--metrics-port", "0")
    out = io.StringIO()
    with pytest.raises(CommandError, match=trig) as raised:
        call_command("store_status", stdout=out)
    assert raised.value.returncode != 0
    assert f"TRIGGER PROBLEM: proc.{trig} disabled" in out.getvalue()


@pytest.mark.django_db
def test_a_dropped_trigger_is_missing_and_a_second_one_on_its_function_is_doubled() -> None:
    trig = _proc_insert()
    with connection.cursor() as cur:
        cur.execute(f"DROP TRIGGER {trig} ON proc")
    assert [(p.trigger, p.problem) for p in trigger_problems(connection)] == [(trig, "missing")]
    with connection.cursor() as cur:
        # Both a renamed copy and the original (as `pgtrigger install` would put it back).
        cur.execute(f"CREATE TRIGGER site_copy AFTER INSERT ON proc FOR EACH ROW EXECUTE FUNCTION {trig}()")
        assert trigger_problems(connection) == []  # a rename alone still counts once
        cur.execute(f"CREATE TRIGGER {trig} AFTER INSERT ON proc FOR EACH ROW EXECUTE FUNCTION {trig}()")
    (problem,) = trigger_problems(connection)
    assert (problem.trigger, problem.problem) == (trig, "doubled")
    assert "site_copy" in problem.detail and problem.fix == "DROP TRIGGER site_copy ON proc"


@pytest.fixture(scope="module")
def adopted_url() -> Iterator[str]:
    name = cb.cuebot_db_name("health")
    url = cb.build_cuebot_db(name)
    try:
        cb.manage(url, "adopt_cuebot_db", "--apply")
        yield url
    finally:
        cb.drop_database(name)


def _problems(url: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        return [(p.trigger, p.problem) for p in trigger_problems(conn)]


def test_an_adopted_database_leaves_cuebots_own_work_out_and_is_clean(adopted_url: str) -> None:
    """The frame-state and usage triggers adoption leaves to Cuebot (CUEBOT_OWNS) are not missing."""
    assert _problems(adopted_url) == []


def test_on_an_adopted_database_a_disabled_trigger_is_refused_then_readoption_enables_it(adopted_url: str) -> None:
    trig = _proc_insert()
    with psycopg.connect(adopted_url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE proc DISABLE TRIGGER {trig}")
    assert _problems(adopted_url) == [(trig, "disabled")]
    done = cb.manage(adopted_url, "run_scheduler", "--no-dispatch", "--metrics-port", "0", check=False, timeout=60)
    assert done.returncode != 0 and f"ALTER TABLE proc ENABLE TRIGGER {trig}" in done.stderr, done.stderr
    assert "adopt_cuebot_db --apply" in done.stderr and "Traceback" not in done.stderr, done.stderr
    status = cb.manage(adopted_url, "store_status", check=False, timeout=60)
    assert status.returncode != 0 and f"TRIGGER PROBLEM: proc.{trig} disabled" in status.stdout, status
    check = cb.manage(adopted_url, "adopt_cuebot_db", "--check").stdout
    assert f"enable trigger proc.{trig} (disabled: tgenabled 'D'" in check, check
    cb.manage(adopted_url, "adopt_cuebot_db", "--apply")
    assert _problems(adopted_url) == []
    assert "nothing to add" in cb.manage(adopted_url, "adopt_cuebot_db", "--check").stdout


def test_on_an_adopted_database_a_copy_beside_cuesched_trigger_is_doubled_then_dropped(adopted_url: str) -> None:
    trig = _proc_insert()
    with psycopg.connect(adopted_url, autocommit=True) as conn:
        conn.execute(f"CREATE TRIGGER site_copy AFTER INSERT ON proc FOR EACH ROW EXECUTE FUNCTION {trig}()")
    assert _problems(adopted_url) == [(trig, "doubled")]
    check = cb.manage(adopted_url, "adopt_cuebot_db", "--check").stdout
    assert f"drop trigger proc.site_copy (not pgtrigger's name, but it runs cuesched's {trig}()" in check, check
    cb.manage(adopted_url, "adopt_cuebot_db", "--apply")
    assert _problems(adopted_url) == []


def test_on_an_adopted_database_cuesched_work_installed_beside_cuebots_is_doubled(adopted_url: str) -> None:
    """`manage.py pgtrigger install` on an adopted database (the runbook says not to) puts
    cuesched's frame-state counting beside Cuebot's update_frame_status_counts: each state change
    counted twice, and Cuebot's limit check reads those counts. The check skipped such triggers
    whenever Cuebot's was there, installed or not; it now names each one doubled."""
    cb.manage(adopted_url, "pgtrigger", "install")
    try:
        doubled = {name for name, problem in _problems(adopted_url) if problem == "doubled"}
        assert any(re.fullmatch(r"pgtrigger_frame_stat_insert_\w{5}", n) for n in doubled), doubled
        status = cb.manage(adopted_url, "store_status", check=False, timeout=60)
        assert status.returncode != 0 and "does the work of Cuebot's update_frame_status_counts" in status.stdout
    finally:
        with psycopg.connect(adopted_url, autocommit=True) as conn:
            for table, name in expected_triggers():
                if (table, name.rsplit("_", 1)[0].removeprefix("pgtrigger_")) in _cuebot_owned():
                    conn.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
    assert _problems(adopted_url) == []


def _cuebot_owned() -> set[tuple[str, str]]:
    from accounting.trigger_health import CUEBOT_OWNS

    return set(CUEBOT_OWNS)
