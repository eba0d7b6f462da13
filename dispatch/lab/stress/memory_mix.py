"""Phase `memory_mix`: a memory-heavy mixed farm, and the memory ledger beside the cores (issue 28).

Hosts of three memory sizes (16, 64 and 256 GB; some with GPUs), layers asking from 2 to 48 GB,
threadable and not, GPU and not, on one managed and one unmanaged show, frames that overlap.
Memory, not cores, is what runs out first on most hosts, so host choice (`scoring`) and the GPU
rule (`gpu_hosts`) are exercised where they decide. While the load runs, a sampler reads, in
one statement each time (one snapshot), the ledgers no writer may break:

* memory: per host SUM(proc.int_mem_reserved) <= int_mem, and int_mem_idle is exactly
  int_mem - SUM(proc.int_mem_reserved) (a host's memory is booked where its procs are);
* GPUs and GPU memory: the same, exact;
* charged = booked: the unmanaged show's five counter tables equal SUM(proc) (the triggers
  charge what the procs book, in the same transaction); the managed show's Store against
  SUM(proc) is the audit every phase ends with (its in-flight figures make it exact only at rest).

The phase ends with that audit (caps, cores ledger, frame and proc states, counters) and the
memory ledger once more at rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from accounting import db
from dispatch.lab.seeding import FarmSeed
from dispatch.lab.stress.audit import DB_COUNTERS_SQL
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import Run, run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport

# (what, host, seen, expected) for every host of the farm whose memory or GPU ledger is wrong.
LEDGER_SQL = """
WITH p AS (
  SELECT pk_host, SUM(int_mem_reserved)::bigint AS mem, SUM(int_gpus_reserved)::bigint AS gpus,
         SUM(int_gpu_mem_reserved)::bigint AS gpu_mem
  FROM proc WHERE pk_host = ANY(%(hosts)s) GROUP BY pk_host
), h AS (
  SELECT h.pk_host, h.int_mem, h.int_mem_idle, h.int_gpus, h.int_gpus_idle, h.int_gpu_mem, h.int_gpu_mem_idle,
         COALESCE(p.mem, 0) AS mem, COALESCE(p.gpus, 0) AS gpus, COALESCE(p.gpu_mem, 0) AS gpu_mem
  FROM host h LEFT JOIN p ON p.pk_host = h.pk_host WHERE h.pk_host = ANY(%(hosts)s)
)
SELECT 'mem_over_host', pk_host, mem, int_mem FROM h WHERE mem > int_mem
UNION ALL SELECT 'mem_idle', pk_host, int_mem_idle, int_mem - mem FROM h WHERE int_mem_idle <> int_mem - mem
UNION ALL SELECT 'gpus_idle', pk_host, int_gpus_idle, int_gpus - gpus FROM h WHERE int_gpus_idle <> int_gpus - gpus
UNION ALL SELECT 'gpu_mem_idle', pk_host, int_gpu_mem_idle, int_gpu_mem - gpu_mem FROM h
  WHERE int_gpu_mem_idle <> int_gpu_mem - gpu_mem
"""
# What ran where: frames on hosts with GPUs, with and without GPUs of their own, and the peak
# share of the farm's memory booked (the farm is memory-heavy when it nears 1).
SHAPE_SQL = """
SELECT count(*) FILTER (WHERE h.int_gpus > 0 AND p.int_gpus_reserved > 0),
       count(*) FILTER (WHERE h.int_gpus > 0 AND p.int_gpus_reserved = 0),
       COALESCE(SUM(p.int_mem_reserved), 0)::float8 / NULLIF((SELECT SUM(int_mem) FROM host
                                                              WHERE pk_host = ANY(%(hosts)s)), 0),
       COALESCE(SUM(p.int_cores_reserved), 0)::float8 / NULLIF((SELECT SUM(int_cores) FROM host
                                                                WHERE pk_host = ANY(%(hosts)s)), 0)
FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_host = ANY(%(hosts)s)
"""


GPU_HOST_SQL = """
WITH g AS (SELECT pk_host FROM host WHERE pk_host = ANY(%(hosts)s::text[]) ORDER BY str_name LIMIT %(n)s)
UPDATE host h SET int_cores = 1600, int_cores_idle = 1600, int_mem = %(mem)s, int_mem_idle = %(mem)s,
       int_gpus = 2, int_gpus_idle = 2, int_gpu_mem = %(gpu_mem)s, int_gpu_mem_idle = %(gpu_mem)s
