"""Phase `outside_managed` (issue 27, row 1): raw bookings of a managed show while the loop books it at its burst.

On a plain database a connection without the writer mark could INSERT a proc of a managed
show: the Store was sent the cores, no cap checked them (433 of 4,260 watchdog samples over the
burst, with 1-core inserts and deletes while the loop booked at the burst). Here writers that
connect as `psql` does (no writer claim) keep trying, under that load: a 1-core INSERT of a
waiting frame of the managed show, an UPDATE growing one of its running procs by a core, or a
1-core INSERT followed by its DELETE in one transaction. Every one must be refused by the
database (`acct_managed_show_booked_outside`); one that commits is a failure (it is released
again after the writers stop, as the reproduction's deletes did), and the watchdog, sampling
SUM(proc) against every cap throughout, counts what it took over a cap. The writers touch no
proc the scheduler booked, so the audit's Store-equals-SUM(proc) is the scheduler's own.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import psycopg

from accounting import db
from accounting.triggers import MANAGED_BOOKED_OUTSIDE
from dispatch.engine.completion import Completion, complete
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, int_launcher, run_inprocess
from dispatch.lab.stress.outside_writers import (
    OW_HOST_WITH_ROOM_SQL,
    OW_INSERT_PROC_SQL,
    OW_PROC_SQL,
    OW_START_FRAME_SQL,
    OW_TAKE_HOST_SQL,
    OW_WAITING_FRAME_SQL,
)
from dispatch.lab.stress.report import PhaseReport

OM_KINDS = ("insert", "grow", "insert_delete")
# The least headroom of any subscription of the managed show: SUM(proc) on it against its burst.
BURST_HEADROOM_SQL = """
SELECT MIN(s.int_burst - COALESCE(u.cc, 0)) FROM subscription s
LEFT JOIN (SELECT p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved) AS cc FROM proc p
           JOIN host h ON h.pk_host = p.pk_host WHERE NOT p.b_local GROUP BY 1, 2) u
       ON u.pk_show = s.pk_show AND u.pk_alloc = s.pk_alloc
WHERE s.pk_show = ANY(%s)
"""
AT_BURST_CENTICORES = 400  # less headroom than the farm's largest frame (4 cores): at the burst


class _Nothing(Exception):
    """No waiting frame, host with room or running proc for this write (counted as skipped)."""


@dataclass
class _RawBookers:
    run: Run
    cfg: StressConfig
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)  # procs a write got in: released by the writer
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _insert(self, c: psycopg.Connection) -> str:
        seed = self.run.seed
        row = c.execute(OW_WAITING_FRAME_SQL, (list(seed.job_ids),)).fetchone()
        if row is None:
            raise _Nothing("no waiting frame")
        frame, layer, job, show, _cores, mem = row
        host = c.execute(OW_HOST_WITH_ROOM_SQL, (list(seed.host_ids), 100, mem)).fetchone()
        if host is None:
            raise _Nothing("no host with room")
        if not c.execute(OW_START_FRAME_SQL, (frame,)).rowcount:
            raise _Nothing("frame taken")
        pk_proc = str(uuid.uuid4())
        c.execute(OW_INSERT_PROC_SQL, (pk_proc, host[0], show, layer, job, frame, 100, mem))
        c.execute(OW_TAKE_HOST_SQL, {"c": 100, "m": mem, "host": host[0]})
        return pk_proc

    def write(self, conn: psycopg.Connection, kind: str) -> str:
        with conn.transaction():
            if kind == "grow":
                row = conn.execute(OW_PROC_SQL, (list(self.run.seed.show_ids),)).fetchone()
                if row is None:
                    raise _Nothing("no running proc")
                if not conn.execute(
                    "UPDATE proc SET int_cores_reserved = int_cores_reserved + 100 WHERE pk_proc = %s", (row[0],)
                ).rowcount:
                    raise _Nothing("proc gone")
                with self._lock:
                    self.failures.append(f"an outside UPDATE grew managed proc {row[0]} by a core")
                raise _Nothing("grown: rolled back")  # never left grown: its host's idle cores were not taken
            pk_proc = self._insert(conn)
            if kind == "insert_delete":
                conn.execute("DELETE FROM proc WHERE pk_proc = %s", (pk_proc,))
        with self._lock:
            self.failures.append(f"an outside {kind} of managed proc {pk_proc} committed")
            self.accepted.append(pk_proc)
        return "committed"

    def writer(self, index: int, ops: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/outside_managed/{index}")
        name = f"cuesched-stress-raw-{index}"
        conn = db.connect(autocommit=True, application_name=name, claim_writer=False)
        try:
            for _ in range(ops):
                if not self.run.loop_alive():
                    break
                kind = rng.choice(OM_KINDS)
                try:
                    outcome = self.write(conn, kind)
                except _Nothing as nothing:
                    outcome = f"skipped ({nothing})"
                except psycopg.errors.CheckViolation as exc:
                    outcome = f"refused ({exc.diag.constraint_name})"
                    if exc.diag.constraint_name != MANAGED_BOOKED_OUTSIDE:
                        self.failures.append(
                            f"{kind}: refused by {exc.diag.constraint_name}, not the managed-show check"
                        )
                except (
                    psycopg.errors.UniqueViolation,
                    psycopg.errors.SerializationFailure,
                    psycopg.errors.DeadlockDetected,
                ) as exc:
                    outcome = f"lost a race ({type(exc).__name__})"
                except psycopg.OperationalError as exc:
                    outcome = f"connection lost ({type(exc).__name__})"
                    conn.close()
                    conn = db.connect(autocommit=True, application_name=name, claim_writer=False)
                except psycopg.Error as exc:
                    outcome = f"error {exc.sqlstate}"
                    self.failures.append(f"{kind}: unexpected {type(exc).__name__}: {exc}")
                self.count(f"{kind} {outcome}")
                self.run.stop_loop.wait(rng.uniform(0, 2 * self.cfg.ow_pause))
        finally:
            conn.close()

    def sample_bursts(self, stop: threading.Event) -> None:
        """How close the loop keeps the subscriptions to their burst while the writers try."""
        with db.connect(autocommit=True, application_name="cuesched-stress-burst") as conn:
            while not stop.wait(0.05):
                row = conn.execute(BURST_HEADROOM_SQL, (list(self.run.seed.show_ids),)).fetchone()
                with self._lock:
                    self.counts["burst samples"] += 1
                    if row and row[0] is not None and row[0] < AT_BURST_CENTICORES:
                        self.counts["burst samples at the burst"] += 1

    def release_accepted(self) -> None:
        """What got in (a failure already) is released, as the reproduction's deletes did."""
        if not self.accepted:
            return
        with db.connect(autocommit=True, application_name="cuesched-stress-agent") as conn:
            complete(conn, [Completion(pk, 0) for pk in self.accepted])


