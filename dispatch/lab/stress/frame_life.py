"""Phase `frame_life`: memory failures, hung frames and real failures under booking load (issue 29).

The perturbation farm (caps that bind, frames that complete and release) with a frame-by-frame
dependency in every job: frame i of layer 2 waits for frame i of layer 1. Each frame lives a
script, drawn once per frame (every kind at least once, then by weight), one outcome per run:

* `ok`: exits 0;
* `fail`: exits 1, a real failure (charged a retry);
* `fail_sig`: killed by signal 9 with its RSS under its reservation, which the scheduler did not
  send: a real failure too (137, charged);
* `mem33`: exits 33, Cuebot's memory failure;
* `mem_sig`: its host reports its RSS over its reservation (`memory.follow_use`, as RQD's and the
  agents' reports do), then it dies of signal 9 (the kernel's OOM killer): our memory failure;
* `busy`: hangs, writing its log (its llu keeps up): killed past the layer's `timeout`;
* `silent`: hangs, its log silent since it started: killed past the layer's `timeout_llu`.

A hung run's host reports its RSS at its reservation, and its kill comes back as RQD reports one
(status 1, signal 9): only the kill mark says it was the scheduler's timeout kill, not the OOM
killer. The timeouts are read the production way: a host-report thread passes every running
run's log age to `kills.mark_timeouts` each `REPORT_INTERVAL`, and a `KillSender` sends the
marked runs' kills through the launcher (as `run_scheduler` runs one beside its loops). Timeouts
are in minutes; this phase alone passes `mark_timeouts` a minute of `LAB_MINUTE` seconds (a
parameter, not a setting: nothing in production can shorten one). Hung frames and exhausted ones
(`fail` until DEAD) are only in layer 2, which nothing depends on: a DEAD frame never satisfies a
dependency (as in Cuebot), so one in layer 1 would leave its dependent in DEPEND for ever, which
is right but is not what this phase checks.

The audit, beside the usual one (caps, cores ledger, frame and proc states, Store and database
counters) and the memory ledger of `memory_mix` at rest:
* drained: every job FINISHED, no frame WAITING, RUNNING or DEPEND, no proc of the farm;
* every frame ran its script exactly (one run per outcome, no more) and ended as it says:
  SUCCEEDED; DEAD with the timeout's reason; DEAD by exhausted retries, with no reason;
* `int_retries` is exactly the frame's real failures that were retried (all of them, but for
  the failure that made an exhausted frame DEAD): memory failures and timeouts are never charged;
* a memory-failed run's next run booked more memory than it, and its layer ends at least at its
  reservation plus the service's `min_memory_increase`, with the optimizer off; layers with no
  memory failure keep their memory;
* one `timeout_kill` audit row per hung frame.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psycopg

from accounting import db
from dispatch.engine import kills
from dispatch.engine.completion import EXIT_STATUS_KILLED, Completion, memory_increase
from dispatch.engine.kills import KillSender
from dispatch.engine.memory import Use, follow_use
from dispatch.hosts.launchers.simulated import PING_HOSTS_SQL
from dispatch.lab.seeding import FarmSeed
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess
from dispatch.lab.stress.memory_mix import LEDGER_SQL
from dispatch.lab.stress.report import PhaseReport

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking
    from dispatch.engine.launcher import RunKill

NAME = "frame_life"
LAB_MINUTE = 0.5  # seconds in one minute of a layer's timeout, in this phase only (see the module)
TIMEOUT = 4  # layer 2's timeout, lab minutes (2 s): 13x the longest simulated run
TIMEOUT_LLU = 2  # layer 2's timeout_llu, lab minutes (1 s)
REPORT_INTERVAL = 0.1  # s between two host reports (RQD's poll, an agent's check)
OVER_KB = 256 * 1024  # a `mem_sig` run's RSS over its reservation at its last report
SIGKILL = 9

OK, FAIL, FAIL_SIG, MEM33, MEM_SIG, BUSY, SILENT = "ok", "fail", "fail_sig", "mem33", "mem_sig", "busy", "silent"
REAL_FAILURES = (FAIL, FAIL_SIG)
MEMORY_FAILURES = (MEM33, MEM_SIG)
HANGS = (BUSY, SILENT)

# (script, weight). Layer 1 (depended on) ends SUCCEEDED; layer 2 may also hang or exhaust.
LAYER1_SCRIPTS: tuple[tuple[tuple[str, ...], int], ...] = (
    ((OK,), 4),
    ((MEM33, OK), 2),
    ((MEM_SIG, OK), 2),
    ((FAIL, OK), 1),
    ((FAIL_SIG, OK), 1),
    ((MEM33, FAIL, MEM_SIG, OK), 1),
)


def layer2_scripts(max_retries: int) -> tuple[tuple[tuple[str, ...], int], ...]:
    return (
        *LAYER1_SCRIPTS,
        ((BUSY,), 2),
        ((SILENT,), 2),
        ((MEM33, BUSY), 1),
        ((FAIL, SILENT), 1),
        ((FAIL,) * (max_retries + 1), 1),  # exhausted: DEAD
    )


def draw_scripts(
    frames: Sequence[str], scripts: Sequence[tuple[tuple[str, ...], int]], rng: random.Random
) -> dict[str, tuple[str, ...]]:
    """A script per frame: every script once (while frames last), then drawn by weight."""
    order = list(frames)
    rng.shuffle(order)
    kinds = [s for s, _w in scripts]
    weights = [w for _s, w in scripts]
    out = {pk: kinds[i] for i, pk in enumerate(order[: len(kinds)])}
    out.update({pk: rng.choices(kinds, weights)[0] for pk in order[len(kinds) :]})
    return out


def retries_charged(script: Sequence[str], max_retries: int) -> int:
    """Real failures followed by another run: what int_retries must read at the end."""
    failures = sum(1 for o in script if o in REAL_FAILURES)
    return min(failures, max_retries)


@dataclass(frozen=True, slots=True)
class RunRecord:
    pk_proc: str
    pk_frame: str
    pk_layer: str
    pk_host: str
    mem: int  # KB booked
    outcome: str


@dataclass
class _Live:
    record: RunRecord
    started: float  # epoch s: a `silent` run's log's last update


@dataclass
class LifeLauncher:
    """The simulated launcher's way (no process runs), with each frame's script of outcomes.

    Ordinary outcomes come due after a drawn runtime; hung runs never end on their own: only a
    kill ends them (`kill`, from the phase's KillSender), reported as RQD reports a killed run.
    """

    runtime_min: float
    runtime_max: float
    seed: int
    scripts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pk_frame -> outcomes, by run
    name: str = "frame_life"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._live: dict[str, _Live] = {}  # pk_proc -> a run that has not ended
        self._ended: list[str] = []  # killed runs whose end the next poll reports
        self._runs: dict[str, int] = {}  # pk_frame -> runs launched
        self.records: list[RunRecord] = []
        self.extra_runs: list[str] = []  # frames launched past their script's end
        self._conn: psycopg.Connection | None = None
        self.rss_reports = 0

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        now, wall = time.monotonic(), time.time()
        with self._lock:
            for b in bookings:
                n = self._runs.get(b.frame.pk, 0)
                self._runs[b.frame.pk] = n + 1
                script = self.scripts.get(b.frame.pk, (OK,))
                if n >= len(script):
                    self.extra_runs.append(b.frame.pk)
                outcome = script[n] if n < len(script) else OK
                rec = RunRecord(b.pk_proc, b.frame.pk, b.layer.pk, b.host.pk, int(b.mem), outcome)
                self.records.append(rec)
                self._live[b.pk_proc] = _Live(rec, wall)
                if outcome not in HANGS:
                    due = now + self._rng.uniform(self.runtime_min, self.runtime_max)
                    heapq.heappush(self._heap, (due, next(self._seq), b.pk_proc))
        return []

    def _report_rss(self, runs: Sequence[tuple[RunRecord, int]], conn: psycopg.Connection | None = None) -> None:
        """The hosts' memory reports for these runs (RSS KB), through the production path, on
        `conn` (the reporter's), else the launcher's own connection (the loop's thread only)."""
        if not runs:
            return
        if conn is None:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = db.connect(autocommit=True, application_name="cuesched-stress-fl")
            conn = self._conn
        by_host: dict[str, list[Use]] = {}
        for rec, rss in runs:
            by_host.setdefault(rec.pk_host, []).append(Use(rec.pk_proc, rss, max_rss=rss))
        for host, uses in sorted(by_host.items()):
            follow_use(conn, host, uses)
            with self._lock:
                self.rss_reports += len(uses)

    def poll_completions(self) -> list[Completion]:
        now = time.monotonic()
        due: list[_Live] = []
        out: list[Completion] = []
        with self._lock:
            for pk in self._ended:
                self._live.pop(pk, None)
                out.append(Completion(pk, 1, exit_signal=SIGKILL))  # as RQD reports a killed run
            self._ended.clear()
            while self._heap and self._heap[0][0] <= now:
                _due, _seq, pk = heapq.heappop(self._heap)
                live = self._live.pop(pk, None)
                if live is not None:
                    due.append(live)
        # Their host's last report before a signal 9: the OOM killer's victims over their
        # reservation, the other kills (a stray `kill -9`) at half of it.
        self._report_rss(
            [(x.record, x.record.mem + OVER_KB) for x in due if x.record.outcome == MEM_SIG]
            + [(x.record, x.record.mem // 2) for x in due if x.record.outcome == FAIL_SIG]
        )
        for x in due:
            pk, outcome = x.record.pk_proc, x.record.outcome
            if outcome == OK:
                out.append(Completion(pk, 0))
            elif outcome == FAIL:
                out.append(Completion(pk, 1))
            elif outcome in (FAIL_SIG, MEM_SIG):
                out.append(Completion(pk, 1, exit_signal=SIGKILL))
            else:  # MEM33
                out.append(Completion(pk, 33))
        return out

    def hung(self) -> list[RunRecord]:
        with self._lock:
            return [x.record for x in self._live.values() if x.record.outcome in HANGS]

    def llu(self) -> dict[str, float]:
        """Every running run's log's last update, as its host reports it (epoch s)."""
        wall = time.time()
        with self._lock:
            return {pk: (x.started if x.record.outcome == SILENT else wall) for pk, x in self._live.items()}

    def next_due(self) -> float | None:
        with self._lock:
            if self._ended:
                return 0.0
            if not self._heap:
                return None
            return max(0.0, self._heap[0][0] - time.monotonic())

    def running(self) -> int:
        with self._lock:
            return len(self._live) + len(self._ended)

    def kill(self, runs: Sequence[RunKill]) -> None:
        with self._lock:
            for run in runs:
                if run.pk_proc in self._live and run.pk_proc not in self._ended:
                    self._ended.append(run.pk_proc)

    def heartbeat(self, conn: psycopg.Connection) -> None:
        with conn.cursor() as cur:
            cur.execute(PING_HOSTS_SQL)

    def abandon(self) -> list[str]:
        with self._lock:
            procs = list(self._live)
            self._live.clear()
            self._heap.clear()
            self._ended.clear()
        return procs

    def close(self) -> None:
        self.abandon()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


DEPEND_SQL = """
INSERT INTO depend (pk_depend, str_type, pk_job_depend_er, pk_job_depend_on, pk_layer_depend_er,
                    pk_layer_depend_on, pk_frame_depend_er, pk_frame_depend_on)
SELECT gen_random_uuid()::text, 'FRAME_BY_FRAME', er.pk_job, er.pk_job, er.pk_layer, onl.pk_layer, fe.pk_frame,
       fo.pk_frame
FROM layer er
JOIN layer onl ON onl.pk_job = er.pk_job AND onl.int_dispatch_order = 1
JOIN frame fe ON fe.pk_layer = er.pk_layer
JOIN frame fo ON fo.pk_layer = onl.pk_layer AND fo.int_number = fe.int_number
WHERE er.pk_job = ANY(%(jobs)s::text[]) AND er.int_dispatch_order = 2
RETURNING pk_frame_depend_er
"""
DEPEND_FRAMES_SQL = """
UPDATE frame SET str_state = 'DEPEND', int_depend_count = 1, int_version = int_version + 1
WHERE pk_frame = ANY(%(frames)s::text[]) AND str_state = 'WAITING'
"""
TIMEOUTS_SQL = """
UPDATE layer SET int_timeout = %(timeout)s, int_timeout_llu = %(llu)s
WHERE pk_job = ANY(%(jobs)s::text[]) AND int_dispatch_order = 2
"""
ACTIONS_SQL = "SELECT COALESCE(max(id), 0) FROM cuesched_farm_action"
LAYERS_SQL = """
SELECT pk_layer, int_dispatch_order, int_mem_min, b_optimize, split_part(str_services, ',', 1), pk_job
FROM layer WHERE pk_job = ANY(%(jobs)s::text[])
"""
FRAMES_SQL = """
SELECT f.pk_frame, f.pk_layer, f.str_state, f.int_retries, f.int_exit_status, COALESCE(f.str_reason, ''),
       j.int_max_retries
FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE f.pk_job = ANY(%(jobs)s::text[])
"""
# Why a frame is left WAITING: its layer's memory and tags, and the largest host of the farm that
# carries one of its tags (layer tags are an OR, as in Cuebot).
STUCK_SQL = """
SELECT f.pk_frame, l.int_mem_min, l.str_tags, l.int_cores_min,
       (SELECT max(h.int_mem) FROM host h WHERE h.pk_host = ANY(%(hosts)s::text[]) AND EXISTS (
          SELECT 1 FROM host_tag t WHERE t.pk_host = h.pk_host
            AND t.str_tag = ANY(string_to_array(replace(l.str_tags, ' ', ''), '|'))))
FROM frame f JOIN layer l ON l.pk_layer = f.pk_layer
WHERE f.pk_job = ANY(%(jobs)s::text[]) AND f.str_state = 'WAITING'
LIMIT 5
"""
REST_SQL = """
SELECT (SELECT count(*) FROM job WHERE pk_job = ANY(%(jobs)s::text[]) AND str_state <> 'FINISHED'),
       (SELECT count(*) FROM proc WHERE pk_job = ANY(%(jobs)s::text[])),
       (SELECT count(*) FROM depend WHERE pk_job_depend_er = ANY(%(jobs)s::text[]) AND b_active),
       (SELECT count(*) FROM cuesched_farm_action WHERE str_action = 'timeout_kill'
          AND str_target = ANY(%(jobs)s::text[]) AND id > %(actions)s)
"""
SHOW_OF_JOBS_SQL = "SELECT pk_job, pk_show FROM job WHERE pk_job = ANY(%(jobs)s::text[])"


def _prepare(launcher: LifeLauncher, cfg: StressConfig, seed: FarmSeed, start: dict[str, int]) -> None:
    """Before anything books: layer 2 waits frame by frame for layer 1 and has the timeouts; every
    frame gets its script."""
    params = {"jobs": list(seed.job_ids), "timeout": TIMEOUT, "llu": TIMEOUT_LLU}
    with db.connect(autocommit=True, application_name="cuesched-stress-fl") as conn, conn.transaction():
        dependers = [r[0] for r in conn.execute(DEPEND_SQL, params).fetchall()]
        conn.execute(DEPEND_FRAMES_SQL, {"frames": dependers})
        conn.execute(TIMEOUTS_SQL, params)
        start["actions"] = int(conn.execute(ACTIONS_SQL).fetchone()[0])
        order = {pk: o for pk, o, mem, *_ in conn.execute(LAYERS_SQL, params).fetchall()}
        start.update({pk: int(mem) for pk, _o, mem, *_ in conn.execute(LAYERS_SQL, params).fetchall()})
        frames = conn.execute(FRAMES_SQL, params).fetchall()
    max_retries = min(int(r[6]) for r in frames)
    rng = random.Random(cfg.seed ^ 0x29)
    for layer_order, scripts in ((1, LAYER1_SCRIPTS), (2, layer2_scripts(max_retries))):
        pks = sorted(r[0] for r in frames if order.get(r[1]) == layer_order)
        launcher.scripts.update(draw_scripts(pks, scripts, rng))


def _report_hosts(run: Run, launcher: LifeLauncher, stats: dict[str, int]) -> None:
    """The host reports while the load runs: every running run's log age (the timeouts), and the
    hung runs' RSS, at their reservation, once each."""
    reported: set[str] = set()
    with db.connect(autocommit=True, application_name="cuesched-stress-fl-report") as conn:
        while not run.stop_loop.is_set():
            fresh = [r for r in launcher.hung() if r.pk_proc not in reported]
            launcher._report_rss([(r, r.mem) for r in fresh], conn)
            reported.update(r.pk_proc for r in fresh)
            llu = launcher.llu()
            if llu:
                stats["marked"] += len(kills.mark_timeouts(conn, llu, minute=LAB_MINUTE))
            stats["reports"] += 1
            run.stop_loop.wait(REPORT_INTERVAL)


def _audit(run: Run, launcher: LifeLauncher, start: dict[str, int], stats: dict[str, int]) -> list[str]:
    failed: list[str] = []
    params = {"jobs": list(run.seed.job_ids), "hosts": list(run.seed.host_ids), "actions": start["actions"]}
    with db.connect(autocommit=True, application_name="cuesched-stress-fl-audit") as conn:
        unfinished, procs, active, audit_rows = conn.execute(REST_SQL, params).fetchone()
        frames = conn.execute(FRAMES_SQL, params).fetchall()
        layers = {r[0]: r for r in conn.execute(LAYERS_SQL, params).fetchall()}
        show_of = dict(conn.execute(SHOW_OF_JOBS_SQL, params).fetchall())
        for pk, mem, tags, cores, largest in conn.execute(STUCK_SQL, params).fetchall():
            failed.append(
                f"frame {pk} left WAITING: its layer needs {mem} KB, {cores} centicores, tags {tags!r}; "
                f"the largest host with one of its tags has {largest} KB"
            )
        for what, key, seen, expected in conn.execute(LEDGER_SQL, params).fetchall():
            failed.append(f"memory ledger {what} {key}: {seen} vs {expected}")
        with conn.cursor() as cur:
            increase = {
                pk: memory_increase(cur, svc or "", show_of[job])
                for pk, _o, _m, _b, svc, job in layers.values()
            }
    if unfinished or procs:
        failed.append(f"not drained: {unfinished} job(s) not FINISHED, {procs} proc(s) left")
    if active:
        failed.append(f"{active} dependencies still active")
    states: dict[str, int] = {}
    for _pk, _l, state, *_ in frames:
        states[state] = states.get(state, 0) + 1
    for state in ("WAITING", "RUNNING", "DEPEND", "SETUP"):
        if states.get(state):
            failed.append(f"{states[state]} frame(s) left {state}")
    runs: dict[str, list[RunRecord]] = {}
    for rec in launcher.records:
        runs.setdefault(rec.pk_frame, []).append(rec)
    if launcher.extra_runs:
        failed.append(f"{len(launcher.extra_runs)} run(s) past their frame's script: {launcher.extra_runs[:3]}")
    hung_frames = 0
    needs: dict[str, int] = {}  # pk_layer -> the least int_mem_min its memory failures require
    for pk, pk_layer, state, retries, exit_status, reason, max_retries in frames:
        script = launcher.scripts.get(pk, (OK,))
        ran = [r.outcome for r in runs.get(pk, [])]
        if ran != list(script):
            failed.append(f"frame {pk}: ran {ran}, its script is {list(script)}")
            continue
        last = script[-1]
        if last == OK:
            want = ("SUCCEEDED", 0)
        elif last in HANGS:
            want = ("DEAD", EXIT_STATUS_KILLED)
            hung_frames += 1
            words = "timeout_llu of" if last == SILENT else "timeout of"
            if not reason.startswith("timeout:") or words not in reason:
                failed.append(f"frame {pk} ({last}): reason {reason!r}, not its {words.split()[0]}")
        else:  # exhausted by real failures
            want = ("DEAD", 1)
            if reason:
                failed.append(f"frame {pk}: DEAD by its own failures, yet reason {reason!r}")
        if (state, int(exit_status)) != want:
            failed.append(
                f"frame {pk} ({'/'.join(script)}): {state} exit {exit_status}, expected {want[0]} exit {want[1]}"
            )
        if int(retries) != retries_charged(script, int(max_retries)):
            failed.append(
                f"frame {pk} ({'/'.join(script)}): int_retries {retries}, its real failures retried "
                f"{retries_charged(script, int(max_retries))}"
            )
        frame_runs = runs[pk]
        for a, b in itertools.pairwise(frame_runs):
            if a.outcome in MEMORY_FAILURES and b.mem <= a.mem:
                failed.append(f"frame {pk}: rebooked at {b.mem} KB after a memory failure at {a.mem} KB")
        for r in frame_runs:
            if r.outcome in MEMORY_FAILURES:
                needs[pk_layer] = max(needs.get(pk_layer, 0), r.mem + increase.get(pk_layer, 0))
    for pk_layer, (_pk, _o, mem, optimize, _svc, _job) in layers.items():
        if pk_layer in needs:
            if int(mem) < needs[pk_layer] or optimize:
                failed.append(f"layer {pk_layer}: memory {mem} KB (optimize {optimize}), needs {needs[pk_layer]}")
        elif int(mem) != start.get(pk_layer) or not optimize:
            failed.append(f"layer {pk_layer}: no memory failure, yet memory {start.get(pk_layer)} -> {mem} KB")
    if int(audit_rows) != hung_frames:
        failed.append(f"{audit_rows} timeout_kill audit rows for {hung_frames} hung frames")
    counts: dict[str, int] = {}
    for rec in launcher.records:
        counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
    stats.update({f"runs_{k}": v for k, v in counts.items()}, hung=hung_frames, layers_raised=len(needs))
    for kind in (MEM33, MEM_SIG, FAIL, FAIL_SIG, BUSY, SILENT):
        if not counts.get(kind):
            failed.append(f"no run was {kind}: the farm is too small for the phase")
    return failed


def phase_frame_life(cfg: StressConfig) -> PhaseReport:
    # The perturbation farm (caps that bind), half its jobs: every frame runs one to four times.
    spec = replace(cfg.perturbation_spec(NAME), layers=2, jobs=max(4, cfg.pert_jobs // 2))
    launcher = LifeLauncher(cfg.runtime_min, cfg.runtime_max, cfg.seed)
    start: dict[str, int] = {}
    stats = {"reports": 0, "marked": 0}
    threads: list[threading.Thread] = []

    def prepare(seed: FarmSeed) -> Callable[[], None] | None:
        _prepare(launcher, cfg, seed, start)
        return None

    def perturb(run: Run) -> None:
        # The scheduler's kill sender, as run_scheduler runs one beside its loops.
        sender = KillSender([launcher], poll=0.2, resend=1.0)
        threads.append(sender.start(run.stop_loop))
        reporter = threading.Thread(target=_report_hosts, args=(run, launcher, stats), name="stress-fl-report")
        reporter.daemon = True
        reporter.start()
        threads.append(reporter)

    def heal(run: Run) -> None:
        for t in threads:
            t.join(10)
        run.report.failed.extend(_audit(run, launcher, start, stats))

    report = run_inprocess(cfg, NAME, spec, launcher=launcher, perturb=perturb, heal=heal, prepare=prepare)
    runs = ", ".join(f"{k[5:]} {v}" for k, v in sorted(stats.items()) if k.startswith("runs_"))
    report.notes.append(
        f"runs: {runs}; hung frames killed: {stats.get('hung', 0)} (marked {stats['marked']} over "
        f"{stats['reports']} host reports); layers raised for memory: {stats.get('layers_raised', 0)}; "
        f"RSS reports: {launcher.rss_reports}"
    )
    if report.booked < report.frames:
        report.failed.append(f"only {report.booked} runs booked for {report.frames} frames")
    return report
