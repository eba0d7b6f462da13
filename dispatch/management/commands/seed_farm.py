"""`manage.py seed_farm`: write (or `--purge`) a deterministic farm; see dispatch.lab.seeding."""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError, OutputWrapper

from dispatch.lab.seeding import FarmExistsError, FarmSeed, FarmSpec, purge_farm, seed_farm

DEFAULTS = FarmSpec()
# Below this many rows a seed is over before a bar would be worth drawing.
PROGRESS_MIN_ROWS = 5000


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise ArgumentTypeError("expected at least one integer")
    return values


def any_int(text: str) -> int:
    """Accepts 12648430 as well as 0xC0FFEE, since the stress suite states its seed in hex."""
    try:
        return int(text, 0)
    except ValueError as exc:
        raise ArgumentTypeError(f"expected an integer, got {text!r}") from exc


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


class TextProgress:
    """A one-line bar on stderr, redrawn in place on a terminal, one line per phase elsewhere."""

    def __init__(self, stream: OutputWrapper, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._phase = ""
        self._drawn = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * done // max(total, 1):3d}% {phase} {done}/{total}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width + 40), ending="")
            self._drawn = True
        elif phase != self._phase or done == total:
            self.stream.write(line)
        self._phase = phase
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("")


class Command(BaseCommand):
    help = (
        "Seed a deterministic farm (facilities, depts, shows, allocs with tags, subscriptions, folders "
        "with caps, hosts with tags, jobs x layers x WAITING frames) under a name prefix, or --purge one. "
        "Cores and caps are in centicores (cores x 100) where the option says so."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        d = DEFAULTS
        parser.add_argument("--prefix", default=d.prefix, help=f"name prefix of every row (default {d.prefix})")
        parser.add_argument("--seed", type=any_int, default=d.seed, help=f"RNG seed (default {d.seed:#x})")
        parser.add_argument("--purge", metavar="PREFIX", help="delete every row of PREFIX and exit")
        parser.add_argument(
            "--replace", action="store_true", help="purge --prefix first instead of refusing an existing prefix"
        )
        sizes = parser.add_argument_group("sizes")
        for name, doc in (
            ("facilities", "facilities"),
            ("depts", "departments"),
            ("shows", "shows"),
            ("allocs", "allocations, each with a tag equal to its name"),
            ("folders_per_show", "folders per show, the root folder included"),
            ("hosts", "hosts, spread round-robin over the allocs"),
            ("jobs", "jobs, spread round-robin over the shows"),
            ("layers", "layers per job"),
            ("frames_per_layer", "WAITING frames per layer"),
            ("manual_tags", "MANUAL host tags (layers draw from these and the alloc tags)"),
        ):
            default = getattr(d, name)
            sizes.add_argument(
                "--" + name.replace("_", "-"), type=int, default=default, help=f"{doc} (default {default})"
            )
        managed = parser.add_argument_group("scheduler ownership")
        managed.add_argument(
            "--managed",
            dest="managed",
            action="store_true",
            default=d.managed,
            help="shows are scheduler-managed (default)",
        )
        managed.add_argument("--unmanaged", dest="managed", action="store_false", help="no show is managed")
        managed.add_argument("--managed-shows", type=int, help="only the first N shows are managed")
        shapes = parser.add_argument_group("host and layer shapes (comma lists, one drawn per row)")
        shapes.add_argument("--host-cores", type=int_list, default=d.host_cores_choices, help="whole cores")
        shapes.add_argument("--host-mem-gb", type=int_list, default=d.host_mem_gb_choices, help="GB")
        shapes.add_argument("--host-gpus", type=int_list, default=d.host_gpus_choices, help="GPU counts")
        shapes.add_argument("--gpu-mem-gb", type=int, default=d.gpu_mem_gb_per_gpu, help="GB of memory per GPU")
        shapes.add_argument("--layer-cores", type=int_list, default=d.layer_cores_choices, help="cores per frame")
        shapes.add_argument("--layer-mem-gb", type=int_list, default=d.layer_mem_gb_choices, help="GB per frame")
        shapes.add_argument("--layer-gpus", type=int_list, default=d.layer_gpus_choices, help="GPUs per frame")
        shapes.add_argument("--layer-tags-max", type=int, default=d.layer_tags_max, help="1..N tags per layer")
        shapes.add_argument("--os", default=d.os, help=f"job and host OS (default {d.os})")
        caps = parser.add_argument_group("caps (centicores / GPU counts; -1 unlimited, 0 books nothing)")
        caps.add_argument("--sub-size", type=int, default=None, help="subscription size (default: the burst)")
        caps.add_argument("--sub-burst", type=int, default=d.sub_burst, help=f"(default {d.sub_burst})")
        caps.add_argument("--folder-max-cores", type=int, default=d.folder_max_cores)
        caps.add_argument("--folder-max-gpus", type=int, default=d.folder_max_gpus)
        caps.add_argument("--job-max-cores", type=int, default=d.job_max_cores, help=f"(default {d.job_max_cores})")
        caps.add_argument("--job-max-gpus", type=int, default=d.job_max_gpus)
        caps.add_argument("--job-priority-max", type=int, default=d.job_priority_max, help="priorities 1..N")
        bar = parser.add_mutually_exclusive_group()
        bar.add_argument(
            "--progress",
            action="store_true",
            help=f"always draw the progress bar (default: only for seeds of {PROGRESS_MIN_ROWS}+ rows)",
        )
        bar.add_argument("--no-progress", action="store_true", help="never draw the progress bar")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["purge"]:
            self._purge(opts["purge"])
            return
        spec = FarmSpec(
            prefix=opts["prefix"],
            seed=opts["seed"],
            facilities=opts["facilities"],
            depts=opts["depts"],
            shows=opts["shows"],
            managed=opts["managed"],
            managed_shows=opts["managed_shows"],
            allocs=opts["allocs"],
            folders_per_show=opts["folders_per_show"],
            hosts=opts["hosts"],
            jobs=opts["jobs"],
            layers=opts["layers"],
            frames_per_layer=opts["frames_per_layer"],
            manual_tags=opts["manual_tags"],
            host_cores_choices=opts["host_cores"],
            host_mem_gb_choices=opts["host_mem_gb"],
            host_gpus_choices=opts["host_gpus"],
            gpu_mem_gb_per_gpu=opts["gpu_mem_gb"],
            sub_size=opts["sub_size"],
            sub_burst=opts["sub_burst"],
            folder_max_cores=opts["folder_max_cores"],
            folder_max_gpus=opts["folder_max_gpus"],
            job_max_cores=opts["job_max_cores"],
            job_max_gpus=opts["job_max_gpus"],
            job_priority_max=opts["job_priority_max"],
            layer_cores_choices=opts["layer_cores"],
            layer_mem_gb_choices=opts["layer_mem_gb"],
            layer_gpus_choices=opts["layer_gpus"],
            layer_tags_max=opts["layer_tags_max"],
            os=opts["os"],
        )
        try:
            spec.validate()
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if opts["replace"]:
            self._purge(spec.prefix)

        rows = spec.hosts * 3 + spec.jobs * spec.layers * (3 + spec.frames_per_layer)
        bar = None
        if opts["progress"] or (not opts["no_progress"] and rows >= PROGRESS_MIN_ROWS):
            bar = TextProgress(self.stderr)
        try:
            seed = seed_farm(spec, progress=bar)
        except FarmExistsError as exc:
            raise CommandError(f"{exc}; use --replace or --purge {spec.prefix}") from exc
        finally:
            if bar is not None:
                bar.close()
        self._summary(seed)

    def _purge(self, prefix: str) -> None:
        try:
            deleted = purge_farm(prefix)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        total = sum(deleted.values())
        detail = ", ".join(f"{table} {n}" for table, n in deleted.items() if n)
        self.stdout.write(f"purged {prefix!r}: {total} rows" + (f" ({detail})" if detail else ""))

    def _summary(self, seed: FarmSeed) -> None:
        spec = seed.spec
        rows = seed.rows
        self.stdout.write(
            f"seeded {spec.prefix!r} (seed {spec.seed:#x}) in {seed.seconds:.2f} s: "
            f"{sum(rows.values())} rows\n"
            f"  {rows['facility']} facilities, {rows['dept']} depts, {rows['show']} shows "
            f"({len(seed.managed_show_ids)} managed), {rows['alloc']} allocs, "
            f"{rows['subscription']} subscriptions (burst {spec.sub_burst} centicores), "
            f"{rows['folder']} folders (max cores {spec.folder_max_cores})\n"
            f"  {rows['host']} hosts ({rows['host_tag']} tags; cores {_csv(spec.host_cores_choices)}, "
            f"mem GB {_csv(spec.host_mem_gb_choices)})\n"
            f"  {rows['job']} jobs (max cores {spec.job_max_cores}) x {spec.layers} layers = {rows['layer']} "
            f"layers, {rows['frame']} WAITING frames"
        )
