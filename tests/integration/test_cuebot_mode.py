"""Cuebot mode on an adopted Cuebot database, with Cuebot's own SQL (tests/integration/cuebot_standin.py).

The database is built from the fixture (cuebot_support) and adopted by `manage.py adopt_cuebot_db
--apply` in a subprocess, as an operator does; the farm rows (host, job, layer, frames) are
plain inserts that Cuebot's own triggers complete (job_resource, layer_resource, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from accounting import channels, cuebot
from accounting.listener import Listener
from accounting.store import Store
from tests.integration.cuebot_standin import CuebotStandIn, notifier_release_payload
from tests.integration.cuebot_support import build_cuebot_db, cuebot_db_name, drop_database

ROOT = Path(__file__).resolve().parents[2]
SHOW = "00000000-0000-0000-0000-000000000000"  # the seed's 'testing' show
ALLOC = "00000000-0000-0000-0000-000000000000"  # local.general
FOLDER = "A0000000-0000-0000-0000-000000000000"
DEPT = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0"
FACILITY = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0"


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    name = cuebot_db_name("mode")
    url = build_cuebot_db(name)
    env = {**os.environ, "DATABASE_URL": url}
    done = subprocess.run(
        [sys.executable, "manage.py", "adopt_cuebot_db", "--apply"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        yield url
    finally:
        drop_database(name)


class Farm:
    """One host and one job of the 'testing' show, with `frames` frames, written as plain rows."""

    def __init__(self, conn: psycopg.Connection, frames: int = 4) -> None:
        self.host = str(uuid.uuid4())
        self.job = str(uuid.uuid4())
        self.layer = str(uuid.uuid4())
        self.frames = [str(uuid.uuid4()) for _ in range(frames)]
        tag = self.job[:8]
        conn.execute(
            "INSERT INTO host (pk_host, pk_alloc, str_name, str_lock_state, int_cores, int_cores_idle, int_mem, "
            "int_mem_idle) VALUES (%s, %s, %s, 'OPEN', 800, 800, 8388608, 8388608)",
            (self.host, ALLOC, f"standin-{tag}"),
        )
        conn.execute("INSERT INTO host_stat (pk_host_stat, pk_host) VALUES (%s, %s)", (str(uuid.uuid4()), self.host))
        conn.execute(
            "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name, str_visible_name, "
            "str_shot, str_user, str_state) VALUES (%s, %s, %s, %s, %s, %s, %s, 'shot', 'standin', 'PENDING')",
            (self.job, FOLDER, SHOW, FACILITY, DEPT, f"testing-shot-standin_{tag}", f"testing-shot-standin_{tag}"),
        )
        conn.execute(
            "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range, str_type) "
            "VALUES (%s, %s, 'render', 'true', '1-4', 'Render')",
            (self.layer, self.job),
        )
        for i, frame in enumerate(self.frames, start=1):
            conn.execute(
                "INSERT INTO frame (pk_frame, pk_job, pk_layer, str_name, int_number, int_layer_order, str_state) "
                "VALUES (%s, %s, %s, %s, %s, 0, 'WAITING')",
                (frame, self.job, self.layer, f"{i:04d}-render", i),
            )
        conn.execute(
            "INSERT INTO point (pk_point, pk_show, pk_dept) SELECT %s, %s, %s "
            "WHERE NOT EXISTS (SELECT 1 FROM point WHERE pk_show = %s AND pk_dept = %s)",
            (str(uuid.uuid4()), SHOW, DEPT, SHOW, DEPT),
        )


def counters(conn: psycopg.Connection, farm: Farm) -> dict[str, int]:
    """The five tables' cores for the farm's keys, and SUM(proc) (the truth) beside them."""
    row = conn.execute(
        """
        SELECT (SELECT int_cores FROM subscription WHERE pk_show = %(show)s AND pk_alloc = %(alloc)s),
               (SELECT int_cores FROM folder_resource WHERE pk_folder = %(folder)s),
               (SELECT int_cores FROM job_resource WHERE pk_job = %(job)s),
               (SELECT int_cores FROM layer_resource WHERE pk_layer = %(layer)s),
               (SELECT int_cores FROM point WHERE pk_show = %(show)s AND pk_dept = %(dept)s),
               (SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc p JOIN host h USING (pk_host)
                 WHERE p.pk_show = %(show)s AND h.pk_alloc = %(alloc)s AND NOT p.b_local)
        """,
        {"show": SHOW, "alloc": ALLOC, "folder": FOLDER, "job": farm.job, "layer": farm.layer, "dept": DEPT},
    ).fetchone()
    names = ("subscription", "folder_resource", "job_resource", "layer_resource", "point", "sum_proc")
    return dict(zip(names, row, strict=True))


@pytest.fixture
def conn(cuebot_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(cuebot_url, autocommit=True) as c:
        c.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        c.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        yield c
        c.execute("DELETE FROM proc")  # Cuebot-side leftovers of a failed test
        c.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))


def test_mode_is_detected_on_an_adopted_cuebot_database(conn: psycopg.Connection, monkeypatch) -> None:
    monkeypatch.delenv("CUESCHED_CUEBOT_MODE", raising=False)
    mode = cuebot.resolve(conn)
    assert mode.enabled and mode.detected and mode.flyway
    monkeypatch.setenv("CUESCHED_CUEBOT_MODE", "off")
    with pytest.raises(cuebot.CuebotModeError, match="verify_subscription"):
        cuebot.resolve(conn)
    monkeypatch.setenv("CUESCHED_CUEBOT_MODE", "bogus")
    with pytest.raises(ValueError, match="auto, on or off"):
        cuebot.resolve(conn)


def test_a_cuebot_booking_of_an_unmanaged_show_is_counted_once(cuebot_url: str, conn: psycopg.Connection) -> None:
    """The issue's first finding: one 100-centicore Cuebot booking read 200 (Java + our trigger)."""
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        proc = standin.book(
            host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
        )
        got = counters(conn, farm)
        assert got["sum_proc"] == 100
        assert got == {k: 100 for k in got}, got
        standin.unbook(proc)
        assert counters(conn, farm) == {k: 0 for k in got}
    finally:
        standin.close()


