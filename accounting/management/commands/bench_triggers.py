"""What the accounting triggers cost a proc DELETE: `manage.py bench_triggers`.

Deletes N procs (default 10,000) of a scratch farm, in one statement and one at a time
(N single-row DELETE statements in one transaction, looped server-side so client round trips
do not drown the trigger cost), and times DELETE + COMMIT (COMMIT is where queued NOTIFYs are
written). Each variant is the median of --runs runs:

* managed show, notifications on: the installed statement-level `acct_proc_delete`;
* managed show, kill switch off: the row is turned off and back on inside the transaction;
* managed show, Store-accounted: the scheduler's compensating delete, which sends nothing; each
  statement checks the writer mark (the claim and the role membership, see accounting.triggers);
* unmanaged show: the database-enforced accounting (five tables updated, caps checked);
* no triggers: `session_replication_role = replica` for the transaction (superuser), else
  `ALTER TABLE proc DISABLE TRIGGER USER` inside it.

A LISTEN connection counts what each variant delivered. Scratch rows carry a `bt-<hex>` prefix
and are removed at the end, with releases suppressed. Works against any DATABASE_URL; on a live
database the no-trigger variant briefly locks `proc`. (A per-row release trigger was measured
against the statement-level one before the proc triggers were unified; the figures are kept in
`accounting.triggers`' history and docs/benchmarks.md.)
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from django.core.management.base import BaseCommand, CommandParser
from django.db import connections
from psycopg import sql

from accounting import triggers
from accounting.notify import RELEASE_CHANNEL, STORE_ACCOUNTED_SQL, conninfo_from_settings

CREATE_FARM_SQL = """
INSERT INTO facility (pk_facility, str_name) VALUES (%(facility)s, %(prefix)s::text);
INSERT INTO dept (pk_dept, str_name) VALUES (%(dept)s, %(prefix)s::text);
INSERT INTO alloc (pk_alloc, pk_facility, str_name, str_tag)
VALUES (%(alloc)s, %(facility)s, %(prefix)s::text, %(prefix)s::text);
INSERT INTO host (pk_host, pk_alloc, str_name, int_cores, int_cores_idle, int_mem, int_mem_idle)
VALUES (%(host)s, %(alloc)s, %(prefix)s::text, 1000000000, 1000000000, 1000000000, 1000000000);
"""
CREATE_SHOW_SQL = """
INSERT INTO show (pk_show, str_name, b_scheduler_managed) VALUES (%(show)s::text, %(name)s::text, %(managed)s);
INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_burst)
VALUES (gen_random_uuid()::text, %(alloc)s, %(show)s::text, 1000000000);
INSERT INTO folder (pk_folder, pk_show, pk_dept, str_name)
VALUES (%(folder)s, %(show)s::text, %(dept)s, %(name)s::text);
INSERT INTO job (pk_job, pk_folder, pk_show, pk_facility, pk_dept, str_name)
SELECT %(show)s::text || '-j' || j, %(folder)s, %(show)s::text, %(facility)s, %(dept)s, %(name)s::text || '-j' || j
FROM generate_series(1, %(jobs)s) j;
UPDATE job_resource SET int_max_cores = -1, int_max_gpus = -1 WHERE pk_job LIKE %(show)s::text || '-j%%';
INSERT INTO layer (pk_layer, pk_job, str_name, str_cmd, str_range)
SELECT %(show)s::text || '-j' || j || '-l' || l, %(show)s::text || '-j' || j, 'l' || l, 'true', '1'
FROM generate_series(1, %(jobs)s) j, generate_series(1, %(layers_per_job)s) l;
INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, int_number)
SELECT gen_random_uuid()::text, la.pk_layer, la.pk_job, n || '-' || la.str_name, n
FROM layer la, generate_series(1, %(frames_per_layer)s) n
WHERE la.pk_job LIKE %(show)s::text || '-j%%';
"""
INSERT_PROCS_SQL = """
INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, int_mem_reserved)
SELECT gen_random_uuid()::text, %(host)s, %(show)s::text, f.pk_job, f.pk_layer, f.pk_frame, 100, 1024
FROM frame f WHERE f.pk_job LIKE %(show)s::text || '-j%%' LIMIT %(procs)s
"""
DELETE_ALL_SQL = "DELETE FROM proc WHERE pk_show = %(show)s::text"
# N single-row statements, looped in the server: the statement-level triggers fire N times.
DELETE_ONE_BY_ONE_SQL = """
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT pk_proc FROM proc WHERE pk_show = {show} LOOP
        DELETE FROM proc WHERE pk_proc = r.pk_proc;
    END LOOP;
