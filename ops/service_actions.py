"""Editing Cuebot's services and a show's overrides of them: one function per change.

Every change an operator makes to `service` or `show_service`, from the console (dispatch.admin)
or the JSON API (dispatch.jobs.api), goes through these functions: one durable transaction each,
with its audit row (`cuesched_farm_action`, kinds "service" and "show_svc") in that same
transaction, so the trail holds a change exactly when it committed, as the farm set-up actions
(ops.setup_actions) do. Callers check who may act; these functions check what is asked.

Values are in the tables' units (Cuebot's: centicores, KB, minutes), keyed by column; the
callers convert what a person typed ("2 cores", "8GB"). `validate` is the one set of rules for
both, and a refused change writes nothing (a ValidationError naming each bad field).

An override is a whole row for its show (Cuebot's getOverride replaces the service, it does not
patch fields), so a new override starts as a copy of the service it overrides, with the given
fields over it. Only an existing service can be overridden: a misspelt name would otherwise make
an override nothing ever resolves. The `default` service can be neither renamed nor deleted:
every layer whose services do not resolve falls back to it (Cuebot's JobSpec.DEFAULT_SERVICE).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from accounting.actions import audit_context
from dispatch.jobs.services import DEFAULT_SERVICE
from dispatch.jobs.spec import CENTICORES_PER_CORE, MAX_CORES, MAX_TIMEOUT_MINUTES, SERVICE_RE
from dispatch.models import Show
from dispatch.models.services import INT_MAX, Service, ShowService
from ops.setup_actions import NotFound, _record

TAG_RE = re.compile(r"^[\w.-]+$")
MAX_TAGS_LEN = 128  # service.str_tags
BIGINT_MAX = 2**63 - 1
# Every column an edit may set, with what a person calls it (the error messages say this).
COLUMNS = {
    "str_name": "name",
    "b_threadable": "threadable",
    "int_cores_min": "cores",
    "int_cores_max": "max cores",
    "int_mem_min": "memory",
    "int_gpus_min": "GPUs",
    "int_gpus_max": "max GPUs",
    "int_gpu_mem_min": "GPU memory",
    "str_tags": "tags",
    "int_timeout": "timeout",
    "int_timeout_llu": "timeout_llu",
    "int_min_memory_increase": "memory-failure increase",
}
REQUIRED = ("str_name", "b_threadable", "int_cores_min", "int_mem_min", "str_tags")


@dataclass(frozen=True)
class Changed:
    pk: str
    name: str
    changes: dict[str, list[Any]] = field(default_factory=dict)  # column -> [old, new]

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def join_tags(value: Any) -> str:
    """A list of tags, or one string of them joined by "|", as Cuebot stores them ("a | b")."""
    items = value.split("|") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(t, str) for t in items):
        raise ValidationError(f"tags: must be a list of tags or one string joined by '|', not {value!r}", code="tags")
    tags = list(dict.fromkeys(t.strip() for t in items if t.strip()))
    return " | ".join(tags)


def _whole(column: str, value: Any, low: int, high: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{COLUMNS[column]}: must be a whole number, not {value!r}", code=column)
    if not low <= value <= high:
        raise ValidationError(f"{COLUMNS[column]}: {value} {hint}", code=column)
    return value


def validate(values: dict[str, Any], *, merged: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values as the columns store them, or a ValidationError naming every bad field.

    `merged` is the whole row after the change (for the rules between fields: max >= min)."""
    errors: list[str] = []
    out: dict[str, Any] = {}
    unknown = sorted(set(values) - set(COLUMNS))
    if unknown:
        errors.append(f"unknown fields {unknown} (fields: {sorted(COLUMNS)})")
    mem_hint = f"KB is out of range: more than 0 and at most {INT_MAX} KB (2 TB)"
    rules = {
        "int_cores_min": (1, MAX_CORES * CENTICORES_PER_CORE, "centicores is out of range: at least 0.01 core"),
        "int_cores_max": (0, MAX_CORES * CENTICORES_PER_CORE, "centicores is out of range: 0 (none) or more"),
        "int_mem_min": (1, INT_MAX, mem_hint),
        "int_min_memory_increase": (1, INT_MAX, mem_hint),
        "int_gpu_mem_min": (0, BIGINT_MAX, "KB must not be negative"),
        "int_gpus_min": (0, 1000, "must be 0 to 1000"),
        "int_gpus_max": (0, 1000, "must be 0 (none) to 1000"),
        "int_timeout": (0, MAX_TIMEOUT_MINUTES, f"minutes must be 0 (none) to {MAX_TIMEOUT_MINUTES}"),
        "int_timeout_llu": (0, MAX_TIMEOUT_MINUTES, f"minutes must be 0 (none) to {MAX_TIMEOUT_MINUTES}"),
    }
    for column, value in values.items():
        if column not in COLUMNS:
            continue
        try:
            if column == "str_name":
                if not isinstance(value, str) or not SERVICE_RE.match(value.strip()):
                    raise ValidationError(
                        f"name: must be 1-36 of letters, digits, _ . -, not {value!r}", code="str_name"
                    )
                out[column] = value.strip()
            elif column == "b_threadable":
                if not isinstance(value, bool):
                    raise ValidationError(f"threadable: must be true or false, not {value!r}", code=column)
                out[column] = value
            elif column == "str_tags":
                tags = join_tags(value)
                bad = [t for t in tags.split(" | ") if t and not TAG_RE.match(t)]
                if bad:
                    # Empty is allowed: a layer of that service then takes the show's allocations' tags.
                    raise ValidationError(f"tags: each is letters, digits, _ . - (not {bad!r})", code=column)
                if len(tags) > MAX_TAGS_LEN:
                    raise ValidationError(f"tags: are longer than {MAX_TAGS_LEN} characters joined", code=column)
                out[column] = tags
            else:
                out[column] = _whole(column, value, *rules[column])
        except ValidationError as exc:
            errors.extend(exc.messages)
    row = {**(merged or {}), **out}
    if not errors:
        cores, max_cores = row.get("int_cores_min"), row.get("int_cores_max")
        if cores and max_cores and max_cores < cores:
            errors.append(f"max cores: {max_cores} centicores is below the cores ({cores}); 0 means no max")
        gpus, max_gpus = row.get("int_gpus_min"), row.get("int_gpus_max")
        if gpus and max_gpus and max_gpus < gpus:
            errors.append(f"max GPUs: {max_gpus} is below the GPUs ({gpus}); 0 means no max")
    if errors:
        raise ValidationError(errors)
    return out


