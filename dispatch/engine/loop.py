"""The dispatch loop `run_scheduler` runs in a thread: completions in, bookings out.

One cycle (`run_once`), all on this loop's own autocommit connection, in this order:
1. settle what a database failure left open: batches whose COMMIT outcome is unknown
   (looked up by proc id), compensations that did not commit;
2. write the completions the launcher reports (the release path), which also gives the
   host view its resources back;
3. every `lost_host_sweep_interval`, release the procs of hosts whose ping is too old;
4. every `host_refresh_interval`, reload the host view, and in between, every
   `host_changes_interval`, re-read the hosts changed lately (freed by their agents);
5. dispatch: read pending work (`feed`), place each frame (`placement`), book it in the
   Store (`service.apply_booking`: the managed decision, once), and every `batch_size`
   bookings write them in one transaction (`dispatcher.write_batch`), launch what
   committed, confirm it; a failed launch is compensated, then rolled back.

Back-off: a cluster (facility, show, layer tags) whose frames found no host sleeps for
`cluster_saturated_sleep`, or until a completion of ours frees resources or the host view
reloads; its layers are left out of the next queries. Work a Store cap blocks is not slept
on: the Store is asked again every cycle (its releases arrive from the listener thread), and
the query leaves out jobs at their cap and shows at burst on every subscription. A cycle
that did nothing makes `run` wait until the next simulated completion is due, at most
`idle_sleep`.

Every booking the Store applied is settled exactly once: rejected by a guard -> rollback;
written and launched -> confirm; written, launch failed -> compensating transaction, then
rollback; the transaction failed before COMMIT -> rollback; COMMIT outcome unknown -> kept
in flight until PostgreSQL says what became of the transaction (`pg_xact_status` of the id
recorded before COMMIT): aborted -> rollback; committed -> launched where the proc still
exists, confirmed where it is gone (whoever deleted it sent the release); unknowable (the xid
is too old, or the server is another one) -> treated as committed, so the counter reads high
until the recompute rather than low. A compensation whose COMMIT is unknown is settled the
same way.

The loop books a managed show only while the service can enforce (`can_enforce`: a fresh
listener heartbeat, the scheduler lease held); a scheduler whose booking transaction finds
the lease gone stops booking at once. The Store refuses a folder or job whose caps it does not
hold, so the loop loads the missing ones (`fill_caps`) before it books.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from accounting import blockers as acct_blockers
from accounting import db as acct_db
from accounting.service import PAUSED, AccountingService, NotManaged
from accounting.store import (
    FOLDER_UNSEEDED,
    JOB_UNSEEDED,
    LICENCE,
    LICENCE_UNSEEDED,
    UNKNOWN_GENERATION,
    Applied,
    BookingDelta,
    LimitExceeded,
    Store,
)
from cuesched_project import conf as project_conf
from dispatch import conf
from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.booking import (
    CAP_REFUSALS,
    REJECT_GENERATION,
    REJECT_LOCKED,
    REJECT_MANAGED_FLIP,
    AmbiguousCommitError,
    AmbiguousCompensationError,
    BatchResult,
    Booking,
    CompensationResult,
    LeaseLostError,
    commit_status,
    compensate,
    find_written,
    write_batch,
)
from dispatch.engine.completion import (
    EXIT_STATUS_DOWN_HOST,
    SHOWS_OF_PROCS_SQL,
    Completion,
    CompletionResult,
    complete,
    ping_procs,
    release_lost_hosts,
)
from dispatch.engine.feed import FreeHosts, JobWork, LiveUsage, Skips, fetch_pending, has_waiting_or_running
from dispatch.engine.kills import KillSender
from dispatch.engine.launcher import Launcher, get_launcher
from dispatch.engine.placement import ALL, CENTI, Demand, HostRec, HostView, Shard

logger = logging.getLogger(__name__)

SUBSCRIPTIONS_SQL = "SELECT pk_show, pk_alloc, int_burst, int_cores FROM subscription"
SIZES_SQL = "SELECT pk_show, pk_alloc, int_size FROM subscription WHERE int_size > 0"

_UNLIMITED_ROOM = 1 << 40
_JOB_FOLDER_MAX = 100_000
_MIN_FEED_FRAMES = 64
# Bookings the batch writer refused: they were placed (so they count as what a cycle could book).
_WRITE_REJECTIONS = ("frame", "proc", "host", "managed_flip", "keys", "generation", "database", REJECT_LOCKED)
_LOCKED_SHOWN = 60.0  # seconds the live view keeps naming a show's blocker after its last skip
SYSTEM_ID_SQL = "SELECT (SELECT system_identifier::text FROM pg_control_system())"
_ALLOC_ATTEMPTS = 3  # a subscription rejection retries the frame on another allocation
_NO_HOST = "no_host"
_SKIP_LAYER = "skip_layer"
_WHY_MAX = 5000

# LimitExceeded.table -> (reason, what is capped, the unit, what would unblock it).
_CAP_WHY = {
    "subscription": (
        "subscription_burst",
        "subscription at burst",
        "cores",
        "raise the subscription burst, or wait for frames to finish",
    ),
    "folder": (
        "folder_max_cores",
        "folder at max cores",
        "cores",
        "raise the folder's max cores, or wait for its frames to finish",
    ),
    "job": (
        "job_max_cores",
        "job at max cores",
        "cores",
        "raise the job's max cores, or wait for its frames to finish",
    ),
    "folder_gpus": ("folder_max_gpus", "folder at max GPUs", "GPUs", "raise the folder's max GPUs"),
    "job_gpus": ("job_max_gpus", "job at max GPUs", "GPUs", "raise the job's max GPUs"),
    PAUSED: (
        PAUSED,
        "accounting paused",
        "ms",
        "wait: the scheduler books managed shows again once its listener is fresh and it holds the lease "
        "(every show, once cuesched's triggers all fire again: store_status names the fix)",
    ),
    FOLDER_UNSEEDED: ("caps_loading", "folder caps not loaded yet", "cores", "wait one cycle"),
    JOB_UNSEEDED: ("caps_loading", "job caps not loaded yet", "cores", "wait one cycle"),
    LICENCE: (
        "limit_full",
        "licence limit full",
        "licences",
        "raise the limit's max value, or wait for frames holding it to finish",
    ),
    LICENCE_UNSEEDED: ("caps_loading", "licence limit not loaded yet", "licences", "wait one cycle"),
    REJECT_GENERATION: (
        "accounting_behind",
        "a cap or key change the scheduler has not applied yet",
        "generation",
        "wait: the show books again as soon as the scheduler's listener (or a reseed) applied it",
    ),
}


class ServerChangedError(RuntimeError):
    """The dispatch connection reached another server than the one the Store was seeded against."""


@dataclass
class Unresolved:
    """A batch whose COMMIT outcome is unknown, with what it had written before COMMIT."""

    bookings: list[Booking]
    result: BatchResult
    xid: int | None
    server_id: str | None


@dataclass
class PendingCompensation:
    bookings: list[Booking]
    attempt: CompensationResult | None  # the attempt whose COMMIT outcome is unknown, if any
    server_id: str | None = None


Cluster = tuple[str, str, frozenset[str]]  # (facility, show, layer tags)


@dataclass
class CycleStats:
    """What one cycle (or, summed, a whole run) did."""

    booked: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    launch_failures: int = 0
    compensated: int = 0
    completed: int = 0
    lost_released: int = 0
    jobs_finished: int = 0
    frames_considered: int = 0
    batches: int = 0
    no_host: int = 0
    # Frames that asked no GPU and found no host because GPU hosts declined them (gpu_hosts).
    gpu_declined: int = 0
    skipped_flip: int = 0
    # Managed jobs left alone because the Store is behind their show's accounting generation.
    skipped_behind: int = 0
    db_errors: int = 0
    # Wall seconds by phase (feed, write, complete; the rest of a cycle is placement and Store).
    seconds: Counter[str] = field(default_factory=Counter)

    @property
    def did_work(self) -> bool:
        return bool(self.booked or self.completed or self.compensated or self.lost_released)

    def add(self, other: CycleStats) -> None:
        for name in (
            "booked",
            "launch_failures",
            "compensated",
            "completed",
            "lost_released",
            "jobs_finished",
            "frames_considered",
            "batches",
            "no_host",
            "gpu_declined",
            "skipped_flip",
            "skipped_behind",
            "db_errors",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected.update(other.rejected)
        self.seconds.update(other.seconds)


class DispatchLoop:
    """Books WAITING frames onto hosts for every dispatched show, and releases completed ones."""

    def __init__(
        self,
        service: AccountingService,
        launcher: Launcher,
        *,
        managed_only: bool | None = None,
        batch_size: int | None = None,
        max_jobs: int | None = None,
        frames_per_layer: int | None = None,
        host_refresh_interval: float | None = None,
        lost_host_timeout: float | None = None,
        lost_host_sweep_interval: float | None = None,
        saturated_sleep: float | None = None,
        idle_sleep: float | None = None,
        connect: Callable[[], psycopg.Connection] | None = None,
        shard: Shard = ALL,
    ) -> None:
        self.service = service
        self.shard = shard
        self.store = service.store
        self.launcher = launcher
        self.managed_only = conf.dispatch_managed_only() if managed_only is None else managed_only
        mode = getattr(service, "cuebot", None)
        self.cuebot_mode = mode is not None and mode.enabled
        # Cuebot's orphan cleanup unbooks a proc whose ts_ping is 300 s old (see ping_procs).
        self.proc_ping_interval = conf.cuebot_proc_ping_interval()
        self._procs_pinged_at = float("-inf")
        if self.cuebot_mode:
            # Beside Cuebot, unmanaged shows are Cuebot's: our triggers leave their counters and
            # caps to Cuebot's Java code, so a booking of ours there would be counted nowhere.
            self.managed_only = True
        self.batch_size = batch_size or conf.batch_size()
        self.max_jobs = max_jobs or conf.feed_max_jobs()
        self.frames_per_layer = frames_per_layer or conf.feed_frames_per_layer()
        self.max_frames = conf.feed_max_frames()
        self._feed_frames = self.max_frames  # adapted each cycle, see _dispatch
        self.completion_batch = conf.completion_batch_size()
        self.host_refresh_interval = (
            conf.host_refresh_interval() if host_refresh_interval is None else host_refresh_interval
        )
        self.lost_host_timeout = conf.lost_host_timeout() if lost_host_timeout is None else lost_host_timeout
        self.lost_host_sweep_interval = (
            conf.lost_host_sweep_interval() if lost_host_sweep_interval is None else lost_host_sweep_interval
        )
        self.saturated_sleep = conf.cluster_saturated_sleep() if saturated_sleep is None else saturated_sleep
        self.idle_sleep = conf.idle_sleep() if idle_sleep is None else idle_sleep
        self.cap_retry = min(conf.cap_retry(), self.saturated_sleep)
        self.mem_used_start = conf.proc_mem_used_start()
        self.fair_share = conf.fair_share()
        self._last_managed_jobs: list[str] = []
        self._connect = connect or (lambda: acct_db.connect(autocommit=True, application_name="cuesched-dispatch"))
        self._conn: psycopg.Connection | None = None
        self.view = HostView(
            conf.host_fit_policy(),
            stale_after=self.lost_host_timeout,
            shard=shard,
            candidates=conf.placement_candidates(),
            gpu_backfill=conf.gpu_backfill(),
        )
        self._hosts_loaded_at = float("-inf")
        self._host_changes_at = float("-inf")
        self.host_changes_interval = conf.host_changes_interval()
        self._lost_swept_at = float("-inf")
        self._subs: dict[str, list[tuple[str, int, int]]] = {}  # show -> [(alloc, burst, cores)] centicores
        self._sizes: dict[tuple[str, str], int] = {}  # (show, alloc) -> subscription size, whole cores
        self._share: dict[tuple[str, str], int] = {}  # this cycle: how far below its size, whole cores
        # Back-off and cap state.
        self._sleeping: dict[Cluster, float] = {}
        self._cluster_layers: dict[Cluster, set[str]] = {}
        self._blocked_jobs: dict[str, tuple[int, float]] = {}  # managed job -> (least whole cores, since)
        # Managed shows whose bookings met a newer accounting generation in the database, with the
        # one the Store had then: skipped until the Store's moves (the listener or a reseed applied
        # the change), so a show the Store is behind on costs no transaction per cycle.
        self._behind: dict[str, tuple[int, float]] = {}
        # Shows skipped because another session held their lock: show -> what the live view shows
        # (skips, first and last skip, back-off end, the blocking sessions). Not booked before `until`.
        self._locked_shows: dict[str, dict[str, Any]] = {}
        self.locked_show_backoff = project_conf.locked_show_backoff()
        self.booking_lock_wait = project_conf.booking_lock_wait()
        self._blocked_folders: dict[str, float] = {}  # managed folder -> since
        self._job_folder: dict[str, str] = {}  # job -> folder, for the jobs the feed returned
        self._managed_seen: set[str] = set()
        # Why each job did not book at the last attempt, for the ops console (bounded).
        self.why: dict[str, dict[str, object]] = {}
        # Work a database failure left open.
        self._pending_completions: list[Completion] = []
        # Completions of a show another session holds the lock of, kept for the next cycle.
        self._held_completions: list[Completion] = []
        self._pending_compensations: list[PendingCompensation] = []
        self._unresolved: list[Unresolved] = []
        self._server_id: str | None = None
        self.totals = CycleStats()
        self.cycles = 0
        self._room_seen = 0
        # Booking window for the benchmarks: from the start of the first cycle that wrote a
        # booking (its feed query included) to the COMMIT of the last one, perf_counter seconds.
        self._cycle_started_at = 0.0
        self.first_booking_cycle_at: float | None = None
        self.last_commit_at: float | None = None

    # -- connection -----------------------------------------------------------------------
    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._drop_connection()
            conn = self._connect()
            try:
                row = conn.execute(SYSTEM_ID_SQL).fetchone()
                system_id = None if row is None else row[0]
            except psycopg.errors.InsufficientPrivilege:
                system_id = None
            if not self.service.accepts_server(system_id):
                conn.close()
                raise ServerChangedError(
                    f"dispatch reached server {system_id}, the Store was seeded against {self.service.server_id}: "
                    "waiting for the listener to reseed there"
                )
            self._conn = conn
            self._server_id = system_id
            self._hosts_loaded_at = float("-inf")
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def requeue_in_process_frames(self) -> int:
        """At stop: requeue the frames that ran inside this process (the lost-host way, no retry
        charged), so none stays RUNNING with its proc booked after the scheduler is gone.

        If the database cannot be reached the procs stay booked, which reads high, never low;
        the log says so."""
        procs = self.launcher.abandon()
        if not procs:
            return 0
        try:
            result = complete(self._connection(), [Completion(pk, EXIT_STATUS_DOWN_HOST, requeue=True) for pk in procs])
        except psycopg.Error:
            logger.exception(
                "dispatch: could not requeue %d in-process frame(s) at stop; their procs stay booked", len(procs)
            )
            return 0
        logger.warning("dispatch: scheduler stopping: %d in-process frame(s) requeued", result.released)
        return result.released

    def close(self) -> None:
        self._drop_connection()

    def __enter__(self) -> DispatchLoop:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def live_view(self) -> dict[str, object]:
        """What ops see of the loop in the published live view (called from the publisher thread)."""
        t = self.totals
        return {
            "cycles": self.cycles,
            "booked": t.booked,
            "completed": t.completed,
            "rejected": dict(t.rejected),
            "launch_failures": t.launch_failures,
            "compensated": t.compensated,
            "lost_released": t.lost_released,
            "jobs_finished": t.jobs_finished,
            "db_errors": t.db_errors,
            "launcher": self.launcher.name,
            "running": self.launcher.running(),
            "hosts_in_view": len(self.view.hosts),
            "sleeping_clusters": len(self._sleeping),
            "blocked_jobs": len(self._blocked_jobs),
            "managed_only": self.managed_only,
            "blocked": dict(self.why),
            "locked_shows": self._locked_view(),
        }

    def _locked_view(self) -> dict[str, dict[str, Any]]:
        now = time.time()
        return {
            show: dict(entry)
            for show, entry in list(self._locked_shows.items())
            if now - entry["last"] <= _LOCKED_SHOWN
        }

    def _note_locked(self, result: BatchResult) -> None:
        """Back off the shows the batch skipped for a held lock, and remember who held it."""
        for show in {b.layer.job.show for b, table in result.rejected if table == REJECT_LOCKED}:
            self._note_locked_show(show, result.blockers.get(show, []))

    def _note_locked_show(self, show: str, blockers: list[dict[str, Any]]) -> None:
        now = time.time()
        entry = self._locked_shows.get(show)
        if entry is None or now - entry["last"] > _LOCKED_SHOWN:
            entry = self._locked_shows[show] = {"skips": 0, "since": now}
        entry["skips"] += 1
        entry["last"] = now
        entry["until_monotonic"] = time.monotonic() + self.locked_show_backoff
        entry["blockers"] = blockers

    def _record_why(self, job: str, reason: str, message: str, unblock: str) -> None:
        """Remember the latest reason a job did not book (the ops console's 'why not booking')."""
        why = self.why
        why.pop(job, None)
        why[job] = {"reason": reason, "message": message, "unblock": unblock, "at": time.time()}
        if len(why) > _WHY_MAX:
            del why[next(iter(why))]  # the oldest entry

    def booking_window(self) -> float:
        """Seconds from the first booking cycle's start to the last booking COMMIT (0 if none)."""
        if self.first_booking_cycle_at is None or self.last_commit_at is None:
            return 0.0
        return self.last_commit_at - self.first_booking_cycle_at

    # -- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event, exit_when_idle: bool = False) -> CycleStats:
        """Cycle until `stop` is set (or, with exit_when_idle, until nothing is WAITING or RUNNING)."""
        backoff = 0.0
        backoff_max = conf.reconnect_backoff_max()
        try:
            while not stop.is_set():
                if self.service.lease_lost.is_set():
                    logger.error("dispatch: this scheduler lost its lease; booking stopped")
                    self._release_open_work()
                    return self.totals
                try:
                    stats = self.run_once()
                    backoff = 0.0
                except LeaseLostError:
                    continue  # logged where it was raised; the check above ends the loop
                except psycopg.Error as exc:
                    self.totals.db_errors += 1
                    backoff = min(backoff_max, max(0.2, backoff * 2))
                    logger.warning("dispatch: database error (%s); reconnecting in %.1fs", exc, backoff)
                    self._drop_connection()
                    self._hosts_loaded_at = float("-inf")
                    stop.wait(backoff)
                    continue
                except Exception:
                    self.totals.db_errors += 1
                    backoff = min(backoff_max, max(0.5, backoff * 2))
                    logger.exception("dispatch: cycle failed; retrying in %.1fs", backoff)
                    self._drop_connection()
                    stop.wait(backoff)
                    continue
                if stats.did_work or self._pending_completions:
                    continue
                if exit_when_idle and self._is_idle():
                    logger.info("dispatch: nothing WAITING or RUNNING; exiting")
                    return self.totals
                due = self.launcher.next_due()
                wait = self.idle_sleep if due is None else min(self.idle_sleep, max(due, 0.001))
                if self._blocked_folders or self._blocked_jobs:
                    # A release may be on its way to the Store: wake when the listener applies
                    # one (or at cap_retry), and ask the Store again about every blocked folder.
                    if self.service.wait_for_room(self._room_seen, min(wait, self.cap_retry)):
                        self._blocked_folders.clear()
                    continue
                stop.wait(wait)
        finally:
            self._drop_connection()
        return self.totals

    def _is_idle(self) -> bool:
        if self._unresolved or self._pending_compensations or self._pending_completions or self._held_completions:
            return False
        if self.launcher.running():
            return False
        try:
            return not has_waiting_or_running(self._connection(), managed_only=self.managed_only)
        except psycopg.Error:
            return False

    def run_once(self) -> CycleStats:
        """One cycle; raises the database error that interrupted it (after settling the Store)."""
        stats = CycleStats()
        self.cycles += 1
        # Before any Store check of this cycle: room that appears after it wakes the idle wait.
        self._room_seen = self.service.room_generation()
        self._cycle_started_at = time.perf_counter()
        try:
            if self._server_id and self.service.server_id and self._server_id != self.service.server_id:
                # The Store was re-seeded on another server while this connection stayed on the
                # old one (a switchover that left it up): never book there.
                self._drop_connection()
            conn = self._connection()
            self._settle_open_work(conn, stats)
            self._complete(conn, stats)
            now = time.monotonic()
            if now - self._lost_swept_at >= self.lost_host_sweep_interval:
                self.launcher.heartbeat(conn)
                self._sweep_lost_hosts(conn, stats)
                self._lost_swept_at = now
            if self.cuebot_mode and now - self._procs_pinged_at >= self.proc_ping_interval:
                ping_procs(conn, self.lost_host_timeout, self.proc_ping_interval, shard=self.shard)
                self._procs_pinged_at = now
            if now - self._hosts_loaded_at >= self.host_refresh_interval:
                self._reload(conn)
                self._host_changes_at = now
            elif now - self._host_changes_at >= self.host_changes_interval:
                # Overlapping windows: a change committed late with an older now() is not missed.
                window = max(2.0, 4 * self.host_changes_interval)
                if self.view.refresh_changed(conn, window):
                    self._sleeping.clear()  # clusters that found no host may find one now
                self._host_changes_at = now
            self._dispatch(conn, stats)
        finally:
            self.totals.add(stats)
        return stats

    # -- settling what a failure left open ------------------------------------------------
    def _release_open_work(self) -> None:
        """After the lease is lost: undo what this loop left half-done, so no proc is left counted
        for a frame nobody will run. Deletes need no lease; their releases reach the new owner."""
        bookings = [b for e in self._unresolved for b in e.bookings] + [
            b for e in self._pending_compensations for b in e.bookings
        ]
        self._unresolved, self._pending_compensations = [], []
        if not bookings:
            return
        try:
            result = compensate(self._connection(), bookings)
            logger.warning("dispatch: released %d procs left open at the lease loss", len(result.procs_deleted))
        except Exception as exc:
            logger.error("dispatch: could not release %d open bookings after the lease loss: %s", len(bookings), exc)

    def _status(self, conn: psycopg.Connection, xid: int | None, server_id: str | None) -> str | None:
        """pg_xact_status of a transaction of ours, None when this server cannot know it."""
        if server_id is not None and self._server_id is not None and server_id != self._server_id:
            return None  # written on another server: its xids mean nothing here
        return commit_status(conn, xid)

    def _settle_open_work(self, conn: psycopg.Connection, stats: CycleStats) -> None:
        for entry in list(self._unresolved):
            # Everything that can fail comes before the entry leaves the list: settled twice (a
            # failure half-way, retried next cycle), a booking would be taken out twice, LOW.
            status = self._status(conn, entry.xid, entry.server_id)
            if status == "in progress":
                continue
            found = set() if status == "aborted" else find_written(conn, entry.result.written)
            self._unresolved.remove(entry)
            if status == "aborted":
                for b in entry.bookings:
                    self.service.rollback_booking(b.result)
                logger.warning(
                    "dispatch: commit outcome resolved: aborted, %d bookings rolled back", len(entry.bookings)
                )
                continue
            # Committed, or unknowable (kept as committed: a counter may read high, never low).
            written = {id(b) for b in entry.result.written}
            for b in entry.bookings:
                if id(b) not in written:
                    self.service.rollback_booking(b.result)  # refused inside the transaction
            present = [b for b in entry.result.written if b.pk_proc in found]
            for b in entry.result.written:
                if b.pk_proc not in found:
                    # Committed and already released by whoever deleted it (its release reached,
                    # or will reach, the Store), or never committed: either way keep it, high.
                    self.service.confirm_booking(b.result, b.xid)
            logger.warning(
                "dispatch: commit outcome resolved: %s, %d bookings launched, %d gone already",
                status or "unknown (kept)",
                len(present),
                len(entry.result.written) - len(present),
            )
            self._launch(conn, present, stats)
        if self._pending_compensations:
            pending = self._pending_compensations
            # First what can fail without changing anything, then each one settled exactly once:
            # a failed attempt re-queues itself (in _compensate), and the ones after it stay queued.
            statuses = [self._compensation_status(conn, entry) for entry in pending]
            self._pending_compensations = []
            for i, (entry, status) in enumerate(zip(pending, statuses, strict=True)):
                try:
                    self._retry_compensation(conn, entry, status, stats)
                except BaseException:
                    self._pending_compensations.extend(pending[i + 1 :])
                    raise

    # -- completions ----------------------------------------------------------------------
    def _complete(self, conn: psycopg.Connection, stats: CycleStats) -> None:
        self._pending_completions.extend(self._held_completions)
        self._pending_completions.extend(self.launcher.poll_completions())
        self._held_completions = []
        held: list[Completion] = []
        while self._pending_completions:
            chunk = self._pending_completions[: self.completion_batch]
            t0 = time.perf_counter()
            now = time.monotonic()
            if any(e["until_monotonic"] > now for e in self._locked_shows.values()):
                # A show is backing off: its completions are set apart without a wait.
                results, kept = self._complete_by_show(conn, chunk)
                held.extend(kept)
            else:
                try:
                    results = [complete(conn, chunk, lock_wait=self.booking_lock_wait)]
                except psycopg.errors.LockNotAvailable:
                    results, kept = self._complete_by_show(conn, chunk)
                    held.extend(kept)
            stats.seconds["complete"] += time.perf_counter() - t0
            del self._pending_completions[: len(chunk)]
            for result in results:
                self._settle_completed(result, stats)
        # Completions of a show another session holds wait for the next cycle (their procs stay
        # booked meanwhile: high, never low); the loop goes on with the other shows.
        self._held_completions = held

    def _complete_by_show(
        self, conn: psycopg.Connection, chunk: list[Completion]
    ) -> tuple[list[CompletionResult], list[Completion]]:
        """Complete `chunk` show by show; returns what was done and what a held lock kept back."""
        shows = dict(conn.execute(SHOWS_OF_PROCS_SQL, ([c.pk_proc for c in chunk],)).fetchall())
        results: list[CompletionResult] = []
        kept: list[Completion] = []
        now = time.monotonic()
        for show in sorted({shows.get(c.pk_proc, "") for c in chunk}):
            part = [c for c in chunk if shows.get(c.pk_proc, "") == show]
            entry = self._locked_shows.get(show)
            if entry is not None and entry["until_monotonic"] > now:
                kept.extend(part)
                continue
            try:
                results.append(complete(conn, part, lock_wait=self.booking_lock_wait))
            except psycopg.errors.LockNotAvailable as exc:
                kept.extend(part)
                found = acct_blockers.for_lock_error(conn, exc, [show]).get(show, [])
                self._note_locked_show(show, found)
                logger.warning(
                    "completion: show %s's completions wait (a lock stayed held past %.2fs): %s",
                    show, self.booking_lock_wait, acct_blockers.describe(found),
                )  # fmt: skip
        return results, kept

    def _settle_completed(self, result: CompletionResult, stats: CycleStats) -> None:
        self.view.set_ledger(result.host_rows, result.freed_mem)
        stats.completed += result.released
        stats.jobs_finished += len(result.finished_jobs)
        if result.released:
            self._sleeping.clear()  # hosts have room again
            for job in result.released_jobs:
                folder = self._job_folder.get(job)
                if folder is not None:
                    self._blocked_folders.pop(folder, None)

    def _sweep_lost_hosts(self, conn: psycopg.Connection, stats: CycleStats) -> None:
        exclude = {b.pk_proc for e in self._pending_compensations for b in e.bookings} | {
            b.pk_proc for e in self._unresolved for b in e.bookings
        }
        try:
            procs, result = release_lost_hosts(
                conn, self.lost_host_timeout, exclude=exclude, shard=self.shard, lock_wait=self.booking_lock_wait
            )
        except psycopg.errors.LockNotAvailable as exc:
            # A show of a lost host's procs is held by another session: the next sweep tries again.
            logger.warning("lost-host sweep: a lock stayed held past %.2fs; next sweep retries: %s",
                           self.booking_lock_wait, exc.diag.message_primary)  # fmt: skip
            return
        if not procs:
            return
        self._hosts_loaded_at = float("-inf")  # the reload leaves the silent hosts out
        stats.lost_released += result.released
        stats.jobs_finished += len(result.finished_jobs)
        if result.host_rows:
            self.view.set_ledger(result.host_rows)

    def _reload(self, conn: psycopg.Connection) -> None:
        self.view.load(conn)
        subs: dict[str, list[tuple[str, int, int]]] = {}
        with conn.cursor() as cur:
            cur.execute(SUBSCRIPTIONS_SQL)
            for show, alloc, burst, cores in cur.fetchall():
                subs.setdefault(show, []).append((alloc, burst, cores))
        self._subs = subs
        with conn.cursor() as cur:
            cur.execute(SIZES_SQL)
            self._sizes = {(show, alloc): int(size / CENTI) for show, alloc, size in cur.fetchall()}
        self._hosts_loaded_at = time.monotonic()
        self._wake_all()

    def _wake_all(self) -> None:
        self._sleeping.clear()
        self._blocked_folders.clear()

    # -- dispatch -------------------------------------------------------------------------
    def _skips(self, now: float) -> Skips:
        self._sleeping = {c: t for c, t in self._sleeping.items() if t > now}
        for c in [c for c in self._cluster_layers if c not in self._sleeping]:
            del self._cluster_layers[c]
        layers = [pk for c in self._sleeping for pk in self._cluster_layers.get(c, ())]
        store = self.store
        jobs = []
        for job, (least, since) in list(self._blocked_jobs.items()):
            cap = store.job_cap(job)
            if now - since > 60 or cap is None or cap[0] < 0 or store.job_cores_in_use(job) + least <= cap[0]:
                del self._blocked_jobs[job]
            else:
                jobs.append(job)
        shows = []
        self._managed_seen = {show for show in self._managed_seen if self.service.is_managed(show)}
        for show in self._managed_seen:
            subs = self._subs.get(show, ())
            if not any(burst - booked >= 1 for booked, burst in (store.sub_counters(show, a) for a, _b, _c in subs)):
                shows.append(show)
        shows += [show for show, e in self._locked_shows.items() if e["until_monotonic"] > now]
        self._blocked_folders = {f: t for f, t in self._blocked_folders.items() if now - t <= self.cap_retry}
        folders = list(self._blocked_folders)
        return Skips(jobs=jobs, shows=shows, folders=folders, layers=layers, limits=store.full_licences())

    def _live_usage(self) -> LiveUsage:
        """The Store's booked cores of managed shows' subscriptions and of the managed jobs the
        last cycle read, for the feed's fair-share order and room test (the database's lag)."""
        is_managed = self.service.is_managed
        keys = [(show, alloc) for show, subs in self._subs.items() if is_managed(show) for alloc, *_ in subs]
        store = self.store
        subs = [(show, alloc, used * CENTI, cap * CENTI) for show, alloc, used, cap in store.sub_counters_many(keys)]
        jobs = [(job, cores * CENTI) for job, cores in store.jobs_cores_in_use(self._last_managed_jobs)]
        return LiveUsage(subs=subs, jobs=jobs)

    def _dispatch(self, conn: psycopg.Connection, stats: CycleStats) -> None:
        now = time.monotonic()
        t0 = time.perf_counter()
        jobs = fetch_pending(
            conn,
            managed_only=self.managed_only,
            max_jobs=self.max_jobs,
            frames_per_layer=self.frames_per_layer,
            max_frames=self._feed_frames,
            skips=self._skips(now),
            shard=self.shard,
            live=self._live_usage(),
            free=FreeHosts.of(self.view.hosts.values()),
            fair_share=self.fair_share,
        )
        stats.seconds["feed"] += time.perf_counter() - t0
        self._last_managed_jobs = [j.pk for j in jobs if j.managed_in_db]
        self.view.set_gpu_wants(_gpu_wants(jobs))
        if not jobs:
            self._feed_frames = self.max_frames
            return
        fetched = sum(len(layer.frames) for job in jobs for layer in job.layers)
        if len(self._job_folder) > _JOB_FOLDER_MAX:
            self._job_folder.clear()
        for job in jobs:
            self._job_folder[job.pk] = job.folder
        self._fill_caps(conn, jobs)
        room = self._room_for_cycle(conn, jobs)
        batch: list[Booking] = []
        placed: set[Cluster] = set()
        no_host: set[Cluster] = set()
        try:
            self._book_jobs(conn, jobs, room, batch, stats, placed, no_host)
            if batch:
                bookings = batch[:]
                batch.clear()
                self._flush(conn, bookings, stats)
        finally:
            # Whatever was booked in the Store but never handed to a batch (an error cut the
            # cycle short) is settled here: nothing of it reached the database.
            for b in batch:
                self.service.rollback_booking(b.result)
            if batch:
                self._hosts_loaded_at = float("-inf")
        until = time.monotonic() + self.saturated_sleep
        for cluster in no_host - placed:
            self._sleeping[cluster] = until
        booked = stats.booked + sum(stats.rejected[t] for t in _WRITE_REJECTIONS)
        if booked >= fetched:
            # Everything read was booked: the read was the limit.
            self._feed_frames = min(self.max_frames, self._feed_frames * 2)
        else:
            # Caps or hosts stopped the cycle: read about what it could book, with some slack.
            self._feed_frames = max(_MIN_FEED_FRAMES, min(self.max_frames, 2 * booked + self.frames_per_layer))

    def _book_jobs(
        self,
        conn: psycopg.Connection,
        jobs: list[JobWork],
        room: dict[Any, int],
        batch: list[Booking],
        stats: CycleStats,
        placed: set[Cluster],
        no_host: set[Cluster],
    ) -> None:
        full_folders: set[str] = set()
        paused = None if self.service.can_enforce() else self.service.pause_reason()
        # Trigger problems stop every show, managed or not (accounting/trigger_watch.py).
        stopped = self.service.booking_stopped()
        eligible: list[tuple[JobWork, bool]] = []
        for job in jobs:
            managed = self.service.is_managed(job.show)
            if managed != job.managed_in_db or (self.managed_only and not managed):
                # A flip in progress (the Store has not published it yet, or has already
                # dropped it): neither path may book the show until both agree.
                stats.skipped_flip += 1
                if job.managed_in_db and not managed:
                    self.service.request_managed_refresh()  # seed it now, not at the next tick
                continue
            if (managed and paused) or stopped:
                stats.rejected[PAUSED] += 1
                self._record_why(job.pk, PAUSED, f"accounting paused: {stopped or paused}", _CAP_WHY[PAUSED][3])
                continue
            if managed and self._is_behind(job.show):
                stats.skipped_behind += 1
                reason, what, _unit, unblock = _CAP_WHY[REJECT_GENERATION]
                self._record_why(job.pk, reason, f"waiting for {what}", unblock)
                continue
            if managed:
                self._managed_seen.add(job.show)
            eligible.append((job, managed))
        # Fair share inside the cycle: the feed's order is the tiers at the cycle's start, so a
        # show at the head would book past its size while shows behind it are still below
        # theirs. First every show books only up to its size (the share pass), then, in the
        # same order, up to its burst (borrowing). Without a show below its size, one pass.
        share = self._share if self.fair_share else {}
        booked_frames: set[str] = set()
        for share_only in (True, False) if share else (False,):
            for job, managed in eligible:
                if job.folder in full_folders:
                    continue
                if share_only and not any(v > 0 for (s, _a), v in share.items() if s == job.show):
                    continue
                self._book_job(
                    conn, job, managed, room, full_folders, batch, stats, placed, no_host,
                    share=share, share_only=share_only, booked_frames=booked_frames,
                )  # fmt: skip

    def _is_behind(self, show: str) -> bool:
        """Whether the show's bookings last met a generation the Store has not reached yet."""
        behind = self._behind.get(show)
        if behind is None:
            return False
        current = self.store.generation(show)
        if (UNKNOWN_GENERATION if current is None else current) != behind[0]:
            del self._behind[show]  # the Store applied something since: try again
            return False
        return True

    def _fill_caps(self, conn: psycopg.Connection, jobs: list[JobWork]) -> None:
        """Load the caps the Store lacks for managed jobs and folders of this cycle (it refuses them)."""
        managed = [j for j in jobs if self.service.is_managed(j.show)]
        if not managed:
            return
        folders, missing = self.store.missing_caps({j.folder for j in managed}, {j.pk for j in managed})
        if folders or missing:
            self.service.fill_caps(conn, sorted(folders), sorted(missing))
        limits = {lim for j in managed for layer in j.layers for lim in layer.limits}
        if limits and self.store.missing_licences(limits):
            self.service.fill_licences(conn)

    def _room_for_cycle(self, conn: psycopg.Connection, jobs: list[JobWork]) -> dict[Any, int]:
        """Whole cores each (show, alloc) may still book this cycle; decremented as we book.

        Managed shows: burst - booked from the Store. Others: int_burst - int_cores, which the
        database-enforced triggers keep exact, read fresh (the trigger has the last word).
        """
        room: dict[Any, int] = {}
        # (show, alloc) -> whole cores the show is below its size there, for the share pass.
        self._share: dict[tuple[str, str], int] = {}
        store = self.store
        unmanaged = []
        for show in {j.show for j in jobs}:
            if not self.service.is_managed(show):
                unmanaged.append(show)
                continue
            for alloc, _burst, _cores in self._subs.get(show, ()):
                booked, cap = store.sub_counters(show, alloc)
                room[(show, alloc)] = cap - booked
                size = self._sizes.get((show, alloc), 0)
                if size > booked:
                    self._share[(show, alloc)] = size - booked
        if unmanaged:
            with conn.cursor() as cur:
                cur.execute(SUBSCRIPTIONS_SQL + " WHERE pk_show = ANY(%s::text[])", (unmanaged,))
                for show, alloc, burst, cores in cur.fetchall():
                    room[(show, alloc)] = int((burst - cores) / CENTI)
                    size = self._sizes.get((show, alloc), 0)
                    if size and size * CENTI > cores:
                        self._share[(show, alloc)] = size - int(cores / CENTI)
        return room

    def _book_job(
        self,
        conn: psycopg.Connection,
        job: JobWork,
        managed: bool,
        room: dict[Any, int],
        full_folders: set[str],
        batch: list[Booking],
        stats: CycleStats,
        placed: set[Cluster],
        no_host: set[Cluster],
        *,
        share: dict[tuple[str, str], int] | None = None,
        share_only: bool = False,
        booked_frames: set[str] | None = None,
    ) -> None:
        """Book what fits of one job's frames. `share` holds how far each (show, alloc) is below
        its size (decremented as this books); with `share_only` the show books only there, up to
        its size. `booked_frames` are frames an earlier pass of this cycle booked: skipped."""
        show = job.show
        share = {} if share is None else share
        booked_frames = set() if booked_frames is None else booked_frames
        # Job budget for this cycle, whole cores: the Store's for managed shows, the
        # trigger-kept total for the others (the authority is still book / the trigger).
        if managed:
            cap = self.store.job_cap(job.pk)
            job_cap: int | None = cap[0] if cap and cap[0] >= 0 else None  # None: unlimited or unseeded
            job_used = self.store.job_cores_in_use(job.pk)
            folder_key: tuple[str, str] | None = None
            booked_key: tuple[str, str] | None = None
        else:
            job_cap = job.max_cores // CENTI if job.max_cores >= 0 else None
            # Plus what this cycle booked for the job already: _book_job runs once per pass (share,
            # then borrowing), and job.cores is the cycle-start total.
            booked_key = ("job_booked", job.pk)
            job_used = int(job.cores / CENTI) + room.get(booked_key, 0)
            # The folder's room this cycle, shared by its jobs (the trigger has the last word).
            folder_key = ("folder", job.folder)
            if folder_key not in room:
                room[folder_key] = (
                    int((job.folder_max_cores - job.folder_cores) / CENTI)
                    if job.folder_max_cores >= 0
                    else _UNLIMITED_ROOM
                )
        least_skipped = 0
        booked_any = False
        view = self.view
        keeps_hint = view.keeps_hint

        if share_only:

            def room_of(alloc: str) -> int:
                return min(room.get((show, alloc), 0), share.get((show, alloc), 0))

        else:

            def room_of(alloc: str) -> int:
                return room.get((show, alloc), 0)

        for layer in job.layers:
            cluster = layer.cluster
            if cluster in self._sleeping:
                self._cluster_layers.setdefault(cluster, set()).add(layer.pk)
                continue
            demand = layer.demand
            hint: HostRec | None = None
            hint_generation = -1
            for frame in layer.frames:
                if frame.pk in booked_frames:
                    continue
                stats.frames_considered += 1
                outcome = _NO_HOST
                booking = None
                for _attempt in range(_ALLOC_ATTEMPTS):
                    found = None
                    if hint is not None and hint_generation == view.generation:
                        cores = view.fits(hint, demand, facility=job.facility, os=job.os, room=room_of)
                        if cores:
                            found = (hint, cores)
                    if found is None:
                        found = view.find(demand, layer.tags, facility=job.facility, os=job.os, room=room_of)
                    if found is None:
                        outcome = _NO_HOST
                        break
                    host, cores = found
                    if job_cap is not None and job_used + cores > job_cap and job_cap > job_used:
                        # Sized on the host placement liked best (cores from memory, a whole host),
                        # the frame passes the job's cores left; on another host it may book
                        # within them. Ask once more with the job's room as the bound: a cap
                        # refuses a booking, it must not refuse the frame every host would size alike.
                        left = job_cap - job_used
                        within = view.find(
                            demand,
                            layer.tags,
                            facility=job.facility,
                            os=job.os,
                            room=lambda alloc, left=left: min(room_of(alloc), left),
                        )
                        if within is not None:
                            host, cores = within
                    if job_cap is not None and job_used + cores > job_cap:
                        stats.rejected["job_precheck"] += 1
                        self._record_why(
                            job.pk,
                            "job_max_cores",
                            f"job at max cores {job_used}/{job_cap} "
                            f"(the next frame needs {_needs(demand, host, cores)})",
                            _CAP_WHY["job"][3],
                        )
                        least = _least_cores(demand, cores)
                        least_skipped = least if not least_skipped else min(least_skipped, least)
                        outcome = _SKIP_LAYER
                        break
                    if folder_key is not None and room[folder_key] < cores:
                        stats.rejected["folder_precheck"] += 1
                        self._record_why(
                            job.pk,
                            "folder_max_cores",
                            f"folder has {max(room[folder_key], 0)} cores left under its max "
                            f"(the next frame needs {_needs(demand, host, cores)})",
                            _CAP_WHY["folder"][3],
                        )
                        full_folders.add(job.folder)
                        return
                    decided_at = time.time()  # before the Store's check: see Booking.decided_at
                    # The seed generation BEFORE the check: read after it, a re-seed published
                    # in between would lend a booking checked on stale counters the new one.
                    generation = self.service.managed_generation(show)
                    result = self.service.apply_booking(
                        BookingDelta(show, host.alloc, job.folder, job.pk, cores, demand.gpus, layer.limits)
                    )
                    if isinstance(result, LimitExceeded) and result.table in (LICENCE, LICENCE_UNSEEDED):
                        stats.rejected[result.table] += 1
                        self._record_why(job.pk, *_licence_why(result, self.store))
                        outcome = _SKIP_LAYER
                        break  # this layer's frames all hold the limit; the job's others may not
                    if isinstance(result, LimitExceeded):
                        stats.rejected[result.table] += 1
                        reason, what, unit, unblock = _CAP_WHY.get(
                            result.table, (result.table, result.table, "cores", "raise the cap")
                        )
                        self._record_why(
                            job.pk,
                            reason,
                            f"{what} {result.current}/{result.limit} {unit} (the next frame needs "
                            f"{_needs(demand, host, cores) if unit == 'cores' else demand.gpus})",
                            unblock,
                        )
                        if result.table == "subscription":
                            room[(show, host.alloc)] = 0
                            outcome = _NO_HOST
                            continue  # another allocation may still have room
                        if result.table in (PAUSED, FOLDER_UNSEEDED, JOB_UNSEEDED):
                            return  # not a cap: try the job again next cycle
                        if result.table in ("job", "job_gpus"):
                            least = cores if result.table == "job_gpus" else _least_cores(demand, cores)
                            self._blocked_jobs[job.pk] = (least, time.monotonic())
                        else:
                            # Until a frame of the folder completes, or cap_retry passes.
                            self._blocked_folders[job.folder] = time.monotonic()
                            full_folders.add(job.folder)
                        return
                    if self.managed_only and isinstance(result, NotManaged):
                        stats.skipped_flip += 1
                        return
                    centi = cores * CENTI
                    booking = Booking(
                        pk_proc=str(uuid.uuid4()),
                        frame=frame,
                        layer=layer,
                        host=host,
                        cores=centi,
                        mem=demand.mem,
                        gpus=demand.gpus,
                        gpu_mem=demand.gpu_mem,
                        result=result,
                        managed=isinstance(result, Applied),
                        decided_at=decided_at,
                        generation=self._generation(generation, result),
                        acct_generation=result.generation if isinstance(result, Applied) else -1,
                    )
                    view.take(host, centi, demand.mem, demand.gpus, demand.gpu_mem)
                    if keeps_hint:
                        hint, hint_generation = host, view.generation
                    room[(show, host.alloc)] = room.get((show, host.alloc), 0) - cores
                    if (show, host.alloc) in share:
                        share[(show, host.alloc)] -= cores
                    if folder_key is not None:
                        room[folder_key] -= cores
                    if booked_key is not None:
                        room[booked_key] = room.get(booked_key, 0) + cores
                    job_used += cores
                    break
                if booking is None:
                    if outcome is _NO_HOST:
                        stats.no_host += 1
                        declined = gpu_hosts.describe(view.gpu_declined)
                        if declined:
                            stats.gpu_declined += 1
                        self._record_why(
                            job.pk,
                            "gpu_host_kept" if declined else "no_host",
                            f"no UP and OPEN host with {max(demand.cores_min // CENTI, 1)} idle cores, "
                            f"{demand.mem // (1024 * 1024)} GB free memory"
                            + (f", {demand.gpus} GPUs" if demand.gpus else "")
                            + f" and a tag of {' | '.join(sorted(layer.tags)) or '(none)'}"
                            + (f" on OS {job.os}" if job.os else "")
                            + " in an allocation the show can still book"
                            + (f"; {declined}" if declined else ""),
                            "GPU hosts are kept for GPU work: add CPU hosts, or set CUESCHED_GPU_BACKFILL=1"
                            if declined
                            else "free or add hosts with those tags, or lower the layer's cores or memory",
                        )
                        anywhere = view.find(demand, layer.tags, facility=job.facility, os=job.os, room=_unlimited)
                        if anywhere is None:
                            # No host at all, whatever the caps: back off this cluster.
                            no_host.add(cluster)
                            self._cluster_layers.setdefault(cluster, set()).add(layer.pk)
                    break  # the layer's other frames ask for the same: next layer
                booked_any = True
                booked_frames.add(frame.pk)
                self.why.pop(job.pk, None)
                placed.add(cluster)
                batch.append(booking)
                if len(batch) >= self.batch_size:
                    bookings = batch[:]
                    batch.clear()  # the batch writer owns them now, and settles them whatever happens
                    refused = self._flush(conn, bookings, stats)
                    if refused and self._absorb_refusals(refused, room, full_folders, job):
                        return
                    if managed and show in self._behind:
                        return
        if managed and least_skipped and not booked_any:
            self._blocked_jobs[job.pk] = (least_skipped, time.monotonic())

    @staticmethod
    def _generation(generation: int | None, result: object) -> int:
        if not isinstance(result, Applied):
            return -1
        return -2 if generation is None else generation  # -2 never matches: unpublished meanwhile

    @staticmethod
    def _absorb_refusals(
        refused: list[tuple[Booking, str]], room: dict[Any, int], full_folders: set[str], job: JobWork
    ) -> bool:
        """Close, for the rest of the cycle, each cap the database trigger refused; True if `job` must stop.

        Only database-enforced bookings meet these refusals (their pre-check read counters that
        other writers have moved since). Without this the cycle would go on sending the same
        folder's next frames, each to be refused in a transaction of its own. A GPU refusal
        closes the folder for core-only frames too: one cycle of under-booking, the safe side.
        """
        stop = False
        for b, table in refused:
            owner = b.layer.job
            if table in ("folder", "folder_gpus"):
                room[("folder", owner.folder)] = 0
                full_folders.add(owner.folder)
                stop = stop or owner.folder == job.folder
            elif table == "subscription":
                room[(owner.show, b.host.alloc)] = 0
            elif table in ("job", "job_gpus"):
                stop = stop or owner.pk == job.pk
        return stop

    def _flush(self, conn: psycopg.Connection, bookings: list[Booking], stats: CycleStats) -> list[tuple[Booking, str]]:
        """Write `bookings`, launch and confirm what committed; returns the cap refusals of the database."""
        if self.service.lease_expired():
            # Not renewed in time (a stop, a slow lock session): a standby may own the Store by
            # now. Nothing is written; the generation check would refuse it after a takeover anyway.
            for b in bookings:
                self.service.rollback_booking(b.result)
                self.view.give(b.host.pk, b.cores, b.mem, b.gpus, b.gpu_mem)
            stats.rejected["lease_expired"] += len(bookings)
            logger.warning("dispatch: the scheduler lease was not renewed in time; %d bookings dropped", len(bookings))
            return []
        stats.batches += 1
        if self.first_booking_cycle_at is None:
            self.first_booking_cycle_at = self._cycle_started_at
        t0 = time.perf_counter()
        try:
            result = write_batch(
                conn,
                bookings,
                mem_used=self.mem_used_start,
                stale_after=self.lost_host_timeout,
                lease=self.service.lease_generation,
            )
        except AmbiguousCommitError as exc:
            # Keep every booking in flight (counters read high: safe) until PostgreSQL says
            # what became of the transaction.
            self._unresolved.append(Unresolved(list(bookings), exc.result, exc.xid, self._server_id))
            self._hosts_loaded_at = float("-inf")
            raise
        except LeaseLostError as exc:
            for b in bookings:
                self.service.rollback_booking(b.result)
            logger.error("dispatch: %s; this scheduler stops booking", exc)
            self.service.lease_lost.set()
            raise
        except BaseException:
            for b in bookings:
                self.service.rollback_booking(b.result)
            self._hosts_loaded_at = float("-inf")
            raise
        self.last_commit_at = time.perf_counter()
        stats.seconds["write"] += self.last_commit_at - t0
        view = self.view
        for b, table in result.rejected:
            self.service.rollback_booking(b.result)
            view.give(b.host.pk, b.cores, b.mem, b.gpus, b.gpu_mem)
            stats.rejected[table] += 1
            if table == REJECT_MANAGED_FLIP and b.managed:
                self.service.request_managed_refresh()
            if table == REJECT_GENERATION and b.managed and isinstance(b.result, Applied):
                show = b.layer.job.show
                if show not in self._behind:
                    self._behind[show] = (b.result.generation, time.monotonic())
                    self.service.report_behind(show, b.result.generation)
            if table in ("job", "job_gpus") and b.managed:
                least = b.cores // CENTI if table == "job_gpus" else _least_cores(b.layer.demand, b.cores // CENTI)
                self._blocked_jobs[b.layer.job.pk] = (least, time.monotonic())
        if result.blockers:
            self._note_locked(result)
        view.set_ledger(result.host_rows)
        if result.failed_hosts:
            view.reload_hosts(conn, result.failed_hosts)
        self._launch(conn, result.written, stats)
        return [(b, table) for b, table in result.rejected if table in CAP_REFUSALS]

    def _launch(self, conn: psycopg.Connection, written: list[Booking], stats: CycleStats) -> None:
        if not written:
            return
        if self.service.lease_expired():
            # Committed under the lease, but this process may have been stopped since: a standby
            # may have taken over and decided otherwise about these frames (a release, a sweep).
            # Launching them now would run work nobody counts; give them back instead.
            logger.error(
                "dispatch: the scheduler lease expired before %d committed bookings were launched; compensating them",
                len(written),
            )
            failures = [(b, "lease expired before the launch") for b in written]
        else:
            try:
                failures = self.launcher.launch(written)
            except Exception as exc:
                logger.exception("dispatch: launcher %s failed on a batch of %d", self.launcher.name, len(written))
                failures = [(b, f"launcher error: {exc}") for b in written]
        failed = {id(b) for b, _reason in failures}
        confirm = self.service.confirm_booking
        for b in written:
            if id(b) not in failed:
                confirm(b.result, b.xid)
        stats.booked += len(written) - len(failed)
        if failures:
            stats.launch_failures += len(failures)
            for b, reason in failures[:5]:
                logger.warning("dispatch: launch of frame %s on %s failed: %s", b.frame.name, b.host.name, reason)
            self._compensate(conn, [b for b, _reason in failures], stats)

    def _compensate(self, conn: psycopg.Connection, bookings: list[Booking], stats: CycleStats) -> None:
        try:
            result = compensate(conn, bookings)
        except AmbiguousCompensationError as exc:
            # Still in flight in the Store (reads high: safe) until the attempt's fate is known.
            self._pending_compensations.append(PendingCompensation(bookings, exc.attempt, self._server_id))
            raise
        except BaseException:
            # Rolled back: nothing of it happened. Try again next cycle.
            self._pending_compensations.append(PendingCompensation(bookings, None, self._server_id))
            raise
        self._settle_compensation(bookings, result, stats)

    def _compensation_status(self, conn: psycopg.Connection, entry: PendingCompensation) -> str | None:
        attempt = entry.attempt
        return "aborted" if attempt is None else self._status(conn, attempt.xid, entry.server_id)

    def _retry_compensation(
        self, conn: psycopg.Connection, entry: PendingCompensation, status: str | None, stats: CycleStats
    ) -> None:
        attempt = entry.attempt
        if status == "in progress":
            self._pending_compensations.append(entry)
            return
        if status == "committed" and attempt is not None:
            self._settle_compensation(entry.bookings, attempt, stats)
            return
        # Aborted or unknowable: run it again; it deletes only what is still there.
        self._compensate(conn, entry.bookings, stats)

    def _settle_compensation(self, bookings: list[Booking], result: CompensationResult, stats: CycleStats) -> None:
        """Confirm every compensated booking: the proc's release (ours or whoever deleted it first)
        takes it out of the Store with the keys the proc had when it went, not the booked ones."""
        freed: dict[str, int] = {}
        for b in bookings:
            if b.pk_proc in result.procs_deleted:
                freed[b.host.pk] = freed.get(b.host.pk, 0) + b.mem
            self.service.confirm_booking(b.result, b.xid)
        stats.compensated += len(result.procs_deleted)
        self.view.set_ledger(result.host_rows, freed)


def _least_cores(demand: Demand, cores: int) -> int:
    """The fewest whole cores a frame that would book `cores` here can book on any host: what a
    job blocked at its max cores waits to have room for.

    Not `cores`: a threadable frame is sized from its memory on the host placement picked, and
    another host sizes it down to its layer's minimum (stress `frame_life`: a 10 GB frame sized
    to 10 on a 32-core, 32 GB host kept its job, max 8, blocked after the job had emptied, while
    an 8-core host that books it at 3 stood idle). Waking early only costs a retry.

    A whole-host layer (cores 0) or all-but-N (cores -N) asks 1 core by `asked_cores`, but books a
    host's every core (less N) wherever it runs: waiting for 1 core woke the job every cycle while
    its room was under any host's size, to be placed and refused again. It waits for `cores`, the
    size on the host placement picked (a smaller host is tried when the block's 60 s pass)."""
    if demand.threadable and demand.cores_min <= 0:
        return cores
    return min(cores, sizing.asked_cores(demand))


def _needs(demand: Demand, host: HostRec, cores: int) -> str:
    """What a refusal says the next frame needs: its cores, and why when that is not what it asks.

    A frame sized from its memory may book 8 cores for a layer asking 1; "the next frame needs
    8: asks 1 core, books 8 on h1: its 32 GB are ..." keeps a capped job from looking stuck.
    """
    if cores == sizing.asked_cores(demand):
        return str(cores)
    return f"{cores}: {sizing.describe(demand, host, host.name)}"


def _licence_why(result: LimitExceeded, store: Store) -> tuple[str, str, str]:
    """(reason, message, unblock) of a booking the Store refused on a licence limit, with its numbers."""
    reason, what, _unit, unblock = _CAP_WHY[result.table]
    use = store.licences().get(result.key)
    if result.table == LICENCE and use is not None:
        kind = "hosts" if use.host else "frames"
        message = (
            f"{what}: limit {result.key} {result.current}/{result.limit} {kind} "
            f"({use.base} counted by the database, {use.inflight + use.pending} booked by this scheduler on top)"
        )
    else:
        message = f"{what}: limit {result.key}"
    return reason, message, unblock


def _gpu_wants(jobs: list[JobWork]) -> gpu_hosts.GpuWants:
    """The GPU layers with frames in this cycle's read: the work GPU hosts are kept for."""
    return gpu_hosts.GpuWants(
        gpu_hosts.GpuWant(layer.tags, job.facility, job.os, layer.demand.gpus, layer.demand.gpu_mem)
        for job in jobs
        for layer in job.layers
        if layer.demand.gpus > 0 and layer.frames
    )


def _unlimited(_alloc: str) -> int:
    return _UNLIMITED_ROOM


def merge_live_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """One dispatch section for the live view out of each worker's: counts add up."""
    if len(views) == 1:
        return views[0]
    merged: dict[str, Any] = {"workers": len(views)}
    for view in views:
        for key, value in view.items():
            if isinstance(value, bool) or not isinstance(value, int | dict):
                merged.setdefault(key, value)
            elif isinstance(value, int):
                merged[key] = merged.get(key, 0) + value
            elif key == "rejected":
                counts = merged.setdefault(key, {})
                for table, n in value.items():
                    counts[table] = counts.get(table, 0) + n
            else:
                merged.setdefault(key, {}).update(value)
    return merged


def dispatch_main(
    launcher: str | None = None,
    *,
    exit_when_idle: bool = False,
    loop_options: dict[str, Any] | None = None,
    workers: int | None = None,
    **launcher_options: Any,
) -> Callable[[AccountingService, threading.Event], None]:
    """The foreground of `run_scheduler`: `SchedulerProcess(...).run(dispatch_main("simulated"))`.

    Runs `workers` loops (CUESCHED_DISPATCH_WORKERS), each on its shard of hosts and jobs with
    its own launcher, and the kill sender over those launchers, once the service's bootstrap is
    done; publishes their counters in the
    live view, and with `exit_when_idle` stops the whole process (sets `stop`) once no frame is
    WAITING or RUNNING.
    """

    def main(service: AccountingService, stop: threading.Event) -> None:
        count = workers or conf.dispatch_workers()
        launchers = [get_launcher(launcher or conf.launcher_name(), **launcher_options) for _ in range(count)]
        loops = [DispatchLoop(service, launchers[i], shard=(i, count), **(loop_options or {})) for i in range(count)]
        service.view_providers["dispatch"] = lambda: merge_live_views([lp.live_view() for lp in loops])
        # Kills go to the hosts through the launchers, from their own thread (dispatch.engine.kills).
        sender = KillSender(launchers)
        killing = sender.start(stop)
        others = [
            threading.Thread(target=lp.run, args=(stop, exit_when_idle), name=f"cuesched-dispatch-{i + 1}", daemon=True)
            for i, lp in enumerate(loops[1:])
        ]
        try:
            for thread in others:
                thread.start()
            loops[0].run(stop, exit_when_idle=exit_when_idle)
            for thread in others:
                thread.join()
        finally:
            # Dispatch is over (idle, stopped, or the first loop failed): the other workers stop too.
            stop.set()
            for thread in others:
                thread.join(30)
            killing.join(10)
            for lp in loops:
                lp.requeue_in_process_frames()
                lp.close()
                lp.launcher.close()

    return main
