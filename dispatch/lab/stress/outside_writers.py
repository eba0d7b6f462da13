"""Phase `outside_writers` (issue 15): writers that are not the scheduler, under booking load.

The writers connect without cuesched's writer claim, as `psql` or a script does. Since issue 27
the database refuses them every write that would book a managed show (an INSERT, a growth, a
host or job move under its running frames: `acct_managed_show_booked_outside`), so what they
write to the managed show is releases, shrinks and moves of hosts and jobs it does not run on; one
that books it and commits is a failure. Before, they carried the claim and such writes went
through, to be judged by the watchdog only once the Store had them."""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from accounting import db
from accounting.triggers import MANAGED_BOOKED_OUTSIDE
from dispatch.engine.completion import Completion, complete
from dispatch.lab.seeding import FarmSeed
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, int_launcher, run_inprocess
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import OutsideWrite, StoreReach


class _Skip(Exception):
    """An outside write that found nothing to do (rolled back, counted as skipped)."""


OW_KINDS: tuple[tuple[str, int], ...] = (
    ("host_move", 3),
    ("job_move", 2),
    ("resize", 3),
    ("insert", 3),
    ("sub_cycle", 1),
    ("reopen", 1),
    ("flip_rr", 1),
)

# The outcomes that count a kind as done under load: the phase fails unless every kind, and a
# managed booking refused (which only the booking kinds can meet), was done at least once.
# flip_rr is done when the REPEATABLE READ writer's INSERT fails on the flipped show's row, which
# the proc trigger locks FOR KEY SHARE (accounting.keylocks): since the row locks replaced the
# one advisory lock, flips no longer bump the epoch row, so no writer fails on that any more.
OW_SHOW_ROW_SERIALIZATION = "serialization (show row lock)"
OW_DONE: dict[str, tuple[str, ...]] = {
    "host_move": ("done",),
    "job_move": ("done",),
    "resize": ("grown", "shrunk"),
    "insert": ("done",),
    "sub_cycle": ("done",),
    "reopen": ("done",),
    "flip_rr": (OW_SHOW_ROW_SERIALIZATION,),
}
OW_MANAGED_REFUSED = "a managed booking refused"
OW_BOOKING_KINDS = ("host_move", "job_move", "resize", "insert")
# Where the proc INSERT trigger locks its procs' show rows (the first of its key locks).
OW_SHOW_LOCK_CONTEXT = ("pgtrigger_acct_proc_insert", "FROM show t WHERE t.pk_show IN")


def ow_missing(counts: Counter[str]) -> list[str]:
    """The kinds (and the managed refusal) not done yet, in OW_KINDS order."""
    missing = [k for k, _w in OW_KINDS if not any(counts[f"{k} {outcome}"] for outcome in OW_DONE[k])]
    if not any(n for k, n in counts.items() if k.endswith(f"refused ({MANAGED_BOOKED_OUTSIDE})")):
        missing.append(OW_MANAGED_REFUSED)
    return missing


# A proc of the farm at random, with the keys it is booked against and whether its show is managed.
OW_PROC_SQL = """
SELECT p.pk_proc, p.pk_host, p.int_cores_reserved, p.pk_show, p.pk_job
FROM proc p WHERE p.pk_show = ANY(%s) AND NOT p.b_local ORDER BY random() LIMIT 1
"""
OW_PROC_KEYS_SQL = """
SELECT s.b_scheduler_managed, p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job
FROM proc p JOIN show s ON s.pk_show = p.pk_show JOIN host h ON h.pk_host = p.pk_host JOIN job j ON j.pk_job = p.pk_job
WHERE p.pk_proc = %s
"""
OW_WAITING_FRAME_SQL = """
SELECT f.pk_frame, f.pk_layer, f.pk_job, j.pk_show, l.int_cores_min, l.int_mem_min
FROM frame f JOIN job j ON j.pk_job = f.pk_job JOIN layer l ON l.pk_layer = f.pk_layer
WHERE f.pk_job = ANY(%s) AND f.str_state = 'WAITING' AND j.str_state = 'PENDING' ORDER BY random() LIMIT 1
"""
OW_HOST_WITH_ROOM_SQL = """
SELECT pk_host FROM host WHERE pk_host = ANY(%s) AND int_cores_idle >= %s AND int_mem_idle >= %s
ORDER BY random() LIMIT 1
"""
OW_START_FRAME_SQL = """
UPDATE frame SET str_state = 'RUNNING', int_version = int_version + 1, ts_started = now(), ts_updated = now()
WHERE pk_frame = %s AND str_state = 'WAITING'
"""
OW_INSERT_PROC_SQL = """
INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, int_mem_reserved,
                  int_gpus_reserved)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 0)
"""
OW_TAKE_HOST_SQL = """
UPDATE host SET int_cores_idle = int_cores_idle - %(c)s, int_mem_idle = int_mem_idle - %(m)s, ts_last_updated = now()
WHERE pk_host = %(host)s AND int_cores_idle >= %(c)s AND int_mem_idle >= %(m)s AND int_cores_idle - %(c)s <= int_cores
"""


