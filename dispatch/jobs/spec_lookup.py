"""The database side of a job spec's validation: the show's folder, the default facility and
dept, the allocation tags a layer naming none takes, each layer's service defaults (as
Cuebot's JobSpec applies them), its licence limits and the other jobs its depends name.
Reads only; `dispatch.jobs.spec.plan_job` calls these and reports every error at once.
"""

from __future__ import annotations

from typing import Any

from django.db import connection

from dispatch.jobs import services as cuebot_services
from dispatch.jobs.plan import LayerPlan
from dispatch.models import Facility, Folder, Job, Layer, LimitRecord, Show

ALLOC_TAGS_SQL = """
SELECT DISTINCT a.str_tag FROM subscription s JOIN alloc a ON a.pk_alloc = s.pk_alloc
WHERE s.pk_show = %s AND a.pk_facility = %s AND a.str_tag IS NOT NULL AND a.str_tag <> ''
ORDER BY a.str_tag
"""


def one_by_name(model: type, name: str | None, what: str, errors: list[str]) -> Any:
    """The row named `name`; else the b_default one; else the only one; else an error."""
    if name is not None:
        row = model.objects.filter(str_name=name).first()
        if row is None:
            known = list(model.objects.order_by("str_name").values_list("str_name", flat=True)[:20])
            errors.append(f"{what}: unknown {what} {name!r} (known: {', '.join(known) or 'none'})")
        return row
    default = model.objects.filter(b_default=True).order_by("str_name").first()
    if default is not None:
        return default
    only = list(model.objects.all()[:2])
    if len(only) == 1:
        return only[0]
    errors.append(f"{what}: none given and there is no default {what}: name one")
    return None


def resolve_folder(show: Show, path: str | None, errors: list[str]) -> Folder | None:
    folders = list(Folder.objects.filter(show=show))  # a show has few folders
    if path is None:
        default = [f for f in folders if f.b_default] or [f for f in folders if f.parent_folder_id is None]
        if len(default) == 1:
            return default[0]
        errors.append(f"folder: none given and show {show.str_name!r} has no single default folder: name one")
        return None
    parts = [p for p in path.split("/") if p]
    candidates = [f for f in folders if f.str_name == parts[-1]] if parts else []
    if len(parts) > 1:
        by_pk = {f.pk_folder: f for f in folders}

        def path_of(f: Folder) -> list[str]:
            names = [f.str_name]
            while f.parent_folder_id is not None and f.parent_folder_id in by_pk:
                f = by_pk[f.parent_folder_id]
                names.append(f.str_name)
            return names[::-1]

        candidates = [f for f in candidates if path_of(f)[-len(parts) :] == parts]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        known = ", ".join(sorted({f.str_name for f in folders})) or "none"
        errors.append(f"folder: show {show.str_name!r} has no folder {path!r} (folders: {known})")
    else:
        errors.append(f"folder: {path!r} names {len(candidates)} folders of show {show.str_name!r}: give its path")
    return None


def apply_service_defaults(layers: list[LayerPlan], show: str) -> None:
    """Each layer's unset fields from its primary service, as Cuebot's JobSpec sets them.

    The rules are Cuebot's (dispatch/jobs/services.py says which); they read the database, as
    the other lookups here do.
    """
    for layer in layers:
        service, layer.services = cuebot_services.primary_service(layer.services, show)
        if service is None:
            continue  # no `default` service either: Cuebot refuses the job; cuesched keeps the spec's defaults
        given = layer.explicit
        if "max_cores" not in given:
            layer.cores_max = service.cores_max
        layer.gpus_max = service.gpus_max
        if "timeout" not in given:
            layer.timeout = service.timeout
        if "timeout_llu" not in given:
            layer.timeout_llu = service.timeout_llu
        if "cores" not in given:
            layer.cores = service.cores_min
        if "gpus" not in given:
            layer.gpus = service.gpus_min
        if "memory" not in given:
            layer.memory = service.memory_min
        if "gpu_memory" not in given:
            layer.gpu_memory = service.gpu_memory_min
        if "tags" not in given and service.tags:
            layer.tags = list(service.tags)
        if 0 < layer.cores < 100:
            layer.threadable = False
        elif "threadable" not in given:
            layer.threadable = service.threadable


def resolve_other_jobs(layers: list[LayerPlan], own_name: str | None, errors: list[str]) -> None:
    """Each dependency on another job: that job by name (any state: a FINISHED job's dependency
    is satisfied at once, by the submit), and its layer. An unknown job or layer is an error."""
    wanted = {d.job for layer in layers for d in layer.depends if d.job is not None}
    if not wanted:
        return
    jobs = {j.str_name: j for j in Job.objects.filter(str_name__in=wanted).only("pk_job", "str_name")}
    layer_ids = {
        (job_id, name): pk
        for job_id, name, pk in Layer.objects.filter(job_id__in=[j.pk_job for j in jobs.values()]).values_list(
            "job_id", "str_name", "pk_layer"
        )
    }
    for layer in layers:
        where = f"layer {layer.name!r}.depends"
        for dep in layer.depends:
            if dep.job is None:
                continue
            if dep.job == own_name:
                errors.append(
                    f'{where}: job {dep.job!r} is this job: name a layer of it without "job", '
                    "or another job (a job cannot depend on itself)"
                )
                continue
            other = jobs.get(dep.job)
            if other is None:
                errors.append(f"{where}: unknown job {dep.job!r} (a job depended on must be submitted first)")
                continue
            dep.job_id = other.pk_job
            if dep.on is not None:
                dep.layer_id = layer_ids.get((other.pk_job, dep.on))
                if dep.layer_id is None:
                    known = sorted(n for (j, n) in layer_ids if j == other.pk_job)
                    errors.append(f"{where}: job {dep.job!r} has no layer {dep.on!r} (layers: {', '.join(known)})")


def resolve_limits(layers: list[LayerPlan], errors: list[str]) -> None:
    """Limit names to ids. A limit is never created here: a misspelt name would start an unlimited one."""
    wanted = {name for layer in layers for name in layer.limits}
    if not wanted:
        return
    found = dict(LimitRecord.objects.filter(str_name__in=wanted).values_list("str_name", "pk_limit_record"))
    for layer in layers:
        missing = [n for n in layer.limits if n not in found]
        if missing:
            errors.append(
                f"layer {layer.name!r}.limits: unknown limit {', '.join(repr(n) for n in missing)} "
                "(create it in the ops console or with POST /api/limits first)"
            )
        else:
            layer.limit_ids = [found[n] for n in layer.limits]


def alloc_tags(show: Show, facility: Facility) -> list[str]:
    with connection.cursor() as cur:
        cur.execute(ALLOC_TAGS_SQL, [show.pk_show, facility.pk_facility])
        return [row[0] for row in cur.fetchall()]
