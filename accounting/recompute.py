"""Recompute: rebuild every Store counter from SUM(proc), and the display columns in PostgreSQL.

The backstop for a missed release: whatever the listener lost, a counter is back to the
truth within one cycle (~15 s). One read of `proc` feeds both halves, the Store first
because it is what enforces:

1. Store side. `begin_recompute()` first, then ONE read-only REPEATABLE READ transaction
   (so the booked sums and the key universe come from the same snapshot, which the
   reference's two concurrent reads did not), then `overwrite_counters` with that
   snapshot's `pg_current_snapshot()`, which lets the Store skip a late release the
   snapshot already accounted for. Every proc of a managed show is counted whatever its
   job's state, so a release can never subtract what the snapshot left out.
2. PostgreSQL side, for CueGUI and the ops console: `int_cores`/`int_gpus` of
   subscription, folder_resource, job_resource, layer_resource and point of managed shows,
   written from the sums the Store side read, touching only rows whose value changes. No
   cap is touched, so an operator's concurrent cap edit can never be reverted (the
   reference's temporary-overwrite trick could).

Why one read: the procs are the expensive part (~0.2 s per aggregation at 100,000 procs).
Reading them once per cycle with GROUPING SETS, one scan summed per key of all five
tables, halved the cycle against a Store query plus a second whole aggregation on the
PostgreSQL side (0.64 s to about 0.3 s, `manage.py bench_accounting`).

The PostgreSQL side writes sums from a snapshot a few milliseconds old. That is harmless
for a managed show (nothing but this pass writes its usage columns) and would be wrong for
a show flipped to unmanaged meanwhile, whose columns the database path now keeps exactly.
So the write takes the shared accounting-keys lock the proc triggers take, which a flip
takes exclusively, and only then re-reads which shows are managed: a flip that committed first
is seen and its show skipped; one that comes later waits and rewrites the show from
SUM(proc) itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psycopg

from accounting.limits import (
    FOLDER_LIMITS_SQL,
    GENERATIONS_SQL,
    JOB_LIMITS_SQL,
    SHOW_GENERATION_SQL,
    SUB_LIMITS_SQL,
    abort_snapshot,
    begin_snapshot,
)
from accounting.store import CounterSnapshot, PgSnapshot, Store
from accounting.triggers import DISPLAY_LIFT_SQL
from accounting.units import usage_to_cores

logger = logging.getLogger(__name__)

# Every non-local proc, summed per key of the five counter tables in one scan. The show is
# the proc's own pk_show, the alloc its host's and the folder its job's, exactly as the
# release trigger builds a release, so both always name the same keys. `kind` says which
# grouping set a row belongs to; `key` is that set's id (the set's other columns are NULL).
USAGE_SQL = """
SELECT CASE WHEN GROUPING(h.pk_alloc) = 0 THEN 'sub'
            WHEN GROUPING(j.pk_folder) = 0 THEN 'folder'
            WHEN GROUPING(p.pk_job) = 0 THEN 'job'
            WHEN GROUPING(p.pk_layer) = 0 THEN 'layer'
            ELSE 'point' END,
       p.pk_show, COALESCE(h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept),
       SUM(p.int_cores_reserved)::bigint, SUM(p.int_gpus_reserved)::bigint
