"""The audit rows of the job, frame and host actions (`cuesched_farm_action`), written inside the
action's own transaction, so the trail holds a control exactly when it committed. Every action
of `dispatch.jobs` writes its `FarmAction` rows here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dispatch.models import FarmAction, Job


def username(actor: Any) -> str:
    if actor is None:
        return ""
    return actor if isinstance(actor, str) else str(actor.get_username())


def record(kind: str, target: str, action: str, changed: int, actor: Any, detail: dict[str, Any] | None = None) -> None:
    """The control's audit row, written inside the control's own transaction (see the module doc)."""
    name = Job.objects.filter(pk=target).values_list("str_name", flat=True).first() or ""
    FarmAction.objects.create(
        str_action=action,
        str_target_kind=kind,
        str_target=target,
        str_target_name=name,
        int_changed=changed,
        detail=detail or {},
        str_username=username(actor),
    )


def record_hosts(action: str, state: str, rows: Sequence[tuple[str, str, str]], actor: Any) -> None:
    """A host control's rows, one per host of (pk_host, str_name, lock state before): changed
    when its lock state was not already `state`."""
    user = username(actor)
    FarmAction.objects.bulk_create(
        FarmAction(
            str_action=action,
            str_target_kind="host",
            str_target=pk,
            str_target_name=name,
            int_changed=int(lock != state),
            detail={"from": lock, "to": state},
            str_username=user,
        )
        for pk, name, lock in rows
    )


def record_host(action: str, pk: str, name: str, changed: int, actor: Any, detail: dict[str, Any]) -> None:
    """One host's row for an allocation move or a tag edit (changed 0: it was so already)."""
    FarmAction.objects.create(
        str_action=action,
        str_target_kind="host",
        str_target=pk,
        str_target_name=name,
        int_changed=changed,
        detail=detail,
        str_username=username(actor),
    )
