"""The audit trail: trigger-recorded history of every cap change and managed flip.

Built on django-pghistory, so the database records the change whoever writes it (this
console, a script, psql, a Cuebot sharing the database) and the console adds who asked for
it through `pghistory.context` inside `accounting.actions`. Two things pghistory does not
give out of the box, added here:

* old AND new value in one event row: pghistory stores one row image (OLD or NEW); our
  trigger writes the NEW image plus `old_<field>` columns from OLD, so an event reads on its
  own, with no window function over earlier events (and no missing "before" for rows that
  existed before the trail did);
* the database role (`session_user`), so a change made outside the admin still says who.

Triggers are row-level with a WHEN clause on the audited columns: the booking path updates
`int_cores` of these same rows on every booking, and a WHEN clause that is false costs no
function call.

The farm tables belong to the `dispatch` app; the triggers are declared on proxy models in
this app so their migrations live here (see `ops.models`).
"""

from __future__ import annotations

from typing import Any

import pghistory
import pgtrigger
from django.db import models
from pghistory import trigger as pgh_trigger

OLD_PREFIX = "old_"


class OldNewRowEvent(pgh_trigger.Event):
    """A row-level pghistory event trigger that also stores OLD values and the database role."""

    def get_func(self, model: type[models.Model]) -> pgtrigger.Func:
        event_model = self.event_model
        tracked = {f.name for f in event_model.pgh_tracked_model._meta.fields}
        values: dict[str, str] = {}
        for f in event_model._meta.fields:
            if isinstance(f, models.AutoField) or not f.concrete:
                continue
            if f.name in tracked:
                values[f.column] = f'NEW."{f.column}"'
            elif f.name.startswith(OLD_PREFIX) and f.name[len(OLD_PREFIX) :] in tracked:
                source = event_model.pgh_tracked_model._meta.get_field(f.name[len(OLD_PREFIX) :])
                values[f.column] = f'OLD."{source.column}"'
        values["pgh_created_at"] = "NOW()"
        values["pgh_label"] = f"'{self.label}'"
        values["pgh_obj_id"] = f'NEW."{event_model.pgh_tracked_model._meta.pk.column}"'
        values["pgh_context_id"] = "_pgh_attach_context()"
        values["db_role"] = "session_user"
        cols = ", ".join(f'"{c}"' for c in sorted(values))
        vals = ", ".join(values[c] for c in sorted(values))
        return pgtrigger.Func(f'INSERT INTO "{event_model._meta.db_table}" ({cols}) VALUES ({vals}); RETURN NULL;')


class _OldNewTracker:
    """Installs `OldNewRowEvent` in place of pghistory's own event trigger."""

    label: str
    trigger_name: str
    row: str
    operation: Any
    condition: Any
    level: Any

    def add_event_trigger(self, event_model: Any) -> None:
        pgtrigger.register(
            OldNewRowEvent(
                event_model=event_model,
                label=self.label,
                name=self.trigger_name,
                row=self.row,
                operation=self.operation,
                condition=self.condition,
                level=self.level,
            )
        )(event_model.pgh_tracked_model)


class ChangeEvent(_OldNewTracker, pghistory.UpdateEvent):
    """An UPDATE of any of `fields` records one event with old and new values."""

    def __init__(self, label: str, fields: list[str]) -> None:
        super().__init__(label, condition=pghistory.AnyChange(*fields), row=pghistory.New, level=pgtrigger.Row)


class CreateEvent(_OldNewTracker, pghistory.InsertEvent):
    """An INSERT records one event: the new values, old ones empty.

    For a row that always exists and cannot be deleted (the kill switch): the only way to
    write it other than by an UPDATE is TRUNCATE, which no row trigger sees, then INSERT.
    """

    def __init__(self, label: str) -> None:
        super().__init__(label, row=pghistory.New, level=pgtrigger.Row)


def old_fields(model: type[models.Model], names: list[str]) -> dict[str, models.Field]:
    """`old_<name>` columns for the event model, typed like the tracked column, nullable."""
    out: dict[str, models.Field] = {}
    for name in names:
        field = model._meta.get_field(name)
        clone = field.__class__(null=True, blank=True)
        out[f"{OLD_PREFIX}{name}"] = clone
    return out


def audit_attrs(model: type[models.Model], names: list[str]) -> dict[str, Any]:
    return {**old_fields(model, names), "db_role": models.CharField(max_length=128, default="", blank=True)}
