"""Review 3 of issue 22 (Cuebot mode): a hole found through a plain connection, as a strict xfail.

The outside ledger takes any change anybody made to a counter row in the transaction as payment
for that transaction's proc debts. A flip back to Cuebot rewrites the five tables from SUM(proc):
where the managed show's display read below SUM(proc) (the scheduler's bookings since its last
display write), that rewrite is a raise the ledger credits to the flipping transaction, and a raw
booking after the flip in the same transaction is then owed nothing: never counted, never checked.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from accounting.db import with_writer_option
from tests.integration.cuebot_support import adopted_cuebot_db, zeroed_counters
from tests.integration.test_cuebot_mode import ALLOC, SHOW, Farm, counters
from tests.integration.test_cuebot_outside_writers import RAW_INSERT


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("review3") as url:
        yield url


@pytest.fixture
def conn(cuebot_url: str) -> Iterator[psycopg.Connection]:
    with zeroed_counters(cuebot_url, SHOW) as c:
        yield c
        c.execute("DELETE FROM proc")


def _writer_url(url: str) -> str:
    return f"{url}?options={with_writer_option(None).replace(' ', '%20').replace('=', '%3D')}"


def _sub_sum(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT COALESCE(SUM(p.int_cores_reserved), 0) FROM proc p JOIN host h ON h.pk_host = p.pk_host "
        "WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local",
        (SHOW, ALLOC),
    ).fetchone()[0]


def test_a_raw_booking_after_a_flip_back_in_one_transaction_is_counted_and_checked(
    cuebot_url: str, conn: psycopg.Connection
) -> None:
    farm = Farm(conn)
    conn.execute("UPDATE subscription SET int_burst = 350 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    # The scheduler books 300 while the show is managed; its display write has not run yet (0).
    with psycopg.connect(_writer_url(cuebot_url), autocommit=True) as ours:
        for frame in farm.frames[:3]:
            ours.execute(RAW_INSERT, (str(uuid.uuid4()), farm.host, SHOW, farm.job, farm.layer, frame, 100))
    assert counters(conn, farm)["subscription"] == 0 and _sub_sum(conn) == 300
    # One psql transaction: the runbook's flip back, then a proc written by hand.
    refused = None
    with psycopg.connect(cuebot_url, autocommit=True) as raw:
        try:
            with raw.transaction():
                raw.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
                raw.execute(RAW_INSERT, (str(uuid.uuid4()), farm.host, SHOW, farm.job, farm.layer, farm.frames[3], 100))
        except psycopg.Error as exc:
            refused = exc  # refused at commit (over the burst of 350): that is the fix
    got = counters(conn, farm)
    assert _sub_sum(conn) <= 350, f"SUM(proc)={_sub_sum(conn)} over the burst of 350 ({got})"
    # By Cuebot's verify_subscription on the top-up, or by cuesched's own cap check.
    assert isinstance(refused, psycopg.errors.CheckViolation | psycopg.errors.RaiseException), refused
    # Refused whole: the flip went with it, the show is still the Store's (its five tables are
    # the display the scheduler writes), and the raw proc was never written.
    managed = conn.execute("SELECT b_scheduler_managed FROM show WHERE pk_show = %s", (SHOW,)).fetchone()[0]
    assert managed and _sub_sum(conn) == 300, (managed, _sub_sum(conn))
    # The same two statements under the burst are counted: the flip's rebuild writes 300, the
    # raw proc's 100 is owed and topped up at commit.
    conn.execute("UPDATE subscription SET int_burst = 1000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    with psycopg.connect(cuebot_url, autocommit=True) as raw:
        with raw.transaction():
            raw.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
            raw.execute(RAW_INSERT, (str(uuid.uuid4()), farm.host, SHOW, farm.job, farm.layer, farm.frames[3], 100))
    got = counters(conn, farm)
    assert got["sum_proc"] == 400 and all(v >= 400 for v in got.values()), got
