"""Prometheus metrics of the scheduler process, served on a local port by `run_scheduler`.

Names are listed in `docs/reference.md`; a test checks every name documented there exists
here. Everything lives in one registry so tests can read values without global state
from other processes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

BOOKINGS = Counter(
    "cuesched_bookings_total",
    "Bookings committed and launched, by who enforced their caps (store, database).",
    ["accounting"],
    registry=REGISTRY,
)
REJECTIONS = Counter(
    "cuesched_rejections_total",
    "Bookings refused by a cap, by table (subscription, folder, job, folder_gpus, job_gpus).",
    ["table"],
    registry=REGISTRY,
)
RELEASES = Counter(
    "cuesched_releases_total",
    "acct_release notifications, by outcome (applied, skipped as already in a snapshot).",
    ["outcome"],
    registry=REGISTRY,
)
LIMIT_CHANGES = Counter(
    "cuesched_limit_changes_total",
    "acct_limit_change notifications, by outcome (applied, skipped as older than a reseed).",
    ["outcome"],
    registry=REGISTRY,
)
DROPPED = Counter(
    "cuesched_payloads_dropped_total",
    "Notifications dropped, by channel and reason (malformed, injected, channel, cuebot_notifier: a release "
    "from Cuebot's AccountingNotifier, which Cuebot mode expects off).",
    ["channel", "reason"],
    registry=REGISTRY,
)
CUEBOT_MODE = Gauge(
    "cuesched_cuebot_mode",
    "1 when the scheduler runs beside Cuebot (CUESCHED_CUEBOT_MODE, detected).",
    registry=REGISTRY,
)
LISTENER_RECONNECTS = Counter("cuesched_listener_reconnects_total", "Listener reconnections.", registry=REGISTRY)
LISTENER_CONNECTED = Gauge(
    "cuesched_listener_connected", "1 while the listener is connected and listening.", registry=REGISTRY
)
RECOMPUTE_SECONDS = Histogram(
    "cuesched_recompute_cycle_seconds",
    "Duration of a recompute cycle (Store and PostgreSQL sides).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
RECOMPUTE_DRIFT = Gauge(
    "cuesched_recompute_drift_cores",
    "Cores by which the Store differed from SUM(proc) at the last recompute, summed over keys, by vertex.",
    ["vertex"],
    registry=REGISTRY,
)
LIMIT_RESEED_SECONDS = Histogram("cuesched_limit_reseed_seconds", "Duration of a limit reseed.", registry=REGISTRY)
MANAGED_SHOWS = Gauge("cuesched_managed_shows", "Shows published as scheduler-managed.", registry=REGISTRY)
LOOP_ERRORS = Counter(
    "cuesched_loop_errors_total",
    "Failed iterations of a background loop, by loop.",
    ["loop"],
    registry=REGISTRY,
)
LISTENER_WEDGES = Counter(
    "cuesched_listener_wedges_total",
    "Listener sessions dropped because no heartbeat came back within CUESCHED_HEARTBEAT_DEADLINE.",
    registry=REGISTRY,
)
HEARTBEAT_AGE = Gauge(
    "cuesched_listener_heartbeat_age_seconds",
    "Age of the newest heartbeat the listener received, from its send (how stale the Store's view may be).",
    registry=REGISTRY,
)
RESYNCS = Counter(
    "cuesched_resyncs_total", "Full reseeds on acct_resync (a TRUNCATE of proc or a cap table).", registry=REGISTRY
)
DB_RECONCILE_DRIFT = Gauge(
    "cuesched_db_reconcile_drift_cores",
    "Cores the last reconcile of unmanaged shows corrected in the database counters, by table.",
    ["table"],
    registry=REGISTRY,
)
LEASE_GENERATION = Gauge(
    "cuesched_scheduler_lease_generation", "The scheduler lease generation this process books under.", registry=REGISTRY
)
FORGOTTEN = Counter(
    "cuesched_server_changes_total",
    "Times the scheduler found another server (or transaction ids gone back) and dropped its snapshots.",
    registry=REGISTRY,
)
TRIGGER_PROBLEMS = Gauge(
    "cuesched_trigger_problems",
    "cuesched triggers missing, disabled or doubled at the scheduler's last catalog check (every "
    "CUESCHED_TRIGGER_CHECK_INTERVAL); while above 0 the scheduler books nothing.",
    registry=REGISTRY,
)
INTEGRITY_ALARMS = Counter(
    "cuesched_integrity_alarms_total",
    "Counters found BELOW SUM(proc), by kind (store_low: a managed show's Store counter at a recompute; "
    "db_low: an unmanaged show's counter tables at a reconcile).",
    ["kind"],
    registry=REGISTRY,
)
INTEGRITY_ALARMS_OPEN = Gauge(
    "cuesched_integrity_alarms_open",
    "Integrity alarms not yet acknowledged (cuesched_integrity_alarm), at the last catalog check.",
    registry=REGISTRY,
)


class MetricsPortError(RuntimeError):
    """The /metrics port cannot be listened on (taken by another process, not permitted)."""


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Expose /metrics; a port of 0 disables the endpoint.

    A port that cannot be bound is a clear error, not a raw OSError traceback: it is the
    usual sign of a second scheduler (or another demo) on the same machine.
    """
    if port:
        try:
            start_http_server(port, addr=addr, registry=REGISTRY)
        except OSError as exc:
            raise MetricsPortError(
                f"cannot serve /metrics on {addr}:{port}: {exc.strerror or exc}; choose another port with "
                "--metrics-port or CUESCHED_METRICS_PORT (0 disables the endpoint)"
            ) from None
