"""`manage.py bench_profile`: where the booking cycle's time goes, in Python and in PostgreSQL.

One drain of a seeded farm (bench's drain or contended shape, Store or database-enforced), the
dispatch loop run in this thread under cProfile while the accounting service runs beside it.
It prints:

- the loop's own phase clocks (feed, write = the booking transaction, complete) and the rest of
  the cycle (placement and the Store), per booked frame;
- the time spent waiting on PostgreSQL (every psycopg execute, fetch and commit), counted per
  batch: that is the round trips and the server's work together;
- the functions with the most time of their own, and the project's with the most in total;
- the wall time of each statement the loop sends, from the call to its result (named by the
  engine's SQL constant it is: BEGIN, the keys lock, the lease check, the booking statement,
  COMMIT...), so that the extra round trips of a batch have a figure each;
- each PL/pgSQL function's calls and time on the server (`pg_stat_user_functions`), the
  difference between before and after the drain: per-row work in triggers. For that the command
  sets `track_functions = all` on its database while it runs (ALTER DATABASE, a superuser's;
  reset at the end);
- with `--explain`, each booking and completion statement's plan: before the real statement, the
  same statement with the same parameters runs under `EXPLAIN (ANALYZE, BUFFERS)` inside a
  savepoint that is then rolled back, so nothing of it stays (its deferred triggers are dropped
  with it). Summed per plan node and per trigger (EXPLAIN prints each AFTER trigger's time for
  DML): the statement's own row work against what each trigger adds. The explained run is not
  in the statement clocks, but it does slow the drain, so read the proportions.

Run it on a scratch database (it seeds and purges its own `--prefix` farm). cProfile adds its
own overhead to every Python call (the Python side reads high against the database side).
"""

from __future__ import annotations

import cProfile
import importlib
import io
import os
import pstats
import threading
import time
from argparse import ArgumentParser
from collections import Counter
from typing import Any

import psycopg
from django.core.management.base import BaseCommand
from django.db import connection
from psycopg import sql

from accounting import db
from accounting.service import AccountingService
from dispatch.engine.loop import DispatchLoop
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm
from dispatch.lab.stress import QUIET_LOOPS, env

VACUUMED = "frame, proc, host, host_stat, job, job_stat, job_resource, layer, layer_stat, layer_resource"
FUNCTIONS_SQL = "SELECT schemaname || '.' || funcname, calls, total_time, self_time FROM pg_stat_user_functions"
# psycopg's calls that send a statement (each one round trip at least).
WAITS = ("execute", "executemany")


