"""The Store's live view, published to PostgreSQL for the web admin and `store_status`.

The Store lives in the scheduler process only; the admin runs in other processes. Once a
second the scheduler writes one JSON document (counters, caps and in-flight amounts per
key, loop and listener state, heartbeat) into a single row of the UNLOGGED table
`cuesched_scheduler_state`. UNLOGGED because it is rebuilt every second and worthless
after a crash; one row because readers want one consistent picture, not a join of
thousands of rows written at different moments.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg

from accounting import db, metrics

if TYPE_CHECKING:
    from accounting import metrics
from accounting.service import AccountingService

logger = logging.getLogger(__name__)

TABLE = "cuesched_scheduler_state"

PUBLISH_SQL = f"""
INSERT INTO {TABLE} (id, pid, hostname, heartbeat, payload)
VALUES (1, %(pid)s, %(hostname)s, now(), %(payload)s::jsonb)
ON CONFLICT (id) DO UPDATE
SET pid = EXCLUDED.pid, hostname = EXCLUDED.hostname, heartbeat = EXCLUDED.heartbeat, payload = EXCLUDED.payload
"""

READ_SQL = f"""
SELECT pid, hostname, heartbeat, EXTRACT(EPOCH FROM (now() - heartbeat))::float8, payload::text
FROM {TABLE} WHERE id = 1
"""

# A view older than this is reported as stale (the scheduler publishes every second).
STALE_AFTER_SECONDS = 5.0


def sub_key(show: str, alloc: str) -> str:
    return f"{show}:{alloc}"


def build_view(service: AccountingService) -> dict[str, Any]:
    """Everything ops may want from the Store, as plain JSON types."""
    store = service.store
    live = store.audit_snapshot()
    inflight = store.inflight_snapshot()
    caps = store.caps()
    zero = (0, 0)
    sub: dict[str, Any] = {}
    for key in live.sub.keys() | caps.sub.keys():
        cores, gpus = live.sub.get(key, zero)
        icores, igpus = inflight.sub.get(key, zero)
        sub[sub_key(*key)] = {
            "cores": cores,
            "gpus": gpus,
            "inflight_cores": icores,
            "inflight_gpus": igpus,
            "burst": caps.sub.get(key),
        }
    vertices: dict[str, dict[str, Any]] = {}
    for name in ("folder", "job"):
        live_map, infl_map, cap_map = getattr(live, name), getattr(inflight, name), getattr(caps, name)
        out: dict[str, Any] = {}
        for key in live_map.keys() | cap_map.keys():
            cores, gpus = live_map.get(key, zero)
            icores, igpus = infl_map.get(key, zero)
            cap = cap_map.get(key)
            out[key] = {
                "cores": cores,
                "gpus": gpus,
                "inflight_cores": icores,
                "inflight_gpus": igpus,
                "max_cores": None if cap is None else cap[0],
                "max_gpus": None if cap is None else cap[1],
            }
        vertices[name] = out
    st = service.state
    ls = service.listener.stats
    rc = st.last_recompute
    heartbeat_age = service.listener.heartbeat_age()
    if heartbeat_age is not None:
        metrics.HEARTBEAT_AGE.set(heartbeat_age)
    return {
        "started_at": st.started_at,
        "bootstrapped_at": st.bootstrapped_at,
        "published_at": time.time(),
        "epoch": store.epoch,
        "managed_shows": {show: st.managed_published_at.get(show) for show in service.managed_shows()},
        "listener": {
            "state": ls.state,
            "connected_since": ls.connected_since,
            "reconnects": ls.reconnects,
            "releases_applied": ls.releases_applied,
            "releases_skipped": ls.releases_skipped,
            "limits_applied": ls.limits_applied,
            "limits_skipped": ls.limits_skipped,
            "dropped": ls.dropped,
            "injected_drops": ls.injected_drops,
            "last_error": ls.last_error,
            "last_reseed_seconds": ls.last_reseed_seconds,
            "heartbeat_age_seconds": heartbeat_age,
            "heartbeat_deadline_seconds": service.listener.deadline,
            "heartbeats": ls.heartbeats,
            "wedges": ls.wedges,
            "resyncs": ls.resyncs,
            "server_id": ls.server_id,
        },
        # Whether the Store books managed shows now, and if not, why (listener stale, lease lost).
        "enforcing": service.can_enforce(),
        "paused_reason": service.pause_reason(),
        "lease_generation": service.lease_generation,
        "server_changes": st.server_changes,
        "reconcile_drift_cores": st.last_reconcile_drift,
        "reconcile_skipped": st.last_reconcile_skipped,
        "cuebot_mode": None
        if service.cuebot is None
        else {
            "enabled": service.cuebot.enabled,
            "setting": service.cuebot.setting,
            "detected": service.cuebot.detected,
            "description": service.cuebot.describe(),
            "notifier_releases_dropped": ls.cuebot_releases_ignored,
        },
        # Cap changes the listener applied, newest last: [vertex, key, field, value, unix time].
        "recent_caps": list(ls.recent_caps),
        "recompute": None
        if rc is None
        else {
            "at": st.loops["recompute"].last_run if "recompute" in st.loops else st.bootstrapped_at,
            "store_seconds": rc.store_seconds,
            "pg_seconds": rc.pg_seconds,
            "keys": rc.keys,
            "rows": rc.rows,
            "drift_cores": rc.drift_cores,
            # Per key, the drift recompute passes corrected within conf.drift_memory_seconds():
            # [signed whole cores, unix time of the pass].
            "drift_keys": {v: {k: [d, at] for k, (d, at) in keys.items()} for v, keys in st.recent_drift.items()},
            "evicted": rc.evicted,
            "pg_error": rc.pg_error,
        },
        "loops": {
            name: {
                "interval": lp.interval,
                "last_run": lp.last_run,
                "last_seconds": lp.last_seconds,
                "runs": lp.runs,
                "errors": lp.errors,
                "last_error": lp.last_error,
            }
            for name, lp in st.loops.items()
        },
        "extra": {name: provider() for name, provider in service.view_providers.items()},
        "sub": sub,
        "folder": vertices["folder"],
        "job": vertices["job"],
    }


def publish(service: AccountingService, conn: psycopg.Connection) -> int:
    payload = json.dumps(build_view(service), separators=(",", ":"), default=str)
    conn.execute(PUBLISH_SQL, {"pid": os.getpid(), "hostname": socket.gethostname(), "payload": payload})
    return len(payload)


def run_publisher(service: AccountingService, stop: threading.Event, interval: float = 1.0) -> None:
    """Publish until stopped; a database error is logged and retried on a new connection."""
    conn: psycopg.Connection | None = None
    while not stop.is_set():
        try:
            if conn is None or conn.closed or conn.broken:
                conn = db.connect(application_name="cuesched-live")
            publish(service, conn)
        except Exception as exc:
            logger.warning("live view publish failed (retrying): %s", exc)
            if conn is not None:
                conn.close()
            conn = None
        stop.wait(interval)
    if conn is not None:
        conn.close()


def read_view(cursor: Any) -> dict[str, Any] | None:
    """Read the published view with its age, from any process (a DB-API cursor)."""
    cursor.execute(READ_SQL)
    row = cursor.fetchone()
    if row is None:
        return None
    pid, hostname, heartbeat, age, payload = row
    view = json.loads(payload)
    view["pid"] = pid
    view["hostname"] = hostname
    view["heartbeat"] = heartbeat.isoformat() if hasattr(heartbeat, "isoformat") else heartbeat
    view["age_seconds"] = round(float(age), 3)
    view["stale"] = view["age_seconds"] > STALE_AFTER_SECONDS
    return view
