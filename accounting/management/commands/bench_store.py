"""Benchmark the Store's hot path: book+confirm pairs per second, one thread and several.

Pure Python, no database (settings load because this runs under manage.py, nothing more).
The Store must never be what limits dispatch; the target is >= 200,000 pairs/s on one thread.

Deltas are built once up front (the dispatcher builds one per proc anyway), so the figures are
the Store's own cost: lock, three dict lookups, the cap checks and the counter arithmetic.
"""

from __future__ import annotations

import platform
import statistics
import threading
import time
from collections.abc import Callable

from django.core.management.base import BaseCommand, CommandParser

from accounting.store import Applied, BookingDelta, Store

SHOW = "00000000-0000-0000-0000-00000000show"
ALLOCS = [f"00000000-0000-0000-0000-0000alloc{i:03d}" for i in range(2)]
FOLDERS = [f"00000000-0000-0000-0000-000folder{i:03d}" for i in range(8)]
JOBS = [f"00000000-0000-0000-0000-000000job{i:03d}" for i in range(64)]
FULL_JOB = "00000000-0000-0000-0000-0000fulljob0"


def build_store(with_full_job: bool) -> Store:
    store = Store()
    store.set_caps(
        {(SHOW, a): 10**15 for a in ALLOCS},
        {f: (-1, -1) for f in FOLDERS},
        {j: (-1, -1) for j in JOBS},
    )
    if with_full_job:
        # A job at its cap: every booking for it passes the subscription and folder checks and
        # is rejected at the last one, the job check (the most expensive rejection).
        store.set_caps({}, {}, {FULL_JOB: (1, -1)})
        full = BookingDelta(SHOW, ALLOCS[0], FOLDERS[0], FULL_JOB, 1, 0)
        store.book(full)
        store.confirm(full)
    return store


def build_deltas(half_rejected: bool, salt: int) -> list[BookingDelta]:
    deltas = []
    for i in range(256):
        if half_rejected and i % 2:
            deltas.append(BookingDelta(SHOW, ALLOCS[0], FOLDERS[0], FULL_JOB, 1, 0))
            continue
        job = JOBS[(i + salt * 7) % len(JOBS)]
        deltas.append(
            BookingDelta(SHOW, ALLOCS[i % 2], FOLDERS[i % len(FOLDERS)], job, 1 + i % 4, 1 if i % 3 == 0 else 0)
        )
    return deltas


def pump(store: Store, deltas: list[BookingDelta], pairs: int) -> int:
    """Book `pairs` deltas, confirming each applied one; returns how many were rejected."""
    book = store.book
    confirm = store.confirm
    mask = len(deltas) - 1
    rejected = 0
    for i in range(pairs):
        delta = deltas[i & mask]
        if type(book(delta)) is Applied:
            confirm(delta)
        else:
            rejected += 1
    return rejected


def run_once(pairs: int, threads: int, half_rejected: bool) -> tuple[float, int]:
    """One timed run; returns (wall seconds, rejected count)."""
    store = build_store(half_rejected)
    per_thread = pairs // threads
    if threads == 1:
        deltas = build_deltas(half_rejected, 0)
        started = time.perf_counter()
        rejected = pump(store, deltas, per_thread)
        return time.perf_counter() - started, rejected
    results = [0] * threads
    gate = threading.Barrier(threads + 1)

    def worker(index: int) -> None:
        deltas = build_deltas(half_rejected, index)
        gate.wait()
        results[index] = pump(store, deltas, per_thread)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    gate.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - started, sum(results)


class Command(BaseCommand):
    help = "Measure Store book+confirm pairs per second (one thread and several; with and without rejections)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--pairs", type=int, default=200_000, help="book attempts per run (default 200000)")
        parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (default 5)")
        parser.add_argument("--threads", type=int, default=4, help="threads for the multi-thread runs (default 4)")

    def handle(self, *args: object, pairs: int, repeats: int, threads: int, **options: object) -> None:
        if pairs <= 0 or repeats <= 0 or threads <= 0:
            raise ValueError("--pairs, --repeats and --threads must be positive")
        out: Callable[[str], None] = self.stdout.write
        out(
            f"bench_store: {pairs:,} book attempts per run (each applied one confirmed), "
            f"median (min..max) of {repeats} runs; {platform.python_implementation()} "
            f"{platform.python_version()}"
        )
        out(f"{'workload':<26}{'threads':>8}{'pairs/s median':>16}{'min':>12}{'max':>12}{'rejected':>10}")
        for label, half in (("no rejections", False), ("half rejected (job cap)", True)):
            for count in sorted({1, threads}):
                rates = []
                rejected = 0
                for _ in range(repeats):
                    seconds, rejected = run_once(pairs, count, half)
                    rates.append((pairs // count) * count / seconds)
                share = rejected / ((pairs // count) * count)
                out(
                    f"{label:<26}{count:>8}{statistics.median(rates):>16,.0f}"
                    f"{min(rates):>12,.0f}{max(rates):>12,.0f}{share:>10.0%}"
                )