@dataclass
class _OutsideWriters:
    """The outside writers of `outside_writers`: plain SQL on autocommit connections of their own.

    They know nothing of the scheduler; they write as a script or a DBA would, each write one
    READ COMMITTED transaction (the REPEATABLE READ writer excepted), without the writer claim.
    What one would add to managed keys is registered with the watchdog (`adding`) before COMMIT
    and, once committed, is a failure: the database must have refused it. Procs they insert run
    on no launcher: an "agent" (cuesched's completion path) completes each after a drawn runtime.
    """

    run: Run
    cfg: StressConfig
    folders: dict[str, list[tuple[str, str | None]]]  # show -> [(folder, dept)]
    counts: Counter[str] = field(default_factory=Counter)
    moved_procs: int = 0
    failures: list[str] = field(default_factory=list)
    flipped: dict[str, bool] = field(default_factory=dict)  # show -> flipped from its seeded state
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Subscription deletes and flips one at a time: a subscription deleted while its show flips
    # to unmanaged would be re-created with a counter of 0 under running procs (see sub_cycle).
    _flip_lock: threading.Lock = field(default_factory=threading.Lock)
    _agent: list[tuple[float, str]] = field(default_factory=list)  # heap of (due, pk_proc)
    _agent_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def seed(self) -> FarmSeed:
        return self.run.seed

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    # -- one write ------------------------------------------------------------------------
    def _write(
        self, conn: psycopg.Connection, body: Callable[[psycopg.Connection], tuple[str, list[tuple[str, str]]]]
    ) -> str:
        """Run `body` in one transaction; what it added to managed keys is registered before COMMIT."""
        write: OutsideWrite | None = None
        try:
            with conn.transaction():
                outcome, keys = body(conn)
                if keys:
                    write = self.run.watchdog.adding(keys)
        except _Skip as skip:
            return f"skipped ({skip})"
        except psycopg.OperationalError:
            if write is not None:
                write.committed = time.monotonic()  # COMMIT may have happened: judged as if it had
            raise
        except BaseException:
            if write is not None:
                write.aborted = True
            raise
        if write is not None:
            write.committed = time.monotonic()
            with self._lock:
                self.failures.append(f"an outside write without the writer mark booked managed keys: {keys}")
        return outcome

    def host_move(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = None
            if rng.random() < 0.75:
                row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            host = row[1] if row else rng.choice(seed.host_ids)
            current = c.execute("SELECT pk_alloc FROM host WHERE pk_host = %s", (host,)).fetchone()
            if current is None:
                raise _Skip("host gone")
            target = rng.choice([a for a in seed.alloc_ids if a != current[0]])
            moved = c.execute(
                "UPDATE host SET pk_alloc = %s, ts_last_updated = now() WHERE pk_host = %s AND pk_alloc = %s",
                (target, host, current[0]),
            ).rowcount
            if not moved:
                raise _Skip("moved meanwhile")
            rows = c.execute(
                "SELECT p.pk_show, s.b_scheduler_managed, count(*) FROM proc p JOIN show s ON s.pk_show = p.pk_show"
                " WHERE p.pk_host = %s AND NOT p.b_local GROUP BY 1, 2",
                (host,),
            ).fetchall()
            with self._lock:
                self.moved_procs += sum(int(n) for _s, _m, n in rows)
            return "done", [("sub", f"{show}:{target}") for show, managed, _n in rows if managed]

        return self._write(conn, body)

    def job_move(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = None
            if rng.random() < 0.75:
                row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            job = row[4] if row else rng.choice(seed.job_ids)
            current = c.execute("SELECT pk_show, pk_folder FROM job WHERE pk_job = %s", (job,)).fetchone()
            if current is None:
                raise _Skip("job gone")
            show, folder = current
            targets = [(f, d) for f, d in self.folders[show] if f != folder]
            if not targets:
                raise _Skip("one folder only")
            target, dept = rng.choice(targets)
            moved = c.execute(
                "UPDATE job SET pk_folder = %s, pk_dept = COALESCE(%s, pk_dept), ts_updated = now()"
                " WHERE pk_job = %s AND pk_folder = %s",
                (target, dept, job, folder),
            ).rowcount
            if not moved:
                raise _Skip("moved meanwhile")
            managed, procs = c.execute(
                "SELECT s.b_scheduler_managed, (SELECT count(*) FROM proc p WHERE p.pk_job = %s AND NOT p.b_local)"
                " FROM show s WHERE s.pk_show = %s",
                (job, show),
            ).fetchone() or (False, 0)
            return "done", [("folder", target)] if managed and procs else []

        return self._write(conn, body)

    def resize(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(OW_PROC_SQL, (list(seed.show_ids),)).fetchone()
            if row is None:
                raise _Skip("no proc")
            pk_proc, host, cores, _show, _job = row
            delta = rng.choice((100, -100))
            if cores + delta < 100:
                delta = 100
            if not c.execute(
                "UPDATE proc SET int_cores_reserved = int_cores_reserved + %s"
                " WHERE pk_proc = %s AND int_cores_reserved + %s >= 100",
                (delta, pk_proc, delta),
            ).rowcount:
                raise _Skip("proc gone")
            if not c.execute(OW_TAKE_HOST_SQL, {"c": delta, "m": 0, "host": host}).rowcount:
                raise _Skip("host full")
            keys: list[tuple[str, str]] = []
            if delta > 0:
                managed, show, alloc, folder, job = c.execute(OW_PROC_KEYS_SQL, (pk_proc,)).fetchone()  # type: ignore[misc]
                if managed:
                    keys = [("sub", f"{show}:{alloc}"), ("folder", folder), ("job", job)]
            return ("grown" if delta > 0 else "shrunk"), keys

        return self._write(conn, body)

    def insert(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed
        pk_proc = str(uuid.uuid4())

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(OW_WAITING_FRAME_SQL, (list(seed.job_ids),)).fetchone()
            if row is None:
                raise _Skip("no waiting frame")
            frame, layer, job, show, cores, mem = row
            host = c.execute(OW_HOST_WITH_ROOM_SQL, (list(seed.host_ids), cores, mem)).fetchone()
            if host is None:
                raise _Skip("no host with room")
            if not c.execute(OW_START_FRAME_SQL, (frame,)).rowcount:
                raise _Skip("frame taken")
            c.execute(OW_INSERT_PROC_SQL, (pk_proc, host[0], show, layer, job, frame, cores, mem))
            if not c.execute(OW_TAKE_HOST_SQL, {"c": cores, "m": mem, "host": host[0]}).rowcount:
                raise _Skip("host full")
            managed, show, alloc, folder, job = c.execute(OW_PROC_KEYS_SQL, (pk_proc,)).fetchone()  # type: ignore[misc]
            return "done", [("sub", f"{show}:{alloc}"), ("folder", folder), ("job", job)] if managed else []

        outcome = self._write(conn, body)
        if outcome == "done":
            due = time.monotonic() + rng.uniform(self.cfg.int_runtime_min, self.cfg.int_runtime_max)
            with self._agent_lock:
                heapq.heappush(self._agent, (due, pk_proc))
        return outcome

    def sub_cycle(self, conn: psycopg.Connection, rng: random.Random) -> str:
        """A managed show's subscription deleted, then re-created as it was.

        Managed shows only: an unmanaged show's subscription row IS its database counter, and a
        re-created row starts at 0 under the procs still running (nothing rebuilds it but the
        periodic reconcile), which no trigger can tell from a new subscription.
        """
        with self._flip_lock:
            managed = [
                s
                for (s,) in conn.execute(
                    "SELECT pk_show FROM show WHERE pk_show = ANY(%s) AND b_scheduler_managed",
                    (list(self.seed.show_ids),),
                )
            ]
            if not managed:
                return "skipped (no managed show)"
            show, alloc = rng.choice(managed), rng.choice(self.seed.alloc_ids)
            row = conn.execute(
                "DELETE FROM subscription WHERE pk_show = %s AND pk_alloc = %s"
                " RETURNING pk_subscription, int_size, int_burst, float_tier",
                (show, alloc),
            ).fetchone()
            if row is None:
                return "skipped (no subscription)"
            # Deleted for a moment while the loop books: the Store must refuse the allocation.
            self.run.stop_loop.wait(rng.uniform(0.05, 0.3))
            conn.execute(
                "INSERT INTO subscription (pk_subscription, pk_alloc, pk_show, int_size, int_burst, float_tier)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (row[0], alloc, show, row[1], row[2], row[3]),
            )
        return "done"

    def reopen(self, conn: psycopg.Connection, rng: random.Random) -> str:
        seed = self.seed

        def body(c: psycopg.Connection) -> tuple[str, list[tuple[str, str]]]:
            row = c.execute(
                "SELECT pk_job FROM job WHERE pk_job = ANY(%s) AND str_state = 'FINISHED' ORDER BY random() LIMIT 1",
                (list(seed.job_ids),),
            ).fetchone()
            if row is None:
                raise _Skip("no finished job yet")
            frames = c.execute(
                "UPDATE frame SET str_state = 'WAITING', int_version = int_version + 1, ts_updated = now()"
                " WHERE pk_frame IN (SELECT pk_frame FROM frame WHERE pk_job = %s AND str_state = 'SUCCEEDED'"
                " ORDER BY random() LIMIT %s)",
                (row[0], rng.randint(2, 6)),
            ).rowcount
            if not frames:
                raise _Skip("nothing to run again")
            if not c.execute(
                "UPDATE job SET str_state = 'PENDING', ts_stopped = NULL, ts_updated = now()"
                " WHERE pk_job = %s AND str_state = 'FINISHED'",
                (row[0],),
            ).rowcount:
                raise _Skip("reopened meanwhile")
            self.count("reopen frames", frames)
            return "done", []

        return self._write(conn, body)

    def flip_rr(self, conn: psycopg.Connection, rng: random.Random, rr: psycopg.Connection) -> str:
        """A show flipped while a REPEATABLE READ writer, whose snapshot predates it, inserts a proc.

        The writer's snapshot is taken (reading a frame and the show's flag) before the flip
        commits; its INSERT comes after, and must fail with a serialization failure (40001)
        on the show's row, which the proc trigger locks FOR KEY SHARE and the flip updated after
        the snapshot: committed, it would be accounted by the side its old snapshot believes
        owns the show.
        """
        with self._flip_lock:
            show = rng.choice(self.seed.show_ids)
            rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            try:
                row = rr.execute(
                    OW_WAITING_FRAME_SQL.replace("f.pk_job = ANY(%s)", "j.pk_show = %s"), (show,)
                ).fetchone()
                host = (
                    rr.execute(OW_HOST_WITH_ROOM_SQL, (list(self.seed.host_ids), row[4], row[5])).fetchone()
                    if row
                    else None
                )
                conn.execute(
                    "UPDATE show SET b_scheduler_managed = NOT b_scheduler_managed WHERE pk_show = %s", (show,)
                )
                self.flipped[show] = not self.flipped.get(show, False)
                self.count("flips")
                if row is None or host is None:
                    rr.execute("ROLLBACK")
                    return "flipped (no frame or host for the writer)"
                frame, layer, job, _show, cores, mem = row
                pk_proc = str(uuid.uuid4())
                try:
                    rr.execute(OW_INSERT_PROC_SQL, (pk_proc, host[0], show, layer, job, frame, cores, mem))
                    rr.execute(OW_START_FRAME_SQL, (frame,))
                    rr.execute(OW_TAKE_HOST_SQL, {"c": cores, "m": mem, "host": host[0]})
                    rr.execute("COMMIT")
                except psycopg.errors.SerializationFailure as exc:
                    rr.execute("ROLLBACK")
                    context = exc.diag.context or ""
                    if all(part in context for part in OW_SHOW_LOCK_CONTEXT):
                        return OW_SHOW_ROW_SERIALIZATION
                    return "serialization"
            except BaseException:
                if rr.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    rr.execute("ROLLBACK")
                raise
        with self._agent_lock:
            heapq.heappush(self._agent, (time.monotonic(), pk_proc))
        self.failures.append(f"a REPEATABLE READ writer inserted proc {pk_proc} across a flip of show {show}")
        return "committed across the flip"

    def restore_flips(self, conn: psycopg.Connection) -> None:
        """Every show back to its seeded state, so the audit sees both kinds."""
        with self._flip_lock:
            for show, flipped in sorted(self.flipped.items()):
                if flipped:
                    conn.execute(
                        "UPDATE show SET b_scheduler_managed = NOT b_scheduler_managed WHERE pk_show = %s", (show,)
                    )
                    self.flipped[show] = False
                    self.count("flips")

    # -- the threads ----------------------------------------------------------------------
    def _draw(self, rng: random.Random, drawn: int, ops: int) -> str | None:
        """The next kind: `ops` drawn by weight, then only the kinds not done yet (None: all done).

        A small run's writers finish their ops in a few seconds, before any job has FINISHED
        (a reopen has nothing to reopen) or a drawn kind met the state it needs; they go on
        with what is missing while the loop books, so the phase's check that every kind was
        done under load is met by doing it, not by luck of size.
        """
        pool = list(OW_KINDS)
        if drawn >= ops:
            with self._lock:
                missing = ow_missing(self.counts)
            if not missing:
                return None
            pool = [
                (k, w) for k, w in OW_KINDS if k in missing or (OW_MANAGED_REFUSED in missing and k in OW_BOOKING_KINDS)
            ]
        return rng.choices([k for k, _w in pool], [w for _k, w in pool])[0]

    def writer(self, index: int, ops: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/outside_writers/{index}")
        conn = db.connect(autocommit=True, application_name=f"cuesched-stress-writer-{index}", claim_writer=False)
        rr = db.connect(autocommit=True, application_name=f"cuesched-stress-rr-{index}", claim_writer=False)
        drawn = 0
        try:
            while self.run.loop_alive():
                kind = self._draw(rng, drawn, ops)
                if kind is None:
                    break
                drawn += 1
                try:
                    if kind == "flip_rr":
                        outcome = self.flip_rr(conn, rng, rr)
                    else:
                        outcome = getattr(self, kind)(conn, rng)
                except psycopg.errors.CheckViolation as exc:
                    outcome = f"refused ({exc.diag.constraint_name})"
                except psycopg.errors.SerializationFailure:
                    outcome = "serialization failure"
                except psycopg.errors.UniqueViolation:
                    # The frame this writer read as WAITING was booked by the scheduler meanwhile
                    # (one proc per frame): the database refused the second one, as it should.
                    outcome = "frame booked meanwhile"
                except psycopg.errors.DeadlockDetected:
                    outcome = "deadlock"
                except psycopg.OperationalError as exc:
                    outcome = f"connection lost ({type(exc).__name__})"
                    conn.close()
                    rr.close()
                    conn = db.connect(
                        autocommit=True, application_name=f"cuesched-stress-writer-{index}", claim_writer=False
                    )
                    rr = db.connect(autocommit=True, application_name=f"cuesched-stress-rr-{index}", claim_writer=False)
                except psycopg.Error as exc:
                    outcome = f"error {exc.sqlstate}"
                    self.failures.append(f"{kind}: unexpected {type(exc).__name__}: {exc}")
                self.count(f"{kind} {outcome}")
                self.run.stop_loop.wait(rng.uniform(0, 2 * self.cfg.ow_pause))
        finally:
            conn.close()
            rr.close()

    def agent(self, stop: threading.Event) -> None:
        """Completes the procs the writers inserted, each once its runtime is up (all when `stop`)."""
        conn = db.connect(autocommit=True, application_name="cuesched-stress-agent")
        try:
            while True:
                with self._agent_lock:
                    now = time.monotonic()
                    due = []
                    while self._agent and (self._agent[0][0] <= now or stop.is_set()):
                        due.append(heapq.heappop(self._agent)[1])
                    empty = not self._agent
                if due:
                    try:
                        result = complete(conn, [Completion(pk, 0) for pk in due])
                    except psycopg.Error as exc:
                        # A deadlock with a booking (both lock a job_stat row and the show's
                        # database-accounting lock, in opposite orders) rolls it back: retry.
                        self.count(f"agent retries ({type(exc).__name__})")
                        with self._agent_lock:
                            for pk in due:
                                heapq.heappush(self._agent, (time.monotonic() + 0.05, pk))
                        if conn.broken or conn.closed:
                            conn = db.connect(autocommit=True, application_name="cuesched-stress-agent")
                        time.sleep(0.05)
                        continue
                    self.count("agent completions", result.released)
                elif stop.is_set() and empty:
                    return
                else:
                    time.sleep(0.01)
        finally:
            conn.close()


def phase_outside_writers(cfg: StressConfig) -> PhaseReport:
    """Issue 15: every outside write, under booking load, beside a managed and an unmanaged show."""
    spec = cfg.integrity_spec("outside_writers", shows=2, managed_shows=1, folders_per_show=3, depts=2)
    box: dict[str, _OutsideWriters] = {}
    reaches: dict[int, StoreReach] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(20):
            return
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            folders: dict[str, list[tuple[str, str | None]]] = {}
            for folder, show, dept in conn.execute(
                "SELECT pk_folder, pk_show, pk_dept FROM folder WHERE pk_folder = ANY(%s) ORDER BY pk_folder",
                (list(run.seed.folder_ids),),
            ):
                folders.setdefault(show, []).append((folder, dept))
            writers = box["w"] = _OutsideWriters(run, cfg, folders)
            reach = reaches[0] = StoreReach(run.service).start()
            run.watchdog.reached_at = reach.reached_at
            stop_agent = threading.Event()
            agent = threading.Thread(target=writers.agent, args=(stop_agent,), name="stress-agent", daemon=True)
            agent.start()
            per_writer = math.ceil(cfg.ow_ops / max(cfg.ow_writers, 1))
            threads = [
                threading.Thread(target=writers.writer, args=(i, per_writer), name=f"stress-writer-{i}", daemon=True)
                for i in range(cfg.ow_writers)
            ]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(cfg.phase_timeout)
                writers.restore_flips(conn)
            finally:
                stop_agent.set()
                agent.join(30)
                # The recorder keeps running: the watchdog judges with it until the audit is over.

    report = run_inprocess(
        cfg,
        "outside_writers",
        spec,
        launcher=int_launcher(cfg),
        perturb=perturb,
        # A recompute every second (evictions of finished jobs, which a reopened job must
        # survive); no database reconcile, so the triggers alone must keep unmanaged counters.
        loop_env={"CUESCHED_RECOMPUTE_INTERVAL": "1", "CUESCHED_DB_RECONCILE_INTERVAL": "3600"},
    )
    for reach in reaches.values():
        reach.stop()
    writers = box.get("w")
    if writers is None:
        report.failed.append("the outside writers never ran")
        return report
    counts = writers.counts
    for kind, _w in OW_KINDS:
        mine = {k.split(" ", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith(kind + " ")}
        report.notes.append(f"outside {kind}: " + (", ".join(f"{k} {n}" for k, n in mine.items()) or "none"))
    report.notes.append(
        f"outside writes: {sum(n for k, n in counts.items() if k.split(' ')[0] in dict(OW_KINDS))} "
        f"({cfg.ow_writers} writers), procs moved with their hosts: {writers.moved_procs}, flips: "
        f"{counts['flips']}, frames reopened: {counts['reopen frames']}, outside procs completed by the agent: "
        f"{counts['agent completions']}"
        + "".join(f", {k} {n}" for k, n in sorted(counts.items()) if k.startswith("agent retries"))
    )
    missing = ow_missing(counts)
    if missing:
        report.failed.append(f"outside writes never done under load: {', '.join(missing)}")
    report.failed.extend(writers.failures)
    return report
