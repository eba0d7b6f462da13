"""Deterministic farm generator shared by `seed_farm`, the demo, the tests and the stress suite.

The same `FarmSpec` always writes the same rows: every random draw comes from a
`random.Random` seeded from the spec, and every key is a uuid5 of (prefix, seed, kind,
index), including the rows the fan-out triggers create (the seeder upserts them with
derived keys). So two seeds of one spec can be compared row by row (`farm_digest`), and a
stress failure can be replayed exactly.

Every name a seed writes carries the prefix in a fixed shape (`{prefix}_h12`,
`{prefix}_a0`, ...), so `purge_farm` finds exactly one seed's rows and never those of a
longer prefix that happens to start the same way (`farm` vs `farm_x`).

Rows are written set-based (COPY, and upserts over `unnest` arrays), never one ORM save per
row: 1,200 hosts and 6,000 frames take about a second. Frame counters are left to the frame
triggers, which count the COPY like any other insert.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

# (phase, rows written so far, rows to write in total)
Progress = Callable[[str, int, int], None]

PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")
INT4_MAX = 2**31 - 1
KB_PER_GB = 1024 * 1024
CENTICORES_PER_CORE = 100

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://cuesched.invalid/seed_farm")

# Every farm table, children first: the order purge deletes in and farm_counts reports in.
PURGE_ORDER: tuple[str, ...] = (
    "proc",
    "frame",
    "layer_stat",
    "layer_resource",
    "layer_mem",
    "layer_env",
    "layer",
    "job_stat",
    "job_resource",
    "job_mem",
    "job_env",
    "job",
    "folder_resource",
    "folder",
    "host_tag",
    "host_stat",
    "host",
    "subscription",
    "point",
    "alloc",
    "show",
    "dept",
    "facility",
)


class FarmExistsError(RuntimeError):
    """The prefix already has rows; seeding over them would break unique names."""


@dataclass(frozen=True)
class FarmSpec:
    """What to seed. Sizes are counts; each unit is in the field name or comment.

    Host and layer sizes are drawn uniformly from the `*_choices` tuples (whole cores, GB);
    the caps are written as stored, in centicores (cores x 100) or GPU counts, where any
    value -1 means unlimited and 0 books nothing. Defaults are the stress suite's drain farm, small.
    """

    prefix: str = "farm"
    seed: int = 0x0C0FFEE
    facilities: int = 1
    depts: int = 1
    shows: int = 1
    # None: every show when `managed`, none otherwise; a number: the first N shows.
    managed: bool = True
    managed_shows: int | None = None
    allocs: int = 3
    folders_per_show: int = 1
    hosts: int = 100
    jobs: int = 20
    layers: int = 4  # per job
    frames_per_layer: int = 5
    manual_tags: int = 8
    host_cores_choices: tuple[int, ...] = (16, 24, 32, 48, 64, 96, 128)  # whole cores
    host_mem_gb_choices: tuple[int, ...] = (32, 64, 96, 128, 192, 256)
    host_gpus_choices: tuple[int, ...] = (0,)
    gpu_mem_gb_per_gpu: int = 16
    sub_size: int | None = None  # centicores; None: equal to the burst
    sub_burst: int = 9_000_000  # centicores (90,000 cores)
    folder_max_cores: int = -1  # centicores
    folder_max_gpus: int = -1
    job_max_cores: int = 10_000_000  # centicores (100,000 cores); must be > 0 for vs_waiting
    job_max_gpus: int = 100
    job_priority_max: int = 200  # priorities are drawn from 1..job_priority_max
    layer_cores_choices: tuple[int, ...] = (1, 2, 4, 8)  # whole cores per frame
    layer_mem_gb_choices: tuple[int, ...] = (2, 4, 6, 8)
    layer_gpus_choices: tuple[int, ...] = (0,)
    layer_tags_max: int = 3
    os: str = "linux"

    @property
    def managed_count(self) -> int:
        if self.managed_shows is not None:
            return self.managed_shows
        return self.shows if self.managed else 0

    @property
    def sub_size_centicores(self) -> int:
        return self.sub_burst if self.sub_size is None else self.sub_size

    def validate(self) -> None:
        """Refuse specs the schema would reject halfway through, with a message naming the field."""
        errors: list[str] = []
        if not PREFIX_RE.match(self.prefix):
            errors.append(f"prefix {self.prefix!r} must match {PREFIX_RE.pattern}")
        sizes = "facilities depts shows allocs folders_per_show hosts jobs layers frames_per_layer manual_tags"
        for name in sizes.split():
            if getattr(self, name) < 0:
                errors.append(f"{name} must be >= 0")
        if (self.allocs or self.jobs) and self.facilities < 1:
            errors.append("allocs and jobs need at least one facility")
        if self.hosts and self.allocs < 1:
            errors.append("hosts need at least one alloc")
        if self.jobs and (self.shows < 1 or self.depts < 1):
            errors.append("jobs need at least one show and one dept")
        if self.shows and self.folders_per_show < 1:
            errors.append("every show needs at least one (root) folder")
        if not 0 <= self.managed_count <= self.shows:
            errors.append(f"managed_shows must be between 0 and shows ({self.shows})")
        for name in ("host_cores_choices", "host_mem_gb_choices", "layer_cores_choices", "layer_mem_gb_choices"):
            values = getattr(self, name)
            if not values or min(values) <= 0:
                errors.append(f"{name} must be a non-empty list of positive numbers")
        for name in ("host_gpus_choices", "layer_gpus_choices"):
            values = getattr(self, name)
            if not values or min(values) < 0:
                errors.append(f"{name} must be a non-empty list of counts >= 0")
        if self.jobs and self.layers and self.layer_tags_max < 1:
            errors.append("layer_tags_max must be >= 1")
        if self.job_priority_max < 1:
            errors.append("job_priority_max must be >= 1")
        for name in ("folder_max_cores", "folder_max_gpus", "job_max_cores", "job_max_gpus"):
            if abs(getattr(self, name)) > INT4_MAX:
                errors.append(f"{name} does not fit the integer column")
        if not self.os or len(self.os) > 12:
            errors.append("os must be 1-12 characters (job.str_os)")
        if not errors and self.allocs:
            # alloc.str_tag is varchar(24) and equals the alloc name.
            longest = alloc_name(self.prefix, self.allocs - 1)
            if len(longest) > 24:
                errors.append(f"alloc tag {longest!r} is longer than 24 characters; shorten the prefix")
        if errors:
            raise ValueError("; ".join(errors))


@dataclass(frozen=True)
class FarmSeed:
    """What `seed_farm` wrote: the keys of the named rows and the row count of every table."""

    spec: FarmSpec
    rows: dict[str, int]
    facility_ids: tuple[str, ...]
    dept_ids: tuple[str, ...]
    show_ids: tuple[str, ...]
    managed_show_ids: tuple[str, ...]
    alloc_ids: tuple[str, ...]
    folder_ids: tuple[str, ...]
    host_ids: tuple[str, ...]
    job_ids: tuple[str, ...]
    layer_ids: tuple[str, ...]
    tags: tuple[str, ...]
    seconds: float = 0.0


# --- Names ---------------------------------------------------------------------------------
# One letter (or three) per kind after the prefix, then the index: the purge patterns
# below match exactly this shape.


def facility_name(prefix: str, i: int) -> str:
    return f"{prefix}_fac{i}"


def dept_name(prefix: str, i: int) -> str:
    return f"{prefix}_d{i}"


def show_name(prefix: str, i: int) -> str:
    return f"{prefix}_s{i}"


def alloc_name(prefix: str, i: int) -> str:
    return f"{prefix}_a{i}"


def host_name(prefix: str, i: int) -> str:
    return f"{prefix}_h{i}"


def job_name(prefix: str, i: int) -> str:
    return f"{prefix}_j{i}"


def folder_name(prefix: str, i: int) -> str:
    return f"{prefix}_f{i}"


def manual_tag(prefix: str, i: int) -> str:
    return f"{prefix}_t{i}"


def layer_name(prefix: str, k: int) -> str:
    return f"{prefix}_l{k}"


# --- The plan: every row, computed in Python before anything is written -----------------------


@dataclass
class FarmPlan:
    """All rows of a seed as tuples in the column order of the COPY statements below.

    Frames are not materialised (a big farm has millions); `frames()` yields them.
    """

    spec: FarmSpec
    facility: list[tuple[Any, ...]] = field(default_factory=list)
    dept: list[tuple[Any, ...]] = field(default_factory=list)
    show: list[tuple[Any, ...]] = field(default_factory=list)
    alloc: list[tuple[Any, ...]] = field(default_factory=list)
    subscription: list[tuple[Any, ...]] = field(default_factory=list)
    point: list[tuple[Any, ...]] = field(default_factory=list)
    folder: list[tuple[Any, ...]] = field(default_factory=list)
    folder_resource: list[tuple[Any, ...]] = field(default_factory=list)
    host: list[tuple[Any, ...]] = field(default_factory=list)
    host_stat: list[tuple[Any, ...]] = field(default_factory=list)
    host_tag: list[tuple[Any, ...]] = field(default_factory=list)
    job: list[tuple[Any, ...]] = field(default_factory=list)
    job_resource: list[tuple[Any, ...]] = field(default_factory=list)
    job_stat: list[tuple[Any, ...]] = field(default_factory=list)
    layer: list[tuple[Any, ...]] = field(default_factory=list)
    layer_resource: list[tuple[Any, ...]] = field(default_factory=list)
    layer_stat: list[tuple[Any, ...]] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @property
    def frame_count(self) -> int:
        return len(self.layer) * self.spec.frames_per_layer

    def frames(self) -> Iterator[tuple[Any, ...]]:
        spec = self.spec
        for pk_layer, pk_job, name, *_ in self.layer:
            for n in range(1, spec.frames_per_layer + 1):
                pk_frame = _key(spec, "frame", pk_layer, n)
                yield (pk_frame, pk_layer, pk_job, f"{n:04d}-{name}", "WAITING", n, n, n)


FACILITY_COLUMNS = ("pk_facility", "str_name", "b_default")
DEPT_COLUMNS = ("pk_dept", "str_name", "b_default")
SHOW_COLUMNS = ("pk_show", "str_name", "b_scheduler_managed")
ALLOC_COLUMNS = ("pk_alloc", "pk_facility", "str_name", "str_tag")
SUBSCRIPTION_COLUMNS = ("pk_subscription", "pk_alloc", "pk_show", "int_size", "int_burst")
POINT_COLUMNS = ("pk_point", "pk_dept", "pk_show")
FOLDER_COLUMNS = ("pk_folder", "pk_parent_folder", "pk_show", "pk_dept", "str_name", "b_default", "f_order")
HOST_COLUMNS = (
    "pk_host",
    "pk_alloc",
    "str_name",
    "str_lock_state",
    "str_tags",
    "int_thread_mode",
    "int_cores",
    "int_cores_idle",
    "int_mem",
    "int_mem_idle",
    "int_gpus",
    "int_gpus_idle",
    "int_gpu_mem",
    "int_gpu_mem_idle",
)
HOST_STAT_COLUMNS = (
    "pk_host_stat",
    "pk_host",
    "str_state",
    "str_os",
    "int_mem_total",
    "int_mem_free",
    "int_gpu_mem_total",
    "int_gpu_mem_free",
)
HOST_TAG_COLUMNS = ("pk_host_tag", "pk_host", "str_tag", "str_tag_type", "b_constant")
JOB_COLUMNS = (
    "pk_job",
    "pk_folder",
    "pk_show",
    "pk_facility",
    "pk_dept",
    "str_name",
    "str_visible_name",
    "str_show",
    "str_shot",
    "str_user",
    "int_uid",
    "str_state",
    "str_log_dir",
    "str_os",
    "int_frame_count",
    "int_layer_count",
)
LAYER_COLUMNS = (
    "pk_layer",
    "pk_job",
    "str_name",
    "str_cmd",
    "str_range",
    "int_chunk_size",
    "int_dispatch_order",
    "int_cores_min",
    "int_mem_min",
    "int_gpus_min",
    "int_gpu_mem_min",
    "b_threadable",
    "str_tags",
    "str_type",
)
FRAME_COLUMNS = (
    "pk_frame",
    "pk_layer",
    "pk_job",
    "str_name",
    "str_state",
    "int_number",
    "int_dispatch_order",
    "int_layer_order",
)

# The fan-out triggers have already made these rows (with random keys and default caps)
# when the parents were copied; the upserts give them derived keys and the spec's values,
# and would create them if a schema ever came without the fan-out.
UPSERT_FOLDER_RESOURCE = """
INSERT INTO folder_resource (pk_folder_resource, pk_folder, int_max_cores, int_max_gpus)
SELECT * FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[])
ON CONFLICT (pk_folder) DO UPDATE SET
  pk_folder_resource = EXCLUDED.pk_folder_resource,
  int_max_cores = EXCLUDED.int_max_cores,
  int_max_gpus = EXCLUDED.int_max_gpus
