"""The simulated launcher: no process runs; each frame "runs" for a drawn time, then completes.

For demos, tests, the stress suite and the benchmarks. A frame's runtime is drawn
uniformly from [runtime_min, runtime_max] seconds (both 0: it completes at the next poll),
it exits 1 with probability `failure_rate` (to exercise retries), and a launch fails with
probability `launch_failure_rate` (to exercise compensation). Completions go back through
the normal completion path, so releases really come from the proc delete trigger. Each run's
max RSS is `rss_fraction` of the memory it booked (CUESCHED_SIM_RSS_FRACTION, 0.5; a test may
decide it per booking with `rss`), carried by its completion as a real launcher's report
carries it: the frame, its layer_mem and its job_mem record it.

No agent runs either, so nothing would refresh host_stat.ts_ping and every seeded host would
be declared lost after the lost-host timeout: the launcher pings every UP host itself before
each lost-host sweep (`heartbeat=False` turns that off, to let a test silence a host).
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg

from dispatch import conf
from dispatch.engine.completion import Completion
from dispatch.engine.launcher import register

if TYPE_CHECKING:
    from dispatch.engine.booking import Booking
    from dispatch.engine.launcher import RunKill

EXIT_KILLED_BY_SIGNAL = 137  # what a real agent reports for a SIGKILLed run (128 + 9)


# The simulated agents are all alive: every UP host pings (only rows that need it are written).
PING_HOSTS_SQL = "UPDATE host_stat SET ts_ping = now() WHERE str_state = 'UP' AND ts_ping < now() - interval '1 second'"


@register("simulated")
class SimulatedLauncher:
    name = "simulated"

    def __init__(
        self,
        *,
        runtime_min: float | None = None,
        runtime_max: float | None = None,
        failure_rate: float | None = None,
        launch_failure_rate: float | None = None,
        seed: int | None = None,
        fail_launch: Callable[[Booking], bool] | None = None,
        exit_status: Callable[[Booking], int | None] | None = None,
        rss: Callable[[Booking], int] | None = None,
        rss_fraction: float | None = None,
        heartbeat: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime_min = conf.simulated_runtime_min() if runtime_min is None else runtime_min
        self.runtime_max = conf.simulated_runtime_max() if runtime_max is None else runtime_max
        if self.runtime_max < self.runtime_min:
            self.runtime_min = self.runtime_max
        self.failure_rate = conf.simulated_failure_rate() if failure_rate is None else failure_rate
        self.launch_failure_rate = (
            conf.simulated_launch_failure_rate() if launch_failure_rate is None else launch_failure_rate
        )
        self._rng = random.Random(conf.simulated_seed() if seed is None else seed)
        # Test hooks: decide a launch failure or an exit status for one booking (None: draw it).
        self.fail_launch = fail_launch
        self.exit_status = exit_status
        self.rss = rss
        self.rss_fraction = conf.simulated_rss_fraction() if rss_fraction is None else rss_fraction
        self._clock = clock
        self.pings_hosts = conf.simulated_heartbeat() if heartbeat is None else heartbeat
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, str, int, int]] = []  # (due, seq, pk_proc, status, max RSS KB)
        self._seq = itertools.count()
        self._killed: set[str] = set()  # killed runs still in the heap (skipped when they come due)
        self._ended: list[str] = []  # killed runs whose end the next poll reports
        self.launched = 0
        self.launch_failures = 0

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        failures: list[tuple[Booking, str]] = []
        now = self._clock()
        rng = self._rng
        lo, hi = self.runtime_min, self.runtime_max
        with self._lock:
            for b in bookings:
                if self.fail_launch is not None:
                    failed = self.fail_launch(b)
                else:
                    failed = self.launch_failure_rate > 0 and rng.random() < self.launch_failure_rate
                if failed:
                    failures.append((b, "simulated launch failure"))
                    continue
                status = self.exit_status(b) if self.exit_status is not None else None
                if status is None:
                    status = 1 if self.failure_rate > 0 and rng.random() < self.failure_rate else 0
                due = now + (rng.uniform(lo, hi) if hi > 0 else 0.0)
                rss = self.rss(b) if self.rss is not None else int(b.mem * self.rss_fraction)
                heapq.heappush(self._heap, (due, next(self._seq), b.pk_proc, status, max(0, rss)))
            self.launched += len(bookings) - len(failures)
            self.launch_failures += len(failures)
        return failures

    def poll_completions(self) -> list[Completion]:
        now = self._clock()
        out: list[Completion] = []
        with self._lock:
            out.extend(Completion(pk, EXIT_KILLED_BY_SIGNAL) for pk in self._ended)
            self._ended.clear()
            heap = self._heap
            while heap and heap[0][0] <= now:
                _due, _seq, pk_proc, status, rss = heapq.heappop(heap)
                if pk_proc in self._killed:
                    self._killed.discard(pk_proc)
                    continue
                out.append(Completion(pk_proc, status, max_rss=rss))
        return out

    def next_due(self) -> float | None:
        with self._lock:
            if self._ended:
                return 0.0
            if not self._heap:
                return None
            return max(0.0, self._heap[0][0] - self._clock())

    def running(self) -> int:
        with self._lock:
            return len(self._heap) - len(self._killed) + len([pk for pk in self._ended if pk in self._killed])

    def kill(self, runs: Sequence[RunKill]) -> None:
        """The simulated run ends now: its completion (signal 9) comes at the next poll, and the
        completion path records it killed (its proc's mark). Until then its proc stays booked.

        A run this launcher does not hold (a previous scheduler's, which died with it) runs
        nowhere, since simulated runs live only in the process that launched them: it is ended
        the same way, or its proc would stay booked for ever (its hosts keep pinging)."""
        with self._lock:
            running = {entry[2] for entry in self._heap}
            for run in runs:
                if run.pk_proc in self._killed or run.pk_proc in self._ended:
                    continue
                if run.pk_proc in running:
                    self._killed.add(run.pk_proc)
                self._ended.append(run.pk_proc)

    def heartbeat(self, conn: psycopg.Connection) -> None:
        if self.pings_hosts:
            with conn.cursor() as cur:
                cur.execute(PING_HOSTS_SQL)

    def abandon(self) -> list[str]:
        with self._lock:
            procs = [entry[2] for entry in self._heap if entry[2] not in self._killed]
            self._heap.clear()
            self._killed.clear()
            procs += self._ended
            self._ended.clear()
        return procs

    def close(self) -> None:
        with self._lock:
            self._heap.clear()
            self._killed.clear()
            self._ended.clear()
