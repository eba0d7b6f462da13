"""cuesched's own settings, read through small accessors with documented defaults.

Each accessor reads the environment at call time (so tests and ops can change a knob
without monkeypatching), falling back to a Django setting of the same name, then to the
default written here. `docs/reference.md` lists them all.
"""

from __future__ import annotations

import os

from django.conf import settings


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is not None and value.strip() != "":
        return value.strip()
    value = getattr(settings, name, None)
    return None if value is None else str(value)


def env_float(name: str, default: float) -> float:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc


def env_int(name: str, default: int) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def env_bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    return raw.lower() in {"1", "true", "yes", "on"}


def env_str(name: str, default: str) -> str:
    raw = _raw(name)
    return default if raw is None else raw


# --- accounting loops (seconds) ---------------------------------------------------------
def recompute_interval() -> float:
    """Store <- SUM(proc) reconciliation; the backstop for a missed release."""
    return env_float("CUESCHED_RECOMPUTE_INTERVAL", 15.0)


def limit_reseed_interval() -> float:
    """Caps <- database; the backstop for a missed cap change."""
    return env_float("CUESCHED_LIMIT_RESEED_INTERVAL", 300.0)


def managed_shows_ttl() -> float:
    """How often the set of scheduler-managed shows is re-read (and new ones seeded)."""
    return env_float("CUESCHED_MANAGED_SHOWS_TTL", 30.0)
