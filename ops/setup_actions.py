"""Setting up a farm: a facility, an allocation, a show and its subscriptions, one function each.

A fresh database has no farm. These are the calls behind `cueadmin -create-show`, `-create-alloc`
and `-create-sub` (served by `opencue_api`), so a farm is set up the way every OpenCue site
already does it, and each change is one durable transaction with its audit row
(`cuesched_farm_action`), like the job controls in `dispatch.jobs.controls`. A subscription's size
and burst change through `accounting.actions.set_subscription`, the console's own action, so the
cap history records them the same way whoever asks.

Names follow Cuebot's rules (`JobSpec.conformName`): at least 3 characters, dashes read as
underscores, lowercase, letters, digits, underscores, dots and dashes. An allocation is named
`<facility>.<name>`, as Cuebot's `AllocationDaoJdbc.insertAllocation` names it, and a
subscription `<allocation>.<show>`; a show name therefore may not contain a dot (Cuebot would take
one and then fail to find the subscription by name).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction

from accounting.actions import audit_context, validate_burst
from dispatch.models import Alloc, Dept, Facility, FarmAction, Folder, Show, Subscription

NAME_RE = re.compile(r"^[\w.-]{3,}$")
DEFAULT_DEPT = "Unknown"  # Cuebot's seed data names its default department so


class NotFound(LookupError):
    """The named facility, allocation, show or subscription does not exist (gRPC NOT_FOUND)."""


@dataclass(frozen=True)
class Created:
    """What a set-up action made; `existed` when the row was there already (Cuebot's re-enable)."""

    pk: str
    name: str
    existed: bool = False


def conform_name(kind: str, name: str) -> str:
    """Cuebot's conformName: the name as stored, or a ValidationError that says what is wrong."""
    if not isinstance(name, str) or len(name.strip()) < 3:
        raise ValidationError(f"the {kind} name must be at least 3 characters, not {name!r}", code="name")
    conformed = name.strip().replace("-", "_").lower()
    if not NAME_RE.match(conformed):
        raise ValidationError(
            f"the {kind} name {conformed!r} is not in the proper format: letters, digits, underscores and dots",
            code="name",
        )
    return conformed


def _record(kind: str, pk: str, name: str, action: str, actor: Any, detail: dict[str, Any] | None = None) -> None:
    FarmAction.objects.create(
        str_action=action,
        str_target_kind=kind,
        str_target=pk,
        str_target_name=name[:256],
        int_changed=1,
        detail=detail or {},
        str_username=actor if isinstance(actor, str) else (actor.get_username() if actor is not None else ""),
    )


def create_facility(name: str, *, actor: Any) -> Created:
    conformed = conform_name("facility", name)
    if len(conformed) > Facility._meta.get_field("str_name").max_length:
        raise ValidationError(f"the facility name {conformed!r} is longer than 36 characters", code="name")
    with transaction.atomic(durable=True), audit_context(actor, "create_facility"):
        existing = Facility.objects.filter(str_name=conformed).first()
        if existing is not None:
            return Created(existing.pk, existing.str_name, existed=True)
        facility = Facility.objects.create(pk=str(uuid.uuid4()), str_name=conformed)
        _record("facility", facility.pk, conformed, "create_facility", actor)
    return Created(facility.pk, conformed)


def create_allocation(facility: str, name: str, tag: str, *, actor: Any) -> Created:
    """`<facility>.<name>` with host tag `tag`; an existing one is re-enabled (Cuebot's insertAllocation)."""
    short = conform_name("allocation", name)
    tag = (tag or "").strip()
    if not tag or not re.match(r"^[\w.-]+$", tag) or len(tag) > Alloc._meta.get_field("str_tag").max_length:
        raise ValidationError(f"the allocation tag must be a word of at most 24 characters, not {tag!r}", code="tag")
    with transaction.atomic(durable=True), audit_context(actor, "create_allocation"):
        fac = Facility.objects.filter(str_name=facility).first() or Facility.objects.filter(pk=facility).first()
        if fac is None:
            raise NotFound(f"no facility named {facility!r}")
        full = short if short.startswith(f"{fac.str_name}.") else f"{fac.str_name}.{short}"
        if len(full) > Alloc._meta.get_field("str_name").max_length:
            raise ValidationError(f"the allocation name {full!r} is longer than 36 characters", code="name")
        existing = Alloc.objects.select_for_update().filter(str_name=full).first()
        if existing is not None:
            if not existing.b_enabled:
                Alloc.objects.filter(pk=existing.pk).update(b_enabled=True)
                _record("alloc", existing.pk, full, "enable_allocation", actor)
            return Created(existing.pk, full, existed=True)
        alloc = Alloc.objects.create(pk=str(uuid.uuid4()), facility_id=fac.pk, str_name=full, str_tag=tag)
        _record("alloc", alloc.pk, full, "create_allocation", actor, {"facility": fac.str_name, "tag": tag})
    return Created(alloc.pk, full)


def _default_dept() -> Dept:
    dept = Dept.objects.filter(b_default=True).order_by("str_name").first()
    if dept is None:
        dept = Dept.objects.filter(str_name=DEFAULT_DEPT).first()
    if dept is None:
        dept = Dept.objects.create(pk=str(uuid.uuid4()), str_name=DEFAULT_DEPT, b_default=True)
    return dept


def create_show(name: str, *, actor: Any) -> Created:
    """The show and its root folder (Cuebot's default group, named after the show, in the default department)."""
    conformed = conform_name("show", name)
    if "." in conformed:
        raise ValidationError(
            f"the show name {conformed!r} has a dot: a subscription is named <allocation>.<show>", code="name"
        )
    with transaction.atomic(durable=True), audit_context(actor, "create_show"):
        if Show.objects.filter(str_name=conformed).exists():
            raise ValidationError(f"a show named {conformed!r} already exists", code="exists")
        show = Show.objects.create(pk=str(uuid.uuid4()), str_name=conformed)
        dept = _default_dept()
        Folder.objects.create(
            pk=str(uuid.uuid4()), show_id=show.pk, dept_id=dept.pk, str_name=conformed[:36], b_default=True
        )
        _record("show", show.pk, conformed, "create_show", actor)
    return Created(show.pk, conformed)


def create_subscription(show: str, alloc: str, *, size_cores: int, burst_cores: int, actor: Any) -> Created:
    """A subscription of `show` (id) to `alloc` (id), size and burst in whole cores."""
    size = validate_burst(size_cores, "size")
    burst = validate_burst(burst_cores, "burst")
    with transaction.atomic(durable=True), audit_context(actor, "create_subscription"):
        show_row = Show.objects.filter(pk=show).first()
        alloc_row = Alloc.objects.filter(pk=alloc).first()
        if show_row is None or alloc_row is None:
            raise NotFound(
                f"no {'show' if show_row is None else 'allocation'} with id {show if show_row is None else alloc!r}"
            )
        name = f"{alloc_row.str_name}.{show_row.str_name}"
        if Subscription.objects.filter(show_id=show, alloc_id=alloc).exists():
            raise ValidationError(f"the subscription {name} already exists", code="exists")
        sub = Subscription.objects.create(
            pk=str(uuid.uuid4()), show_id=show, alloc_id=alloc, int_size=size, int_burst=burst
        )
        _record("sub", sub.pk, name, "create_subscription", actor, {"size": size, "burst": burst})
    return Created(sub.pk, name)


SUB_IN_USE_SQL = """
SELECT COUNT(*) FROM proc p JOIN host h ON h.pk_host = p.pk_host
WHERE p.pk_show = %s AND h.pk_alloc = %s AND NOT p.b_local
"""


def delete_subscription(sub_id: str, *, actor: Any) -> None:
    """Refused while frames of the show run on the allocation: their cores would be counted nowhere."""
    with transaction.atomic(durable=True), audit_context(actor, "delete_subscription"):
        sub = Subscription.objects.select_for_update().select_related("show", "alloc").filter(pk=sub_id).first()
        if sub is None:
            raise NotFound(f"no subscription with id {sub_id!r}")
        with connection.cursor() as cur:
            cur.execute(SUB_IN_USE_SQL, [sub.show_id, sub.alloc_id])
            (running,) = cur.fetchone()
        name = f"{sub.alloc.str_name}.{sub.show.str_name}"
        if running:
            raise ValidationError(
                f"the subscription {name} has {running} running frames: lower its burst to 0 and let them finish first",
                code="in_use",
            )
        Subscription.objects.filter(pk=sub_id).delete()
        _record("sub", sub_id, name, "delete_subscription", actor)
