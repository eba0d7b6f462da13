"""Cuebot's service defaults for a layer, on every database: Cuebot's and cuesched's own.

Why: a show's layers get their defaults from Cuebot's `service` table and the show's
`show_service` overrides (a show that renders "arnold" with 16 GB by default). A job submitted
through cuesched must get the same layer as Cuebot's JobSpec would build, or the same spec books
differently depending on who took it. cuesched's own schema has the same two tables
(dispatch.models.services, migration 0040_services_tables) seeded with Cuebot's default services
(0041_services_seed), so the resolution below is one code path everywhere.

Cuebot's rules, from OpenCue cuebot/src/main/java/com/imageworks/spcue/:
- service/JobSpec.determineResourceDefaults: of the layer's service names (empty ones and
  repeats dropped), the first that resolves is the primary service; a name resolves through
  ServiceManagerService.getService(name, show): the show's override (ServiceDaoJdbc.getOverride,
  QUERY_FOR_SERVICE_OVER), else the service itself (ServiceDaoJdbc.get, QUERY_FOR_SERVICE). None
  resolving: the `default` service (ServiceDaoJdbc.get, no show override), and its name is
  appended to the layer's services. The primary service sets threadable, min and max cores, min
  memory, min and max GPUs, min GPU memory, tags, timeout and LLU timeout.
- then what the spec sets explicitly wins (determineMinimumCores, determineMinimumGpus,
  determineTags, determineMinimumMemory, determineMinimumGpuMemory), and determineThreadable:
  a layer of more than 0 and less than 100 centicores is never threadable, else an explicit
  `threadable` wins. Max cores, max GPUs and the timeouts have no spec field: the service's.
- ServiceDaoJdbc.splitTags: the service's tags split on " | ", spaces removed; LayerDaoJdbc
  writes the layer's services joined by ",".

A layer that names no service gets the `default` service, as in Cuebot, on every database: the
layer is recorded as `default`, the console's Services page shows what that sets, and an
operator who edits `default` changes what such layers book. cuesched seeds its own `default`
(threadable, 4 GB, no tags), not Cuebot's (3.2 GB, not threadable, "general | desktop"): its
allocations are tagged with their own names, not Cuebot's `general`, so Cuebot's tags would
leave every untagged layer unbookable. A service with no tags leaves a layer without tags to
the submit, which gives it the tags of the show's allocations. The spec's own defaults are the
same values, the fallback of a database with no `default` row (the actions refuse to delete it).

This module reads the services; the job spec (dispatch/jobs/spec.py) applies the primary
service to its layer plans, so the import runs one way: spec -> services.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

DEFAULT_SERVICE = "default"  # JobSpec.DEFAULT_SERVICE

_COLUMNS = (
    "{t}.str_name, {t}.b_threadable, {t}.int_cores_min, {t}.int_cores_max, {t}.int_mem_min, {t}.int_gpus_min, "
    "{t}.int_gpus_max, {t}.int_gpu_mem_min, {t}.str_tags, {t}.int_timeout, {t}.int_timeout_llu"
)
# ServiceDaoJdbc.QUERY_FOR_SERVICE + get(id)
SERVICE_SQL = f"SELECT {_COLUMNS.format(t='service')} FROM service WHERE (pk_service=%s OR str_name=%s)"
# ServiceDaoJdbc.QUERY_FOR_SERVICE_OVER + getOverride(id, show)
SERVICE_OVERRIDE_SQL = (
    f"SELECT {_COLUMNS.format(t='show_service')} FROM show_service, show "
    "WHERE show_service.pk_show = show.pk_show "
    "AND (show_service.pk_show_service=%s OR show_service.str_name=%s) AND (show.str_name=%s OR show.pk_show=%s)"
)


@dataclass(frozen=True)
class Service:
    name: str
    threadable: bool
    cores_min: int
    cores_max: int
    memory_min: int
    gpus_min: int
    gpus_max: int
    gpu_memory_min: int
    tags: list[str]
    timeout: int
    timeout_llu: int


def _service(row: tuple | None) -> Service | None:
    if row is None:
        return None
    name, threadable, cores_min, cores_max, mem, gpus_min, gpus_max, gpu_mem, tags, timeout, llu = row
    split = [t.replace(" ", "") for t in (tags or "").split(" | ")]
    return Service(
        name, threadable, cores_min, cores_max, mem, gpus_min, gpus_max, gpu_mem, [t for t in split if t], timeout, llu
    )


def primary_service(names: list[str], show: str) -> tuple[Service | None, list[str]]:
    """The layer's primary service for `show` (name or id) and its services as Cuebot records them."""
    services = list(names)
    with connection.cursor() as cur:
        for name in services:
            cur.execute(SERVICE_OVERRIDE_SQL, [name, name, show, show])
            found = _service(cur.fetchone())
            if found is None:
                cur.execute(SERVICE_SQL, [name, name])
                found = _service(cur.fetchone())
            if found is not None:
                return found, services
        cur.execute(SERVICE_SQL, [DEFAULT_SERVICE, DEFAULT_SERVICE])
        found = _service(cur.fetchone())
    if found is not None:
        services.append(found.name)
    return found, services