def _row(obj: Service | ShowService) -> dict[str, Any]:
    return {c: getattr(obj, c) for c in COLUMNS}


def _service(ref: str, *, lock: bool = False) -> Service:
    rows = Service.objects.select_for_update() if lock else Service.objects
    found = rows.filter(Q(pk=ref) | Q(str_name=ref)).first()
    if found is None:
        raise NotFound(f"no service {ref!r}")
    return found


def _show(ref: str) -> Show:
    found = Show.objects.filter(Q(pk=ref) | Q(str_name=ref)).first()
    if found is None:
        raise NotFound(f"no show {ref!r}")
    return found


def _override(show: Show, ref: str, *, lock: bool = False) -> ShowService:
    rows = ShowService.objects.select_for_update() if lock else ShowService.objects
    found = rows.filter(Q(pk=ref) | Q(str_name=ref), show_id=show.pk).first()
    if found is None:
        raise NotFound(f"show {show.str_name!r} has no override of service {ref!r}")
    return found


def _exists(name: str, what: str) -> ValidationError:
    return ValidationError(f"name: {what} {name!r} already exists", code="exists")


def create_service(values: dict[str, Any], *, actor: Any) -> Changed:
    """A new service; cores, memory, tags and threadable must be given, the rest take Cuebot's defaults."""
    missing = [COLUMNS[c] for c in REQUIRED if c not in values]
    if missing:
        raise ValidationError([f"{m}: required for a new service" for m in missing])
    clean = validate(values, merged={})
    with transaction.atomic(durable=True), audit_context(actor, "create_service"):
        if Service.objects.filter(str_name=clean["str_name"]).exists():
            raise _exists(clean["str_name"], "a service named")
        service = Service.objects.create(pk=str(uuid.uuid4()), **clean)
        row = _row(service)
        _record("service", service.pk, service.str_name, "create_service", actor, {"values": row})
    return Changed(service.pk, service.str_name, {c: [None, v] for c, v in row.items()})


