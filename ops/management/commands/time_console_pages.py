"""`manage.py time_console_pages`: how long each console page takes on this database, and its queries.

Speed is measured, never asserted: this prints, per page, the median, fastest and slowest of
`--runs` server-side renders (after one warm-up) through Django's test client, and the number
of SQL queries the page ran. Seed a large farm first, for example
`manage.py seed_farm --prefix big --hosts 2000 --jobs 200 --layers 5 --frames-per-layer 100 --shows 4`
(100,000 frames), and let a scheduler book some of it (procs).
"""

from __future__ import annotations

import statistics
import time
from argparse import ArgumentParser
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatch.models import Frame, Job, Show

TIMER_USER = "console-timer"


class Command(BaseCommand):
    help = "Render every ops console page a few times and print the median time and the query count of each."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--runs", type=int, default=5, help="timed renders per page, after one warm-up (default 5)")
        parser.add_argument(
            "--per-page", type=int, default=100, help="rows per list page (the admin's list_per_page, default 100)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        runs = options["runs"]
        if runs < 1:
            raise CommandError("--runs must be at least 1")
        show = Show.objects.order_by("str_name").first()
        job = Job.objects.filter(str_state="PENDING", stat__int_waiting_count__gt=0).order_by("pk_job").first()
        frame = Frame.objects.filter(str_state="WAITING", job=job).order_by("pk_frame").first() if job else None
        if show is None or job is None or frame is None:
            raise CommandError("no show with a waiting job: seed a farm first (manage.py seed_farm)")
        # A superuser that exists only to look (it has no password: it cannot log in elsewhere).
        user, _ = get_user_model().objects.get_or_create(
            username=TIMER_USER, defaults={"is_staff": True, "is_superuser": True}
        )
        user.set_unusable_password()
        user.save(update_fields=["password"])
        client = Client(HTTP_HOST=(settings.ALLOWED_HOSTS or ["localhost"])[0])
        client.force_login(user)

        from django.contrib import admin

        for registered in admin.site._registry.values():
            registered.list_per_page = options["per_page"]
        pages = [
            ("overview", reverse("admin:ops_console_overview")),
            ("show live", reverse("admin:ops_show_live", args=[show.pk])),
            ("job why", reverse("admin:ops_job_why", args=[job.pk])),
            ("frame why", reverse("admin:ops_frame_why", args=[frame.pk])),
            ("audit", reverse("admin:ops_audit")),
            ("hosts", reverse("admin:dispatch_host_changelist")),
            ("hosts locked", reverse("admin:dispatch_host_changelist") + "?str_lock_state__exact=LOCKED"),
            ("jobs", reverse("admin:dispatch_job_changelist")),
            ("jobs pending", reverse("admin:dispatch_job_changelist") + "?str_state__exact=PENDING"),
            ("frames", reverse("admin:dispatch_frame_changelist")),
            ("frames waiting", reverse("admin:dispatch_frame_changelist") + "?str_state__exact=WAITING"),
            ("frames search", reverse("admin:dispatch_frame_changelist") + f"?q={job.str_name}"),
            ("procs", reverse("admin:dispatch_proc_changelist")),
            ("subscriptions", reverse("admin:dispatch_subscription_changelist")),
            ("folder caps", reverse("admin:dispatch_folderresource_changelist")),
            ("job caps", reverse("admin:dispatch_jobresource_changelist")),
            ("farm actions", reverse("admin:dispatch_farmaction_changelist")),
        ]
        with connection.cursor() as cur:
            cur.execute("SELECT (SELECT count(*) FROM host), (SELECT count(*) FROM frame), (SELECT count(*) FROM proc)")
            hosts, frames, procs = cur.fetchone()
        self.stdout.write(
            f"farm: {hosts} hosts, {frames} frames, {procs} procs; {runs} runs per page after one warm-up, "
            f"{options['per_page']} rows per list page"
        )
        self.stdout.write(f"{'page':<20} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'queries':>8}  status")
        for name, url in pages:
            client.get(url)  # warm-up
            times, queries, code = [], 0, 0
            for _ in range(runs):
                with CaptureQueriesContext(connection) as ctx:
                    start = time.perf_counter()
                    response = client.get(url)
                    times.append((time.perf_counter() - start) * 1000)
                queries, code = len(ctx.captured_queries), response.status_code
            median, low, high = statistics.median(times), min(times), max(times)
            self.stdout.write(f"{name:<20} {median:>10.0f} {low:>8.0f} {high:>8.0f} {queries:>8}  {code}")
