"""Phase `stall` (issue 27, row 7): one show's lock held by a stuck session while the farm books.

Two sessions that are not the scheduler, opened as psql would open them, each left idle inside
its transaction: one has written a proc of an unmanaged show (it holds that show's
database-accounting lock and its counter rows), the other has locked a managed show's row
`FOR UPDATE` (a booking of that show cannot take its foreign-key lock on it). Before, the
booking transaction waited for them, and so did every show of the farm. The phase measures
the other shows' booking rate for a window before the hold and for a window during it, and
fails when the ratio falls under `stall_min_ratio`, when a held show still books, or when the
loop's live view does not name the holding session; the watchdog and the audit run as for
every phase.
"""

from __future__ import annotations

import time
import uuid

import psycopg

from accounting import db
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, int_launcher, run_inprocess
from dispatch.lab.stress.report import PhaseReport

HOLDER = "stress-stall-holder"

# Frames of these shows whose last start falls in [start, end) (unix times): the bookings made then.
STARTED_SQL = """
SELECT count(*) FROM frame f JOIN job j ON j.pk_job = f.pk_job
WHERE j.pk_show = ANY(%s) AND f.ts_started >= to_timestamp(%s) AND f.ts_started < to_timestamp(%s)
"""
WAITING_FRAME_SQL = """
SELECT f.pk_frame, f.pk_layer, f.pk_job FROM frame f JOIN job j ON j.pk_job = f.pk_job
JOIN job_resource jr ON jr.pk_job = j.pk_job
WHERE j.pk_show = %s AND f.str_state = 'WAITING' AND (jr.int_max_cores < 0 OR jr.int_cores + 100 <= jr.int_max_cores)
ORDER BY random() LIMIT 1
"""
ROOMY_HOST_SQL = """
SELECT h.pk_host FROM host h JOIN subscription s ON s.pk_alloc = h.pk_alloc AND s.pk_show = %s
WHERE h.pk_host = ANY(%s) AND s.int_cores + 100 <= s.int_burst ORDER BY random() LIMIT 1
"""
HOLD_INSERT_SQL = """
INSERT INTO proc (pk_proc, pk_host, pk_show, pk_job, pk_layer, pk_frame, int_cores_reserved, int_mem_reserved)
VALUES (%s, %s, %s, %s, %s, %s, 100, 1)
"""


def _count(conn: psycopg.Connection, shows: list[str], start: float, end: float) -> int:
    row = conn.execute(STARTED_SQL, (shows, start, end)).fetchone()
    return int(row[0]) if row else 0


def _rate(conn: psycopg.Connection, shows: list[str], start: float, end: float) -> float:
    return _count(conn, shows, start, end) / max(end - start, 1e-6)


def _hold_insert(holder: psycopg.Connection, conn: psycopg.Connection, hosts: list[str], show: str) -> bool:
    """BEGIN; INSERT INTO proc ... for `show`, left open: retried on another frame and host while
    the caps refuse it (the load keeps them full)."""
    for _ in range(400):
        frame = conn.execute(WAITING_FRAME_SQL, (show,)).fetchone()
        roomy = conn.execute(ROOMY_HOST_SQL, (show, hosts)).fetchone()
        if frame is None or roomy is None:
            time.sleep(0.02)
            continue
        host = roomy[0]
        holder.execute("BEGIN")
        try:
            holder.execute(HOLD_INSERT_SQL, (str(uuid.uuid4()), host, show, frame[2], frame[1], frame[0]))
            return True
        except psycopg.errors.CheckViolation:
            holder.execute("ROLLBACK")
            time.sleep(0.02)
    return False


def phase_stall(cfg: StressConfig) -> PhaseReport:
    """Issue 27 row 7: other shows keep booking while one unmanaged and one managed show are held."""
    figures: dict[str, float] = {}
    named: dict[str, bool] = {}

    def perturb(run: Run) -> None:
        if not run.under_load(20):
            return
        seed = run.seed
        managed, unmanaged = list(seed.managed_show_ids), [s for s in seed.show_ids if s not in seed.managed_show_ids]
        held_managed, held_unmanaged = managed[0], unmanaged[0]
        others = [s for s in seed.show_ids if s not in (held_managed, held_unmanaged)]
        window = cfg.stall_window
        with db.connect(autocommit=True, application_name="cuesched-stress") as conn:
            before_start = time.time()
            run.stop_loop.wait(window)
            before_end = time.time()
            holders = [psycopg.connect(db.conninfo(), autocommit=True, application_name=HOLDER) for _ in range(2)]
            try:
                if not _hold_insert(holders[0], conn, list(seed.host_ids), held_unmanaged):
                    run.report.failed.append("no proc of the unmanaged show could be inserted (its caps were full)")
                    return
                holders[1].execute("BEGIN")
                holders[1].execute("SELECT 1 FROM show WHERE pk_show = %s FOR UPDATE", (held_managed,))
                held_at = time.time()
                run.stop_loop.wait(window)
                held_end = time.time()
                locked = run.loop.live_view().get("locked_shows") or {}
                for show in (held_managed, held_unmanaged):
                    blockers = locked.get(show, {}).get("blockers", [])
                    named[show] = any(b.get("application_name") == HOLDER for b in blockers)
                # A batch already past its locks when the hold began may still commit: from 0.5 s on, none.
                figures["held_booked"] = _count(conn, [held_managed, held_unmanaged], held_at + 0.5, held_end)
            finally:
                for h in holders:
                    h.execute("ROLLBACK")
                    h.close()
            released = time.time()
            figures["before"] = _rate(conn, others, before_start, before_end)
            figures["during"] = _rate(conn, others, held_at, held_end)
            # Booking resumes for the held shows once the sessions are gone (after the loop's back-off).
            if run.wait_for(
                "the held shows to book again",
                lambda: _count(conn, [held_managed, held_unmanaged], released, time.time() + 1) > 0
                or not run.loop_alive(),
                30,
            ):
                figures["resumed"] = time.time() - released

    report = run_inprocess(
        cfg,
        "stall",
        cfg.integrity_spec("stall", shows=4, managed_shows=2, frames_per_layer=cfg.stall_frames_per_layer),
        launcher=int_launcher(cfg),
        perturb=perturb,
    )
    if "during" not in figures:
        report.failed.append("the hold never ran")
        return report
    before, during = figures["before"], figures["during"]
    ratio = during / before if before > 0 else 0.0
    report.notes.append(
        f"other shows' booking rate: {before:.1f}/s before the hold, {during:.1f}/s while one unmanaged and one "
        f"managed show were held ({ratio:.2f} of before; fails under {cfg.stall_min_ratio:.2f})"
    )
    if "resumed" in figures:
        report.notes.append(f"held shows booked again {figures['resumed']:.2f}s after the sessions ended")
    if before <= 0:
        report.failed.append("nothing booked before the hold: the window measured nothing")
    elif ratio < cfg.stall_min_ratio:
        report.failed.append(f"other shows booked at {ratio:.2f} of their rate while one show was held")
    if figures.get("held_booked", 0) > 0:
        report.failed.append(f"a held show booked {figures['held_booked']:.0f} frames while its lock was held")
    for show, ok in named.items():
        if not ok:
            report.failed.append(f"the loop's live view did not name the session holding show {show}")
    return report
