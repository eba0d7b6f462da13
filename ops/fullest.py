"""Figures of the overview read from the database, whoever wrote them.

The fullest capped folder of each show, for the overview's utilization column, and the frame
runs that ended lately, for the Dispatch card.

A show's allocation bars measure its bookings against the burst only. A folder at its max
books nothing more while those bars read 30 %, so the operator looking for why work waits is
sent the wrong way: the overview also shows, per show, the folder closest to its max (a max of
0 is full: it books nothing). Measured on SUM(proc), the record of truth, in one query for the
whole page whatever the number of shows.
"""

from __future__ import annotations

from django.db import connection

from accounting.units import centicores_to_cores, centicores_to_cores_cap
from ops.counters import Row

FULLEST_FOLDER_SQL = """
SELECT DISTINCT ON (f.pk_show) f.pk_show, f.pk_folder, f.str_name, COALESCE(u.cc, 0)::bigint, COALESCE(u.n, 0)::bigint,
       fr.int_max_cores
FROM folder f
JOIN folder_resource fr ON fr.pk_folder = f.pk_folder
LEFT JOIN (
  SELECT j.pk_folder, SUM(p.int_cores_reserved) AS cc, COUNT(*) AS n
  FROM proc p JOIN job j ON j.pk_job = p.pk_job
  WHERE NOT p.b_local
  GROUP BY j.pk_folder
) u ON u.pk_folder = f.pk_folder
WHERE fr.int_max_cores >= 0
ORDER BY f.pk_show,
         CASE WHEN fr.int_max_cores = 0 THEN 'Infinity'::float8
              ELSE COALESCE(u.cc, 0)::float8 / fr.int_max_cores END DESC,
         f.pk_folder
"""


def fullest_folders() -> dict[str, Row]:
    """Per show id, its capped folder nearest its max cores (shows without a capped folder: absent)."""
    with connection.cursor() as cur:
        cur.execute(FULLEST_FOLDER_SQL)
        rows = cur.fetchall()
    return {
        show: Row(
            pk=folder,
            label=name,
            enforced_cores=None,
            enforced_gpus=None,
            db_cores=centicores_to_cores(cc),
            db_gpus=0,
            procs=int(procs),
            cap_cores=centicores_to_cores_cap(max_cc),
        )
        for show, folder, name, cc, procs, max_cc in rows
    }


RECENT_RUNS_MINUTES = 5
RECENT_RUNS_SQL = "SELECT count(*) FROM frame WHERE ts_stopped >= now() - make_interval(mins => %s)"


def recent_frame_ends(minutes: int = RECENT_RUNS_MINUTES) -> int:
    """Frames whose last run ended within `minutes`, from `frame.ts_stopped`.

    The loop's own "completed" counts only what its launcher hands back: with the q2 or remote
    launchers the agents write every frame's end themselves and the loop counts 0 while frames
    complete. The database sees every end, whichever process wrote it.
    """
    with connection.cursor() as cur:
        cur.execute(RECENT_RUNS_SQL, [minutes])
        (count,) = cur.fetchone()
    return int(count)
