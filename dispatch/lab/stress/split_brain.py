"""Phase `split_brain` (issue 16): a standby takes over after the first scheduler's lock session dies."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from accounting import db, singleton
from accounting.scheduler import SchedulerOptions, SchedulerProcess
from accounting.service import AccountingService
from dispatch.engine.completion import kill_frames
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.stress.audit import audit, store_counters
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import QUIET_LOOPS, WAITING_SQL, env, fresh_farm, teardown, watchdog_notes
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.watchdog import CapWatchdog

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking


class _RecordingLauncher(SimulatedLauncher):
    """The simulated launcher, recording each booking it is handed (its batch has committed)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.booked: list[tuple[str, str, float, float]] = []  # (pk_proc, pk_frame, decided, launched), unix

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        now = time.time()
        self.booked.extend((b.pk_proc, b.frame.pk, b.decided_at or now, now) for b in bookings)
        return super().launch(bookings)


class _InprocScheduler:
    """A real SchedulerProcess (lock, lease, service, publisher) with one dispatch loop, in a thread.

    The same process `run_scheduler` runs (`SchedulerProcess.run(main)`), with a main that is
    `dispatch_main`'s single-worker case on a recording launcher, so the phase knows which
    scheduler booked what and when it decided it.
    """

    def __init__(self, cfg: StressConfig, name: str, *, standby: bool, lock_check_interval: float, offset: int) -> None:
        self.name = name
        self.launcher = _RecordingLauncher(
            runtime_min=cfg.int_runtime_min,
            runtime_max=cfg.int_runtime_max,
            failure_rate=0.0,
            launch_failure_rate=0.0,
            seed=cfg.seed + offset,
        )
        self.process = SchedulerProcess(
            SchedulerOptions(bootstrap_timeout=30, standby=standby, lock_check_interval=lock_check_interval)
        )
        self.loop: DispatchLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"stress-{name}", daemon=True)

    def _main(self, service: AccountingService, stop: threading.Event) -> None:
        loop = self.loop = DispatchLoop(service, self.launcher)
        service.view_providers["dispatch"] = loop.live_view
        try:
            loop.run(stop)
        finally:
            loop.close()
            self.launcher.close()

    def _run(self) -> None:
        try:
            self.process.run(self._main)
        except BaseException as exc:  # reported by the phase
            self.error = exc

    def start(self) -> _InprocScheduler:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.process.stop.set()
        self.thread.join(timeout)

    def decided(self) -> list[float]:
        return [d for _p, _f, d, _l in self.launcher.booked]

    def launched(self) -> list[float]:
        return [launched for _p, _f, _d, launched in self.launcher.booked]


LEASE_ROW_SQL = (
    "SELECT int_generation, EXTRACT(EPOCH FROM ts_acquired)::float8 FROM cuesched_scheduler_lease WHERE id = 1"
)