"""
UPSERT_JOB_RESOURCE = """
INSERT INTO job_resource (pk_job_resource, pk_job, int_priority, int_max_cores, int_max_gpus)
SELECT * FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[], %s::int[])
ON CONFLICT (pk_job) DO UPDATE SET
  pk_job_resource = EXCLUDED.pk_job_resource,
  int_priority = EXCLUDED.int_priority,
  int_max_cores = EXCLUDED.int_max_cores,
  int_max_gpus = EXCLUDED.int_max_gpus
"""
UPSERT_JOB_STAT = """
INSERT INTO job_stat (pk_job_stat, pk_job)
SELECT * FROM unnest(%s::text[], %s::text[])
ON CONFLICT (pk_job) DO UPDATE SET pk_job_stat = EXCLUDED.pk_job_stat
"""
UPSERT_LAYER_RESOURCE = """
INSERT INTO layer_resource (pk_layer_resource, pk_layer, pk_job)
SELECT * FROM unnest(%s::text[], %s::text[], %s::text[])
ON CONFLICT (pk_layer) DO UPDATE SET pk_layer_resource = EXCLUDED.pk_layer_resource
"""
UPSERT_LAYER_STAT = """
INSERT INTO layer_stat (pk_layer_stat, pk_layer, pk_job)
SELECT * FROM unnest(%s::text[], %s::text[], %s::text[])
ON CONFLICT (pk_layer) DO UPDATE SET pk_layer_stat = EXCLUDED.pk_layer_stat
"""


def _key(spec: FarmSpec, kind: str, *parts: object) -> str:
    return str(uuid.uuid5(_NAMESPACE, "/".join([spec.prefix, str(spec.seed), kind, *map(str, parts)])))


def _row(columns: Sequence[str], **values: Any) -> tuple[Any, ...]:
    """A row in COPY column order; naming every value keeps long rows from drifting out of order."""
    if set(values) != set(columns):
        raise KeyError(f"row columns {sorted(values)} do not match {sorted(columns)}")
    return tuple(values[c] for c in columns)


def _rng(spec: FarmSpec, family: str) -> random.Random:
    # One stream per family, so adding jobs does not change the hosts a seed draws.
    return random.Random(f"{spec.seed}/{family}")


def plan_farm(spec: FarmSpec) -> FarmPlan:
    """Compute every row of the farm without touching the database."""
    spec.validate()
    p = spec.prefix
    plan = FarmPlan(spec=spec)

    facility_ids = [_key(spec, "facility", i) for i in range(spec.facilities)]
    plan.facility = [(pk, facility_name(p, i), i == 0) for i, pk in enumerate(facility_ids)]
    dept_ids = [_key(spec, "dept", i) for i in range(spec.depts)]
    plan.dept = [(pk, dept_name(p, i), i == 0) for i, pk in enumerate(dept_ids)]
    show_ids = [_key(spec, "show", i) for i in range(spec.shows)]
    plan.show = [(pk, show_name(p, i), i < spec.managed_count) for i, pk in enumerate(show_ids)]

    alloc_ids = [_key(spec, "alloc", i) for i in range(spec.allocs)]
    alloc_tags = [alloc_name(p, i) for i in range(spec.allocs)]
    plan.alloc = [
        (pk, facility_ids[i % spec.facilities], alloc_tags[i], alloc_tags[i]) for i, pk in enumerate(alloc_ids)
    ]
    plan.subscription = [
        (_key(spec, "subscription", s, a), alloc_ids[a], show_ids[s], spec.sub_size_centicores, spec.sub_burst)
        for s in range(spec.shows)
        for a in range(spec.allocs)
    ]
    plan.point = [
        (_key(spec, "point", s, d), dept_ids[d], show_ids[s]) for s in range(spec.shows) for d in range(spec.depts)
    ]

    # Each show: a root folder named after the show (as Cuebot does), then child folders.
    folders_of_show: list[list[tuple[str, str]]] = []  # (pk_folder, pk_dept) per show
    child = 0
    for s, pk_show in enumerate(show_ids):
        root = _key(spec, "folder", s, 0)
        root_dept = dept_ids[0] if dept_ids else None
        plan.folder.append((root, None, pk_show, root_dept, show_name(p, s), True, 0))
        mine = [(root, root_dept)]
        for j in range(1, spec.folders_per_show):
            pk = _key(spec, "folder", s, j)
            dept = dept_ids[child % len(dept_ids)] if dept_ids else None
            plan.folder.append((pk, root, pk_show, dept, folder_name(p, child), False, j))
            mine.append((pk, dept))
            child += 1
        folders_of_show.append(mine)
    plan.folder_resource = [
        (_key(spec, "folder_resource", row[0]), row[0], spec.folder_max_cores, spec.folder_max_gpus)
        for row in plan.folder
    ]

    manual_tags = [manual_tag(p, i) for i in range(spec.manual_tags)]
    plan.tags = manual_tags + alloc_tags
    _plan_hosts(plan, alloc_ids, alloc_tags, manual_tags)
    _plan_jobs(plan, show_ids, facility_ids, folders_of_show)
    return plan


def _plan_hosts(plan: FarmPlan, alloc_ids: list[str], alloc_tags: list[str], manual_tags: list[str]) -> None:
    spec = plan.spec
    rng = _rng(spec, "hosts")
    for i in range(spec.hosts):
        pk = _key(spec, "host", i)
        cores = rng.choice(spec.host_cores_choices) * CENTICORES_PER_CORE
        mem = rng.choice(spec.host_mem_gb_choices) * KB_PER_GB
        gpus = rng.choice(spec.host_gpus_choices)
        gpu_mem = gpus * spec.gpu_mem_gb_per_gpu * KB_PER_GB
        # Host i < #tags carries manual tag i (so every tag has a host); the others 0-2 random.
        if i < len(manual_tags):
            manual = [manual_tags[i]]
        elif manual_tags:
            manual = rng.sample(manual_tags, rng.randint(0, min(2, len(manual_tags))))
        else:
            manual = []
        a = i % len(alloc_ids)
        tags = [alloc_tags[a], *manual]
        plan.host.append(
            _row(
                HOST_COLUMNS,
                pk_host=pk,
                pk_alloc=alloc_ids[a],
                str_name=host_name(spec.prefix, i),
                str_lock_state="OPEN",
                str_tags=" ".join(tags),
                int_thread_mode=0,
                int_cores=cores,
                int_cores_idle=cores,
                int_mem=mem,
                int_mem_idle=mem,
                int_gpus=gpus,
                int_gpus_idle=gpus,
                int_gpu_mem=gpu_mem,
                int_gpu_mem_idle=gpu_mem,
            )
        )
        plan.host_stat.append((_key(spec, "host_stat", i), pk, "UP", spec.os, mem, mem, gpu_mem, gpu_mem))
        plan.host_tag.append((_key(spec, "host_tag", i, 0), pk, alloc_tags[a], "ALLOC", False))
        for t, tag in enumerate(manual, start=1):
            plan.host_tag.append((_key(spec, "host_tag", i, t), pk, tag, "MANUAL", False))


def _plan_jobs(
    plan: FarmPlan,
    show_ids: list[str],
    facility_ids: list[str],
    folders_of_show: list[list[tuple[str, str]]],
) -> None:
    spec = plan.spec
    job_rng = _rng(spec, "jobs")
    layer_rng = _rng(spec, "layers")
    frames = spec.frames_per_layer
    for i in range(spec.jobs):
        pk_job = _key(spec, "job", i)
        s = i % len(show_ids)
        pk_folder, pk_dept = job_rng.choice(folders_of_show[s])
        name = job_name(spec.prefix, i)
        plan.job.append(
            _row(
                JOB_COLUMNS,
                pk_job=pk_job,
                pk_folder=pk_folder,
                pk_show=show_ids[s],
                pk_facility=facility_ids[i % len(facility_ids)],
                pk_dept=pk_dept,
                str_name=name,
                str_visible_name=name,
                str_show=show_name(spec.prefix, s),
                str_shot=f"sh{i % 100:03d}",
                str_user="cuesched",
                int_uid=1000,
                str_state="PENDING",
                str_log_dir=f"/tmp/cuesched/{name}",
                str_os=spec.os,
                int_frame_count=spec.layers * frames,
                int_layer_count=spec.layers,
            )
        )
        priority = job_rng.randint(1, spec.job_priority_max)
        plan.job_resource.append(
            (_key(spec, "job_resource", i), pk_job, priority, spec.job_max_cores, spec.job_max_gpus)
        )
        plan.job_stat.append((_key(spec, "job_stat", i), pk_job))
        for k in range(spec.layers):
            pk_layer = _key(spec, "layer", i, k)
            cores = layer_rng.choice(spec.layer_cores_choices) * CENTICORES_PER_CORE
            mem = layer_rng.choice(spec.layer_mem_gb_choices) * KB_PER_GB
            gpus = layer_rng.choice(spec.layer_gpus_choices)
            n_tags = layer_rng.randint(1, min(spec.layer_tags_max, len(plan.tags)))
            tags = " | ".join(layer_rng.sample(plan.tags, n_tags))
            plan.layer.append(
                _row(
                    LAYER_COLUMNS,
                    pk_layer=pk_layer,
                    pk_job=pk_job,
                    str_name=layer_name(spec.prefix, k),
                    str_cmd=f"echo {spec.prefix} #FRAME#",
                    str_range=f"1-{frames}",
                    int_chunk_size=1,
                    int_dispatch_order=k + 1,
                    int_cores_min=cores,
                    int_mem_min=mem,
                    int_gpus_min=gpus,
                    int_gpu_mem_min=gpus * spec.gpu_mem_gb_per_gpu * KB_PER_GB,
                    b_threadable=True,
                    str_tags=tags,
                    str_type="Render",
                )
            )
            plan.layer_resource.append((_key(spec, "layer_resource", i, k), pk_layer, pk_job))
            plan.layer_stat.append((_key(spec, "layer_stat", i, k), pk_layer, pk_job))


# --- Writing ----------------------------------------------------------------------------------


class _Counter:
    """Reports progress at most every `step` rows, so a big COPY is not slowed by the callback."""

    def __init__(self, total: int, progress: Progress | None, step: int = 2000) -> None:
        self.total = total
        self.done = 0
        self.progress = progress
        self.step = step
        self._next = step

    def add(self, phase: str, n: int = 1) -> None:
        self.done += n
        if self.progress is not None and (self.done >= self._next or self.done == self.total):
            self._next = self.done + self.step
            self.progress(phase, self.done, self.total)


def _copy(cur: Any, table: str, columns: Sequence[str], rows: Iterable[tuple[Any, ...]], counter: _Counter) -> int:
    n = 0
    with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
            n += 1
            counter.add(table)
    return n


def _columns(rows: list[tuple[Any, ...]]) -> list[list[Any]]:
    width = len(rows[0]) if rows else 0
    return [[row[c] for row in rows] for c in range(width)]


def _upsert(cur: Any, sql: str, rows: list[tuple[Any, ...]], table: str, counter: _Counter) -> int:
    if rows:
        cur.execute(sql, _columns(rows))
    counter.add(table, len(rows))
    return len(rows)


def seed_farm(spec: FarmSpec, progress: Progress | None = None) -> FarmSeed:
    """Write the farm of `spec` in one transaction; raise FarmExistsError if the prefix has rows."""
    started = time.perf_counter()
    plan = plan_farm(spec)
    simple = [
        ("facility", FACILITY_COLUMNS, plan.facility),
        ("dept", DEPT_COLUMNS, plan.dept),
        ("show", SHOW_COLUMNS, plan.show),
        ("alloc", ALLOC_COLUMNS, plan.alloc),
        ("subscription", SUBSCRIPTION_COLUMNS, plan.subscription),
        ("point", POINT_COLUMNS, plan.point),
        ("folder", FOLDER_COLUMNS, plan.folder),
    ]
    host_tables = [
        ("host", HOST_COLUMNS, plan.host),
        ("host_stat", HOST_STAT_COLUMNS, plan.host_stat),
        ("host_tag", HOST_TAG_COLUMNS, plan.host_tag),
    ]
    children = [plan.folder_resource, plan.job, plan.job_resource, plan.job_stat]
    children += [plan.layer, plan.layer_resource, plan.layer_stat]
    total = sum(len(rows) for _, _, rows in simple + host_tables) + sum(map(len, children)) + plan.frame_count
    counter = _Counter(total, progress)
    rows: dict[str, int] = {}

    with transaction.atomic():
        existing = farm_counts(spec.prefix)
        if any(existing.values()):
            taken = ", ".join(f"{t}={n}" for t, n in existing.items() if n)
            raise FarmExistsError(f"prefix {spec.prefix!r} already has rows ({taken}); purge it first")
        connection.ensure_connection()
        with connection.connection.cursor() as cur:
            for table, columns, table_rows in simple:
                rows[table] = _copy(cur, table, columns, table_rows, counter)
            rows["folder_resource"] = _upsert(
                cur, UPSERT_FOLDER_RESOURCE, plan.folder_resource, "folder_resource", counter
            )
            for table, columns, table_rows in host_tables:
                rows[table] = _copy(cur, table, columns, table_rows, counter)
            rows["job"] = _copy(cur, "job", JOB_COLUMNS, plan.job, counter)
            rows["job_resource"] = _upsert(cur, UPSERT_JOB_RESOURCE, plan.job_resource, "job_resource", counter)
            rows["job_stat"] = _upsert(cur, UPSERT_JOB_STAT, plan.job_stat, "job_stat", counter)
            rows["layer"] = _copy(cur, "layer", LAYER_COLUMNS, plan.layer, counter)
            rows["layer_resource"] = _upsert(cur, UPSERT_LAYER_RESOURCE, plan.layer_resource, "layer_resource", counter)
            rows["layer_stat"] = _upsert(cur, UPSERT_LAYER_STAT, plan.layer_stat, "layer_stat", counter)
            rows["frame"] = _copy(cur, "frame", FRAME_COLUMNS, plan.frames(), counter)
    # The fan-out triggers made one max-RSS row per job and layer; a seed writes no environment.
    rows["proc"] = rows["job_env"] = rows["layer_env"] = 0
    rows["job_mem"], rows["layer_mem"] = rows["job"], rows["layer"]

    return FarmSeed(
        spec=spec,
        rows={table: rows[table] for table in PURGE_ORDER},
        facility_ids=tuple(r[0] for r in plan.facility),
        dept_ids=tuple(r[0] for r in plan.dept),
        show_ids=tuple(r[0] for r in plan.show),
        managed_show_ids=tuple(r[0] for r in plan.show if r[2]),
        alloc_ids=tuple(r[0] for r in plan.alloc),
        folder_ids=tuple(r[0] for r in plan.folder),
        host_ids=tuple(r[0] for r in plan.host),
        job_ids=tuple(r[0] for r in plan.job),
        layer_ids=tuple(r[0] for r in plan.layer),
        tags=tuple(plan.tags),
        seconds=time.perf_counter() - started,
    )


# --- Finding, counting, digesting and purging one seed's rows -----------------------------------
# A table's scope is the seed's named rows plus every row that references them (which the
# foreign keys would otherwise not let go). Names match both a LIKE prefix (cheap) and an
# exact regex on the `{prefix}_{kind}{n}` shape (so `farm` never matches `farm_x`'s rows).


def _named(column: str, kind: str) -> str:
    return f"({column} LIKE %(like_{kind})s AND {column} ~ %(re_{kind})s)"


_KINDS = ("fac", "d", "s", "a", "h", "j")

FACILITIES = f"SELECT pk_facility FROM facility WHERE {_named('str_name', 'fac')}"
DEPTS = f"SELECT pk_dept FROM dept WHERE {_named('str_name', 'd')}"
SHOWS = f"SELECT pk_show FROM show WHERE {_named('str_name', 's')}"
ALLOCS = f"SELECT pk_alloc FROM alloc WHERE {_named('str_name', 'a')} OR pk_facility IN ({FACILITIES})"
HOSTS = f"SELECT pk_host FROM host WHERE {_named('str_name', 'h')} OR pk_alloc IN ({ALLOCS})"
FOLDERS = f"SELECT pk_folder FROM folder WHERE pk_show IN ({SHOWS}) OR pk_dept IN ({DEPTS})"
JOBS = (
    f"SELECT pk_job FROM job WHERE {_named('str_name', 'j')} OR pk_show IN ({SHOWS})"
    f" OR pk_folder IN ({FOLDERS}) OR pk_facility IN ({FACILITIES}) OR pk_dept IN ({DEPTS})"
)
LAYERS = f"SELECT pk_layer FROM layer WHERE pk_job IN ({JOBS})"
# Seeds write no dependencies, but jobs submitted into a seeded show do (dispatch.jobs.submit).
DEPENDS = f"pk_job_depend_er IN ({JOBS}) OR pk_job_depend_on IN ({JOBS})"
# Operators comment on seeded jobs and hosts through the OpenCue clients (dispatch.jobs.comments).
COMMENTS = f"pk_job IN ({JOBS}) OR pk_host IN ({HOSTS})"

SCOPE: dict[str, str] = {
    "proc": f"pk_job IN ({JOBS}) OR pk_host IN ({HOSTS}) OR pk_show IN ({SHOWS}) OR pk_layer IN ({LAYERS})",
    "frame": f"pk_job IN ({JOBS}) OR pk_layer IN ({LAYERS})",
    "layer_stat": f"pk_job IN ({JOBS}) OR pk_layer IN ({LAYERS})",
    "layer_resource": f"pk_job IN ({JOBS}) OR pk_layer IN ({LAYERS})",
    "layer_mem": f"pk_job IN ({JOBS}) OR pk_layer IN ({LAYERS})",
    "layer_env": f"pk_job IN ({JOBS}) OR pk_layer IN ({LAYERS})",
    "layer": f"pk_job IN ({JOBS})",
    "job_stat": f"pk_job IN ({JOBS})",
    "job_resource": f"pk_job IN ({JOBS})",
    "job_mem": f"pk_job IN ({JOBS})",
    "job_env": f"pk_job IN ({JOBS})",
    "job": f"pk_job IN ({JOBS})",
    "folder_resource": f"pk_folder IN ({FOLDERS})",
    "folder": f"pk_folder IN ({FOLDERS})",
    "host_tag": f"pk_host IN ({HOSTS})",
    "host_stat": f"pk_host IN ({HOSTS})",
    "host": f"pk_host IN ({HOSTS})",
    "subscription": f"pk_show IN ({SHOWS}) OR pk_alloc IN ({ALLOCS})",
    "point": f"pk_show IN ({SHOWS}) OR pk_dept IN ({DEPTS})",
    "alloc": f"pk_alloc IN ({ALLOCS})",
    "show": f"pk_show IN ({SHOWS})",
    "dept": f"pk_dept IN ({DEPTS})",
    "facility": f"pk_facility IN ({FACILITIES})",
}

# A row as JSON without its timestamps (now() at insert time), hashed in key order.
DIGEST_SQL = """
SELECT count(*), coalesce(md5(string_agg(
  (SELECT jsonb_object_agg(key, value) FROM jsonb_each(to_jsonb(t)) WHERE key NOT LIKE 'ts\\_%%')::text,
  E'\\n' ORDER BY t.{pk})), '')
