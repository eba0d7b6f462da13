"""`manage.py bench`: the project's figures side by side, each the median of several runs.

1. Booking throughput, Store against database-enforced accounting (the same farm with
   `b_scheduler_managed = false`), on the drain workload and on a contended one (one
   subscription, one folder), in three dispatcher shapes:
   - batched: our loop, one set-based transaction per batch of bookings, one worker;
   - workers: `--workers` such loops at once (run_scheduler --workers), each on its own share
     of hosts and jobs, so all they share is the accounting: the Store, or the subscription,
     folder and point rows the database path updates;
   - per-proc: Cuebot's shape, one booking per transaction, `--threads` workers, each booking
     taking the show's accounting rows (database path) for one transaction.
   The same shape runs for both accounting modes, so each ratio isolates the accounting.
2. The floor: the same writes for the same bookings (frame update, proc insert, host
   update) set-based in batches of the loop's size, with no scheduling logic at all.
3. Release throughput: `--agents` host agents completing one frame per transaction, as
   `run_agent` does, Store against database-enforced accounting on one show.
4. Recompute cycle at 100k procs over 10k jobs, notification-to-Store delay p50/p99 over
   1,000 releases, Store book+confirm pairs per second.

Writes bench.json and bench.png into --out.
"""

from __future__ import annotations

import json
import os
import threading
import time
from argparse import ArgumentParser
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from accounting import bench as acct_bench
from accounting import db
from accounting.bench import Spread
from accounting.management.commands import bench_store
from accounting.service import AccountingService
from dispatch import conf
from dispatch.engine.completion import Completion, complete
from dispatch.engine.feed import FreeHosts, fetch_pending
from dispatch.engine.loop import DispatchLoop
from dispatch.engine.placement import HostView
from dispatch.hosts.launchers.simulated import SimulatedLauncher
from dispatch.lab.seeding import FarmSeed, FarmSpec, purge_farm, seed_farm, show_name
from dispatch.lab.stress import QUIET_LOOPS, env

VACUUMED = "frame, proc, host, host_stat, job, job_stat, job_resource, layer, layer_stat, layer_resource"

# The procs of the held drain, in the order the agents report them.
HELD_PROCS_SQL = """
SELECT p.pk_proc FROM proc p JOIN show s ON s.pk_show = p.pk_show
WHERE s.str_name = ANY(%s) ORDER BY p.ts_booked, p.pk_proc LIMIT %s
"""

# The floor: one batch of planned bookings (frame, host, cores, memory) as the three writes
# of a booking, set-based in one transaction. The plan (which frame on which host) is made
# before the clock starts: the floor has no scheduling logic at all.
FLOOR_SQL = """
WITH pairs AS (
  SELECT * FROM unnest(%(frames)s::text[], %(hosts)s::text[], %(cores)s::bigint[], %(mem)s::bigint[])
    AS x(pk_frame, pk_host, c, m)
), started AS (
  UPDATE frame f SET str_state = 'RUNNING', int_version = f.int_version + 1, ts_started = now(),
         int_cores = pairs.c, int_mem_reserved = pairs.m
  FROM pairs WHERE f.pk_frame = pairs.pk_frame
  RETURNING f.pk_frame, f.pk_job, f.pk_layer, pairs.pk_host, pairs.c, pairs.m
), procs AS (
  INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, int_mem_reserved)
  SELECT gen_random_uuid()::text, st.pk_host, j.pk_show, st.pk_layer, st.pk_job, st.pk_frame, st.c, st.m
  FROM started st JOIN job j ON j.pk_job = st.pk_job
  RETURNING pk_host, int_cores_reserved, int_mem_reserved
)
UPDATE host h SET int_cores_idle = h.int_cores_idle - agg.c, int_mem_idle = h.int_mem_idle - agg.m
FROM (SELECT pk_host, SUM(int_cores_reserved) AS c, SUM(int_mem_reserved) AS m FROM procs GROUP BY pk_host) agg
WHERE h.pk_host = agg.pk_host
"""
PLAN_FRAMES_SQL = """
SELECT f.pk_frame, l.int_cores_min, l.int_mem_min FROM frame f JOIN job j ON j.pk_job = f.pk_job
JOIN layer l ON l.pk_layer = f.pk_layer WHERE j.pk_show = ANY(%s) AND f.str_state = 'WAITING' ORDER BY f.pk_frame
"""
PLAN_HOSTS_SQL = "SELECT pk_host, int_cores_idle, int_mem_idle FROM host WHERE pk_host = ANY(%s) ORDER BY pk_host"


