"""The two notification channels and their payloads, parsed strictly.

A notification is a hint; the tables are the truth. So a payload that does not parse is
logged with its raw text, counted and dropped, never half-applied: the recompute (for a
release) and the limit reseed (for a cap) heal whatever it would have said.

Payloads, compact JSON written by the triggers in `accounting.triggers`:
- `acct_release`: show, alloc, folder, job, layer, dept (UUID text), cores (signed whole
  cores: negative for a release, positive for a proc written or grown outside the scheduler or
  the new side of a move), gpus (signed), xid (the writing transaction's `pg_current_xact_id()`,
  optional for payloads from an older writer such as Cuebot).
- `acct_limit_change`: `{"vertex": "sub", show, alloc, burst}` or
  `{"vertex": "folder"|"job", id, max_cores?, max_gpus?}` in whole cores (-1 unlimited), or
  either with `"removed": true` for a deleted row, plus the optional xid. Writers may add keys
  (the triggers add `seq`); they are ignored.
- `acct_resync`: `{"table": <name>, xid}`, a TRUNCATE no row-level message can describe.

A release or cap message may end with `"gen_from": F, "gen": G` (a cap message of a folder or
job also with the `show` it belongs to): the last message of a show whose accounting
generation the writing transaction's trigger bumped, from F to G (accounting.triggers,
bump_generation). The Store records G once the message's change is applied.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from accounting.licences import limit_max
from accounting.notify import (
    CHANNELS,
    HEARTBEAT_CHANNEL,
    LICENCE_CHANNEL,
    LIMIT_CHANNEL,
    RELEASE_CHANNEL,
    RESYNC_CHANNEL,
)
from accounting.store import BookingDelta, LimitChange, LimitKind

__all__ = [
    "CHANNELS",
    "HEARTBEAT_CHANNEL",
    "LICENCE_CHANNEL",
    "LIMIT_CHANNEL",
    "RELEASE_CHANNEL",
    "RESYNC_CHANNEL",
    "LicenceNotice",
    "LimitNotice",
    "PayloadError",
    "Release",
    "Resync",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class PayloadError(ValueError):
    """A payload that cannot be applied; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class Release:
    delta: BookingDelta
    xid: int | None
    generation: tuple[int, int] | None = None  # (gen_from, gen) of the release's show


@dataclass(frozen=True, slots=True)
class LimitNotice:
    changes: tuple[LimitChange, ...]
    xid: int | None
    generation: tuple[str, int, int] | None = None  # (show, gen_from, gen)


@dataclass(frozen=True, slots=True)
class LicenceNotice:
    """A licence limit's absolute state (`removed`: the row was deleted; the values are then 0)."""

    limit: str
    max: int
    host: bool
    running: int
    removed: bool
    xid: int | None


@dataclass(frozen=True, slots=True)
class Resync:
    table: str
    xid: int | None


def _object(payload: str) -> dict[str, Any]:
    try:
        data = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PayloadError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PayloadError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _id(data: dict[str, Any], field: str) -> str:
    if field not in data:
        raise PayloadError(f"missing field {field!r}")
    value = data[field]
    if not isinstance(value, str):
        raise PayloadError(f"field {field!r} must be a UUID string, got {type(value).__name__}")
    try:
        uuid.UUID(value)
    except ValueError:
        raise PayloadError(f"field {field!r} is not a UUID: {value[:64]!r}") from None
    if len(value) != 36:
        # Keys are VARCHAR(36) text compared case-sensitively; braces or URNs never match a row.
        raise PayloadError(f"field {field!r} is not a canonical 36-character UUID: {value[:64]!r}")
    return value


def _int(data: dict[str, Any], field: str, lo: int, hi: int, *, required: bool = True) -> int | None:
    if field not in data:
        if required:
            raise PayloadError(f"missing field {field!r}")
        return None
    value = data[field]
    # bool is an int in Python; JSON true/false is never a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(f"field {field!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PayloadError(f"field {field!r} out of range: {value}")
    return value


def _xid(data: dict[str, Any]) -> int | None:
    return _int(data, "xid", 1, INT64_MAX, required=False)


def _generation(data: dict[str, Any]) -> tuple[int, int] | None:
    """(gen_from, gen) when the message carries a bump; both or neither."""
    gen = _int(data, "gen", 1, INT64_MAX, required=False)
    gen_from = _int(data, "gen_from", 0, INT64_MAX, required=gen is not None)
    if gen is None:
        if gen_from is not None:
            raise PayloadError("field 'gen_from' without 'gen'")
        return None
    assert gen_from is not None
    if gen_from >= gen:
        raise PayloadError(f"generation goes from {gen_from} to {gen}: not a bump")
    return gen_from, gen


