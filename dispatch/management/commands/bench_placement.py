"""`manage.py bench_placement`: frames per host-hour on a mixed farm, one host-choice policy against another.

Runs `dispatch.lab.placement_bench` (the loop's placement on a simulated busy farm, no
database) once per policy with the same queue and runtimes, and prints per policy: frames
completed per host-hour, core and memory use, and the wall time per placement; then each
policy's frames per host-hour against the first one's (`tightest`, the policy before issue 28).

`--real-loop`: the same question of the real runtime (dispatch.lab.placement_loop): the
memory_mix stress phase's farm seeded into the configured database for every run, drained by
the accounting service, the dispatch loop and the simulated launcher, behaviour before issue 28
(`before`: cores as asked, tightest, no GPU host kept; a lab-only substitution in this process)
against main's (`after`), alternated for `--rounds`; per run and as medians: frames per
host-hour, cores booked per core asked, core and memory occupancy, stranded cores.
"""

from __future__ import annotations

import os
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dispatch.engine.placement import FIT_POLICIES
from dispatch.lab import placement_loop
from dispatch.lab.placement_bench import FRAMES, HOSTS, run


class Command(BaseCommand):
    help = (
        "Frames per host-hour on a simulated mixed farm (memory-heavy and light, GPU and not), per placement "
        "policy; --real-loop: the real dispatch loop on the memory_mix farm, before issue 28 against after."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--units", type=int, default=3, help="farm units; a unit is 4 wide, 2 deep and 1 GPU host")
        parser.add_argument("--hours", type=float, default=4.0, help="simulated hours measured")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--window", type=int, default=50, help="layers with frames left each pass looks at")
        parser.add_argument("--candidates", type=int, default=64, help="scored policy: host shapes scored per choice")
        parser.add_argument(
            "--policies", default="tightest,scored", help=f"comma-separated, of {', '.join(FIT_POLICIES)}"
        )
        parser.add_argument("--gpu-backfill", action="store_true", help="as CUESCHED_GPU_BACKFILL=1")
        real = parser.add_argument_group("--real-loop: the real dispatch loop on PostgreSQL, simulated launchers")
        real.add_argument("--real-loop", action="store_true", help="run the real loop, before against after")
        real.add_argument(
            "--variants",
            default="before,after",
            help=f"comma-separated, of {', '.join(placement_loop.VARIANTS)} (the first is the base)",
        )
        real.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant once (ABBA order)")
        real.add_argument("--seconds", type=float, default=60.0, help="wall seconds measured per run")
        real.add_argument("--hosts", type=int, default=40, help="hosts of the memory_mix farm")
        real.add_argument("--jobs", type=int, default=400, help="jobs (2 layers each) of the memory_mix farm")
        real.add_argument("--frames-per-layer", type=int, default=10)
        real.add_argument("--runtime-min", type=float, default=3.0, help="simulated frame runtime, seconds")
        real.add_argument("--runtime-max", type=float, default=6.0)

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["real_loop"]:
            self._real_loop(opts)
            return
        policies = [p.strip() for p in opts["policies"].split(",") if p.strip()]
        unknown = [p for p in policies if p not in FIT_POLICIES]
        if unknown or not policies:
            raise CommandError(f"--policies takes {', '.join(FIT_POLICIES)}; got {opts['policies']!r}")
        if opts["units"] < 1 or opts["hours"] <= 0 or opts["window"] < 1:
            raise CommandError("--units and --window must be at least 1 and --hours above 0")
        hosts = ", ".join(
            f"{h.per_unit * opts['units']} {h.name} ({h.cores} cores, {h.mem_gb} GB"
            + (f", {h.gpus} GPUs" if h.gpus else "")
            + ")"
            for h in HOSTS
        )
        frames = ", ".join(
            f"{f.name} {f.cores}c/{f.mem_gb}GB{'/' + str(f.gpus) + 'gpu' if f.gpus else ''}"
            f"{' threadable' if f.threadable else ''} x{f.share}"
            for f in FRAMES
        )
        self.stdout.write(f"farm: {hosts}")
        self.stdout.write(f"queue (shape, share): {frames}; {opts['hours']:g} h measured, seed {opts['seed']}")
        header = f"{'policy':<9} {'frames':>7} {'frames/host-h':>14} {'core use':>9} {'mem use':>8} {'us/place':>9}"
        self.stdout.write(header)
        results = []
        for policy in policies:
            r = run(
                policy,
                opts["units"],
                opts["hours"],
                opts["seed"],
                window=opts["window"],
                candidates=opts["candidates"],
                backfill=opts["gpu_backfill"],
            )
            results.append(r)
            self.stdout.write(
                f"{policy:<9} {r.frames:>7} {r.frames_per_host_hour:>14.2f} {r.core_use:>9.1%} {r.mem_use:>8.1%} "
                f"{r.us_per_placement:>9.1f}"
            )
        base = results[0]
        for r in results[1:]:
            gain = r.frames_per_host_hour / base.frames_per_host_hour - 1 if base.frames_per_host_hour else 0.0
            self.stdout.write(
                f"{r.policy} against {base.policy}: {gain:+.1%} frames per host-hour "
                f"({base.frames_per_host_hour:.2f} -> {r.frames_per_host_hour:.2f})"
            )

    def _real_loop(self, opts: dict[str, Any]) -> None:
        names = [v.strip() for v in opts["variants"].split(",") if v.strip()]
        unknown = [v for v in names if v not in placement_loop.VARIANTS]
        if unknown or len(names) < 2 or len(set(names)) != len(names):
            raise CommandError(f"--variants takes two or more of {', '.join(placement_loop.VARIANTS)}; got {names}")
        if opts["rounds"] < 1 or opts["seconds"] <= 0 or opts["hosts"] < 1 or opts["jobs"] < 1:
            raise CommandError("--rounds, --hosts and --jobs must be at least 1 and --seconds above 0")
        if not 0 <= opts["runtime_min"] <= opts["runtime_max"] or opts["runtime_max"] <= 0:
            raise CommandError("--runtime-min must be between 0 and --runtime-max, and --runtime-max above 0")
        variants = [placement_loop.VARIANTS[n] for n in names]
        spec = placement_loop.farm_spec(opts["hosts"], opts["jobs"], opts["frames_per_layer"], opts["seed"])
        w = self.stdout.write
        w(
            f"real loop on the memory_mix farm: {spec.hosts} hosts ({spec.host_cores_choices} cores, "
            f"{spec.host_mem_gb_choices} GB, one in 8 a 16-core 256 GB host with 2 GPUs), "
            f"{spec.jobs} jobs x 2 layers x {spec.frames_per_layer} frames ({spec.layer_cores_choices} cores, "
            f"{spec.layer_mem_gb_choices} GB, every other layer threadable, a quarter asking a GPU), "
            f"job max {spec.job_max_cores // 100} cores; runtimes {opts['runtime_min']:g}-{opts['runtime_max']:g} s; "
            f"{opts['seconds']:g} s measured per run, {opts['rounds']} rounds, seed {opts['seed']}"
        )
        for v in variants:
            w(f"  {v.name}: {v.what}")
        w(
            "  frames/host-h: frames completed in the window / (hosts x window hours); booked/asked: core-seconds "
            "booked / core-seconds the layers ask; occupancy: booked core-s and reserved memory-s / the farm's; "
            "stranded: farm core-s idle on hosts with less idle memory than the least any layer asks"
        )
        w(f"load average before: {placement_loop.load()} ({os.cpu_count()} CPUs)")
        w(
            f"{'round':>5} {'variant':<9} {'frames':>6} {'frames/host-h':>13} {'booked/asked':>12} "
            f"{'core occ':>8} {'mem occ':>8} {'stranded':>8} {'waiting cpu/gpu':>15}  refused"
        )

        def emit(r: placement_loop.Result) -> None:
            refused = ", ".join(f"{k} {n}" for k, n in sorted(r.refused.items())) or "-"
            w(
                f"{r.round:>5} {r.variant:<9} {r.frames:>6} {r.frames_per_host_hour:>13.1f} "
                f"{r.booked_per_asked:>12.2f} {r.core_occupancy:>8.1%} {r.mem_occupancy:>8.1%} "
                f"{r.stranded:>8.1%} {'/'.join(map(str, r.waiting_left)):>15}  {refused}"
            )

        results = placement_loop.run_rounds(
            variants,
            spec,
            rounds=opts["rounds"],
            seconds=opts["seconds"],
            runtime=(opts["runtime_min"], opts["runtime_max"]),
            emit=emit,
        )
        w(f"load average after: {placement_loop.load()}")
        dry = [f"{r.variant} round {r.round}" for r in results if 0 in r.waiting_left]
        w("medians:")
        base = placement_loop.summarise(results, names[0])
        for name in names:
            s = placement_loop.summarise(results, name)
            w(
                f"{name}: frames per host-hour {s.frames_per_host_hour:.1f}, cores booked per core asked "
                f"{s.booked_per_asked:.2f}, core occupancy {s.core_occupancy:.1%}, memory occupancy "
                f"{s.mem_occupancy:.1%}, stranded cores {s.stranded:.1%}"
            )
        for name in names[1:]:
            s = placement_loop.summarise(results, name)
            ratios = placement_loop.round_ratios(results, name, names[0])
            ratio = s.frames_per_host_hour / base.frames_per_host_hour if base.frames_per_host_hour else 0.0
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
            w(
                f"{name} against {names[0]}: frames per host-hour x{ratio:.2f} ({base.frames_per_host_hour:.1f} -> "
                f"{s.frames_per_host_hour:.1f}; per-round {spread})"
            )
        if dry:
            raise CommandError(
                f"the queue ran dry in {', '.join(dry)}: frames per host-hour undercounts there; seed more --jobs"
            )