def plan_floor(
    frames: list[tuple[str, int, int]], hosts: list[tuple[str, int, int]]
) -> list[tuple[str, str, int, int]]:
    """Frames on hosts round-robin, skipping hosts without room (the writes must be valid)."""
    idle = [[h, c, m] for h, c, m in hosts]
    out = []
    i = 0
    for frame, cores, mem in frames:
        for _ in range(len(idle)):
            h = idle[i % len(idle)]
            i += 1
            if h[1] >= cores and h[2] >= mem:
                h[1] -= cores
                h[2] -= mem
                out.append((frame, h[0], cores, mem))
                break
    return out


def _spread(samples: list[float]) -> dict[str, float]:
    s = Spread.of(samples)
    return {"median": s.median, "min": s.low, "max": s.high, "runs": s.runs}


class Command(BaseCommand):
    help = "Booking throughput (Store vs database-enforced, vs the floor) and the accounting figures; JSON + PNG."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--out", default="artifacts/bench/")
        parser.add_argument("--runs", type=int, default=3, help="runs per figure (median, min, max)")
        parser.add_argument("--prefix", default="bench")
        parser.add_argument("--hosts", type=int, default=1200)
        parser.add_argument("--jobs", type=int, default=300)
        parser.add_argument("--layers", type=int, default=4)
        parser.add_argument("--frames-per-layer", type=int, default=5)
        parser.add_argument("--sub-burst", type=int, default=600, help="cores (contended workload)")
        parser.add_argument("--folder-max-cores", type=int, default=400, help="cores (contended workload)")
        parser.add_argument("--workers", type=int, default=2, help="dispatch workers of the contended 'workers' shape")
        parser.add_argument("--threads", type=int, default=4, help="dispatch workers of the per-proc shape")
        parser.add_argument(
            "--per-proc-seconds",
            type=float,
            default=10.0,
            help="the per-proc shape books for this long (it would take minutes to drain the farm)",
        )
        parser.add_argument("--agents", type=int, default=8, help="host agents reporting completions (releases part)")
        parser.add_argument("--release-count", type=int, default=3000, help="completions timed per releases run")
        parser.add_argument("--recompute-jobs", type=int, default=10_000)
        parser.add_argument("--recompute-frames", type=int, default=10, help="procs per job")
        parser.add_argument("--releases", type=int, default=1000)
        parser.add_argument("--store-pairs", type=int, default=200_000)
        parser.add_argument(
            "--skip",
            default="",
            help="comma list of parts to skip: throughput, floor, releases, accounting, fairshare, limits (quick runs)",
        )
        parser.add_argument("--fairshare-shows", type=int, default=3, help="shows of the fair-share drain farm")
        parser.add_argument(
            "--feed-calls", type=int, default=20, help="feed queries timed per variant (fairshare part)"
        )
        parser.add_argument(
            "--limits-per-layer",
            type=int,
            default=2,
            help="licence limits put on every layer in the limits-on drains (limits part)",
        )

    # -- one drain --------------------------------------------------------------------------
    def _spec(self, opts: dict[str, Any], *, managed: bool, contended: bool) -> FarmSpec:
        extra: dict[str, Any] = {}
        if contended:
            extra = {
                "allocs": 1,
                "sub_burst": opts["sub_burst"] * 100,
                "folder_max_cores": opts["folder_max_cores"] * 100,
            }
        return FarmSpec(
            prefix=opts["prefix"],
            hosts=opts["hosts"],
            jobs=opts["jobs"],
            layers=opts["layers"],
            frames_per_layer=opts["frames_per_layer"],
            managed=managed,
            **extra,
        )

    def _drain(
        self,
        spec: FarmSpec,
        *,
        threads: int,
        batch_size: int | None,
        seconds: float | None = None,
        hold: bool = False,
        sharded: bool = False,
        while_held: Callable[[], dict[str, float]] | None = None,
        after_seed: Callable[[FarmSeed], None] | None = None,
    ) -> dict[str, float]:
        """One drain to idle, or `seconds` of steady booking (the slow per-proc shape).

        With `hold` nothing completes; `while_held` then runs once every frame is booked, with
        the accounting service still listening, and its figures join the result.
        """
        purge_farm(spec.prefix)
        seeded = seed_farm(spec)
        if after_seed is not None:
            after_seed(seeded)
        with db.connect(application_name="cuesched-bench") as conn:
            conn.execute(f"VACUUM ANALYZE {VACUUMED}")
        stop = threading.Event()
        with env(**QUIET_LOOPS):
            service = AccountingService()
            service.start(stop, bootstrap_timeout=30)
            loops = [
                DispatchLoop(
                    service,
                    SimulatedLauncher(
                        runtime_min=3600 if hold else 0,
                        runtime_max=3600 if hold else 0,
                        failure_rate=0,
                        launch_failure_rate=0,
                        seed=i,
                    ),
                    batch_size=batch_size,
                    shard=(i, threads) if sharded else (0, 1),
                )
                for i in range(threads)
            ]
        loop_stop = threading.Event()
        workers = [
            threading.Thread(target=lp.run, args=(loop_stop, seconds is None and not hold), daemon=True) for lp in loops
        ]
        started = time.perf_counter()
        for w in workers:
            w.start()
        if seconds is not None:
            loop_stop.wait(seconds)
            loop_stop.set()
        elif hold:
            # Nothing completes: the phase is over once every frame is booked.
            frames = spec.jobs * spec.layers * spec.frames_per_layer
            deadline = time.monotonic() + 600
            while sum(lp.totals.booked for lp in loops) < frames and time.monotonic() < deadline:
                time.sleep(0.01)
            loop_stop.set()
        for w in workers:
            w.join(600)
        wall = time.perf_counter() - started
        loop_stop.set()
        try:
            held = while_held() if while_held is not None else {}
        finally:
            stop.set()
            service.join()
        firsts = [lp.first_booking_cycle_at for lp in loops if lp.first_booking_cycle_at is not None]
        lasts = [lp.last_commit_at for lp in loops if lp.last_commit_at is not None]
        window = (max(lasts) - min(firsts)) if firsts and lasts else 0.0
        booked = sum(lp.totals.booked for lp in loops)
        rejected: dict[str, int] = {}
        for lp in loops:
            for k, v in lp.totals.rejected.items():
                rejected[k] = rejected.get(k, 0) + v
        purge_farm(spec.prefix)
        return {
            "rate": booked / window if window else 0.0,
            "window": window,
            "wall": wall,
            "booked": booked,
            **{f"rejected_{k}": v for k, v in rejected.items()},
            **held,
        }

    def _throughput(self, opts: dict[str, Any], results: dict[str, Any]) -> None:
        variants = []
        for workload, shape, threads, batch in (
            ("drain-hold", "batched", 1, None),
            ("drain", "batched", 1, None),
            ("contended", "batched", 1, None),
            # Several writers at once: what makes the shared rows (or the Store) contended.
            ("contended", "workers", opts["workers"], None),
            ("contended", "per-proc", opts["threads"], 1),
        ):
            for mode in ("store", "database"):
                variants.append((workload, shape, threads, batch, mode))
        # Interleaved (each round runs every variant once, the floor included), so that the
        # load of this shared machine weighs on every figure alike.
        samples: dict[str, list[dict[str, float]]] = {}
        floor: list[float] = []
        for i in range(opts["runs"]):
            for workload, shape, threads, batch, mode in variants:
                name = f"{workload}/{shape}/{mode}"
                spec = self._spec(opts, managed=mode == "store", contended=workload == "contended")
                seconds = opts["per_proc_seconds"] if shape == "per-proc" else None
                r = self._drain(
                    spec,
                    threads=threads,
                    batch_size=batch,
                    seconds=seconds,
                    hold=workload == "drain-hold",
                    sharded=threads > 1,
                )
                samples.setdefault(name, []).append(r)
                self.stdout.write(
                    f"  {name} run {i + 1}: throughput: {r['rate']:.0f} frames/s over a {r['window']:.2f}s "
                    f"booking window (wall {r['wall']:.2f}s), booked {r['booked']:.0f}"
                )
            if "floor" not in opts["skip"]:
                floor.append(self._floor_once(opts))
                self.stdout.write(f"  floor run {i + 1}: {floor[-1]:.0f} frames/s")
        table: dict[str, Any] = {}
        for workload, shape, threads, batch, mode in variants:
            name = f"{workload}/{shape}/{mode}"
            runs = samples[name]
            table[name] = {
                "workload": workload,
                "shape": shape,
                "mode": mode,
                "threads": threads,
                "batch_size": batch or conf.batch_size(),
                "rate": _spread([r["rate"] for r in runs]),
                "runs": runs,
            }
            self.stdout.write(f"{name}: {self._fmt(table[name]['rate'], 'frames/s')}")
        if floor:
            results["floor"] = {"batch_size": conf.batch_size(), "rate": _spread(floor)}
            self.stdout.write(
                f"floor (bulk writes, no scheduling, batches of {conf.batch_size()}): "
                f"{self._fmt(results['floor']['rate'], 'frames/s')}"
            )
            for name in ("drain/batched/store", "drain-hold/batched/store"):
                share = table[name]["rate"]["median"] / results["floor"]["rate"]["median"]
                results.setdefault("share_of_floor", {})[name] = share
                self.stdout.write(f"{name} as a share of the floor: {100 * share:.0f}%")
        results["throughput"] = table
        ratios = {}
        for workload, shape in (
            ("drain", "batched"),
            ("drain-hold", "batched"),
            ("contended", "batched"),
            ("contended", "workers"),
            ("contended", "per-proc"),
        ):
            s = table.get(f"{workload}/{shape}/store")
            d = table.get(f"{workload}/{shape}/database")
            if s and d and d["rate"]["median"]:
                ratios[f"{workload}/{shape}"] = s["rate"]["median"] / d["rate"]["median"]
        best_store = table["contended/batched/store"]["rate"]["median"]
        cuebot = table.get("contended/per-proc/database")
        if cuebot and cuebot["rate"]["median"]:
            ratios["contended/ours vs cuebot-shaped database-enforced"] = best_store / cuebot["rate"]["median"]
        results["ratios"] = ratios
        for k, v in ratios.items():
            self.stdout.write(f"ratio Store / database-enforced, {k}: {v:.2f}x")

    def _release_once(self, opts: dict[str, Any], *, managed: bool) -> float:
        """Completions/s when `--agents` host agents each report one frame per transaction.

        The production release path (`run_agent` writes each frame's end itself), on one show
        with every frame of the drain workload running: database-enforced, each release
        updates the show's counter rows under its accounting lock; with the Store, it only
        notifies.
        """
        spec = self._spec(opts, managed=managed, contended=False)
        count = min(opts["release_count"], spec.jobs * spec.layers * spec.frames_per_layer)
        shows = [show_name(spec.prefix, i) for i in range(spec.shows)]

        def release() -> dict[str, float]:
            with db.connect(application_name="cuesched-bench") as conn:
                procs = [r[0] for r in conn.execute(HELD_PROCS_SQL, (shows, count))]
            todo = iter(procs)
            lock = threading.Lock()
            errors: list[BaseException] = []

            def agent() -> None:
                try:
                    with db.connect(autocommit=True, application_name="cuesched-bench-agent") as conn:
                        while True:
                            with lock:
                                pk = next(todo, None)
                            if pk is None:
                                return
                            complete(conn, [Completion(pk, 0)])
                except BaseException as exc:  # reported below: a dead agent must not pass for a fast one
                    errors.append(exc)

            agents = [threading.Thread(target=agent, daemon=True) for _ in range(opts["agents"])]
            started = time.perf_counter()
            for a in agents:
                a.start()
            for a in agents:
                a.join(600)
            elapsed = time.perf_counter() - started
            if errors:
                raise CommandError(f"a release agent failed: {errors[0]!r}") from errors[0]
            return {"releases": len(procs), "release_seconds": elapsed}

        r = self._drain(spec, threads=1, batch_size=None, hold=True, while_held=release)
        return r["releases"] / r["release_seconds"] if r["release_seconds"] else 0.0

    def _releases(self, opts: dict[str, Any], results: dict[str, Any]) -> None:
        rates: dict[str, list[float]] = {"store": [], "database": []}
        for i in range(opts["runs"]):
            for mode in rates:
                rates[mode].append(self._release_once(opts, managed=mode == "store"))
                self.stdout.write(f"  releases/{mode} run {i + 1}: {rates[mode][-1]:.0f} completions/s")
        table = {mode: _spread(values) for mode, values in rates.items()}
        ratio = table["store"]["median"] / table["database"]["median"] if table["database"]["median"] else 0.0
        results["releases"] = {"agents": opts["agents"], "rate": table, "ratio": ratio}
        for mode, spread in table.items():
            self.stdout.write(
                f"releases/{mode}, {opts['agents']} agents, one frame per transaction: "
                f"{self._fmt(spread, 'completions/s')}"
            )
        self.stdout.write(f"ratio Store / database-enforced, releases: {ratio:.2f}x")

    def _floor_once(self, opts: dict[str, Any]) -> float:
        batch = conf.batch_size()
        spec = self._spec(opts, managed=True, contended=False)
        purge_farm(spec.prefix)
        seed = seed_farm(spec)
        with db.connect(application_name="cuesched-bench") as conn:
            conn.execute(f"VACUUM ANALYZE {VACUUMED}")
            frames = [tuple(r) for r in conn.execute(PLAN_FRAMES_SQL, (list(seed.show_ids),))]
            hosts = [tuple(r) for r in conn.execute(PLAN_HOSTS_SQL, (list(seed.host_ids),))]
            plan = plan_floor(frames, hosts)  # type: ignore[arg-type]
            started = time.perf_counter()
            for i in range(0, len(plan), batch):
                chunk = plan[i : i + batch]
                with conn.transaction():
                    conn.execute(
                        FLOOR_SQL,
                        {
                            "frames": [c[0] for c in chunk],
                            "hosts": [c[1] for c in chunk],
                            "cores": [c[2] for c in chunk],
                            "mem": [c[3] for c in chunk],
                        },
                    )
            elapsed = time.perf_counter() - started
        purge_farm(spec.prefix)
        return len(plan) / elapsed if elapsed else 0.0

    def _accounting(self, opts: dict[str, Any], results: dict[str, Any]) -> None:
        prefix = f"{opts['prefix']}_acct"
        purge_farm(prefix)
        spec = FarmSpec(
            prefix=prefix,
            hosts=2000,
            jobs=opts["recompute_jobs"],
            layers=1,
            frames_per_layer=opts["recompute_frames"],
            host_cores_choices=(128,),
            host_mem_gb_choices=(256,),
            managed=True,
            allocs=3,
        )
        seed_farm(spec)
        try:
            with db.connect(application_name="cuesched-bench") as conn:
                # Fresh statistics first: with the counts of an emptier table the planner
                # turns book_all's joins over 100k frames quadratic (minutes instead of seconds).
                conn.execute(f"VACUUM ANALYZE {VACUUMED}")
                procs = acct_bench.book_all(conn, prefix, spec.jobs * spec.frames_per_layer)
                conn.execute(f"VACUUM ANALYZE {VACUUMED}")
            rc = acct_bench.measure_recompute(max(opts["runs"], 5))
            results["recompute"] = {
                "procs": rc.procs,
                "jobs": rc.jobs,
                "cycle": asdict(rc.cycle),
                "store_side": asdict(rc.store_side),
                "pg_side": asdict(rc.pg_side),
            }
            self.stdout.write(
                f"recompute cycle with {rc.procs} procs ({procs} booked) over {rc.jobs} jobs: {rc.cycle.fmt()}"
            )
            self.stdout.write(f"  store side {rc.store_side.fmt()}; pg side {rc.pg_side.fmt()}")
            nd = acct_bench.measure_notify_delay(prefix, opts["releases"])
            results["notify"] = asdict(nd)
            self.stdout.write(
                f"notification-to-Store delay over {nd.releases} releases: p50 {nd.p50_ms:.2f} ms, "
                f"p99 {nd.p99_ms:.2f} ms, max {nd.max_ms:.2f} ms"
            )
        finally:
            purge_farm(prefix)
        pairs = []
        for _ in range(max(opts["runs"], 3)):
            seconds, _rejected = bench_store.run_once(opts["store_pairs"], 1, False)
            pairs.append(opts["store_pairs"] / seconds)
        results["store_pairs_per_s"] = _spread(pairs)
        self.stdout.write(
            f"Store book+confirm pairs/s (one thread): {self._fmt(results['store_pairs_per_s'], 'pairs/s')}"
        )

    # -- fair share (issue 19) ----------------------------------------------------------------
    def _fairshare_spec(self, opts: dict[str, Any]) -> FarmSpec:
        """The drain farm over several shows, each sized a fraction of its burst, so the tiers
        differ and move as the shows book (fair share reorders the feed every cycle)."""
        spec = self._spec(opts, managed=True, contended=False)
        return replace(spec, shows=opts["fairshare_shows"], sub_size=spec.hosts * 2000 // opts["fairshare_shows"])

    def _feed_cost(self, opts: dict[str, Any], spec: FarmSpec) -> dict[str, list[float]]:
        """Milliseconds of one feed read (its two queries) on the seeded farm, per variant: fair
        share on or off, with or without the head-of-line host test."""
        purge_farm(spec.prefix)
        seed_farm(spec)
        out: dict[str, list[float]] = {}
        with db.connect(autocommit=True, application_name="cuesched-bench") as conn:
            conn.execute(f"VACUUM ANALYZE {VACUUMED}")
            view = HostView()
            view.load(conn)
            free = FreeHosts.of(view.hosts.values())
            for _ in range(opts["feed_calls"]):
                for name, fair, hosts in (
                    ("fair share on, host test", True, free),
                    ("fair share off, host test", False, free),
                    ("fair share on, no host test", True, None),
                    ("fair share off, no host test", False, None),
                ):
                    t0 = time.perf_counter()
                    fetch_pending(
                        conn,
                        managed_only=False,
                        max_jobs=conf.feed_max_jobs(),
                        frames_per_layer=conf.feed_frames_per_layer(),
                        max_frames=conf.feed_max_frames(),
                        free=hosts,
                        fair_share=fair,
                    )
                    out.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
        purge_farm(spec.prefix)
        return out

    def _fairshare(self, opts: dict[str, Any], results: dict[str, Any]) -> None:
        """Drain throughput with CUESCHED_FAIR_SHARE on against off, interleaved in one run, and
        what the feed read costs in each variant. The head-of-line filters run in both (they
        are not a setting); the feed figures show their cost alone."""
        spec = self._fairshare_spec(opts)
        samples: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
        for i in range(opts["runs"]):
            for mode in ("on", "off"):
                with env(CUESCHED_FAIR_SHARE="1" if mode == "on" else "0"):
                    r = self._drain(spec, threads=1, batch_size=None)
                samples[mode].append(r)
                self.stdout.write(
                    f"  fairshare {mode} run {i + 1}: throughput: {r['rate']:.0f} frames/s over a "
                    f"{r['window']:.2f}s booking window (wall {r['wall']:.2f}s), booked {r['booked']:.0f}"
                )
        table: dict[str, Any] = {}
        for mode, runs in samples.items():
            table[f"drain/fairshare-{mode}"] = {"rate": _spread([r["rate"] for r in runs]), "runs": runs}
            rate = self._fmt(table[f"drain/fairshare-{mode}"]["rate"], "frames/s")
            self.stdout.write(f"drain, {spec.shows} shows, fair share {mode}: {rate}")
        on, off = (table[f"drain/fairshare-{m}"]["rate"]["median"] for m in ("on", "off"))
        if off:
            table["ratio_on_off"] = on / off
            self.stdout.write(f"ratio fair share on / off (drain throughput): {on / off:.2f}x")
        feed = self._feed_cost(opts, spec)
        table["feed_ms"] = {name: _spread(ms) for name, ms in feed.items()}
        for name, spread in table["feed_ms"].items():
            self.stdout.write(
                f"feed read ({spec.jobs} jobs, {spec.hosts} hosts), {name}: {spread['median']:.1f} ms "
                f"(min {spread['min']:.1f}, max {spread['max']:.1f}, {spread['runs']} calls)"
            )
        results["fairshare"] = table
    # -- licence limits on against off (issue 19) ----------------------------------------------
    def _limits_on_off(self, opts: dict[str, Any], results: dict[str, Any]) -> None:
        """The drain workload with every layer holding `--limits-per-layer` licence limits, against none.

        The limits are large enough never to bind (max = twice the farm's frames): the figure is
        the cost of enforcing them (the Store's check, the proc triggers' lock and recount, the
        feed's filter), not the effect of a full limit. Interleaved runs, each mode, both paths.
        """
        per_layer = opts["limits_per_layer"]
        frames = opts["jobs"] * opts["layers"] * opts["frames_per_layer"]

        def tag(seeded: FarmSeed) -> None:
            with db.connect(autocommit=True, application_name="cuesched-bench") as conn:
                names = [f"{opts['prefix']}-lic{i}" for i in range(per_layer)]
                conn.execute(
                    "DELETE FROM layer_limit WHERE pk_limit_record IN"
                    " (SELECT pk_limit_record FROM limit_record WHERE str_name = ANY(%s))",
                    (names,),
                )
                conn.execute("DELETE FROM limit_record WHERE str_name = ANY(%s)", (names,))
                ids = [
                    row[0]
                    for row in conn.execute(
                        "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value)"
                        " SELECT gen_random_uuid()::text, n, %s FROM unnest(%s::text[]) AS n RETURNING pk_limit_record",
                        (2 * frames, names),
                    ).fetchall()
                ]
                conn.execute(
                    "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record)"
                    " SELECT gen_random_uuid()::text, l, r FROM unnest(%s::text[]) AS l, unnest(%s::text[]) AS r",
                    (list(seeded.layer_ids), ids),
                )

        samples: dict[str, list[float]] = {}
        for i in range(opts["runs"]):
            for mode in ("store", "database"):
                for limits in ("off", "on"):
                    spec = self._spec(opts, managed=mode == "store", contended=False)
                    r = self._drain(spec, threads=1, batch_size=None, after_seed=tag if limits == "on" else None)
                    name = f"drain/{mode}/limits-{limits}"
                    samples.setdefault(name, []).append(r["rate"])
                    self.stdout.write(
                        f"  {name} run {i + 1}: {r['rate']:.0f} frames/s over {r['window']:.2f}s, "
                        f"booked {r['booked']:.0f}"
                    )
        table = {name: _spread(rates) for name, rates in samples.items()}
        results["limits"] = {"limits_per_layer": per_layer, "rate": table}
        for name, spread in table.items():
            self.stdout.write(f"{name}: {self._fmt(spread, 'frames/s')}")
        for mode in ("store", "database"):
            on, off = table[f"drain/{mode}/limits-on"], table[f"drain/{mode}/limits-off"]
            if off["median"]:
                ratio = on["median"] / off["median"]
                results["limits"][f"ratio_{mode}"] = ratio
                self.stdout.write(f"limits on / off, {mode}: {ratio:.2f}x")

    @staticmethod
    def _fmt(s: dict[str, float], unit: str) -> str:
        return f"{s['median']:.0f} {unit} (min {s['min']:.0f}, max {s['max']:.0f}, {s['runs']} runs)"

    def handle(self, *args: Any, **opts: Any) -> None:
        skip = {s.strip() for s in opts["skip"].split(",") if s.strip()}
        out = Path(opts["out"])
        out.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_before": os.getloadavg(),
            "cpus": os.cpu_count(),
            "options": {k: v for k, v in opts.items() if isinstance(v, (int, float, str))},
        }
        if "throughput" not in skip:
            self._throughput(opts, results)
        if "releases" not in skip:
            self._releases(opts, results)
        if "accounting" not in skip:
            self._accounting(opts, results)
        if "fairshare" not in skip:
            self._fairshare(opts, results)
        if "limits" not in skip:
            self._limits_on_off(opts, results)
        results["load_average_after"] = os.getloadavg()
        (out / "bench.json").write_text(json.dumps(results, indent=2, default=str))
        chart(results, out / "bench.png")
        self.stdout.write(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


def chart(results: dict[str, Any], path: Path) -> None:
    """Throughput bars with min/max whiskers and the floor; accounting figures against their targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 1, 2]})
    names, med, lo, hi, colors = [], [], [], [], []
    for name, row in results.get("throughput", {}).items():
        names.append(name.replace("/", "\n"))
        r = row["rate"]
        med.append(r["median"])
        lo.append(r["median"] - r["min"])
        hi.append(r["max"] - r["median"])
        colors.append("tab:blue" if row["mode"] == "store" else "tab:orange")
    if "floor" in results:
        r = results["floor"]["rate"]
        names.append("floor\n(bulk writes,\nno scheduling)")
        med.append(r["median"])
        lo.append(r["median"] - r["min"])
        hi.append(r["max"] - r["median"])
        colors.append("tab:gray")
    ax1.bar(range(len(names)), med, yerr=[lo, hi], color=colors, capsize=4)
    for i, v in enumerate(med):
        ax1.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax1.axhline(2000, color="green", linestyle="--", linewidth=1, label="target 2,000 frames/s (drain)")
    ax1.axhline(975, color="red", linestyle=":", linewidth=1, label="OpenCue Rust scheduler, published 975")
    ax1.set_xticks(range(len(names)), names, fontsize=8)
    ax1.set_ylabel("frames booked per second (median, min-max)")
    ratios = results.get("ratios", {})
    ax1.set_title(
        "Booking throughput: Store (blue) vs database-enforced (orange)\n"
        + "\n".join(f"Store/database {k}: {v:.2f}x" for k, v in ratios.items()),
        fontsize=9,
    )
    ax1.legend(fontsize=8)
    if "releases" in results:
        rel = results["releases"]
        spreads = [rel["rate"]["store"], rel["rate"]["database"]]
        meds = [r["median"] for r in spreads]
        ax3.bar(
            [0, 1],
            meds,
            yerr=[[m - r["min"] for m, r in zip(meds, spreads, strict=True)],
                  [r["max"] - m for m, r in zip(meds, spreads, strict=True)]],
            color=["tab:blue", "tab:orange"],
            capsize=4,
        )  # fmt: skip
        for i, v in enumerate(meds):
            ax3.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax3.set_xticks([0, 1], ["store", "database"], fontsize=8)
        ax3.set_ylabel("completions per second (median, min-max)")
        ax3.set_title(
            f"Releases: {rel['agents']} agents,\none frame per transaction\nStore/database: {rel['ratio']:.2f}x",
            fontsize=9,
        )
    else:
        ax3.set_axis_off()
    labels, values, targets = [], [], []
    if "recompute" in results:
        c = results["recompute"]["cycle"]
        labels.append(f"recompute cycle\n{results['recompute']['procs']} procs (ms)")
        values.append(c["median"] * 1000)
        targets.append(1000)
    if "notify" in results:
        labels += ["notify p50 (ms)", "notify p99 (ms)"]
        values += [results["notify"]["p50_ms"], results["notify"]["p99_ms"]]
        targets += [50, 50]
    if labels:
        bars = ax2.bar(range(len(labels)), values, color="tab:blue")
        ax2.scatter(range(len(labels)), targets, color="red", marker="_", s=600, label="target (below)", zorder=3)
        for b, v in zip(bars, values, strict=True):
            ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax2.set_xticks(range(len(labels)), labels, fontsize=8)
        ax2.set_yscale("log")
        title = "Accounting figures (log scale)"
        if "store_pairs_per_s" in results:
            title += f"\nStore book+confirm: {results['store_pairs_per_s']['median']:,.0f} pairs/s"
        ax2.set_title(title, fontsize=9)
        ax2.legend(fontsize=8)
    load = ", ".join(f"{x:.1f}" for x in results.get("load_average_before") or ())
    fig.suptitle(
        f"cuesched bench {results.get('started_at')} ({results.get('cpus')} CPUs, load before {load})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