FROM proc p
JOIN host h ON h.pk_host = p.pk_host
JOIN job j ON j.pk_job = p.pk_job
WHERE NOT p.b_local AND {shows}
GROUP BY GROUPING SETS ((p.pk_show, h.pk_alloc), (j.pk_folder), (p.pk_job), (p.pk_layer), (p.pk_show, j.pk_dept))
"""
BOOKED_SQL = USAGE_SQL.format(shows="p.pk_show IN (SELECT pk_show FROM show WHERE b_scheduler_managed)")
# The same for one show whatever its flag: the managed-flip seed runs it before the show
# is published as managed.
SHOW_BOOKED_SQL = USAGE_SQL.format(shows="p.pk_show = %(show)s")

# Managed shows with their flip generation (see accounting.models.ShowFlip).
MANAGED_SQL = """
SELECT s.pk_show, COALESCE(f.int_generation, 0) FROM show s
LEFT JOIN cuesched_show_flip f ON f.pk_show = s.pk_show
WHERE s.b_scheduler_managed
"""

SHOW_KEYS_SQL = {
    "sub": "SELECT pk_show, pk_alloc FROM subscription WHERE pk_show = %(show)s",
    "folder": "SELECT pk_folder FROM folder WHERE pk_show = %(show)s",
    "job": "SELECT pk_job FROM job WHERE pk_show = %(show)s AND str_state <> 'FINISHED'",
}

# The aggregation of ~30,000 groups keyed by 36-character ids outgrows the default 4 MB and
# spills to disk; the read is one per cycle, so it gets room for a large farm.
RECOMPUTE_WORK_MEM = "64MB"

# The PostgreSQL side: the usage read by the Store side arrives as arrays, and five
# data-modifying CTEs rewrite only the rows of still-managed shows whose totals differ (a
# key with no procs left is 0). Run after LOCK_MANAGED_SHOWS_SQL in the same transaction, with its shows. A row another
# session holds (an operator's UPDATE left open) is skipped (SKIP LOCKED) and written by the
# next pass: the display write waits for nobody, so it can neither stall nor close a deadlock
# cycle with an operator's multi-row cap write.
LOCK_MANAGED_SHOWS_SQL = (
    "SELECT pk_show FROM show WHERE b_scheduler_managed AND pk_show = ANY(%(shows)s::text[]) "
    "ORDER BY pk_show FOR KEY SHARE SKIP LOCKED"
)
PG_REFRESH_SQL = """
WITH managed AS MATERIALIZED (
  SELECT pk_show FROM show WHERE b_scheduler_managed AND pk_show = ANY(%(shows)s::text[])
),
sub_in AS (
  SELECT * FROM unnest(%(sub_show)s::text[], %(sub_alloc)s::text[], %(sub_cores)s::bigint[], %(sub_gpus)s::bigint[])
    AS u(pk_show, pk_alloc, cores, gpus)
),
sub_upd AS (
  UPDATE subscription t SET int_cores = x.cores, int_gpus = x.gpus
  FROM (SELECT sub.pk_subscription AS pk, COALESCE(u.cores, 0) AS cores, COALESCE(u.gpus, 0) AS gpus
        FROM subscription sub
        JOIN managed m ON m.pk_show = sub.pk_show
        LEFT JOIN sub_in u ON u.pk_show = sub.pk_show AND u.pk_alloc = sub.pk_alloc
        WHERE (sub.int_cores, sub.int_gpus) IS DISTINCT FROM (COALESCE(u.cores, 0), COALESCE(u.gpus, 0))
        FOR UPDATE OF sub SKIP LOCKED) x
  WHERE t.pk_subscription = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cores, x.gpus)
  RETURNING 1
),
folder_upd AS (
  UPDATE folder_resource t SET int_cores = x.cores, int_gpus = x.gpus
  FROM (SELECT f.pk_folder AS pk, COALESCE(u.cores, 0) AS cores, COALESCE(u.gpus, 0) AS gpus
        FROM folder f
        JOIN folder_resource fr ON fr.pk_folder = f.pk_folder
        JOIN managed m ON m.pk_show = f.pk_show
        LEFT JOIN unnest(%(folder_id)s::text[], %(folder_cores)s::bigint[], %(folder_gpus)s::bigint[])
          AS u(pk, cores, gpus) ON u.pk = f.pk_folder
        WHERE (fr.int_cores, fr.int_gpus) IS DISTINCT FROM (COALESCE(u.cores, 0), COALESCE(u.gpus, 0))
        FOR UPDATE OF fr SKIP LOCKED) x
  WHERE t.pk_folder = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cores, x.gpus)
  RETURNING 1
),
job_upd AS (
  UPDATE job_resource t SET int_cores = x.cores, int_gpus = x.gpus
  FROM (SELECT j.pk_job AS pk, COALESCE(u.cores, 0) AS cores, COALESCE(u.gpus, 0) AS gpus
        FROM job j
        JOIN job_resource jr ON jr.pk_job = j.pk_job
        JOIN managed m ON m.pk_show = j.pk_show
        LEFT JOIN unnest(%(job_id)s::text[], %(job_cores)s::bigint[], %(job_gpus)s::bigint[])
          AS u(pk, cores, gpus) ON u.pk = j.pk_job
        WHERE (jr.int_cores, jr.int_gpus) IS DISTINCT FROM (COALESCE(u.cores, 0), COALESCE(u.gpus, 0))
        FOR UPDATE OF jr SKIP LOCKED) x
  WHERE t.pk_job = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cores, x.gpus)
  RETURNING 1
),
layer_upd AS (
  UPDATE layer_resource t SET int_cores = x.cores, int_gpus = x.gpus
  FROM (SELECT l.pk_layer AS pk, COALESCE(u.cores, 0) AS cores, COALESCE(u.gpus, 0) AS gpus
        FROM layer l
        JOIN layer_resource lr ON lr.pk_layer = l.pk_layer
        JOIN job j ON j.pk_job = l.pk_job
        JOIN managed m ON m.pk_show = j.pk_show
        LEFT JOIN unnest(%(layer_id)s::text[], %(layer_cores)s::bigint[], %(layer_gpus)s::bigint[])
          AS u(pk, cores, gpus) ON u.pk = l.pk_layer
        WHERE (lr.int_cores, lr.int_gpus) IS DISTINCT FROM (COALESCE(u.cores, 0), COALESCE(u.gpus, 0))
        FOR UPDATE OF lr SKIP LOCKED) x
  WHERE t.pk_layer = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cores, x.gpus)
  RETURNING 1
),
point_upd AS (
  UPDATE point t SET int_cores = x.cores, int_gpus = x.gpus
  FROM (SELECT pt.pk_point AS pk, COALESCE(u.cores, 0) AS cores, COALESCE(u.gpus, 0) AS gpus
        FROM point pt
        JOIN managed m ON m.pk_show = pt.pk_show
        LEFT JOIN unnest(%(point_show)s::text[], %(point_dept)s::text[], %(point_cores)s::bigint[],
                         %(point_gpus)s::bigint[]) AS u(pk_show, pk_dept, cores, gpus)
          ON u.pk_show = pt.pk_show AND u.pk_dept = pt.pk_dept
        WHERE (pt.int_cores, pt.int_gpus) IS DISTINCT FROM (COALESCE(u.cores, 0), COALESCE(u.gpus, 0))
        FOR UPDATE OF pt SKIP LOCKED) x
  WHERE t.pk_point = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cores, x.gpus)
  RETURNING 1
)
SELECT (SELECT count(*) FROM sub_upd), (SELECT count(*) FROM folder_upd), (SELECT count(*) FROM job_upd),
       (SELECT count(*) FROM layer_upd), (SELECT count(*) FROM point_upd)