def phase_split_brain(cfg: StressConfig) -> PhaseReport:
    """Issue 16: a standby takes over after the first scheduler's lock session is killed.

    Both are real SchedulerProcess objects in this process, each with its own Store, listener
    and dispatch loop. The first's lock check is made longer than the phase, so only the lease
    (checked by every booking transaction) can stop it: the lock session dies, the standby takes
    the lock and the lease (which waits for the first's in-flight batch), bootstraps and books;
    the first's next batch must find the lease gone and stop. Its frames, left running on its
    launcher, are released the completion way (as their agents would report them) and the
    second books them again.
    """
    spec = cfg.integrity_spec("split_brain")
    report = PhaseReport(name="split_brain", frames=cfg.frames(spec))
    seed = fresh_farm(spec)
    jobs = list(seed.job_ids)
    started = time.perf_counter()
    with env(**QUIET_LOOPS, CUESCHED_STANDBY_POLL_INTERVAL=str(cfg.sb_poll)):
        watchdog = CapWatchdog(list(seed.show_ids), interval=cfg.watch_interval).start()
        conn = db.connect(autocommit=True, application_name="cuesched-stress")
        first = _InprocScheduler(cfg, "first", standby=False, lock_check_interval=cfg.phase_timeout * 10, offset=0)
        second = _InprocScheduler(cfg, "second", standby=True, lock_check_interval=5.0, offset=1)
        deadline = time.monotonic() + cfg.phase_timeout

        def count(sql: str) -> int:
            row = conn.execute(sql, (jobs,)).fetchone()
            return int(row[0]) if row else 0

        def wait(what: str, predicate: Callable[[], bool], timeout: float) -> bool:
            until = min(deadline, time.monotonic() + timeout)
            while time.monotonic() < until:
                if predicate():
                    return True
                time.sleep(0.01)
            report.failed.append(f"timed out waiting for {what}")
            return False

        moments: dict[str, Any] = {}

        def scenario() -> None:
            first.start()
            if not wait("the first scheduler to be ready", first.process.ready.is_set, 30):
                return
            procs_sql = "SELECT count(*) FROM proc WHERE pk_job = ANY(%s)"
            wait("20 procs booked by the first scheduler", lambda: count(procs_sql) >= 20, 60)
            second.start()
            # The standby is retrying (the case): its first attempts fail, and its poll,
            # not the kill, decides when it takes over, so the first scheduler books on for up
            # to a poll interval without its lock. Only the lease can stop it then.
            time.sleep(1.5 * cfg.sb_poll)
            if second.process.ready.is_set():
                report.failed.append("the standby took over while the first scheduler held the lock")
                return
            holder = conn.execute(singleton.HOLDER_SQL, {"key": singleton.SCHEDULER_LOCK_KEY}).fetchone()
            if holder is None or holder[1] != "cuesched-scheduler-lock":
                report.failed.append(f"no scheduler lock session to kill ({holder})")
                return
            conn.execute("SELECT pg_terminate_backend(%s)", (holder[0],))
            moments["killed"] = time.time()
            if not wait("the standby to take over", second.process.ready.is_set, 30):
                return
            moments["lease"] = conn.execute(LEASE_ROW_SQL).fetchone()
            if not wait("the first scheduler to stop on its lost lease", lambda: not first.thread.is_alive(), 30):
                first.stop()
            # The first's frames still run on its (dead) launcher: release them as their agents would.
            mine = {p for p, _f, _d, _l in first.launcher.booked}
            orphans = [
                f
                for pk, f in conn.execute("SELECT pk_proc, pk_frame FROM proc WHERE pk_job = ANY(%s)", (jobs,))
                if pk in mine
            ]
            released = kill_frames(conn, orphans).released
            report.notes.append(f"the first scheduler's frames left running, released the completion way: {released}")
            wait(
                "the second scheduler to run every frame",
                lambda: count(WAITING_SQL) == 0 and count(procs_sql) == 0,
                cfg.phase_timeout,
            )
            service = second.process.service
            report.failed.extend(audit(seed, lambda: store_counters(service, seed)))

        try:
            scenario()
        finally:
            second.stop()
            first.stop()
            watchdog.stop()
            conn.close()
    report.wall = time.perf_counter() - started
    for sched in (first, second):
        if sched.error is not None:
            report.failed.append(f"the {sched.name} scheduler raised {type(sched.error).__name__}: {sched.error}")
    rejected: Counter[str] = Counter()
    for sched in (first, second):
        if sched.loop is not None:
            rejected.update(sched.loop.totals.rejected)
    report.rejected = dict(rejected)
    a_decided, b_decided = first.decided(), second.decided()
    report.booked = len(a_decided) + len(b_decided)
    everything = a_decided + b_decided
    if everything:
        report.window = max(first.launched() + second.launched()) - min(everything)
    if not first.process.service.lease_lost.is_set():
        report.failed.append("the first scheduler never found its lease gone")
    if not a_decided or not b_decided:
        report.failed.append(f"each scheduler must book: first {len(a_decided)}, second {len(b_decided)}")
    elif "lease" in moments and moments["lease"] is not None and second.process.lease_taken_at is not None:
        killed_at, lease_row = moments["killed"], moments["lease"]
        lease_taken = second.process.lease_taken_at
        a_last_decided, a_last_commit = max(a_decided), max(first.launched())
        b_first = min(b_decided)
        generation, ts_acquired = lease_row
        report.notes.append(
            f"lock session killed -> standby's lease (generation {generation}) committed: "
            f"{lease_taken - killed_at:.3f}s; -> its first booking decided: {b_first - killed_at:.3f}s"
        )
        report.notes.append(
            f"lost lock session -> the first scheduler's last booking committed: {a_last_commit - killed_at:+.3f}s "
            "(it held the lease until the takeover)"
        )
        report.notes.append(
            f"lost lease -> the first scheduler's last booking: committed {a_last_commit - lease_taken:+.3f}s, "
            f"decided {a_last_decided - ts_acquired:+.3f}s after the lease's ts_acquired (<= 0 or tiny: the fence)"
        )
        loop = first.loop
        report.notes.append(
            f"bookings: first {len(a_decided)}, second {len(b_decided)}; first's loop database errors "
            f"(the fence's LeaseLostError among them): {loop.totals.db_errors if loop else 0}"
        )
        # One booker at a time: every decision of the first precedes the lease it lost (the
        # takeover waits for the batch those decisions went into) and the second's first one.
        if a_last_decided >= lease_taken or a_last_decided >= b_first:
            report.failed.append(
                f"two schedulers booked at once: the first decided a booking {a_last_decided - lease_taken:+.3f}s "
                f"after the second took the lease, {a_last_decided - b_first:+.3f}s after the second's first booking"
            )
    report.breaches = len(watchdog.breaches)
    report.breach_keys = sorted(f"{v} {k}" for v, k in watchdog.breach_keys())
    report.samples = watchdog.samples
    watchdog_notes(watchdog, report)
    teardown(spec, report)
    return report
