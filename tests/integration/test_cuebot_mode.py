"""Cuebot mode on an adopted Cuebot database, with Cuebot's own SQL (tests/integration/cuebot_standin.py).

The database is built from the fixture (cuebot_support) and adopted by `manage.py adopt_cuebot_db
--apply` in a subprocess, as an operator does; the farm rows (host, job, layer, frames) are
plain inserts that Cuebot's own triggers complete (job_resource, layer_resource, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from accounting import channels, cuebot
from accounting.listener import Listener
from accounting.store import Store
from tests.integration.cuebot_standin import CuebotStandIn, notifier_release_payload
from tests.integration.cuebot_support import adopted_cuebot_db

ROOT = Path(__file__).resolve().parents[2]
SHOW = "00000000-0000-0000-0000-000000000000"  # the seed's 'testing' show
ALLOC = "00000000-0000-0000-0000-000000000000"  # local.general
FOLDER = "A0000000-0000-0000-0000-000000000000"
DEPT = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA0"
FACILITY = "AAAAAAAA-AAAA-AAAA-AAAA-AAAAAAAAAAA1"  # local.general's facility


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    with adopted_cuebot_db("mode") as url:
        yield url


class Farm:
    """One host and one job of the 'testing' show, with `frames` frames, written as plain rows."""

    def __init__(self, conn: psycopg.Connection, frames: int = 4, *, url: str | None = None) -> None:
        self.host = str(uuid.uuid4())
        self.job = str(uuid.uuid4())
        self.layer = str(uuid.uuid4())
        self.frames = [str(uuid.uuid4()) for _ in range(frames)]
        tag = self.job[:8]
        self.host_name = f"standin-{tag}"
        conn.execute(
            "INSERT INTO host (pk_host, pk_alloc, str_name, str_lock_state, int_cores, int_cores_idle, int_mem, "
            "int_mem_idle) VALUES (%s, %s, %s, 'OPEN', 1600, 1600, 67108864, 67108864)",
            (self.host, ALLOC, self.host_name),
        )
        conn.execute(
            "INSERT INTO host_stat (pk_host_stat, pk_host, int_mem_total, int_mem_free, ts_ping) "
            "VALUES (%s, %s, 67108864, 67108864, now())",
            (str(uuid.uuid4()), self.host),
        )
        # HostDaoJdbc.tagHost: the allocation's tag, as Cuebot tags a host it registers
        conn.execute(
            "INSERT INTO host_tag (pk_host_tag, pk_host, str_tag, str_tag_type, b_constant) "
            "VALUES (%s, %s, 'general', 'Alloc', true)",
            (str(uuid.uuid4()), self.host),
        )
        conn.execute(
            "INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name, str_visible_name, "
            "str_shot, str_user, str_state) VALUES (%s, %s, %s, %s, %s, %s, %s, 'shot', 'standin', 'PENDING')",
            (self.job, FOLDER, SHOW, FACILITY, DEPT, f"testing-shot-standin_{tag}", f"testing-shot-standin_{tag}"),
        )
        conn.execute(
            "INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range, str_type, str_tags) "
            "VALUES (%s, %s, 'render', 'true', '1-4', 'Render', 'general')",
            (self.layer, self.job),
        )
        standin = CuebotStandIn(url or _url(conn))
        try:
            standin.activate(
                job=self.job,
                layer=self.layer,
                layer_name="render",
                frames=[(f, i) for i, f in enumerate(self.frames, start=1)],
            )
        finally:
            standin.close()
        conn.execute(
            "INSERT INTO point (pk_point, pk_show, pk_dept) SELECT %s, %s, %s "
            "WHERE NOT EXISTS (SELECT 1 FROM point WHERE pk_show = %s AND pk_dept = %s)",
            (str(uuid.uuid4()), SHOW, DEPT, SHOW, DEPT),
        )


def _url(conn: psycopg.Connection) -> str:
    from tests.integration.cuebot_support import server_url

    return server_url(conn.info.dbname)


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


def test_a_cuesched_writer_releases_an_unmanaged_proc_it_booked_while_managed(cuebot_url: str) -> None:
    """A frame the scheduler booked while the show was managed and completes after the flip back:
    Cuebot's Java never sees it, so our trigger counts that release (cuesched's connections carry
    the writer mark); read HIGH forever before."""
    from accounting.db import with_writer_option

    ours_url = f"{cuebot_url}?options={with_writer_option(None).replace(' ', '%20').replace('=', '%3D')}"
    with psycopg.connect(cuebot_url, autocommit=True) as conn, psycopg.connect(ours_url, autocommit=True) as ours:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        farm = Farm(conn)
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
        pk = str(uuid.uuid4())
        ours.execute(
            "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, "
            "int_mem_reserved, int_mem_pre_reserved) VALUES (%s, %s, %s, %s, %s, %s, 100, 1048576, 1048576)",
            (pk, farm.host, SHOW, farm.job, farm.layer, farm.frames[0]),
        )
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        got = counters(conn, farm)
        assert got == {k: 100 for k in got}, got  # the flip rebuilt Cuebot's counters from SUM(proc)
        ours.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))
        got = counters(conn, farm)
        assert got == {k: 0 for k in got}, got


def _view(conn: psycopg.Connection) -> dict | None:
    from accounting import live

    with conn.cursor() as cur:
        return live.read_view(cur)


def _wait(what: str, cond, timeout: float = 30.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)  # polling a condition with a deadline, not standing in for an event
    raise AssertionError(f"timed out waiting for {what}")


def _flag(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT b_scheduler_managed FROM show WHERE pk_show = %s", (SHOW,)).fetchone()[0]


def _sum_proc(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT COALESCE(SUM(p.int_cores_reserved), 0) FROM proc p JOIN host h USING (pk_host) "
        "WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local",
        (SHOW, ALLOC),
    ).fetchone()[0]


def test_beside_run_scheduler_with_flips_under_load(cuebot_url: str) -> None:
    """run_scheduler in Cuebot mode (detected) and the Cuebot stand-in (notifier ON, the harder
    case) on one show flipped back and forth while both book and complete frames: SUM(proc) never
    passes the burst, the five tables equal SUM(proc) once the show is Cuebot's again, the Store
    equals it once the show is the scheduler's, with every release counted once."""
    burst = 500  # centicores: 5 cores, for both sides
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("DELETE FROM proc")
        conn.execute("UPDATE subscription SET int_cores = 0, int_gpus = 0")
        conn.execute(
            "UPDATE subscription SET int_burst = %s WHERE pk_show = %s AND pk_alloc = %s", (burst, SHOW, ALLOC)
        )
        farm = Farm(conn, frames=400)
        env = {
            **os.environ,
            "DATABASE_URL": cuebot_url,
            "CUESCHED_CUEBOT_MODE": "auto",
            "CUESCHED_MANAGED_SHOWS_TTL": "0.3",
            "CUESCHED_RECOMPUTE_INTERVAL": "1",
            "CUESCHED_SIM_RUNTIME_MIN": "0.2",
            "CUESCHED_SIM_RUNTIME_MAX": "0.6",
        }
        sched = subprocess.Popen(
            [sys.executable, "manage.py", "run_scheduler", "--launcher", "simulated", "--metrics-port", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        stop = threading.Event()
        breaches: list[int] = []
        stats = {"cuebot_booked": 0, "cuebot_refused": 0, "cuebot_aborted": 0, "samples": 0}
        errors: list[BaseException] = []

        def cuebot_side() -> None:
            standin = CuebotStandIn(cuebot_url, notifier=True)
            running: list[tuple[float, object]] = []
            try:
                while not stop.is_set():
                    try:
                        proc = standin.dispatch_one(
                            host=farm.host, host_name=farm.host_name, alloc=ALLOC, job=farm.job, cores=100
                        )
                        if proc is not None:
                            stats["cuebot_booked"] += 1
                            running.append((time.monotonic(), proc))
                    except psycopg.errors.RaiseException as exc:
                        # Cuebot's verify_subscription / verify_host_resources refusing: nothing written
                        assert "exceeded" in str(exc) or "unable to allocate" in str(exc), exc
                        stats["cuebot_refused"] += 1
                    except (psycopg.errors.DeadlockDetected, psycopg.errors.UniqueViolation):
                        # Around a flip both sides may take the same frame or host: PostgreSQL
                        # aborts one transaction whole, and Cuebot's dispatcher moves on.
                        stats["cuebot_aborted"] += 1
                    except psycopg.errors.CheckViolation as exc:
                        # Cuebot read the show as its own just before a flip to the scheduler
                        # committed: its booking is refused whole (test_cuebot_semantics).
                        assert exc.diag.constraint_name == "acct_managed_show_booked_outside", exc
                        stats["cuebot_aborted"] += 1
                    now = time.monotonic()
                    for started, proc in [r for r in running if now - r[0] > 0.3]:
                        try:
                            standin.complete(proc)
                        except psycopg.errors.DeadlockDetected:
                            stats["cuebot_aborted"] += 1  # retried next time round, as Cuebot would
                            continue
                        running.remove((started, proc))
                    stop.wait(0.02)
                for _started, proc in running:
                    standin.complete(proc)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
            finally:
                standin.close()

        def sampler() -> None:
            with psycopg.connect(cuebot_url, autocommit=True) as c:
                while not stop.is_set():
                    total = _sum_proc(c)
                    stats["samples"] += 1
                    if total > burst:
                        breaches.append(total)
                    stop.wait(0.02)

        threads = [threading.Thread(target=cuebot_side), threading.Thread(target=sampler)]
        try:
            _wait("the scheduler's view", lambda: (_view(conn) or {}).get("cuebot_mode"), timeout=60)
            assert _view(conn)["cuebot_mode"]["enabled"] is True
            for t in threads:
                t.start()
            for _round in range(3):
                time.sleep(2.0)  # load runs for a while in each state (a duration, not a synchronisation)
                conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
                _wait("the show published as managed", lambda: SHOW in (_view(conn) or {}).get("managed_shows", {}))
                time.sleep(2.0)
                conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
            stop.set()
            for t in threads:
                t.join(30)
            assert not errors, errors
            # The show is Cuebot's: the scheduler's last frames drain through our completion path.
            _wait("the scheduler's frames to drain", lambda: _sum_proc(conn) == 0, timeout=30)
            got = counters(conn, farm)
            assert got == {k: 0 for k in got}, got
            # Hold a few Cuebot procs, then hand the show to the scheduler with the job paused.
            conn.execute("UPDATE job SET b_paused = true WHERE pk_job = %s", (farm.job,))
            standin = CuebotStandIn(cuebot_url, notifier=True)
            conn.execute("UPDATE job SET b_paused = false WHERE pk_job = %s", (farm.job,))
            held = [
                standin.dispatch_one(host=farm.host, host_name=farm.host_name, alloc=ALLOC, job=farm.job, cores=100)
                for _ in range(3)
            ]
            conn.execute("UPDATE job SET b_paused = true WHERE pk_job = %s", (farm.job,))
            got = counters(conn, farm)
            assert got == {k: 300 for k in got}, got
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))

            def store_cores() -> int | None:
                view = _view(conn) or {}
                if SHOW not in (view.get("managed_shows") or {}):
                    return None
                return (view.get("sub") or {}).get(f"{SHOW}:{ALLOC}", {}).get("cores")

            _wait("the Store to hold Cuebot's 3 procs", lambda: store_cores() == 3)
            dropped_before = _view(conn)["cuebot_mode"]["notifier_releases_dropped"]
            for proc in held:
                standin.complete(proc)  # notifier on: two releases per proc reach the listener
            standin.close()

            # Cuebot's copy of each release is sent after our trigger's (same transaction, later
            # statement), so a view that counted the three dropped copies has applied ours.
            def handled_all() -> dict | None:
                v = _view(conn)
                return v if v and v["cuebot_mode"]["notifier_releases_dropped"] >= dropped_before + 3 else None

            view = _wait("a view that handled all six releases", handled_all)
            assert view["sub"][f"{SHOW}:{ALLOC}"]["cores"] == 0 == _sum_proc(conn), view["sub"]
        finally:
            stop.set()
            sched.terminate()
            out, _ = sched.communicate(timeout=60)
            conn.execute("UPDATE job SET b_paused = false WHERE pk_job = %s", (farm.job,))
            conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        print(out[-3000:])
        print(stats)
        assert stats["samples"] > 10 and stats["cuebot_booked"] > 0
        assert not breaches, f"SUM(proc) passed the burst {burst}: {breaches[:10]}"
        succeeded = conn.execute(
            "SELECT count(*) FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'", (farm.job,)
        ).fetchone()[0]
        assert succeeded > stats["cuebot_booked"] + 3, "the scheduler completed none of the frames"


