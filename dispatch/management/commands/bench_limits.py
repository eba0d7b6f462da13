"""`manage.py bench_limits`: does a licence limit overshoot under concurrent bookers? Cuebot's check against ours.

Cuebot (and the Rust scheduler) check a limit in their dispatch SQL: the layer is bookable
while `sum_running < int_max_value`, counted from the running procs, outside any lock, and the
proc is inserted after. Two bookers can both read "one left" and both insert. This command
runs the same load against two layers of one seeded unmanaged farm:

* `cuebot-copy`: a layer with NO layer_limit row. Each booker reads the layer's running procs
  (`SELECT count(*) FROM proc WHERE pk_layer = ...`, Cuebot's sum_running), and if it is below
  the max, inserts a proc, holds it a moment and deletes it: Cuebot's check, copied;
* `cuesched`: a layer holding a real limit of the same max. Each booker just inserts; the
  proc triggers recount the limit under its row's lock and refuse a count above the max.

A sampler on its own connection counts the running procs of each layer as often as it can.
Printed per run and as medians: the highest count any sample saw, and the share of samples
above the max. It is a measurement, not a test: the Cuebot copy's overshoot depends on the
load and the machine; ours must be 0 whatever they are.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from argparse import ArgumentParser
from typing import Any

import psycopg
from django.core.management.base import BaseCommand
from psycopg import errors as pg_errors

from accounting import db
from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm

COUNT_SQL = "SELECT count(*) FROM proc WHERE pk_layer = %s"
INSERT_SQL = (
    "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, int_mem_reserved)"
    " SELECT %s, %s, j.pk_show, f.pk_layer, f.pk_job, f.pk_frame, 100, 1024"
    " FROM frame f JOIN job j ON j.pk_job = f.pk_job WHERE f.pk_frame = %s"
)


class Command(BaseCommand):
    help = "Concurrent bookers on one limit: Cuebot's SQL-only check (a copy) against cuesched's triggers."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--prefix", default="benchlim")
        parser.add_argument("--bookers", type=int, default=8, help="concurrent booking connections")
        parser.add_argument("--max", type=int, default=4, help="the limit's int_max_value")
        parser.add_argument("--seconds", type=float, default=5.0, help="per run and per variant")
        parser.add_argument("--runs", type=int, default=3)
        parser.add_argument("--hold-ms", type=float, default=2.0, help="how long a booked proc runs")

    def handle(self, *args: Any, **opts: Any) -> None:
        prefix = opts["prefix"]
        purge_farm(prefix)
        seeded = seed_farm(
            FarmSpec(prefix=prefix, managed=False, hosts=8, jobs=2, layers=1, frames_per_layer=400, manual_tags=0)
        )
        cuebot_layer, ours_layer = seeded.layer_ids[0], seeded.layer_ids[1]
        limit_name = f"{prefix}-licence"
        try:
            with db.connect(autocommit=True, application_name="cuesched-bench-limits") as conn:
                conn.execute("DELETE FROM limit_record WHERE str_name = %s", (limit_name,))
                limit = str(uuid.uuid4())
                conn.execute(
                    "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value) VALUES (%s, %s, %s)",
                    (limit, limit_name, opts["max"]),
                )
                conn.execute(
                    "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
                    (str(uuid.uuid4()), ours_layer, limit),
                )
                frames = {
                    layer: [r[0] for r in conn.execute("SELECT pk_frame FROM frame WHERE pk_layer = %s", (layer,))]
                    for layer in (cuebot_layer, ours_layer)
                }
            results: dict[str, list[tuple[int, float, int]]] = {"cuebot-copy": [], "cuesched": []}
            for i in range(opts["runs"]):
                for variant, layer in (("cuebot-copy", cuebot_layer), ("cuesched", ours_layer)):
                    peak, share, booked = self._run(opts, layer, frames[layer], list(seeded.host_ids), variant)
                    results[variant].append((peak, share, booked))
                    self.stdout.write(
                        f"  {variant} run {i + 1}: highest running {peak} (max {opts['max']}), "
                        f"{100 * share:.1f}% of samples over the max, {booked} bookings"
                    )
            for variant, runs in results.items():
                self.stdout.write(
                    f"{variant}: highest running median {statistics.median(r[0] for r in runs):.0f} "
                    f"(max {opts['max']}, worst {max(r[0] for r in runs)}), samples over the max median "
                    f"{100 * statistics.median(r[1] for r in runs):.1f}%, bookings/run median "
                    f"{statistics.median(r[2] for r in runs):.0f} ({opts['bookers']} bookers, {opts['seconds']}s runs)"
                )
        finally:
            with db.connect(autocommit=True, application_name="cuesched-bench-limits") as conn:
                conn.execute("DELETE FROM proc WHERE pk_layer = ANY(%s)", (list(seeded.layer_ids),))
            purge_farm(prefix)
            with db.connect(autocommit=True, application_name="cuesched-bench-limits") as conn:
                conn.execute("DELETE FROM limit_record WHERE str_name = %s", (limit_name,))

    def _run(
        self, opts: dict[str, Any], layer: str, frames: list[str], hosts: list[str], variant: str
    ) -> tuple[int, float, int]:
        stop = threading.Event()
        samples: list[int] = []
        booked = [0] * opts["bookers"]
        hold = opts["hold_ms"] / 1000
        max_value = opts["max"]

        def booker(i: int) -> None:
            mine = frames[i :: opts["bookers"]]
            with db.connect(autocommit=True, application_name="cuesched-bench-limits") as c:
                n = 0
                while not stop.is_set():
                    frame = mine[n % len(mine)]
                    n += 1
                    pk = str(uuid.uuid4())
                    try:
                        with c.transaction():
                            if variant == "cuebot-copy":
                                row = c.execute(COUNT_SQL, (layer,)).fetchone()
                                if row is None or row[0] >= max_value:
                                    continue
                            c.execute(INSERT_SQL, (pk, hosts[i % len(hosts)], frame))
                    except (pg_errors.CheckViolation, pg_errors.SerializationFailure):
                        continue
                    booked[i] += 1
                    time.sleep(hold)
                    c.execute("DELETE FROM proc WHERE pk_proc = %s", (pk,))

        def sampler() -> None:
            with db.connect(autocommit=True, application_name="cuesched-bench-limits") as c:
                while not stop.is_set():
                    try:
                        row = c.execute(COUNT_SQL, (layer,)).fetchone()
                    except psycopg.Error:
                        continue
                    samples.append(row[0] if row else 0)

        threads = [threading.Thread(target=booker, args=(i,), daemon=True) for i in range(opts["bookers"])]
        threads.append(threading.Thread(target=sampler, daemon=True))
        for t in threads:
            t.start()
        time.sleep(opts["seconds"])
        stop.set()
        for t in threads:
            t.join(30)
        over = sum(1 for s in samples if s > max_value)
        return (max(samples) if samples else 0), (over / len(samples) if samples else 0.0), sum(booked)