def test_cuebot_enforces_its_burst_on_its_own_counters(cuebot_url: str, conn: psycopg.Connection) -> None:
    """Burst 150: Cuebot's first 100-centicore booking fits, the second is refused by its verify_subscription."""
    farm = Farm(conn)
    conn.execute("UPDATE subscription SET int_burst = 150 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
    standin = CuebotStandIn(cuebot_url)
    try:
        first = standin.book(
            host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
        )
        with pytest.raises(psycopg.errors.RaiseException, match="subscription has exceeded burst size"):
            standin.book(
                host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[1], cores=100
            )
        got = counters(conn, farm)
        assert got == {k: 100 for k in got}, got
        standin.unbook(first)
    finally:
        standin.close()


def test_recalculate_subs_agrees_with_the_counters(cuebot_url: str, conn: psycopg.Connection) -> None:
    """Cuebot's maintenance rewrite from SUM(proc) finds nothing to fix: nothing was counted twice."""
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        procs = [
            standin.book(host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=f, cores=100)
            for f in farm.frames[:3]
        ]
        before = counters(conn, farm)
        standin.recalculate_subs()
        assert counters(conn, farm) == before == {k: 300 for k in before}
        for proc in procs:
            standin.unbook(proc)
    finally:
        standin.close()


def _drain(listen: psycopg.Connection, want: int, timeout: float = 10.0) -> list[str]:
    got: list[str] = []
    for note in listen.notifies(timeout=timeout, stop_after=want):
        if note.channel == channels.RELEASE_CHANNEL:
            got.append(note.payload)
    return got


@pytest.mark.parametrize("notifier", [False, True], ids=["notifier-off", "notifier-on"])
def test_a_managed_proc_deleted_by_cuebot_reaches_the_store_once(
    cuebot_url: str, conn: psycopg.Connection, notifier: bool
) -> None:
    """procDestroyed of a managed show, with Cuebot's AccountingNotifier off (expected) or on:
    our trigger's release (with xid) is applied, Cuebot's (no xid) is dropped and counted."""
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url, notifier=notifier)
    try:
        proc = standin.book(
            host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=200
        )
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
        with psycopg.connect(cuebot_url, autocommit=True) as listen:
            listen.execute(f"LISTEN {channels.RELEASE_CHANNEL}")
            assert standin.unbook(proc)
            payloads = _drain(listen, 2 if notifier else 1)
            # Nothing else is on its way: a third message would be a second count.
            payloads += _drain(listen, 1, timeout=1.0)
        parsed = [channels.parse_release(p) for p in payloads]
        ours = [r for r in parsed if r.xid is not None]
        theirs = [p for p, r in zip(payloads, parsed, strict=True) if r.xid is None]
        assert len(ours) == 1 and ours[0].delta.cores == -2, payloads
        assert len(theirs) == (1 if notifier else 0), payloads
        listener = Listener(Store())
        listener.ignore_xidless_releases = True
        for payload in theirs:
            assert listener.handle(channels.RELEASE_CHANNEL, payload) == "dropped:cuebot_notifier"
        assert listener.stats.cuebot_releases_ignored == len(theirs)
    finally:
        standin.close()


def test_the_listener_drops_cuebot_notifier_releases_in_cuebot_mode() -> None:
    """A Cuebot release (AccountingNotifier's exact format, no xid) never reaches the Store in the mode."""
    ids = [str(uuid.uuid4()) for _ in range(6)]
    payload = notifier_release_payload(*ids, 300, 0)
    store = Store()
    listener = Listener(store)
    listener.ignore_xidless_releases = True
    assert listener.handle(channels.RELEASE_CHANNEL, payload) == "dropped:cuebot_notifier"
    assert listener.stats.releases_applied == 0 and listener.stats.releases_skipped == 0
    assert listener.stats.cuebot_releases_ignored == 1


def test_cuebot_orphan_cleanup_sees_a_stale_ping(cuebot_url: str, conn: psycopg.Connection) -> None:
    """The stand-in's orphan query is Cuebot's: a proc with a ping older than 300 s is found, a fresh one not."""
    farm = Farm(conn)
    standin = CuebotStandIn(cuebot_url)
    try:
        proc = standin.book(
            host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=farm.frames[0], cores=100
        )
        assert proc.pk_proc not in standin.orphans()
        conn.execute("UPDATE proc SET ts_ping = now() - interval '301 seconds' WHERE pk_proc = %s", (proc.pk_proc,))
        assert proc.pk_proc in standin.orphans()
        standin.unbook(proc)
    finally:
        standin.close()