def test_the_display_write_passes_cuebots_verify_triggers(cuebot_url: str, conn: psycopg.Connection) -> None:
    """A managed show's display value above its cap (a burst lowered under running frames; a job
    max lowered under them, which Cuebot's verify_job_resources refuses every increase against)
    is written as recalculate_subs() writes it: the caps lifted and put back in one transaction,
    the lift of the burst never announced to the Store. Failed with Cuebot's error before."""
    from accounting.recompute import Recomputer, Usage

    farm = Farm(conn)
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    conn.execute(
        "UPDATE subscription SET int_cores = 200, int_burst = 250 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC)
    )
    conn.execute("UPDATE job_resource SET int_max_cores = 200 WHERE pk_job = %s", (farm.job,))
    usage = Usage(shows=[SHOW], sub={(SHOW, ALLOC): (300, 0)}, job={farm.job: (300, 0)})
    recomputer = Recomputer(Store())
    recomputer.cuebot = True
    with psycopg.connect(cuebot_url, autocommit=True) as listen, psycopg.connect(cuebot_url) as writer:
        listen.execute(f"LISTEN {channels.LIMIT_CHANNEL}")
        result = recomputer.pg_pass(writer, usage)
        assert result.pg_error is None, result.pg_error
        notices = [channels.parse_limit_change(n.payload) for n in listen.notifies(timeout=1.0)]
    sub = conn.execute(
        "SELECT int_cores, int_burst FROM subscription WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC)
    ).fetchone()
    assert sub == (300, 250)
    assert conn.execute(
        "SELECT int_cores, int_max_cores FROM job_resource WHERE pk_job = %s", (farm.job,)
    ).fetchone() == (300, 200)
    bursts = [c.value for n in notices for c in n.changes if c.kind.name == "SUB_BURST"]
    assert all(b <= 2 for b in bursts), bursts  # the lift to 3 cores never reached the Store
    job_caps = [c.value for n in notices for c in n.changes if c.kind.name.startswith("JOB")]
    assert job_caps and job_caps[-1][0] == 2, job_caps  # (max cores, max GPUs): the last word is the real cap
    assert all(c[0] <= 2 for c in job_caps), job_caps  # nor did the job's lift to 3


