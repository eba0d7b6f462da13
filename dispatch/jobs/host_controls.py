"""Host controls: lock, unlock, drain; the allocation move and tag edits. One durable
transaction each, the hosts' rows locked in one order, one `FarmAction` row per host in that
transaction (`audit.record_hosts`, `audit.record_host`). The
console, the JSON API and the OpenCue client API call these and nothing else.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from accounting.actions import audit_context
from dispatch.jobs import audit
from dispatch.jobs.action_base import retry_on_deadlock
from dispatch.models import Alloc, Host, HostTag, Proc

HOST_LOCK_STATE = {"lock": "LOCKED", "drain": "LOCKED", "unlock": "OPEN"}


@dataclass
class HostActionResult:
    """What a host control did: the hosts whose lock state changed, and those already there."""

    action: str
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    running: int = 0  # frames still running on the hosts (drain: they finish, nothing new starts)


def lock_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """LOCKED: placement books nothing new on the hosts (booking re-checks OPEN in its own
    statement, so a booking in flight either committed first or fails); running frames go on."""
    return _set_lock(hosts, "lock", actor)


def unlock_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """OPEN again. A NIMBY_LOCKED host (its owner's lock) is unlocked too: the operator asked."""
    return _set_lock(hosts, "unlock", actor)


def drain_hosts(hosts: Sequence[str], *, actor: Any = None) -> HostActionResult:
    """Slurm's drain: lock the hosts and let their running frames finish; the host list reads
    "draining (N running)" until the last one ends, then "drained". Nothing is killed: to empty
    a host now, kill its frames (they go back to WAITING and run elsewhere)."""
    return _set_lock(hosts, "drain", actor)


def _set_lock(hosts: Sequence[str], action: str, actor: Any) -> HostActionResult:
    ids = [h for h in hosts if isinstance(h, str)] if isinstance(hosts, (list, tuple)) else []
    if not ids or len(ids) != len(hosts):
        raise ValidationError("hosts must be a non-empty list of host ids or names")
    return retry_on_deadlock(lambda: _set_lock_once(ids, action, actor), f"host {action}")


def _set_lock_once(ids: list[str], action: str, actor: Any) -> HostActionResult:
    state = HOST_LOCK_STATE[action]
    result = HostActionResult(action)
    with transaction.atomic(durable=True), audit_context(actor, f"host_{action}"):
        # Row locks in a fixed order: two bulk locks over overlapping hosts cannot deadlock.
        rows = list(
            Host.objects.select_for_update()
            .filter(_id_or_name(ids))
            .order_by("pk_host")
            .values_list("pk_host", "str_name", "str_lock_state")
        )
        found = {v for pk, name, _ in rows for v in (pk, name)}
        missing = [h for h in ids if h not in found]
        if missing:
            raise ValidationError(f"no host {', '.join(repr(m) for m in missing[:10])}")
        moving = [pk for pk, _name, lock in rows if lock != state]
        result.changed = [name for _pk, name, lock in rows if lock != state]
        result.unchanged = [name for _pk, name, lock in rows if lock == state]
        if moving:
            Host.objects.filter(pk__in=moving).update(str_lock_state=state, ts_last_updated=Now())
        if action == "drain":
            result.running = Proc.objects.filter(host_id__in=[r[0] for r in rows]).count()
        audit.record_hosts(action, state, rows, actor)
    return result


def _id_or_name(ids: list[str]) -> Q:
    return Q(pk__in=ids) | Q(str_name__in=ids)


# --- allocation and tags ---------------------------------------------------------------------

# A tag is one word that a layer's `|`-separated tags can name (host_tag.str_tag is 45 long).
TAG_RE = re.compile(r"^[A-Za-z0-9_.:+-]{1,45}$")
TAGS_MAX = 128  # host.str_tags, the tags as one string (Cuebot's recalculateTags)
# Tags the host's registration derives (its allocation's, its name): not an operator's to remove.
DERIVED_TAG_TYPES = ("ALLOC", "HOSTNAME")


@dataclass
class HostChangeResult:
    """What an allocation move or tag edit did to one host."""

    action: str
    host: str
    changed: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


def set_host_allocation(host: str, alloc: str, *, actor: Any = None) -> HostChangeResult:
    """Move the host to another allocation (Cuebot's setAllocation): its ALLOC tag becomes the new
    allocation's. The host's running procs move subscription with it, in the same statement, by
    the accounting triggers on `host.pk_alloc` (`acct_host_move`), which also refuse the move
    while a scheduler-managed show's frames run on it; nothing is moved then."""
    target = _one_host(host)
    if not isinstance(alloc, str) or not alloc:
        raise ValidationError("allocation: name the allocation to move the host to (its id or name)")
    return retry_on_deadlock(lambda: _move_once(target, alloc, actor), f"allocation move of host {target}")


def add_host_tags(host: str, tags: Sequence[str], *, actor: Any = None) -> HostChangeResult:
    """Tag the host (MANUAL tags, as Cuebot's addTags); a tag it has already is left as it is, and
    an empty list writes nothing."""
    return _edit_tags(_one_host(host), _tags(tags), "host_add_tags", actor)


def remove_host_tags(host: str, tags: Sequence[str], *, actor: Any = None) -> HostChangeResult:
    """Untag the host; a tag it does not have is no error (as Cuebot). Its allocation's and its
    name's tags, and constant tags, are refused: dispatch reads them, the registration owns them."""
    return _edit_tags(_one_host(host), _tags(tags), "host_remove_tags", actor)


def _one_host(host: Any) -> str:
    if not isinstance(host, str) or not host:
        raise ValidationError("host: name the host (its id or name)")
    return host


def _tags(tags: Any) -> list[str]:
    if not isinstance(tags, (list, tuple)):
        raise ValidationError("tags: give a list of tags")
    wanted = list(tags)
    bad = [t for t in wanted if not isinstance(t, str) or not TAG_RE.match(t)]
    if bad:
        raise ValidationError(
            f"tags: {bad[0]!r} is not a tag (1 to 45 letters, digits, '_', '.', ':', '+' or '-', no space or '|')"
        )
    return list(dict.fromkeys(wanted))


def _locked_host(ref: str) -> Host:
    found = Host.objects.select_for_update().filter(_id_or_name([ref])).first()
    if found is None:
        raise Host.DoesNotExist(f"no host {ref!r}")
    return found


def _move_once(ref: str, alloc_ref: str, actor: Any) -> HostChangeResult:
    with transaction.atomic(durable=True), audit_context(actor, "host_set_allocation"):
        alloc = Alloc.objects.filter(Q(pk=alloc_ref) | Q(str_name=alloc_ref)).first()
        if alloc is None:
            raise Alloc.DoesNotExist(f"no allocation {alloc_ref!r}")
        host = Host.objects.filter(_id_or_name([ref])).select_related("alloc").first()
        if host is None:
            raise Host.DoesNotExist(f"no host {ref!r}")
        old = host.alloc
        # The accounting triggers lock the row (bounded) and move the running procs' usage.
        changed = Host.objects.filter(pk=host.pk).exclude(alloc_id=alloc.pk).update(alloc=alloc, ts_last_updated=Now())
        if changed:
            HostTag.objects.filter(host_id=host.pk, str_tag_type="ALLOC").delete()
            HostTag.objects.create(
                pk_host_tag=str(uuid.uuid4()),
                host_id=host.pk,
                str_tag=alloc.str_tag or alloc.str_name,
                str_tag_type="ALLOC",
            )
            _recalculate_tags(host.pk)
        detail = {"from": old.str_name, "to": alloc.str_name}
        audit.record_host("set_allocation", host.pk, host.str_name, changed, actor, detail)
    return HostChangeResult("set_allocation", host.str_name, changed, detail)


def _edit_tags(ref: str, tags: list[str], action: str, actor: Any) -> HostChangeResult:
    adding = action == "host_add_tags"
    if not tags:  # pycue drops the tags the host has before it sends: nothing to do, nothing written
        return HostChangeResult(action.removeprefix("host_"), ref)
    with transaction.atomic(durable=True), audit_context(actor, action):
        host = _locked_host(ref)
        rows = list(HostTag.objects.filter(host_id=host.pk).values_list("str_tag", "str_tag_type", "b_constant"))
        have = {tag for tag, _kind, _constant in rows}
        if adding:
            new = [t for t in tags if t not in have]
            HostTag.objects.bulk_create(
                HostTag(pk_host_tag=str(uuid.uuid4()), host_id=host.pk, str_tag=t, str_tag_type="MANUAL") for t in new
            )
            changed = len(new)
        else:
            kept = sorted({t for t, kind, constant in rows if t in tags and (constant or kind in DERIVED_TAG_TYPES)})
            if kept:
                raise ValidationError(
                    f"tags: {kept[0]!r} is the host's allocation, name or a constant tag, which only its "
                    "registration or an allocation move changes"
                )
            changed, _ = HostTag.objects.filter(host_id=host.pk, str_tag__in=tags).delete()
        if changed:
            _recalculate_tags(host.pk)
        audit.record_host(action.removeprefix("host_"), host.pk, host.str_name, changed, actor, {"tags": tags})
    return HostChangeResult(action.removeprefix("host_"), host.str_name, changed, {"tags": tags})


def _recalculate_tags(pk_host: str) -> None:
    """host.str_tags from its host_tag rows, and ts_last_updated so placement reloads the host."""
    tags = list(
        dict.fromkeys(HostTag.objects.filter(host_id=pk_host).order_by("str_tag").values_list("str_tag", flat=True))
    )
    joined = " ".join(tags)
    if len(joined) > TAGS_MAX:
        raise ValidationError(f"tags: the host's tags would be {len(joined)} characters, more than {TAGS_MAX}")
    Host.objects.filter(pk=pk_host).update(str_tags=joined, ts_last_updated=Now())