class StatementClock:
    """Wall time of every statement the loop's thread sends, by statement (named when it is one of
    the engine's SQL constants, else its first words), from the call to its result.

    Installed on psycopg's Cursor.execute for the drain only; other threads (the service's)
    pass through unrecorded.
    """

    # The owner of a constant first: the modules that import it would otherwise name it.
    MODULES = ("accounting.triggers", "dispatch.engine.booking", "dispatch.engine.completion",
               "dispatch.engine.feed", "dispatch.engine.loop")  # fmt: skip

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        for module in self.MODULES:
            mod = importlib.import_module(module)
            for name, value in vars(mod).items():
                if name.isupper() and isinstance(value, str) and len(value) > 6:
                    self.names.setdefault(value, f"{module.rsplit('.', 1)[1]}.{name}")
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.thread = threading.get_ident()
        self._original: Any = None
        self.explain: set[str] = set()
        # label -> {"statements", "rows", "ms", "nodes": {node: ms}, "triggers": {name: [calls, ms]}}
        self.plans: dict[str, dict[str, Any]] = {}
        self.connections: dict[int, psycopg.Connection] = {}  # the loop thread's, by id

    def label(self, query: Any) -> str:
        text = query if isinstance(query, str) else str(getattr(query, "as_string", lambda _c: query)(None))
        return self.names.get(text) or " ".join(text.split())[:60]

    def __enter__(self) -> StatementClock:
        original = self._original = psycopg.Cursor.execute
        clock = self

        def execute(cur: psycopg.Cursor, query: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != clock.thread:
                return original(cur, query, *args, **kwargs)
            clock.connections.setdefault(id(cur.connection), cur.connection)
            label = clock.label(query)
            if label in clock.explain:
                clock.explained(original, cur, label, query, *args, **kwargs)
            started = time.perf_counter()
            try:
                return original(cur, query, *args, **kwargs)
            finally:
                clock.seconds[label] += time.perf_counter() - started
                clock.calls[label] += 1

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.Cursor.execute = self._original  # type: ignore[method-assign]

    def flush_stats(self) -> None:
        """Make the loop's sessions publish their function statistics now.

        A session flushes them to the shared ones at most once a second (PostgreSQL 15), so a
        read right after the drain missed some (the smoke test saw the proc insert trigger
        missing). `pg_stat_force_next_flush()` makes the session flush when it next goes idle,
        which it does before it answers the statement: once the answer is here, so are its stats.
        """
        for conn in self.connections.values():
            if conn.closed or conn.broken:
                continue
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                continue  # never the case after the loop stopped; its stats would wait for its commit
            conn.execute("SELECT pg_stat_force_next_flush()")
            if not conn.autocommit:
                conn.commit()  # the session flushes when idle outside a transaction

    def explained(self, original: Any, cur: psycopg.Cursor, label: str, query: str, *args: Any, **kwargs: Any) -> None:
        """Run `query` once under EXPLAIN ANALYZE in a savepoint rolled back after it, and add up its plan."""
        original(cur, "SAVEPOINT bench_profile_explain")
        try:
            original(cur, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, *args, **kwargs)
            (doc,) = cur.fetchone() or ([{}],)
        finally:
            original(cur, "ROLLBACK TO SAVEPOINT bench_profile_explain")
            original(cur, "RELEASE SAVEPOINT bench_profile_explain")
        top = doc[0]
        plan = self.plans.setdefault(label, {"statements": 0, "rows": 0, "ms": 0.0, "nodes": Counter(), "triggers": {}})
        plan["statements"] += 1
        plan["ms"] += float(top.get("Execution Time", 0.0))
        for trig in top.get("Triggers", []):
            name = f"{trig.get('Trigger Name')} on {trig.get('Relation')}"
            calls_ms = plan["triggers"].setdefault(name, [0, 0.0])
            calls_ms[0] += int(trig.get("Calls", 0))
            calls_ms[1] += float(trig.get("Time", 0.0))

        def walk(node: dict[str, Any]) -> float:
            """Add each node's own time (its total less its children's) under its type and relation."""
            loops = node.get("Actual Loops", 1)
            total = float(node.get("Actual Total Time", 0.0)) * loops
            children = sum(walk(child) for child in node.get("Plans", []))
            name = node.get("Node Type", "?")
            if node.get("Relation Name"):
                name += f" {node['Relation Name']}"
            if node.get("Operation"):
                name = f"{node['Operation']} {name}"
            plan["nodes"][name] += max(total - children, 0.0)
            if node.get("Node Type") == "ModifyTable":
                plan["rows"] += int(node.get("Actual Rows", 0))
            return total

        walk(top["Plan"])


def _functions(conn: Any) -> dict[str, tuple[int, float, float]]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return {name: (int(c), float(t), float(s)) for name, c, t, s in conn.execute(FUNCTIONS_SQL).fetchall()}


class Command(BaseCommand):
    help = (
        "Profile one drain of the booking loop: phase clocks, time waiting on PostgreSQL, hot functions, trigger time."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--prefix", default="bprof")
        parser.add_argument("--hosts", type=int, default=1200)
        parser.add_argument("--jobs", type=int, default=300)
        parser.add_argument("--layers", type=int, default=4)
        parser.add_argument("--frames-per-layer", type=int, default=5)
        parser.add_argument("--database-enforced", action="store_true", help="the shows unmanaged (triggers account)")
        parser.add_argument(
            "--contended", action="store_true", help="bench's contended farm (one subscription, one folder)"
        )
        parser.add_argument("--sub-burst", type=int, default=600, help="cores (contended farm)")
        parser.add_argument("--folder-max-cores", type=int, default=400, help="cores (contended farm)")
        parser.add_argument("--hold", action="store_true", help="frames never finish (no completions in the cycle)")
        parser.add_argument("--top", type=int, default=25, help="functions listed per table")
        parser.add_argument(
            "--explain",
            action="store_true",
            help="also EXPLAIN (ANALYZE, BUFFERS) each booking and completion statement in a rolled-back savepoint",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        extra: dict[str, Any] = {}
        if opts["contended"]:
            extra = {
                "allocs": 1,
                "sub_burst": opts["sub_burst"] * 100,
                "folder_max_cores": opts["folder_max_cores"] * 100,
            }
        spec = FarmSpec(
            prefix=opts["prefix"],
            hosts=opts["hosts"],
            jobs=opts["jobs"],
            layers=opts["layers"],
            frames_per_layer=opts["frames_per_layer"],
            managed=not opts["database_enforced"],
            **extra,
        )
        frames = spec.jobs * spec.layers * spec.frames_per_layer
        purge_farm(spec.prefix)
        seed_farm(spec)
        track = sql.SQL("ALTER DATABASE {} SET track_functions = 'all'").format(
            sql.Identifier(connection.settings_dict["NAME"])
        )
        untrack = sql.SQL("ALTER DATABASE {} RESET track_functions").format(
            sql.Identifier(connection.settings_dict["NAME"])
        )
        try:
            with db.connect(autocommit=True, application_name="cuesched-bench-profile") as conn:
                conn.execute(track)  # for the sessions opened from now on: the service's and the loop's
                conn.execute(f"VACUUM ANALYZE {VACUUMED}")
                before = _functions(conn)
            stop_service, stop_loop = threading.Event(), threading.Event()
            with env(**QUIET_LOOPS):
                service = AccountingService()
                service.start(stop_service, bootstrap_timeout=30)
                runtime = 3600 if opts["hold"] else 0
                launcher = SimulatedLauncher(
                    runtime_min=runtime, runtime_max=runtime, failure_rate=0, launch_failure_rate=0, seed=0
                )
                loop = DispatchLoop(service, launcher)
            if opts["hold"]:

                def watch() -> None:
                    deadline = time.monotonic() + 600
                    while loop.totals.booked < frames and time.monotonic() < deadline and not stop_loop.is_set():
                        time.sleep(0.005)
                    stop_loop.set()

                threading.Thread(target=watch, daemon=True).start()
            profile = cProfile.Profile()
            clock = StatementClock()
            if opts["explain"]:
                clock.explain = {"booking.BOOK_SQL", "completion.COMPLETE_SQL"}
            started = time.perf_counter()
            try:
                with clock:
                    profile.runcall(loop.run, stop_loop, not opts["hold"])
            finally:
                wall = time.perf_counter() - started
                stop_loop.set()
                stop_service.set()
                service.join()
                launcher.close()
            clock.flush_stats()
            with db.connect(autocommit=True, application_name="cuesched-bench-profile") as conn:
                after = _functions(conn)
        finally:
            with db.connect(autocommit=True, application_name="cuesched-bench-profile") as conn:
                conn.execute(untrack)
            purge_farm(spec.prefix)
        self._report(opts, spec, loop, wall, profile, before, after)
        self._statements(clock, loop, wall, opts["top"])

    def _report(
        self,
        opts: dict[str, Any],
        spec: FarmSpec,
        loop: DispatchLoop,
        wall: float,
        profile: cProfile.Profile,
        before: dict[str, tuple[int, float, float]],
        after: dict[str, tuple[int, float, float]],
    ) -> None:
        out = self.stdout.write
        t = loop.totals
        booked = max(t.booked, 1)
        mode = "database-enforced" if opts["database_enforced"] else "Store"
        shape = "contended" if opts["contended"] else "drain"
        out(
            f"{shape}{'-hold' if opts['hold'] else ''}, {mode}: {t.booked} booked in {t.batches} batches over "
            f"{loop.cycles} cycles, wall {wall:.2f}s under cProfile ({t.booked / wall:.0f} frames/s); "
            f"load {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
        )
        phases = dict(t.seconds)
        phases["rest of the cycle (placement, Store, launch, loop)"] = wall - sum(t.seconds.values())
        for name, seconds in phases.items():
            out(f"  {name}: {seconds:.3f}s, {100 * seconds / wall:.0f}%, {1e6 * seconds / booked:.0f} us per frame")
        stats = pstats.Stats(profile)
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        waiting, calls = 0.0, 0
        for (filename, _line, name), (_cc, nc, tt, _ct, _callers) in raw.items():
            where = f"{filename} {name}"
            if filename.endswith(("psycopg/cursor.py", "psycopg/connection.py")) and name in WAITS:
                calls += nc if filename.endswith("cursor.py") and name in ("execute", "executemany") else 0
            # psycopg blocks in its wait function (C or Python) until the server's answer is in.
            if "psycopg" in where and "wait" in name:
                waiting += tt
        out(
            f"  waiting on PostgreSQL (socket waits inside psycopg): {waiting:.3f}s, {100 * waiting / wall:.0f}%; "
            f"statements sent: {calls} ({calls / max(t.batches, 1):.1f} per batch, "
            f"{calls / max(loop.cycles, 1):.1f} per cycle)"
        )
        text = io.StringIO()
        stats.stream = text  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(opts["top"])
        out("functions by own time:")
        out(self._table(text.getvalue()))
        text = io.StringIO()
        stats.stream = text  # type: ignore[attr-defined]
        stats.sort_stats("cumulative").print_stats(r"(dispatch|accounting)/", opts["top"])
        out("the project's functions by total time:")
        out(self._table(text.getvalue()))
        out("PL/pgSQL functions on the server during the drain (pg_stat_user_functions, ms):")
        rows = []
        for name, (c, total, own) in after.items():
            c0, t0, s0 = before.get(name, (0, 0.0, 0.0))
            if c - c0:
                rows.append((own - s0, total - t0, c - c0, name))
        server = sum(r[0] for r in rows)
        for own, total, c, name in sorted(rows, reverse=True)[: opts["top"]]:
            out(f"  {name}: {c} calls, self {own:.1f} ms, total {total:.1f} ms, {1000 * own / c:.1f} us per call")
        out(f"  all functions, self time: {server:.1f} ms ({server / 1000 / wall * 100:.0f}% of the wall)")

    def _statements(self, clock: StatementClock, loop: DispatchLoop, wall: float, top: int) -> None:
        out = self.stdout.write
        total = sum(clock.seconds.values())
        batches = max(loop.totals.batches, 1)
        out(f"statements of the loop, wall from the call to the result ({total:.3f}s, {100 * total / wall:.0f}%):")
        for label, seconds in clock.seconds.most_common(top):
            n = clock.calls[label]
            out(
                f"  {label}: {n} calls ({n / batches:.1f} per batch), {seconds:.3f}s, "
                f"{1000 * seconds / n:.2f} ms per call, {100 * seconds / wall:.0f}%"
            )
        for label, plan in clock.plans.items():
            n, ms = plan["statements"], plan["ms"]
            out(f"EXPLAIN ANALYZE of {label}: {n} statements, {ms:.1f} ms executed, {ms / n:.2f} ms per statement")
            for name, own in plan["nodes"].most_common(top):
                if own >= 0.005 * ms:
                    out(f"  node {name}: {own:.1f} ms own, {100 * own / ms:.0f}%")
            for name, (calls, tms) in sorted(plan["triggers"].items(), key=lambda kv: -kv[1][1]):
                out(f"  trigger {name}: {calls} calls, {tms:.1f} ms, {100 * tms / ms:.0f}%")

    @staticmethod
    def _table(text: str) -> str:
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        return "\n".join(line for line in lines[start:] if line.strip())