END $$
"""
DROP_FARM_SQL = """
DELETE FROM proc WHERE pk_host = %(host)s;
DELETE FROM frame WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM layer_stat WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM layer_resource WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM layer_mem WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM layer_env WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM layer WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM job_stat WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM job_resource WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM job_mem WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM job_env WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM job WHERE pk_job LIKE %(prefix)s::text || '%%';
DELETE FROM folder_resource WHERE pk_folder LIKE %(prefix)s::text || '%%';
DELETE FROM folder WHERE pk_folder LIKE %(prefix)s::text || '%%';
DELETE FROM point WHERE pk_show LIKE %(prefix)s::text || '%%';
DELETE FROM subscription WHERE pk_alloc = %(alloc)s;
DELETE FROM host WHERE pk_host = %(host)s;
DELETE FROM alloc WHERE pk_alloc = %(alloc)s;
DELETE FROM show WHERE pk_show LIKE %(prefix)s::text || '%%';
DELETE FROM dept WHERE pk_dept = %(dept)s;
DELETE FROM facility WHERE pk_facility = %(facility)s;
"""
KILL_SWITCH_SQL = (
    f"INSERT INTO {triggers.SETTINGS_TABLE} (id, notify_enabled, ts_updated) VALUES (1, %(on)s, now()) "
    "ON CONFLICT (id) DO UPDATE SET notify_enabled = EXCLUDED.notify_enabled"
)


@dataclass(frozen=True)
class ScratchFarm:
    prefix: str
    managed_show: str
    unmanaged_show: str
    host: str
    params: dict[str, object]


@dataclass(frozen=True)
class Variant:
    label: str
    managed: bool
    # Runs inside the timed transaction before the DELETE, untimed; returns the undo to run after it.
    prepare: Callable[[psycopg.Connection], Callable[[psycopg.Connection], None]]


def _nothing(conn: psycopg.Connection) -> Callable[[psycopg.Connection], None]:
    return lambda conn: None


def _kill_switch_off(conn: psycopg.Connection) -> Callable[[psycopg.Connection], None]:
    conn.execute(KILL_SWITCH_SQL, {"on": False})
    return lambda conn: conn.execute(KILL_SWITCH_SQL, {"on": True})


def _store_accounted(conn: psycopg.Connection) -> Callable[[psycopg.Connection], None]:
    """The scheduler's own compensating delete: the writer mark is checked (claim and role) on each statement."""
    conn.execute(STORE_ACCOUNTED_SQL)
    return lambda conn: None


def _no_triggers(conn: psycopg.Connection) -> Callable[[psycopg.Connection], None]:
    try:
        with conn.transaction():  # a savepoint: a refused SET must not abort the timed transaction
            conn.execute("SET LOCAL session_replication_role = replica")
        return lambda conn: None
    except psycopg.errors.InsufficientPrivilege:
        conn.execute("ALTER TABLE proc DISABLE TRIGGER USER")
        return lambda conn: conn.execute("ALTER TABLE proc ENABLE TRIGGER USER")


VARIANTS = (
    Variant("managed, notifications on (statement-level, installed)", True, _nothing),
    Variant("managed, kill switch off", True, _kill_switch_off),
    Variant("managed, Store-accounted (the scheduler's own)", True, _store_accounted),
    Variant("unmanaged (database-enforced accounting)", False, _nothing),
    Variant("no triggers at all", True, _no_triggers),
)


