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
        "--frames-per-layer", "5", "--top", "5", stdout=out,
    )  # fmt: skip
    text = out.getvalue()
    assert text.startswith("drain, Store: 20 booked"), text
    for phase in ("  feed: ", "  write: ", "  rest of the cycle", "waiting on PostgreSQL", "statements sent: "):
        assert phase in text, text
    assert "pgtrigger_acct_proc_insert" in text, text  # the booking's proc insert fired its trigger
    assert not any("track_functions" in s for s in _database_settings())
    assert not any(farm_counts("tbprof").values())