def update_service(ref: str, values: dict[str, Any], *, actor: Any) -> Changed:
    """Change the given columns of the service `ref` (id or name); an unchanged value writes nothing."""
    with transaction.atomic(durable=True), audit_context(actor, "update_service"):
        service = _service(ref, lock=True)
        old = _row(service)
        clean = validate(values, merged=old)
        changes = {c: [old[c], v] for c, v in clean.items() if old[c] != v}
        if not changes:
            return Changed(service.pk, service.str_name)
        if "str_name" in changes:
            if old["str_name"] == DEFAULT_SERVICE:
                raise ValidationError(
                    f"name: the {DEFAULT_SERVICE!r} service cannot be renamed: every layer whose services do not "
                    "resolve falls back to it",
                    code="default",
                )
            if Service.objects.filter(str_name=clean["str_name"]).exclude(pk=service.pk).exists():
                raise _exists(clean["str_name"], "a service named")
        Service.objects.filter(pk=service.pk).update(**{c: new for c, (_old, new) in changes.items()})
        name = clean.get("str_name", service.str_name)
        _record("service", service.pk, name, "update_service", actor, {"changes": changes})
    return Changed(service.pk, name, changes)


def delete_service(ref: str, *, actor: Any) -> Changed:
    """Delete the service `ref`; the shows' overrides of it stay (they resolve by name, as in Cuebot)."""
    with transaction.atomic(durable=True), audit_context(actor, "delete_service"):
        service = _service(ref, lock=True)
        if service.str_name == DEFAULT_SERVICE:
            raise ValidationError(
                f"the {DEFAULT_SERVICE!r} service cannot be deleted: every layer whose services do not resolve "
                "falls back to it",
                code="default",
            )
        row = _row(service)
        Service.objects.filter(pk=service.pk).delete()
        _record("service", service.pk, service.str_name, "delete_service", actor, {"values": row})
    return Changed(service.pk, service.str_name, {c: [v, None] for c, v in row.items()})


def _override_name(show: Show, name: str) -> str:
    return f"{show.str_name}/{name}"


def create_show_service(show_ref: str, values: dict[str, Any], *, actor: Any) -> Changed:
    """Show `show_ref`'s override of the service named in values["str_name"]: a copy of the
    service with the given fields over it."""
    name = values.get("str_name")
    if name is None:
        raise ValidationError(["name: the service to override is required"])
    with transaction.atomic(durable=True), audit_context(actor, "create_show_service"):
        show = _show(show_ref)
        base = Service.objects.filter(str_name=name.strip() if isinstance(name, str) else name).first()
        if base is None:
            raise NotFound(f"no service {name!r} to override (create the service first)")
        row = _row(base)
        clean = validate(values, merged=row)
        row.update(clean)
        if ShowService.objects.filter(show_id=show.pk, str_name=row["str_name"]).exists():
            raise _exists(row["str_name"], f"show {show.str_name!r}'s override of")
        override = ShowService.objects.create(pk=str(uuid.uuid4()), show_id=show.pk, **row)
        label = _override_name(show, override.str_name)
        _record("show_svc", override.pk, label, "create_show_service", actor, {"show": show.str_name, "values": row})
    return Changed(override.pk, label, {c: [None, v] for c, v in row.items()})


def update_show_service(show_ref: str, ref: str, values: dict[str, Any], *, actor: Any) -> Changed:
    """Change the given columns of show `show_ref`'s override `ref` (its id or service name).

    Its name is the service it overrides, so it is not changed here (delete it and override another)."""
    if "str_name" in values:
        raise ValidationError(["name: an override's name is the service it overrides; it cannot change"])
    with transaction.atomic(durable=True), audit_context(actor, "update_show_service"):
        show = _show(show_ref)
        override = _override(show, ref, lock=True)
        old = _row(override)
        clean = validate(values, merged=old)
        changes = {c: [old[c], v] for c, v in clean.items() if old[c] != v}
        label = _override_name(show, override.str_name)
        if not changes:
            return Changed(override.pk, label)
        ShowService.objects.filter(pk=override.pk).update(**{c: new for c, (_old, new) in changes.items()})
        _record(
            "show_svc", override.pk, label, "update_show_service", actor, {"show": show.str_name, "changes": changes}
        )
    return Changed(override.pk, label, changes)


def delete_show_service(show_ref: str, ref: str, *, actor: Any) -> Changed:
    """Drop show `show_ref`'s override `ref`: the show's layers get the service itself again."""
    with transaction.atomic(durable=True), audit_context(actor, "delete_show_service"):
        show = _show(show_ref)
        override = _override(show, ref, lock=True)
        row = _row(override)
        label = _override_name(show, override.str_name)
        ShowService.objects.filter(pk=override.pk).delete()
        _record("show_svc", override.pk, label, "delete_show_service", actor, {"show": show.str_name, "values": row})
    return Changed(override.pk, label, {c: [v, None] for c, v in row.items()})