@pytest.mark.parametrize(
    "flag",
    [
        "UPDATE show SET b_paused = true WHERE pk_show = %(show)s",
        "UPDATE show SET b_booking_enabled = false WHERE pk_show = %(show)s",
        "UPDATE show SET b_dispatch_enabled = false WHERE pk_show = %(show)s",
        "UPDATE job SET b_auto_book = false WHERE pk_job = %(job)s",
    ],
    ids=["show-paused", "booking-disabled", "dispatch-disabled", "job-not-auto-book"],
)
def test_the_feed_honours_cuebots_show_and_job_flags(conn: psycopg.Connection, flag: str) -> None:
    """A managed show's job is dispatchable until one of Cuebot's flags says otherwise."""
    from dispatch.engine.feed import fetch_pending

    farm = Farm(conn)
    conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
    try:

        def pending() -> set[str]:
            work = fetch_pending(conn, managed_only=True, max_jobs=50, frames_per_layer=5)
            return {job.pk for job in work}

        assert farm.job in pending()
        conn.execute(flag, {"show": SHOW, "job": farm.job})
        assert farm.job not in pending()
    finally:
        conn.execute(
            "UPDATE show SET b_paused = false, b_booking_enabled = true, b_dispatch_enabled = true WHERE pk_show = %s",
            (SHOW,),
        )
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.job,))