FROM g WHERE h.pk_host = g.pk_host
"""
GPU_HOST_STAT_SQL = """
UPDATE host_stat hs SET int_mem_total = h.int_mem, int_mem_free = h.int_mem, int_gpu_mem_total = h.int_gpu_mem,
       int_gpu_mem_free = h.int_gpu_mem
FROM host h WHERE h.pk_host = hs.pk_host AND h.pk_host = ANY(%(hosts)s::text[]) AND h.int_gpus > 0
"""
KB_PER_GB = 1024 * 1024


def _mixed_farm(seed: FarmSeed) -> Callable[[], None] | None:
    """Before anything books: every other layer not threadable (the seeder makes them all
    threadable), and the farm's first hosts GPU hosts of 256 GB, one per eight hosts (at least
    one), so every GPU layer fits one whatever its memory."""
    hosts = list(seed.host_ids)
    with db.connect(autocommit=True, application_name="cuesched-stress-mm") as conn:
        conn.execute(
            "UPDATE layer SET b_threadable = false WHERE pk_layer = ANY(%s::text[]) AND int_dispatch_order %% 2 = 0",
            (list(seed.layer_ids),),
        )
        params = {"hosts": hosts, "n": max(1, len(hosts) // 8), "mem": 256 * KB_PER_GB, "gpu_mem": 32 * KB_PER_GB}
        conn.execute(GPU_HOST_SQL, params)
        conn.execute(GPU_HOST_STAT_SQL, params)
    return None


def phase_memory_mix(cfg: StressConfig) -> PhaseReport:
    spec = cfg.memory_mix_spec()
    params: dict[str, list[str]] = {}
    problems: list[str] = []
    stats = {"samples": 0, "gpu_frames": 0, "cpu_on_gpu_hosts": 0, "mem_peak": 0.0, "cores_peak": 0.0}

    def sample(conn: psycopg.Connection) -> None:
        for what, key, seen, expected in conn.execute(LEDGER_SQL, params).fetchall():
            problems.append(f"{what} {key}: {seen} vs {expected}")
        for what, key, seen, expected in conn.execute(DB_COUNTERS_SQL, params).fetchall():
            problems.append(f"charged != booked: {what} {key}: counter {seen} vs SUM(proc) {expected}")
        gpu, cpu_on_gpu, mem, cores = conn.execute(SHAPE_SQL, params).fetchone()
        stats["gpu_frames"] = max(stats["gpu_frames"], int(gpu))
        stats["cpu_on_gpu_hosts"] = max(stats["cpu_on_gpu_hosts"], int(cpu_on_gpu))
        stats["mem_peak"] = max(stats["mem_peak"], float(mem or 0.0))
        stats["cores_peak"] = max(stats["cores_peak"], float(cores or 0.0))
        stats["samples"] += 1

    def watch(run: Run) -> None:
        params.update(hosts=list(run.seed.host_ids), shows=list(run.seed.show_ids))
        with db.connect(autocommit=True, application_name="cuesched-stress-mm") as conn:
            while not run.stop_loop.is_set() and len(problems) < 20:
                sample(conn)
                time.sleep(cfg.watch_interval)

    def at_rest(run: Run) -> None:
        with db.connect(autocommit=True, application_name="cuesched-stress-mm") as conn:
            sample(conn)
        run.report.failed.extend(problems[:20])

    report = run_inprocess(
        cfg,
        "memory_mix",
        spec,
        launcher=sim_launcher(cfg, runtime=True),
        perturb=watch,
        heal=at_rest,
        prepare=_mixed_farm,
    )
    report.notes.append(
        f"memory ledger samples: {stats['samples']}; peak share booked: memory {stats['mem_peak']:.0%}, "
        f"cores {stats['cores_peak']:.0%}; most frames at once on GPU hosts: {stats['gpu_frames']} GPU, "
        f"{stats['cpu_on_gpu_hosts']} CPU"
    )
    if stats["samples"] < 2:
        report.failed.append(f"the memory ledger was sampled {stats['samples']} time(s) under load")
    if report.booked < 0.9 * report.frames:
        report.failed.append(f"only {report.booked} of {report.frames} frames booked (< 90%)")
    return report