"""
# Beside Cuebot (accounting.cuebot): Cuebot's verify_subscription and verify_job_resources refuse
# an int_cores increase above the cap when the cap is unchanged in the same UPDATE, so a display
# value over a cap (a burst lowered under running frames, a job cap of -1, which is unlimited to
# us and refuses everything to Cuebot) would fail the whole refresh. As Cuebot's recalculate_subs()
# (V45) does, the caps of just those rows are lifted to the value about to be written, in the
# refresh's transaction and under DISPLAY_LIFT_SQL (the lift is not announced to the Store, see
# accounting.triggers), and put back after it. Rows are locked from the lift to the commit, so
# nobody else's cap edit comes in between; each returns (key, old cap) for the restore.
PG_LIFT_SQL = """
WITH managed AS MATERIALIZED (
  SELECT pk_show FROM show WHERE b_scheduler_managed AND pk_show = ANY(%(shows)s::text[])
),
sub_lift AS (
  UPDATE subscription t SET int_burst = u.cores
  FROM (SELECT sub.pk_subscription AS pk, sub.int_burst AS old, x.cores
        FROM unnest(%(sub_show)s::text[], %(sub_alloc)s::text[], %(sub_cores)s::bigint[]) AS x(pk_show, pk_alloc, cores)
        JOIN subscription sub ON sub.pk_show = x.pk_show AND sub.pk_alloc = x.pk_alloc
        JOIN managed m ON m.pk_show = sub.pk_show
        WHERE x.cores > sub.int_burst AND x.cores > sub.int_cores) u
  WHERE t.pk_subscription = u.pk
  RETURNING 's', t.pk_subscription, u.old
),
job_lift AS (
  UPDATE job_resource t SET int_max_cores = u.cores
  FROM (SELECT jr.pk_job_resource AS pk, jr.int_max_cores AS old, x.cores
        FROM unnest(%(job_id)s::text[], %(job_cores)s::bigint[]) AS x(pk_job, cores)
        JOIN job_resource jr ON jr.pk_job = x.pk_job
        JOIN job j ON j.pk_job = jr.pk_job
        JOIN managed m ON m.pk_show = j.pk_show
        WHERE x.cores > jr.int_max_cores AND x.cores > jr.int_cores) u
  WHERE t.pk_job_resource = u.pk
  RETURNING 'j', t.pk_job_resource, u.old
)
SELECT * FROM sub_lift UNION ALL SELECT * FROM job_lift
"""
PG_RESTORE_SQL = """
WITH lifted AS (SELECT * FROM unnest(%(kind)s::text[], %(pk)s::text[], %(old)s::bigint[]) AS l(kind, pk, old)),
sub_back AS (
  UPDATE subscription t SET int_burst = l.old FROM lifted l WHERE l.kind = 's' AND t.pk_subscription = l.pk
  RETURNING 1
)
UPDATE job_resource t SET int_max_cores = l.old FROM lifted l WHERE l.kind = 'j' AND t.pk_job_resource = l.pk
"""

PG_REFRESH_TABLES = ("subscription", "folder_resource", "job_resource", "layer_resource", "point")

Sums = tuple[int, int]  # (centicores, gpus)


@dataclass
class Usage:
    """SUM(proc) per key of the five counter tables, in centicores and GPUs, from one snapshot."""

    shows: list[str] = field(default_factory=list)
    sub: dict[tuple[str, str], Sums] = field(default_factory=dict)
    folder: dict[str, Sums] = field(default_factory=dict)
    job: dict[str, Sums] = field(default_factory=dict)
    layer: dict[str, Sums] = field(default_factory=dict)
    point: dict[tuple[str, str], Sums] = field(default_factory=dict)


def read_usage(rows: Iterable[tuple[str, str, str, int, int]], shows: Iterable[str]) -> Usage:
    """Sort the grouping-set rows of USAGE_SQL by table."""
    usage = Usage(shows=list(shows))
    sub, point = usage.sub, usage.point
    by_id = {"folder": usage.folder, "job": usage.job, "layer": usage.layer}
    for kind, show, key, cores, gpus in rows:
        if kind == "sub":
            sub[(show, key)] = (int(cores), int(gpus))
        elif kind == "point":
            point[(show, key)] = (int(cores), int(gpus))
        else:
            by_id[kind][key] = (int(cores), int(gpus))
    return usage


def refresh_params(usage: Usage) -> dict[str, list[str] | list[int]]:
    """PG_REFRESH_SQL's arrays: one list per column, in the same order for each table."""
    params: dict[str, list[str] | list[int]] = {"shows": usage.shows}
    for name, sums, key_columns in (
        ("sub", usage.sub, ("show", "alloc")),
        ("folder", usage.folder, ("id",)),
        ("job", usage.job, ("id",)),
        ("layer", usage.layer, ("id",)),
        ("point", usage.point, ("show", "dept")),
    ):
        keys = list(sums)
        if len(key_columns) == 2:
            params[f"{name}_{key_columns[0]}"] = [k[0] for k in keys]
            params[f"{name}_{key_columns[1]}"] = [k[1] for k in keys]
        else:
            params[f"{name}_id"] = keys
        params[f"{name}_cores"] = [sums[k][0] for k in keys]
        params[f"{name}_gpus"] = [sums[k][1] for k in keys]
    return params


