"""`manage.py bench_profile` at a size of seconds: it profiles a real drain, reads the triggers'
server time, and leaves its database's settings and rows as it found them."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from dispatch.lab.seeding import farm_counts

pytestmark = pytest.mark.django_db(transaction=True)


def _database_settings() -> list[str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT unnest(setconfig) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase"
            " WHERE d.datname = current_database()"
        )
        return [r[0] for r in cur.fetchall()]


def test_a_profiled_drain_reports_its_phases_and_the_proc_triggers_then_leaves_nothing() -> None:
    out = StringIO()
    call_command(
        "bench_profile", "--prefix", "tbprof", "--hosts", "40", "--jobs", "4", "--layers", "1",
        "--frames-per-layer", "5", "--top", "50", stdout=out,
    )  # fmt: skip  (--top 50: the PL/pgSQL list is cut at --top, and the proc insert is not the costliest)
    text = out.getvalue()
    assert text.startswith("drain, Store: 20 booked"), text
    for phase in ("  feed: ", "  write: ", "  rest of the cycle", "waiting on PostgreSQL", "statements sent: "):
        assert phase in text, text
    assert "pgtrigger_acct_proc_insert" in text, text  # the booking's proc insert fired its trigger
    assert not any("track_functions" in s for s in _database_settings())
    assert not any(farm_counts("tbprof").values())


def test_explain_reports_each_booking_statements_triggers_and_keeps_nothing_of_its_own_run() -> None:
    out = StringIO()
    call_command(
        "bench_profile", "--prefix", "tbprofx", "--hosts", "40", "--jobs", "4", "--layers", "1",
        "--frames-per-layer", "5", "--top", "5", "--explain", stdout=out,
    )  # fmt: skip
    text = out.getvalue()
    # The explained run was rolled back: the drain still booked every frame once.
    assert text.startswith("drain, Store: 20 booked"), text
    assert "EXPLAIN ANALYZE of booking.BOOK_SQL: " in text, text
    assert "EXPLAIN ANALYZE of completion.COMPLETE_SQL: " in text, text
    assert "trigger pgtrigger_frame_stat_update" in text, text
    assert not any(farm_counts("tbprofx").values())