def parse_release(payload: str) -> Release:
    data = _object(payload)
    delta = BookingDelta(
        show=_id(data, "show"),
        alloc=_id(data, "alloc"),
        folder=_id(data, "folder"),
        job=_id(data, "job"),
        cores=_int(data, "cores", INT64_MIN, INT64_MAX),  # type: ignore[arg-type]
        gpus=_int(data, "gpus", INT32_MIN, INT32_MAX),  # type: ignore[arg-type]
    )
    return Release(delta=delta, xid=_xid(data), generation=_generation(data))


# vertex -> (max cores, max GPUs, both, removed)
_VERTEX_KINDS = {
    "folder": (LimitKind.FOLDER_MAX_CORES, LimitKind.FOLDER_MAX_GPUS, LimitKind.FOLDER_CAPS, LimitKind.FOLDER_REMOVED),
    "job": (LimitKind.JOB_MAX_CORES, LimitKind.JOB_MAX_GPUS, LimitKind.JOB_CAPS, LimitKind.JOB_REMOVED),
}


def _removed(data: dict[str, Any]) -> bool:
    value = data.get("removed", False)
    if not isinstance(value, bool):
        raise PayloadError(f"field 'removed' must be a boolean, got {type(value).__name__}")
    return value


def parse_limit_change(payload: str) -> LimitNotice:
    """A cap message as Store changes: one for both fields of a row, as Cuebot's one field each."""
    data = _object(payload)
    notice = _parse_limit_change(data)
    bump = _generation(data)
    if bump is None:
        return notice
    return LimitNotice(notice.changes, notice.xid, (_id(data, "show"), *bump))


def _parse_limit_change(data: dict[str, Any]) -> LimitNotice:
    vertex = data.get("vertex")
    if vertex == "sub":
        key = (_id(data, "show"), _id(data, "alloc"))
        if _removed(data):
            return LimitNotice((LimitChange(LimitKind.SUB_REMOVED, key, 0),), _xid(data))
        burst = _int(data, "burst", INT64_MIN, INT64_MAX)
        return LimitNotice((LimitChange(LimitKind.SUB_BURST, key, burst),), _xid(data))  # type: ignore[arg-type]
    if vertex in _VERTEX_KINDS:
        cores_kind, gpus_kind, both_kind, removed_kind = _VERTEX_KINDS[vertex]
        ident = _id(data, "id")
        if _removed(data):
            return LimitNotice((LimitChange(removed_kind, ident, 0),), _xid(data))
        max_cores = _int(data, "max_cores", INT64_MIN, INT64_MAX, required=False)
        max_gpus = _int(data, "max_gpus", INT64_MIN, INT64_MAX, required=False)
        if max_cores is not None and max_gpus is not None:
            return LimitNotice((LimitChange(both_kind, ident, (max_cores, max_gpus)),), _xid(data))
        changes = []
        if max_cores is not None:
            changes.append(LimitChange(cores_kind, ident, max_cores))
        if max_gpus is not None:
            changes.append(LimitChange(gpus_kind, ident, max_gpus))
        return LimitNotice(tuple(changes), _xid(data))
    raise PayloadError(f"unknown vertex {vertex!r}")


def parse_resync(payload: str) -> Resync:
    data = _object(payload)
    table = data.get("table")
    if not isinstance(table, str) or not table:
        raise PayloadError("missing field 'table'")
    return Resync(table=table[:64], xid=_xid(data))


def parse_licence(payload: str) -> LicenceNotice:
    """An acct_licence message; a count below 0 is refused (the triggers never write one)."""
    data = _object(payload)
    limit = _id(data, "id")
    if _removed(data):
        return LicenceNotice(limit, 0, False, 0, True, _xid(data))
    host = data.get("host", False)
    if not isinstance(host, bool):
        raise PayloadError(f"field 'host' must be a boolean, got {type(host).__name__}")
    if "max" in data and data["max"] is None:
        # A limit without a max runs nothing (accounting.licences.limit_max), never unlimited.
        max_value: int | None = limit_max(None, cuebot=False)
    else:
        max_value = _int(data, "max", INT32_MIN, INT32_MAX)
    running = _int(data, "running", 0, INT32_MAX)
    return LicenceNotice(limit, max_value, host, running, False, _xid(data))  # type: ignore[arg-type]