@dataclass
class RecomputeResult:
    keys: int = 0
    # Rows of the usage read: one per key of the five tables that has procs.
    rows: int = 0
    evicted: int = 0
    store_seconds: float = 0.0
    pg_seconds: float = 0.0
    pg_rows_updated: dict[str, int] = field(default_factory=dict)
    pg_error: str | None = None
    # Sum over keys of |after - before| in whole cores: how far the Store had drifted.
    drift_cores: dict[str, int] = field(default_factory=dict)
    # Signed drift per key the pass corrected (Store before - SUM(proc), whole cores; nonzero
    # keys only, at most DRIFT_KEYS_KEPT per vertex): the console shows a key's drift from this
    # one consistent measurement instead of comparing figures read at different moments.
    drift_keys: dict[str, dict[str, int]] = field(default_factory=dict)
    # xmax of the pass's snapshot: the service notices a server whose xids went backwards.
    pg_xmax: int = 0
    # Whether the pass could judge the Store against SUM(proc) (`Recomputer.settle` said every
    # notification older than the read had arrived), and the keys it found BELOW the truth:
    # vertex -> key ("show:alloc" for subscriptions) -> (store cores, SUM cores, store GPUs,
    # SUM GPUs). The service raises the integrity alarm from these (accounting/integrity.py).
    judged: bool = False
    low: dict[str, dict[str, tuple[int, int, int, int]]] = field(default_factory=dict)


