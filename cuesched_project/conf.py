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


def cuebot_mode_setting() -> str:
    """`auto` (default): Cuebot mode when the database is Cuebot's (its verify_subscription trigger
    is on `subscription`, the test the proc triggers make too); `on` or `off` force it. Forcing it
    `off` on a Cuebot database is refused by the scheduler: the triggers would still stand down."""
    raw = env_str("CUESCHED_CUEBOT_MODE", "auto").lower()
    if raw not in ("auto", "on", "off"):
        raise ValueError(f"CUESCHED_CUEBOT_MODE must be auto, on or off, got {raw!r}")
    return raw


def managed_shows_ttl() -> float:
    """How often the set of scheduler-managed shows is re-read (and new ones seeded)."""
    return env_float("CUESCHED_MANAGED_SHOWS_TTL", 30.0)


def trigger_check_interval() -> float:
    """How often the scheduler checks that cuesched's triggers are installed and firing, seconds
    (a problem stops every booking within this plus one dispatch cycle)."""
    return env_float("CUESCHED_TRIGGER_CHECK_INTERVAL", 2.0)


def db_reconcile_interval() -> float:
    """Five counter tables of unmanaged shows <- SUM(proc): the database-enforced path's backstop."""
    return env_float("CUESCHED_DB_RECONCILE_INTERVAL", 60.0)


def history_interval() -> float:
    """How often the scheduler samples the farm into the history table (the console's charts), seconds."""
    return env_float("CUESCHED_HISTORY_INTERVAL", 10.0)


def history_retention_hours() -> float:
    """History samples older than this are deleted by the sampler (the charts show the last day), hours."""
    return env_float("CUESCHED_HISTORY_RETENTION_HOURS", 48.0)


def drift_memory_seconds() -> float:
    """How long the live view keeps a key's drift after a recompute corrected it (the console shows it), seconds."""
    return env_float("CUESCHED_DRIFT_MEMORY_SECONDS", 900.0)


# --- listener liveness and the scheduler's fence ----------------------------------------
def heartbeat_interval() -> float:
    """How often the scheduler NOTIFYs itself on cuesched_heartbeat, seconds."""
    return env_float("CUESCHED_HEARTBEAT_INTERVAL", 0.5)


def heartbeat_deadline() -> float:
    """Managed shows book only while a heartbeat sent at most this long ago came back through
    the listener; past it the listener reconnects and reseeds (seconds)."""
    return env_float("CUESCHED_HEARTBEAT_DEADLINE", 3.0)


def tcp_user_timeout_ms() -> int:
    """libpq tcp_user_timeout of the scheduler's connections: unacknowledged data after this long
    fails the connection instead of waiting out the kernel's retries (~15 minutes)."""
    return env_int("CUESCHED_TCP_USER_TIMEOUT_MS", 10000)


def scheduler_database_url() -> str:
    """A DATABASE_URL for the scheduler's own connections (listener, loops, dispatch, lock), when
    they must take another path than Django's (a pooler, a proxy); empty means Django's."""
    return env_str("CUESCHED_SCHEDULER_DATABASE_URL", "")


def standby_poll_interval() -> float:
    """A `run_scheduler --standby` retries the one-scheduler lock this often, seconds."""
    return env_float("CUESCHED_STANDBY_POLL_INTERVAL", 1.0)


# --- lock and statement timeouts: one stuck session slows at most its own show -------------
def db_lock_timeout() -> float:
    """`lock_timeout` of every scheduler connection, seconds (0 disables it): no wait for a lock,
    however it was taken (a psql session left open), lasts longer; the loops skip or retry."""
    return env_float("CUESCHED_DB_LOCK_TIMEOUT", 5.0)


def db_statement_timeout() -> float:
    """`statement_timeout` of every scheduler connection, seconds (0 disables it): the longest one
    statement of the scheduler (a recompute read of a big farm included) may run."""
    return env_float("CUESCHED_DB_STATEMENT_TIMEOUT", 120.0)


def db_idle_in_transaction_timeout() -> float:
    """`idle_in_transaction_session_timeout` of the scheduler's own connections, seconds (0
    disables it): a scheduler session wedged inside a transaction (a stopped thread, a lost
    peer) is ended by PostgreSQL instead of holding its locks."""
    return env_float("CUESCHED_DB_IDLE_IN_TRANSACTION_TIMEOUT", 60.0)


def booking_lock_wait() -> float:
    """How long the booking transaction waits for any one lock (a show's database-accounting lock,
    a licence limit's row, a frame, host or show row), seconds. Past it, the show (or the
    limit's bookings) is skipped for this cycle and the others are written."""
    return env_float("CUESCHED_BOOKING_LOCK_WAIT", 0.2)


def locked_show_backoff() -> float:
    """A show skipped because another session held its lock is not booked again for this long,
    seconds, so a stuck session costs the loop one lock wait per back-off, not one per cycle."""
    return env_float("CUESCHED_LOCKED_SHOW_BACKOFF", 2.0)


def reconcile_lock_wait() -> float:
    """How long the reconcile waits for one unmanaged show's lock, seconds, before it moves on to
    the next show (it comes back to the skipped ones, three passes in all)."""
    return env_float("CUESCHED_RECONCILE_LOCK_WAIT", 1.0)


def cap_write_wait() -> float:
    """How long an operator's cap or limit write (the console, the API, the commands) waits for a
    booking that holds its row, seconds, before it fails with a message naming the holder."""
    return env_float("CUESCHED_CAP_WRITE_WAIT", 10.0)


def flip_lock_wait() -> float:
    """How long a flip through the console or `accounting.actions.flip_show` waits for its show's
    row (FOR UPDATE), seconds, before it fails naming the sessions inside a transaction that hold
    it (every open transaction that wrote a proc of that show does)."""
    return env_float("CUESCHED_FLIP_LOCK_WAIT", 10.0)
def lease_ttl() -> float:
    """The scheduler lease's deadline is renewed to now + this, seconds. Once it has passed, a
    standby terminates the holder's sessions and takes over: a stopped holder is replaced this
    long after its last renewal (plus a standby poll). Keep it above lease_renew_interval x 2."""
    return env_float("CUESCHED_LEASE_TTL", 6.0)


def lease_renew_interval() -> float:
    """How often the scheduler renews its lease deadline on its lock session, seconds."""
    return env_float("CUESCHED_LEASE_RENEW_INTERVAL", 1.5)