class Command(BaseCommand):
    help = "Time deleting N procs with the accounting triggers, per variant (prints figures)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--procs", type=int, default=10_000, help="procs deleted per run")
        parser.add_argument("--runs", type=int, default=3, help="runs per figure (the median is printed)")
        parser.add_argument("--jobs", type=int, default=4)
        parser.add_argument("--layers-per-job", type=int, default=5)
        parser.add_argument("--database", default="default")

    def handle(self, *args: object, **opts: object) -> None:
        procs, runs = int(opts["procs"]), int(opts["runs"])  # type: ignore[call-overload]
        jobs, layers_per_job = int(opts["jobs"]), int(opts["layers_per_job"])  # type: ignore[call-overload]
        conninfo = conninfo_from_settings(connections[str(opts["database"])].settings_dict)
        keys = jobs * layers_per_job
        self.stdout.write(
            f"bench_triggers: {procs} procs of one show in {keys} layers ({jobs} jobs x {layers_per_job}), "
            f"DELETE + COMMIT, median of {runs} runs"
        )
        self.stdout.write(f"{'variant':<58}{'one statement':>24}{'one by one, 1 transaction':>30}")
        with (
            psycopg.connect(conninfo) as conn,
            psycopg.connect(conninfo, autocommit=True) as listener,
            scratch_farm(conn, procs, jobs, layers_per_job) as farm,
        ):
            listener.execute(f'LISTEN "{RELEASE_CHANNEL}"')
            for variant in VARIANTS:
                cells = []
                for one_by_one in (False, True):
                    timings, received = [], []
                    for _ in range(runs):
                        elapsed, count = timed_delete(conn, listener, conninfo, farm, variant, one_by_one)
                        timings.append(elapsed)
                        received.append(count)
                    cells.append(f"{fmt(statistics.median(timings))} {max(received):>6} msgs")
                self.stdout.write(f"{variant.label:<58}{cells[0]:>24}{cells[1]:>30}")


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


@contextmanager
def scratch_farm(conn: psycopg.Connection, procs: int, jobs: int, layers_per_job: int) -> Iterator[ScratchFarm]:
    prefix = f"bt-{uuid.uuid4().hex[:8]}"
    params: dict[str, object] = {
        "prefix": prefix,
        "facility": f"{prefix}-facility",
        "dept": f"{prefix}-dept",
        "alloc": f"{prefix}-alloc",
        "host": f"{prefix}-host",
        "jobs": jobs,
        "layers_per_job": layers_per_job,
        "frames_per_layer": -(-procs // (jobs * layers_per_job)),
    }
    farm = ScratchFarm(prefix, f"{prefix}-managed", f"{prefix}-unmanaged", str(params["host"]), params)
    try:
        with conn.transaction():
            execute_script(conn, CREATE_FARM_SQL, params)
            for show, managed in ((farm.managed_show, True), (farm.unmanaged_show, False)):
                show_params = {**params, "show": show, "name": show, "managed": managed, "folder": f"{show}-folder"}
                execute_script(conn, CREATE_SHOW_SQL, show_params)
        yield farm
    finally:
        conn.rollback()
        with conn.transaction():
            conn.execute(STORE_ACCOUNTED_SQL)
            execute_script(conn, DROP_FARM_SQL, params)


def execute_script(conn: psycopg.Connection, script: str, params: dict[str, object]) -> None:
    """Run `;`-separated statements one by one: the extended protocol takes one per call."""
    for statement in script.split(";\n"):
        if statement.strip():
            conn.execute(statement, params)


def timed_delete(
    conn: psycopg.Connection,
    listener: psycopg.Connection,
    conninfo: str,
    farm: ScratchFarm,
    variant: Variant,
    one_by_one: bool,
) -> tuple[float, int]:
    """Insert the procs (committed), then time DELETE + COMMIT; returns (seconds, releases received)."""
    show = farm.managed_show if variant.managed else farm.unmanaged_show
    procs = int(farm.params["frames_per_layer"]) * int(farm.params["jobs"]) * int(farm.params["layers_per_job"])
    with conn.transaction():
        conn.execute(INSERT_PROCS_SQL, {"host": farm.host, "show": show, "procs": procs})
    drain(listener, conninfo)

    delete = (
        sql.SQL(DELETE_ONE_BY_ONE_SQL).format(show=sql.Literal(show)).as_string(conn) if one_by_one else DELETE_ALL_SQL
    )
    conn.execute("SELECT 1")  # open the transaction, so prepare's savepoints nest inside it
    undo = variant.prepare(conn)
    started = time.perf_counter()
    conn.execute(delete, None if one_by_one else {"show": show})
    elapsed = time.perf_counter() - started
    undo(conn)
    started = time.perf_counter()
    conn.commit()
    elapsed += time.perf_counter() - started
    return elapsed, drain(listener, conninfo)


def drain(listener: psycopg.Connection, conninfo: str) -> int:
    """Count releases delivered so far: everything before a sentinel sent now."""
    sentinel = f"bench-sentinel-{uuid.uuid4()}"
    with psycopg.connect(conninfo, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", (RELEASE_CHANNEL, sentinel))
    count = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for notify in listener.notifies(timeout=max(0.0, deadline - time.monotonic()), stop_after=1):
            if notify.payload == sentinel:
                return count
            count += 1
    raise RuntimeError("the sentinel notification never arrived")