def phase_outside_managed(cfg: StressConfig) -> PhaseReport:
    """Row 1 under booking load: a managed show's burst binds while raw writers try to book it."""
    # A small burst, no folder cap and job caps as large: the subscription bursts are what binds,
    # as in the report (a burst of 20).
    spec = cfg.integrity_spec(
        "outside_managed",
        shows=1,
        managed_shows=1,
        sub_burst=cfg.om_burst * 100,
        folder_max_cores=-1,
        job_max_cores=cfg.om_burst * 100,
    )
    box: dict[str, _RawBookers] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(20):
            return
        bookers = box["b"] = _RawBookers(run, cfg)
        per_writer = -(-cfg.om_ops // max(cfg.om_writers, 1))
        threads = [
            threading.Thread(target=bookers.writer, args=(i, per_writer), name=f"stress-raw-{i}", daemon=True)
            for i in range(cfg.om_writers)
        ]
        stop_sampler = threading.Event()
        sampler = threading.Thread(target=bookers.sample_bursts, args=(stop_sampler,), daemon=True)
        started = time.monotonic()
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg.phase_timeout)
        bookers.counts["seconds"] = round(time.monotonic() - started)
        stop_sampler.set()
        sampler.join(10)
        bookers.release_accepted()

    report = run_inprocess(cfg, "outside_managed", spec, launcher=int_launcher(cfg), perturb=perturb)
    bookers = box.get("b")
    if bookers is None:
        report.failed.append("the raw writers never ran")
        return report
    counts = bookers.counts
    for kind in OM_KINDS:
        mine = {k.split(" ", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith(kind + " ")}
        report.notes.append(f"raw {kind}: " + (", ".join(f"{k} {n}" for k, n in mine.items()) or "none"))
    refused = sum(n for k, n in counts.items() if k.endswith(f"refused ({MANAGED_BOOKED_OUTSIDE})"))
    report.notes.append(
        f"raw writes of the managed show refused by the database: {refused} in {counts['seconds']} s "
        f"({cfg.om_writers} writers), committed: {len(bookers.accepted)}"
    )
    report.notes.append(
        f"samples with a subscription less than {AT_BURST_CENTICORES // 100} cores under its burst while they "
        f"wrote: {counts['burst samples at the burst']} of {counts['burst samples']}"
    )
    if not refused:
        report.failed.append("no raw booking of the managed show was tried under load")
    if not counts["burst samples at the burst"]:
        report.failed.append("the loop never booked a subscription up to its burst while the writers tried")
    report.failed.extend(bookers.failures)
    return report
