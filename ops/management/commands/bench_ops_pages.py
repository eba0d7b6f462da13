"""`manage.py bench_ops_pages`: median render time and query count of console pages, on the farm
in the database (seed one first with `seed_farm`).

Measured in-process with Django's test client as a superuser, so the figure is the server's
work (queries and templates) without a network or a browser. `--history-day` first fills a
full day of history samples (8,640, one per 10 s) copied from one real sample of this farm,
so the charts are measured at full retention; `--purge-history` deletes them again.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from accounting import history

FILL_SQL = f"""
INSERT INTO {history.TABLE} (ts, pending_frames, running_procs, booked_cc, bookings_per_min, completions_per_min,
                             drift_cores, subs, shows)
SELECT now() - make_interval(secs => g * 10), s.pending_frames, s.running_procs, s.booked_cc, s.bookings_per_min,
       s.completions_per_min, s.drift_cores, s.subs, s.shows
FROM (SELECT * FROM {history.TABLE} ORDER BY ts DESC LIMIT 1) s, generate_series(1, %(n)s) g
"""


class Command(BaseCommand):
    help = "Median render time (ms) and query count of the ops console pages on the farm in the database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--runs", type=int, default=5, help="renders per page (default 5); the median is printed")
        parser.add_argument("--url", action="append", help="a page to measure (repeatable; default: the console's)")
        parser.add_argument(
            "--history-day", action="store_true", help="first fill a day of history samples (8,640) from one real one"
        )
        parser.add_argument("--purge-history", action="store_true", help="delete every history sample and exit")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["purge_history"]:
            with connection.cursor() as cur:
                cur.execute(f"DELETE FROM {history.TABLE}")
                self.stdout.write(f"deleted {cur.rowcount} history sample(s)")
            return
        if options["history_day"]:
            self._fill_history()
        user = get_user_model().objects.filter(is_superuser=True).first()
        if user is None:
            user = get_user_model().objects.create_superuser("bench-ops", "bench@localhost", None)
        client = Client(HTTP_HOST="127.0.0.1")
        client.force_login(user)
        urls = options["url"] or self._default_urls()
        self.stdout.write(f"{'page':60} {'median ms':>10} {'min ms':>8} {'queries':>8}")
        for url in urls:
            times, queries = [], 0
            for _ in range(max(1, options["runs"])):
                with CaptureQueriesContext(connection) as ctx:
                    started = time.perf_counter()
                    response = client.get(url)
                    times.append((time.perf_counter() - started) * 1000)
                if response.status_code != 200:
                    self.stderr.write(f"{url}: HTTP {response.status_code}")
                    break
                queries = len(ctx.captured_queries)
            self.stdout.write(f"{url:60} {statistics.median(times):10.1f} {min(times):8.1f} {queries:8d}")

    def _default_urls(self) -> list[str]:
        """The console's pages, the farm lists and one job's, one frame's and its log's pages."""
        with connection.cursor() as cur:
            cur.execute("SELECT pk_show FROM show ORDER BY str_name LIMIT 1")
            row = cur.fetchone()
            # The job with the most frames, and one of its frames (the heaviest job page).
            cur.execute("SELECT pk_job FROM job_stat ORDER BY int_total_count DESC, pk_job LIMIT 1")
            job = cur.fetchone()
            frame = None
            if job:
                cur.execute("SELECT pk_frame FROM frame WHERE pk_job = %s ORDER BY int_number LIMIT 1", [job[0]])
                frame = cur.fetchone()
        urls = ["/admin/ops/console/", "/admin/ops/console/procs/", "/admin/ops/console/procs/?stuck=1",
                "/admin/ops/console/allocations/", "/admin/dispatch/job/", "/admin/dispatch/job/?q=big",
                "/admin/dispatch/frame/", "/admin/dispatch/frame/?str_state__exact=WAITING", "/admin/dispatch/host/",
                "/admin/dispatch/proc/", "/admin/dispatch/layer/", "/admin/dispatch/subscription/",
                "/admin/dispatch/folderresource/", "/admin/dispatch/jobresource/",
                "/admin/ops/console/audit/"]  # fmt: skip
        if row:
            urls.insert(1, f"/admin/ops/console/show/{row[0]}/")
        if job:
            urls += [f"/admin/ops/console/job/{job[0]}/", f"/admin/ops/console/job/{job[0]}/?state=WAITING"]
        if frame:
            urls += [f"/admin/ops/console/frame/{frame[0]}/"]
        return urls

    def _fill_history(self) -> None:
        """Time the sampler's statement (what the scheduler runs every CUESCHED_HISTORY_INTERVAL), then copy it."""
        times = []
        with connection.cursor() as cur:
            for _ in range(5):
                started = time.perf_counter()
                cur.execute(history.SAMPLE_SQL, {"drift": 0, "show_drift": "{}"})
                times.append((time.perf_counter() - started) * 1000)
            self.stdout.write(f"history: one sample of this farm takes {statistics.median(times):.1f} ms (median of 5)")
            cur.execute(FILL_SQL, {"n": 8635})
            cur.execute(f"SELECT COUNT(*) FROM {history.TABLE}")
            self.stdout.write(f"history: {cur.fetchone()[0]} sample(s) in the table")
