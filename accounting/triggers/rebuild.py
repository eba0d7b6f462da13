"""The database-enforced counters rebuilt from SUM(proc): a flip to unmanaged, a TRUNCATE of
proc, and the scheduler's periodic reconcile all write the truth the same way.
"""

from __future__ import annotations

# --- rebuilding the database-enforced counters from SUM(proc) --------------------------------

# The five tables of the shows in `{shows}` (a SQL expression yielding pk_show values) set to
# SUM(proc) of their non-local procs, touching only rows whose value differs. Used by a flip to
# unmanaged (the Store kept them only approximately), by a TRUNCATE of proc, and by the
# scheduler's periodic reconcile of unmanaged shows (`RECONCILE_SQL`), which reports the
# centicores it corrected as drift. Caps are not checked: a rebuild writes the truth.
_IN_TARGET = "IN (SELECT pk_show FROM target)"
# Finished history holding nothing is skipped: a rebuild costs the live jobs, not years of them.
_LIVE_OR_HOLDING = "(j.str_state <> 'FINISHED' OR {a}.int_cores <> 0 OR {a}.int_gpus <> 0 OR l.{key} IS NOT NULL)"
# name -> (table, alias, primary key, FROM clause, how live procs join, which rows)
_REBUILT = {
    "sub": (
        "subscription",
        "s",
        "pk_subscription",
        "subscription s",
        "l.pk_show = s.pk_show AND l.pk_alloc = s.pk_alloc",
        f"s.pk_show {_IN_TARGET}",
    ),
    "folder": (
        "folder_resource",
        "fr",
        "pk_folder_resource",
        "folder_resource fr JOIN folder f ON f.pk_folder = fr.pk_folder",
        "l.pk_folder = fr.pk_folder",
        f"f.pk_show {_IN_TARGET}",
    ),
    "job": (
        "job_resource",
        "jr",
        "pk_job_resource",
        "job_resource jr JOIN job j ON j.pk_job = jr.pk_job",
        "l.pk_job = jr.pk_job",
        f"j.pk_show {_IN_TARGET} AND " + _LIVE_OR_HOLDING.format(a="jr", key="pk_job"),
    ),
    "layer": (
        "layer_resource",
        "lr",
        "pk_layer_resource",
        "layer_resource lr JOIN job j ON j.pk_job = lr.pk_job",
        "l.pk_layer = lr.pk_layer",
        f"j.pk_show {_IN_TARGET} AND " + _LIVE_OR_HOLDING.format(a="lr", key="pk_layer"),
    ),
    "point": (
        "point",
        "pt",
        "pk_point",
        "point pt",
        "l.pk_show = pt.pk_show AND l.pk_dept = pt.pk_dept",
        f"pt.pk_show {_IN_TARGET}",
    ),
}
REBUILD_TABLES = tuple(spec[0] for spec in _REBUILT.values())


def _rebuild_ctes(name: str, *, low: bool = False) -> str:
    """The sum per row (`<name>_x`) and the write of the rows that differ (`<name>_u`, their drift).

    With `low`, each written row also returns how far its counter was BELOW the truth (cores
    and GPUs): the reconcile's integrity alarm. Off for the trigger bodies, which only need drift.
    """
    table, a, pk, source, live_on, where = _REBUILT[name]
    old_g = f", {a}.int_gpus AS old_g" if low else ""
    low_cols = ", GREATEST(x.cc - x.old_c, 0) AS low_cc, GREATEST(x.g - x.old_g, 0) AS low_g" if low else ""
    return f"""
    {name}_x AS (
        SELECT {a}.{pk} AS pk, {a}.int_cores AS old_c{old_g}, COALESCE(SUM(l.cc), 0) AS cc, COALESCE(SUM(l.g), 0) AS g
        FROM {source} LEFT JOIN live l ON {live_on}
        WHERE {where}
        GROUP BY {a}.{pk}
    ),
    {name}_u AS (
        UPDATE {table} t SET int_cores = x.cc, int_gpus = x.g FROM {name}_x x
        WHERE t.{pk} = x.pk AND (t.int_cores, t.int_gpus) IS DISTINCT FROM (x.cc, x.g)
        RETURNING abs(x.cc - x.old_c) AS drift{low_cols}
    ),"""


def rebuild_sql(shows: str, *, into: str = "", low: bool = False) -> str:
    """Rebuild the five tables of `shows`; the last SELECT returns the centicores corrected per table.

    With `low` (the reconcile), then for each of the five tables the centicores and the GPUs by
    which its rows had read below SUM(proc) (a point row inserted now read 0).
    """
    drift = ", ".join(f"(SELECT COALESCE(SUM(drift), 0) FROM {n}_u)::bigint" for n in _REBUILT if n != "point")
    point_drift = "((SELECT COALESCE(SUM(drift), 0) FROM point_u) + (SELECT COALESCE(SUM(drift), 0) FROM point_new))"
    point_drift += "::bigint"
    lows = ""
    if low:
        lows = "".join(
            f", (SELECT COALESCE(SUM(low_cc), 0) FROM {n}_u)::bigint"
            f", (SELECT COALESCE(SUM(low_g), 0) FROM {n}_u)::bigint"
            for n in _REBUILT
            if n != "point"
        )
        lows += (
            ", ((SELECT COALESCE(SUM(low_cc), 0) FROM point_u)"
            " + (SELECT COALESCE(SUM(drift), 0) FROM point_new))::bigint"
            ", ((SELECT COALESCE(SUM(low_g), 0) FROM point_u) + (SELECT COALESCE(SUM(g), 0) FROM point_new))::bigint"
        )
    return f"""
    WITH target AS MATERIALIZED ({shows}),
    live AS (
        SELECT p.pk_show, h.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
               p.int_cores_reserved::bigint AS cc, p.int_gpus_reserved::bigint AS g
        FROM proc p
        JOIN host h ON h.pk_host = p.pk_host
        JOIN job j ON j.pk_job = p.pk_job
        WHERE NOT p.b_local AND p.pk_show {_IN_TARGET}
    ),{"".join(_rebuild_ctes(n, low=low) for n in _REBUILT)}
    point_new AS (
        INSERT INTO point (pk_point, pk_show, pk_dept, int_cores, int_gpus)
        SELECT gen_random_uuid()::text, l.pk_show, l.pk_dept, SUM(l.cc)::int, SUM(l.g)::int
        FROM live l
        WHERE NOT EXISTS (SELECT 1 FROM point pt WHERE pt.pk_show = l.pk_show AND pt.pk_dept = l.pk_dept)
        GROUP BY l.pk_show, l.pk_dept
        ON CONFLICT (pk_show, pk_dept) DO NOTHING
        RETURNING int_cores AS drift{", int_gpus AS g" if low else ""}
    )
    SELECT {drift},
           {point_drift}{lows}
    {into}
"""


# The scheduler's reconcile of every unmanaged show, from a client: run after its show's row FOR
# KEY SHARE (no flip under it) and LOCK_DB_SHOWS_SQL for the same shows (no database-enforced
# writer, nor a move of its procs' keys, between its read of proc and its write), in one READ
# COMMITTED transaction. Returns the centicores corrected per table.
UNMANAGED_SHOWS_SQL = "SELECT pk_show FROM show WHERE NOT b_scheduler_managed ORDER BY pk_show"
RECONCILE_SQL = rebuild_sql("SELECT unnest(%(shows)s::text[]) AS pk_show", low=True)
