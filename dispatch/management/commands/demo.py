"""`manage.py demo` (what `./dev run` runs): migrate, seed a small farm once, print a login, serve.

Later issues add the scheduler and a local host agent: they go into BACKGROUND_PROCESSES
(started before the web server, stopped when it exits), so `./dev run` stays the one
command that brings the whole thing up.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction

from dispatch.models import Show
from dispatch.seeding import FarmSpec, seed_farm

DEFAULT_ADDR = "127.0.0.1:8000"
ADMIN_USER = "admin"

# Two shows on two allocations, one of them scheduler-managed, with caps small enough that
# a handful of jobs reaches them: 100 cores of burst per (show, alloc), 40 cores per job.
DEMO_SPEC = FarmSpec(
    prefix="demo",
    seed=0x0C0FFEE,
    shows=2,
    managed_shows=1,
    allocs=2,
    folders_per_show=2,
    hosts=20,
    jobs=10,
    layers=3,
    frames_per_layer=10,
    manual_tags=4,
    host_cores_choices=(8, 16, 32),
    host_mem_gb_choices=(32, 64, 128),
    sub_burst=10_000,
    job_max_cores=4_000,
    layer_cores_choices=(1, 2, 4),
    layer_mem_gb_choices=(2, 4),
)


@dataclass(frozen=True)
class BackgroundProcess:
    """A process that runs beside the web server for as long as it does."""

    name: str
    argv: list[str]


def background_processes() -> list[BackgroundProcess]:
    """The hook for the scheduler and a local agent, e.g.
    `BackgroundProcess("scheduler", [sys.executable, "manage.py", "run_scheduler"])`;
    none yet (their issues add them).
    """
    return []


@contextmanager
def running(processes: list[BackgroundProcess], write: Callable[[str], Any]) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        for proc in processes:
            write(f"starting {proc.name}: {' '.join(proc.argv)}")
            started.append(subprocess.Popen(proc.argv))
        yield started
    finally:
        for popen in reversed(started):
            popen.terminate()
        for popen in reversed(started):
            try:
                popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()


class Command(BaseCommand):
    help = "Migrate, seed a demo farm when the database has no show, print an admin login, serve the admin."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"ip:port to serve on (default {DEFAULT_ADDR})")
        parser.add_argument("--no-serve", action="store_true", help="set everything up, then exit")

    def handle(self, *args: Any, **opts: Any) -> None:
        call_command("migrate", interactive=False, verbosity=0, stdout=self.stdout, stderr=self.stderr)
        self.stdout.write("database migrated")
        self.seed_if_empty()
        password = self.reset_admin()
        url = f"http://{opts['addr']}/admin/"
        self.stdout.write(
            self.style.SUCCESS(f"\nadmin login: {ADMIN_USER} / {password}\nadmin URL:   {url}\n"), ending="\n"
        )
        if opts["no_serve"]:
            return
        with running(background_processes(), self.stdout.write):
            # No autoreloader: it would re-run this command (and reset the password) in a child.
            call_command("runserver", opts["addr"], use_reloader=False)

    def seed_if_empty(self) -> None:
        if Show.objects.exists():
            self.stdout.write("database already has shows; not seeding the demo farm")
            return
        seed = seed_farm(DEMO_SPEC)
        rows = seed.rows
        self.stdout.write(
            f"seeded demo farm: {rows['show']} shows ({len(seed.managed_show_ids)} managed), "
            f"{rows['alloc']} allocs, {rows['host']} hosts, {rows['job']} jobs, {rows['frame']} frames"
        )

    def reset_admin(self) -> str:
        """Create `admin`, or give it a fresh password: the printed login is always the valid one."""
        password = secrets.token_urlsafe(12)
        user_model = get_user_model()
        with transaction.atomic():
            user, _ = user_model.objects.get_or_create(username=ADMIN_USER)
            user.is_staff = True
            user.is_superuser = True
            user.is_active = True
            user.set_password(password)
            user.save()
        return password
