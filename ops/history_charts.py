"""The history charts' data: the scheduler's samples (`ops.models.HistorySample`) as plot series.

One query per window, whatever the retention: the samples are bucketed in SQL (the last sample
of each bucket, DISTINCT ON), so the last hour keeps every 10 s sample and the last day one
per two minutes (at most 720 points a line; the hour at most 3,600), and the JSON of a large farm's subscriptions is
never read more than once per bucket. The browser draws them with uPlot, served from the app
(ops/static/ops/vendor/uplot-1.6.32). Amounts are converted to whole cores here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.db import connection

from accounting.units import centicores_to_cores
from cuesched_project import conf


@dataclass(frozen=True)
class Window:
    key: str
    title: str
    seconds: int
    bucket_seconds: int


def windows() -> tuple[Window, ...]:
    """The last hour at the sampling interval (at least 1 s), the last day in two-minute buckets."""
    return (
        Window("hour", "Last hour", 3600, max(1, round(conf.history_interval()))),
        Window("day", "Last day", 86400, 120),
    )

# The last sample of each bucket is picked first (on the ts index, no JSON touched); only the
# picked rows' JSON is read.
PICK = """
SELECT s.* FROM (
  SELECT DISTINCT ON (b) id FROM (
    SELECT date_bin(make_interval(secs => %(bucket)s), ts, timestamptz '2000-01-01') AS b, id, ts
    FROM ops_history_sample WHERE ts >= now() - make_interval(secs => %(seconds)s)) t
  ORDER BY b, ts DESC) pick
JOIN ops_history_sample s ON s.id = pick.id
"""

FARM_SQL = f"""
SELECT NULL, EXTRACT(EPOCH FROM ts)::float8, pending_frames, running_procs, booked_cc,
       bookings_per_min, completions_per_min, drift_cores,
       (SELECT COALESCE(SUM((v ->> 1)::bigint), 0) FROM jsonb_each(subs) AS e(k, v))
FROM ({PICK}) t ORDER BY ts
"""

SHOW_SQL = f"""
SELECT NULL, EXTRACT(EPOCH FROM ts)::float8, shows -> %(show)s,
       (SELECT COALESCE(jsonb_object_agg(k, v), '{{}}'::jsonb) FROM jsonb_each(subs) AS e(k, v)
        WHERE k LIKE %(prefix)s)
FROM ({PICK}) t ORDER BY ts
"""


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _chart(cid: str, title: str, labels: list[str], xs: list[float], *ys: list[Any], unit: str = "") -> dict[str, Any]:
    return {"id": cid, "title": title, "labels": labels, "unit": unit, "data": [xs, *ys], "points": len(xs)}


def farm_charts() -> list[dict[str, Any]]:
    """Per window: booked vs burst, pending frames, bookings and completions per minute, drift."""
    out = []
    c = centicores_to_cores
    for w in windows():
        with connection.cursor() as cur:
            cur.execute(FARM_SQL, {"bucket": w.bucket_seconds, "seconds": w.seconds})
            rows = cur.fetchall()
        xs = [r[1] for r in rows]
        out.append(
            {
                "key": w.key,
                "title": w.title,
                "samples": len(rows),
                "charts": [
                    _chart(
                        f"farm-{w.key}-booked",
                        "Booked against burst (all subscriptions)",
                        ["booked", "burst"],
                        xs,
                        [c(r[4]) for r in rows],
                        [c(r[8]) for r in rows],
                        unit="cores",
                    ),
                    _chart(
                        f"farm-{w.key}-pending",
                        "Pending frames and running procs",
                        ["pending frames", "procs"],
                        xs,
                        [r[2] for r in rows],
                        [r[3] for r in rows],
                    ),
                    _chart(
                        f"farm-{w.key}-rate",
                        "Bookings and completions per minute",
                        ["bookings", "completions"],
                        xs,
                        [r[5] for r in rows],
                        [r[6] for r in rows],
                        unit="/min",
                    ),
                    _chart(
                        f"farm-{w.key}-drift",
                        "Drift the recompute and reconcile corrected",
                        ["drift"],
                        xs,
                        [r[7] for r in rows],
                        unit="cores",
                    ),
                ],
            }
        )
    return out


def show_charts(show: str) -> list[dict[str, Any]]:
    """Per window: each subscription's booked against its burst, the show's pending frames and drift."""
    with connection.cursor() as cur:
        cur.execute("SELECT pk_alloc, str_name FROM alloc")
        alloc_names = dict(cur.fetchall())
    out = []
    c = centicores_to_cores
    for w in windows():
        with connection.cursor() as cur:
            cur.execute(
                SHOW_SQL, {"show": show, "prefix": f"{show}:%", "bucket": w.bucket_seconds, "seconds": w.seconds}
            )
            # Django's connection leaves jsonb as text (its JSONField decodes it itself).
            rows = [(r[0], r[1], _json(r[2]), _json(r[3])) for r in cur.fetchall()]
        xs = [r[1] for r in rows]
        keys = sorted({k for r in rows for k in (r[3] or {})})
        charts = []
        for key in keys:
            alloc = key.split(":", 1)[1]
            name = alloc_names.get(alloc, alloc)
            booked = [c(((r[3] or {}).get(key) or [0, 0, 0])[0]) if (r[3] or {}).get(key) else None for r in rows]
            burst = [c(((r[3] or {}).get(key))[1]) if (r[3] or {}).get(key) else None for r in rows]
            size = [c(((r[3] or {}).get(key))[2]) if (r[3] or {}).get(key) else None for r in rows]
            charts.append(
                _chart(
                    f"show-{w.key}-sub-{len(charts)}",
                    f"Booked against burst @ {name}",
                    ["booked", "burst", "size"],
                    xs,
                    booked,
                    burst,
                    size,
                    unit="cores",
                )
            )
        stats = [r[2] or [0, 0, 0, 0] for r in rows]
        charts.append(
            _chart(
                f"show-{w.key}-pending",
                "Pending frames and running procs",
                ["pending frames", "procs"],
                xs,
                [s[0] for s in stats],
                [s[1] for s in stats],
            )
        )
        charts.append(
            _chart(
                f"show-{w.key}-drift",
                "Store drift the recompute corrected",
                ["drift"],
                xs,
                [s[3] if len(s) > 3 else 0 for s in stats],
                unit="cores",
            )
        )
        out.append({"key": w.key, "title": w.title, "samples": len(rows), "charts": charts})
    return out
