"""Shared field helpers for the Cuebot-mapped tables.

Cuebot's keys are VARCHAR(36) UUID strings, not native uuid columns, and every default
lives in the database (`db_default`), so rows written by raw SQL, COPY, a script or a real
Cuebot sharing the database get the same values as rows written through the ORM.
"""

from __future__ import annotations

import datetime
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


class CurrentTimestamp(models.Func):
    """SQL's CURRENT_TIMESTAMP, as a column default: the very default Cuebot's DDL declares
    (Django's Now() renders STATEMENT_TIMESTAMP() on PostgreSQL)."""

    template = "CURRENT_TIMESTAMP"
    output_field = models.DateTimeField()


class CuebotLocalTimestamp(models.DateTimeField):
    """A Cuebot `TIMESTAMP (6)` column: without time zone, as Cuebot's DDL has it (comments.ts_created).

    Django's DateTimeField is `timestamp with time zone`; on a Cuebot database the column is
    Cuebot's and keeps its type, so the model must declare the same one for adoption to find
    nothing to change. PostgreSQL writes such a column in the session's time zone, which is UTC
    on Django's connections, so values are read back as UTC and written converted to UTC.
    """

    def db_type(self, connection: Any) -> str:
        return "timestamp(6)"

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if isinstance(value, datetime.datetime) and value.tzinfo is None:
            return value.replace(tzinfo=datetime.UTC)
        return value

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        value = super().get_db_prep_value(value, connection, prepared)
        if isinstance(value, datetime.datetime) and value.tzinfo is not None:
            return value.astimezone(datetime.UTC).replace(tzinfo=None)
        return value
