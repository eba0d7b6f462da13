"""Form fields and forms of the console: caps in whole cores on screen, centicores in the database.

The cap fields keep their model names (`int_burst`, `int_max_cores`, ...) so they work both on
change forms and as `list_editable` columns, but show and take whole cores. Validation is the
one in `accounting.actions` (no negatives but -1 "unlimited", 0 books nothing, no fractions, at
most `MAX_CAP_CORES`, limits in cores), so the form and the action can never disagree.
`has_changed` compares in database units, so an untouched row of an editable change list is
not saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from accounting import actions
from accounting.units import CENTICORES_PER_CORE, UNLIMITED, is_unlimited_cap


class CapField(forms.IntegerField):
    """An integer cap shown in whole cores (or GPUs) and cleaned into the column's units."""

    def __init__(self, *, to_db: Callable[[Any], int], cores: bool, unlimited_ok: bool, **kwargs: Any) -> None:
        self.to_db = to_db
        self.cores = cores
        self.unlimited_ok = unlimited_ok
        kwargs.setdefault("widget", forms.NumberInput(attrs={"step": "1", "class": "ops-cap-input"}))
        super().__init__(**kwargs)

    def to_screen(self, db_value: int) -> int | float:
        if self.unlimited_ok and is_unlimited_cap(db_value):
            return UNLIMITED
        if not self.cores:
            return db_value
        if db_value % CENTICORES_PER_CORE == 0:
            return db_value // CENTICORES_PER_CORE
        # A fraction written by another tool is shown as it is; saving it asks for a whole value.
        return db_value / CENTICORES_PER_CORE

    def prepare_value(self, value: Any) -> Any:
        # Initial values come from the model (int, database units); bound data is what was typed.
        if isinstance(value, int) and not isinstance(value, bool):
            return self.to_screen(value)
        return value

    def to_python(self, value: Any) -> int | None:
        if isinstance(value, str) and value.strip() not in ("", "-") and "." in value:
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None and not number.is_integer():
                raise ValidationError("Whole cores only: no fractions of a core.", code="whole")
        return super().to_python(value)

    def clean(self, value: Any) -> int | None:
        number = super().clean(value)
        if number is None:
            return None
        return self.to_db(number)

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            new = self.clean(data)
        except ValidationError:
            return True
        return new != initial


def burst_field(label: str = "burst (cores)", **kw: Any) -> CapField:
    kw.setdefault(
        "help_text",
        "Whole cores, at most 1,000,000. The hard cap of this show on this allocation; 0 = book nothing "
        "(asks to confirm first).",
    )
    return CapField(to_db=actions.validate_burst, cores=True, unlimited_ok=False, label=label, **kw)


def size_field(**kw: Any) -> CapField:
    kw.setdefault("help_text", "Whole cores. Informational: the scheduler enforces the burst, not the size.")
    return CapField(
        to_db=lambda v: actions.validate_burst(v, "size"), cores=True, unlimited_ok=False, label="size (cores)", **kw
    )


def max_cores_field(**kw: Any) -> CapField:
    kw.setdefault("help_text", "Whole cores; -1 = unlimited, 0 = book nothing (asks to confirm first).")
    return CapField(to_db=actions.validate_max_cores, cores=True, unlimited_ok=True, label="max cores", **kw)


def max_gpus_field(**kw: Any) -> CapField:
    kw.setdefault("help_text", "GPUs; -1 = unlimited, 0 = no GPU frame (asks to confirm first).")
    return CapField(to_db=actions.validate_max_gpus, cores=False, unlimited_ok=True, label="max GPUs", **kw)


CAP_FIELDS = {
    "subscription": {"int_burst": burst_field, "int_size": size_field},
    "folderresource": {"int_max_cores": max_cores_field, "int_max_gpus": max_gpus_field},
    "jobresource": {"int_max_cores": max_cores_field, "int_max_gpus": max_gpus_field},
}


def cap_formfield(model_name: str, field_name: str, **kw: Any) -> CapField | None:
    factory = CAP_FIELDS.get(model_name, {}).get(field_name)
    return None if factory is None else factory(**kw)


def db_to_cores(column: str, value: int) -> int:
    """A cleaned cap (database units) back into what the actions take (whole cores / GPUs)."""
    if is_unlimited_cap(value):
        return UNLIMITED
    if column == "int_max_gpus":
        return value
    return value // CENTICORES_PER_CORE


class FlipForm(forms.Form):
    """The confirmation of a managed flip: the target state is posted back with the confirmation."""

    managed = forms.TypedChoiceField(
        choices=[("true", "scheduler-managed"), ("false", "database-enforced")],
        coerce=lambda v: v == "true",
        widget=forms.HiddenInput,
    )
    confirm = forms.BooleanField(required=True, widget=forms.HiddenInput, initial=True)


class KillSwitchForm(forms.Form):
    enabled = forms.TypedChoiceField(
        choices=[("true", "on"), ("false", "off")], coerce=lambda v: v == "true", widget=forms.HiddenInput
    )
    confirm = forms.BooleanField(required=True, widget=forms.HiddenInput, initial=True)


class AuditFilterForm(forms.Form):
    KINDS = [("", "all"), ("sub", "subscription caps"), ("folder", "folder caps"), ("job", "job caps")]
    KINDS += [("flip", "managed flips"), ("kill_switch", "kill switch"), ("limit", "licence limits")]
    KINDS += [("farm", "job, frame and host controls")]
    kind = forms.ChoiceField(choices=KINDS, required=False)
    who = forms.CharField(required=False, label="user or role")
    q = forms.CharField(required=False, label="object id or name")
    days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="last N days")
    people = forms.BooleanField(required=False, label="only people (console, CLI, API)")
    page = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)