FROM {table} t WHERE {scope}
"""


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def scope_params(prefix: str) -> dict[str, str]:
    """Bind values for the scope SQL: a LIKE pattern and an anchored regex per name kind."""
    params: dict[str, str] = {}
    for kind in _KINDS:
        params[f"like_{kind}"] = _like_escape(f"{prefix}_{kind}") + "%"
        params[f"re_{kind}"] = "^" + re.escape(prefix) + "_" + kind + "[0-9]+$"
    return params


def farm_counts(prefix: str) -> dict[str, int]:
    """Rows per table that belong to `prefix` (PURGE_ORDER)."""
    params = scope_params(prefix)
    counts: dict[str, int] = {}
    with connection.cursor() as cur:
        for table in PURGE_ORDER:
            cur.execute(f"SELECT count(*) FROM {table} WHERE {SCOPE[table]}", params)
            counts[table] = cur.fetchone()[0]
    return counts


def farm_digest(prefix: str) -> dict[str, str]:
    """Per table, `count:md5` over every row of the prefix, timestamps left out.

    Equal digests mean the same rows with the same keys and values, so this is how a test
    shows that one spec always seeds the same farm.
    """
    params = scope_params(prefix)
    digests: dict[str, str] = {}
    with connection.cursor() as cur:
        for table in PURGE_ORDER:
            cur.execute(DIGEST_SQL.format(table=table, pk=f"pk_{table}", scope=SCOPE[table]), params)
            count, md5 = cur.fetchone()
            digests[table] = f"{count}:{md5}"
    return digests


def farm_fingerprint(prefix: str) -> str:
    """One hash over `farm_digest`, for logs and reports."""
    digest = farm_digest(prefix)
    return hashlib.sha256("\n".join(f"{t}={d}" for t, d in digest.items()).encode()).hexdigest()


def purge_farm(prefix: str) -> dict[str, int]:
    """Delete every row of `prefix` in one transaction, children first; rows deleted per table.

    Procs go first, so triggers that account for or announce a released proc still find its
    job, folder and subscription rows.
    """
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r} must match {PREFIX_RE.pattern}")
    params = scope_params(prefix)
    deleted: dict[str, int] = {}
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"DELETE FROM depend WHERE {DEPENDS}", params)
        depends = cur.rowcount
        # Licence limits the farm's layers hold (the limits themselves span farms: kept). After
        # the procs, so the recount of each limit sees them gone.
        cur.execute(f"DELETE FROM proc WHERE {SCOPE['proc']}", params)
        deleted["proc"] = cur.rowcount
        cur.execute(
            f"DELETE FROM layer_limit WHERE pk_layer IN (SELECT pk_layer FROM layer WHERE {SCOPE['layer']})", params
        )
        # Comments on the farm's jobs and hosts (as Cuebot's job delete trigger deletes a job's).
        cur.execute(f"DELETE FROM comments WHERE {COMMENTS}", params)
        comments = cur.rowcount
        for table in PURGE_ORDER:
            cur.execute(f"DELETE FROM {table} WHERE {SCOPE[table]}", params)
            deleted[table] = deleted.get(table, 0) + cur.rowcount
    if comments:
        deleted = {"comments": comments, **deleted}
    if depends:
        deleted = {"depend": depends, **deleted}
    return deleted