def build_snapshot(
    usage: Usage,
    sub_keys: Iterable[tuple[str, str]],
    folder_keys: Iterable[str],
    job_keys: Iterable[str],
) -> CounterSnapshot:
    """A CounterSnapshot over a zero baseline: a key whose procs all drained resets to 0.

    Centicores were summed per key by the database; each key is converted once, rounding
    up (a key holding 2.5 cores reads 3: a counter may read high, never low).
    """
    snapshot = CounterSnapshot(
        sub=dict.fromkeys(sub_keys, (0, 0)),
        folder=dict.fromkeys(folder_keys, (0, 0)),
        job=dict.fromkeys(job_keys, (0, 0)),
    )
    for target, sums in ((snapshot.sub, usage.sub), (snapshot.folder, usage.folder), (snapshot.job, usage.job)):
        for key, (cc, gg) in sums.items():
            target[key] = (usage_to_cores(cc), gg)
    return snapshot


DRIFT_KEYS_KEPT = 500


def _drift_keys(before: CounterSnapshot, after: CounterSnapshot) -> dict[str, dict[str, int]]:
    """Signed per-key corrections; sub keys as "show:alloc" (the live view's key)."""
    out: dict[str, dict[str, int]] = {}
    for name in ("sub", "folder", "job"):
        b, a = getattr(before, name), getattr(after, name)
        found: dict[str, int] = {}
        for k in a.keys() | b.keys():
            d = b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]
            if d:
                found[":".join(k) if isinstance(k, tuple) else str(k)] = d
        biggest = sorted(found.items(), key=lambda kv: -abs(kv[1]))[:DRIFT_KEYS_KEPT]
        out[name] = dict(biggest)
    return out


