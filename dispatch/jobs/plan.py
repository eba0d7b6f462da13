"""What a validated job spec is: the plan the submit writes (`JobPlan`, its `LayerPlan`s and
their `DependPlan`s, in database units), and `SpecError`, every reason a spec is refused.
`dispatch.jobs.spec` reads a spec into these, `dispatch.jobs.spec_lookup` resolves their rows,
`dispatch.jobs.submit` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dispatch.jobs.frameset import Chunk
from dispatch.models import Dept, Facility, Folder, Show


class SpecError(Exception):
    """The spec cannot be submitted; `errors` lists every reason, one message each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass
class DependPlan:
    on: str | None  # the layer depended on (None: the whole other job)
    kind: str  # LAYER_ON_LAYER, FRAME_BY_FRAME or LAYER_ON_JOB
    job: str | None = None  # another job's name (None: a layer of this job)
    # The other job's rows, resolved by `plan_job` (another job only).
    job_id: str | None = None
    layer_id: str | None = None


@dataclass
class LayerPlan:
    """A validated layer, in database units (centicores, KB)."""

    name: str
    command: str
    range: str
    chunk_size: int
    cores: int
    memory: int
    gpus: int
    gpu_memory: int
    tags: list[str]
    threadable: bool
    depends: list[DependPlan]
    chunks: list[Chunk]
    order: int  # int_dispatch_order, 1-based in spec order
    type: str = "Render"  # layer.str_type: Render or Util (Cuebot's LayerType)
    # Licence limits by name (limit_record.str_name); resolved to ids in `limit_ids`.
    limits: list[str] = field(default_factory=list)
    limit_ids: list[str] = field(default_factory=list)
    # Service names (Cuebot's str_services), the SERVICE_FIELDS the spec set, and what only a
    # Cuebot service sets (0: none).
    services: list[str] = field(default_factory=list)
    explicit: frozenset[str] = frozenset()
    cores_max: int = 0
    gpus_max: int = 0
    timeout: int = 0
    timeout_llu: int = 0
    env: dict[str, str] = field(default_factory=dict)  # layer_env, over the job's

    @property
    def str_tags(self) -> str:
        return " | ".join(self.tags)

    @property
    def str_services(self) -> str:
        return ",".join(self.services) or "default"


@dataclass
class JobPlan:
    """A validated job, its rows resolved; what `dispatch.jobs.submit.submit_job` writes."""

    name: str
    user: str
    show: Show
    folder: Folder
    facility: Facility
    dept: Dept
    shot: str
    priority: int
    max_retries: int
    os: str | None
    max_cores: int  # centicores, -1 unlimited
    max_gpus: int
    paused: bool
    auto_eat: bool = False  # job.b_autoeat: failed frames EATEN, not retried
    layers: list[LayerPlan] = field(default_factory=list)
    email: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # job_env
    uid: int | None = None  # job.int_uid

    @property
    def frame_count(self) -> int:
        return sum(len(layer.chunks) for layer in self.layers)
