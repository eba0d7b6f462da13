"""Shared field helpers for the Cuebot-mapped tables.

Cuebot's keys are VARCHAR(36) UUID strings, not native uuid columns, and every default
lives in the database (`db_default`), so rows written by raw SQL, COPY, a script or a real
Cuebot sharing the database get the same values as rows written through the ORM.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models
from django.db.models.functions import Now


def new_id() -> str:
    return str(uuid.uuid4())


def pk_field(column: str) -> models.CharField:
    return models.CharField(max_length=36, primary_key=True, default=new_id, db_column=column, editable=False)


def fk(to: str, column: str, *, null: bool = False, related_name: str = "+", **kw: Any) -> models.ForeignKey:
    """A Cuebot `pk_*` reference column. Deletion order is the writer's job (as in Cuebot)."""
    return models.ForeignKey(
        to,
        on_delete=models.DO_NOTHING,
        db_column=column,
        null=null,
        blank=null,
        related_name=related_name,
        **kw,
    )


def one_to_one(to: str, column: str, related_name: str) -> models.OneToOneField:
    return models.OneToOneField(to, on_delete=models.DO_NOTHING, db_column=column, related_name=related_name)


def now_default() -> Now:
    return Now()