def _drift(before: CounterSnapshot, after: CounterSnapshot) -> dict[str, int]:
    out = {}
    for name in ("sub", "folder", "job"):
        b, a = getattr(before, name), getattr(after, name)
        out[name] = sum(abs(a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0]) for k in a.keys() | b.keys())
    return out


class Recomputer:
    """Runs recompute passes; `lock` keeps begin->overwrite pairs strictly sequential.

    The same lock is taken by the listener's reconnect reseed, which also runs a store
    pass: two overlapping passes would clear each other's settled buckets early.
    """

    def __init__(self, store: Store, lock: threading.Lock | None = None) -> None:
        self.store = store
        self.lock = lock or threading.Lock()
        # Beside Cuebot the display write lifts caps around itself (PG_LIFT_SQL); set by the service.
        self.cuebot = False
        # Called with the managed shows (and generations) a pass's snapshot saw, before its
        # overwrite: the service unpublishes a show the snapshot saw unmanaged or flipped since
        # its seed, since the overwrite is about to treat its keys as zero.
        self.on_managed: Callable[[dict[str, int]], None] | None = None
        # Test hook (the stress suite's recompute straddle): called between begin_recompute
        # and the snapshot read, so bookings can land inside the window on purpose.
        self.before_snapshot: Callable[[], None] | None = None
        # Set by the service: blocks until every notification committed before the given
        # monotonic time has been applied (a heartbeat sent after it came back), False if that
        # could not be told in time. Only then can a Store counter below SUM(proc) be told from
        # a notification still on its way, so without it a pass judges nothing.
        self.settle: Callable[[float], bool] | None = None
        # The accounting generation(s) the last seed_show read, in its snapshot.
        self.generations_seen: dict[str, int] = {}

    def store_pass(
        self, conn: psycopg.Connection, result: RecomputeResult | None = None, *, judge: bool = False
    ) -> tuple[RecomputeResult, Usage]:
        """Overwrite the Store's counters; the usage read is returned for the PostgreSQL side.

        With `judge` (the periodic pass, never the listener's own reseed, which cannot wait for
        the listener), the Store is first compared with the read once `settle` says every older
        notification arrived: keys below SUM(proc) go to `result.low`.
        """
        result = result or RecomputeResult()
        store = self.store
        started = time.monotonic()
        with self.lock:
            incarnation = store.incarnation
            epoch = store.begin_recompute()
            try:
                if self.before_snapshot is not None:
                    self.before_snapshot()
                snap = begin_snapshot(conn)
                conn.execute(f"SET LOCAL work_mem = '{RECOMPUTE_WORK_MEM}'")
                rows = conn.execute(BOOKED_SQL).fetchall()
                managed = {s: int(g) for s, g in conn.execute(MANAGED_SQL)}
                shows = list(managed)
                sub_keys = [(s, a) for s, a, _ in conn.execute(SUB_LIMITS_SQL)]
                folder_keys = [f for f, _, _ in conn.execute(FOLDER_LIMITS_SQL)]
                job_keys = [j for j, _, _ in conn.execute(JOB_LIMITS_SQL)]
                generations = {s: int(g) for s, g in conn.execute(GENERATIONS_SQL)}
                conn.execute("COMMIT")
            except BaseException:
                # No overwrite: the stale bucket is carried once more (a safe over-count).
                abort_snapshot(conn)
                raise
            read_done = time.monotonic()
            if self.on_managed is not None:
                self.on_managed(managed)
            usage = read_usage(rows, shows)
            if judge and self.settle is not None:
                result.judged = self.settle(read_done)
            before = store.audit_snapshot()
            db_jobs = set(job_keys)
            # Keys the Store knows but the database universe lacks (finished or deleted jobs,
            # shows no longer managed) are in the snapshot too, at their SUM(proc): every proc
            # of a managed show is in the usage, so anything else really is zero.
            snapshot = build_snapshot(
                usage,
                [*sub_keys, *before.sub.keys()],
                [*folder_keys, *before.folder.keys()],
                [*job_keys, *before.job.keys()],
            )
            if result.judged:
                result.low = {
                    vertex: {(":".join(k) if isinstance(k, tuple) else k): v for k, v in keys.items()}
                    for vertex, keys in store.below(snapshot, snap).items()
                }
            store.overwrite_counters(snapshot, epoch, pg_snapshot=snap, incarnation=incarnation)
            store.cover_generations("counters", generations, incarnation)
            result.pg_xmax = snap.xmax
        after = store.audit_snapshot()
        result.drift_cores = _drift(before, after)
        result.drift_keys = _drift_keys(before, after)
        result.evicted = store.evict_jobs([j for j, v in after.job.items() if j not in db_jobs and v == (0, 0)])
        result.keys = len(snapshot.sub) + len(snapshot.folder) + len(snapshot.job)
        result.rows = len(rows)
        result.store_seconds = time.monotonic() - started
        return result, usage

    def pg_pass(self, conn: psycopg.Connection, usage: Usage, result: RecomputeResult | None = None) -> RecomputeResult:
        """Write `usage` to the display columns of the shows that are still managed."""
        result = result or RecomputeResult()
        started = time.monotonic()
        try:
            with conn.transaction():
                params = refresh_params(usage)
                # The managed shows' rows FOR KEY SHARE (accounting.keylocks): a flip of one waits
                # for this write, whose display of SUM(proc) must not land after the flip's own
                # rebuild. A show whose row a flip (or anybody) holds is left out, written next
                # pass: the display waits for nobody.
                params["shows"] = [r[0] for r in conn.execute(LOCK_MANAGED_SHOWS_SQL, params).fetchall()]
                lifted: list[tuple[str, str, int]] = []
                if self.cuebot:
                    conn.execute(DISPLAY_LIFT_SQL)
                    lifted = conn.execute(PG_LIFT_SQL, params).fetchall()
                counts = conn.execute(PG_REFRESH_SQL, params).fetchone() or ()
                if lifted:
                    conn.execute(
                        PG_RESTORE_SQL,
                        {"kind": [r[0] for r in lifted], "pk": [r[1] for r in lifted], "old": [r[2] for r in lifted]},
                    )
            result.pg_rows_updated = dict(zip(PG_REFRESH_TABLES, counts, strict=True))
        except psycopg.Error as exc:
            result.pg_error = f"{type(exc).__name__}: {exc}"
            logger.warning("recompute: PostgreSQL-side refresh failed (the Store pass still ran): %s", exc)
        result.pg_seconds = time.monotonic() - started
        return result

    def run_once(self, conn: psycopg.Connection) -> RecomputeResult:
        result, usage = self.store_pass(conn, judge=True)
        self.pg_pass(conn, usage, result)
        return result

    def seed_show(self, conn: psycopg.Connection, show: str) -> tuple[CounterSnapshot, PgSnapshot, int]:
        """Read one show's booked counters over a zero baseline of its keys (managed-flip seed).

        The show's accounting generation is read in the same snapshot: `generations_seen`
        holds it for the caller to cover once the counters are written.
        """
        incarnation = self.store.incarnation
        self.store.open_release_window()
        try:
            snap = begin_snapshot(conn)
            params = {"show": show}
            rows = conn.execute(SHOW_BOOKED_SQL, params).fetchall()
            sub_keys = [(s, a) for s, a in conn.execute(SHOW_KEYS_SQL["sub"], params)]
            folder_keys = [f for (f,) in conn.execute(SHOW_KEYS_SQL["folder"], params)]
            job_keys = [j for (j,) in conn.execute(SHOW_KEYS_SQL["job"], params)]
            self.generations_seen = {s: int(g) for s, g in conn.execute(SHOW_GENERATION_SQL, params)}
            conn.execute("COMMIT")
        except BaseException:
            abort_snapshot(conn)
            raise
        return build_snapshot(read_usage(rows, [show]), sub_keys, folder_keys, job_keys), snap, incarnation