def test_cuebots_orphan_cleanup_leaves_the_schedulers_running_frames_alone(cuebot_url: str) -> None:
    """The scheduler refreshes proc.ts_ping of the managed frames it runs (simulated launcher, no
    RQD to report to Cuebot), so Cuebot's orphan query stops listing them; never refreshed before."""
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
        conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE str_state = 'PENDING'")
        conn.execute("DELETE FROM proc")
        conn.execute("UPDATE subscription SET int_cores = 0, int_gpus = 0")
        farm = Farm(conn, frames=2)
        conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (SHOW,))
        env = {
            **os.environ,
            "DATABASE_URL": cuebot_url,
            "CUESCHED_CUEBOT_PROC_PING_INTERVAL": "1",
            "CUESCHED_SIM_RUNTIME_MIN": "120",
            "CUESCHED_SIM_RUNTIME_MAX": "120",
        }
        sched = subprocess.Popen(
            [sys.executable, "manage.py", "run_scheduler", "--launcher", "simulated", "--metrics-port", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        standin = CuebotStandIn(cuebot_url)
        try:
            running = _wait(
                "the scheduler to run both frames",
                lambda: (
                    [r[0] for r in conn.execute("SELECT pk_proc FROM proc WHERE pk_job = %s", (farm.job,))]
                    if conn.execute("SELECT count(*) FROM proc WHERE pk_job = %s", (farm.job,)).fetchone()[0] == 2
                    else None
                ),
                timeout=60,
            )
            conn.execute("UPDATE proc SET ts_ping = now() - interval '301 seconds' WHERE pk_job = %s", (farm.job,))
            assert set(running) <= set(standin.orphans())  # Cuebot would unbook them now
            _wait("the pings refreshed", lambda: not set(running) & set(standin.orphans()), timeout=20)
        finally:
            standin.close()
            sched.terminate()
            sched.wait(60)
            conn.execute("DELETE FROM proc WHERE pk_job = %s", (farm.job,))
            conn.execute("UPDATE job SET str_state = 'FINISHED' WHERE pk_job = %s", (farm.job,))
            conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (SHOW,))
