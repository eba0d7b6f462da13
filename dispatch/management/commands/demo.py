"""`manage.py demo` (what `./dev run` runs): migrate, seed a small farm once, print a login, serve.

Beside the web server it starts the scheduler (`run_scheduler --launcher q2`) and one local
host agent (`run_agent --host demo_agent`, django-q2 on the database: no broker service), so
the demo's frames really run (`echo rendering <frame>`, then a short sleep) and go WAITING ->
RUNNING -> SUCCEEDED in the admin. The seeded hosts have no agent: the seed marks them DOWN
(`run_agent --host demo_h3 --cores 8 --memory 32G` brings one up), and the local agent's host
carries every demo tag, so it can run every layer. Both processes stop with the web server.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import connection, transaction

from dispatch.lab.seeding import FarmSpec, alloc_name, manual_tag, seed_farm
from dispatch.models import Show

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


# What the demo's frames run: real, harmless, short (tokens substituted by the agent).
DEMO_COMMAND = "echo rendering #FRAME# of #JOB#; sleep 1"
DEMO_AGENT_HOST = "demo_agent"
DEMO_AGENT_CORES = 8
DEMO_AGENT_MEMORY = "32G"


@dataclass(frozen=True)
class BackgroundProcess:
    """A process that runs beside the web server for as long as it does."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None  # added to this process's environment


def background_processes() -> list[BackgroundProcess]:
    """The scheduler (q2 launcher) and one local agent for the demo host."""
    manage = [sys.executable, "manage.py"]
    tags = [alloc_name(DEMO_SPEC.prefix, i) for i in range(1, DEMO_SPEC.allocs)]
    tags += [manual_tag(DEMO_SPEC.prefix, i) for i in range(DEMO_SPEC.manual_tags)]
    return [
        BackgroundProcess(
            "scheduler",
            [*manage, "run_scheduler", "--launcher", "q2"],
            # The agent writes a frame's end itself; the scheduler sees the freed host at its
            # next host reload, so reload often in this small farm.
            env={"CUESCHED_HOST_REFRESH_INTERVAL": "1"},
        ),
        BackgroundProcess(
            "agent",
            [
                *manage,
                "run_agent",
                "--transport",
                "q2",
                "--host",
                DEMO_AGENT_HOST,
                "--alloc",
                alloc_name(DEMO_SPEC.prefix, 0),
                "--tags",
                " ".join(tags),
                "--cores",
                str(DEMO_AGENT_CORES),
                "--memory",
                DEMO_AGENT_MEMORY,
            ],
        ),
    ]


@contextmanager
def running(processes: list[BackgroundProcess], write: Callable[[str], Any]) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        for proc in processes:
            write(f"starting {proc.name}: {' '.join(proc.argv)}")
            env = {**os.environ, **proc.env} if proc.env else None
            started.append(subprocess.Popen(proc.argv, env=env))
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
        # SIGTERM (a service manager, `timeout`) must unwind like Ctrl-C does, so the
        # scheduler and agent started below are stopped too instead of being orphaned.
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
        with running(background_processes(), self.stdout.write):
            # No autoreloader: it would re-run this command (and reset the password) in a child.
            call_command("runserver", opts["addr"], use_reloader=False)

    def seed_if_empty(self) -> None:
        if Show.objects.exists():
            self.stdout.write("database already has shows; not seeding the demo farm")
            return
        seed = seed_farm(DEMO_SPEC)
        with transaction.atomic(), connection.cursor() as cur:
            # Real commands for the local agent; the seeded hosts have no agent: DOWN.
            cur.execute("UPDATE layer SET str_cmd = %s WHERE pk_job = ANY(%s)", [DEMO_COMMAND, list(seed.job_ids)])
            cur.execute("UPDATE host_stat SET str_state = 'DOWN' WHERE pk_host = ANY(%s)", [list(seed.host_ids)])
        rows = seed.rows
        self.stdout.write(
            f"seeded demo farm: {rows['show']} shows ({len(seed.managed_show_ids)} managed), "
            f"{rows['alloc']} allocs, {rows['host']} hosts (DOWN: no agent runs on them), {rows['job']} jobs, "
            f"{rows['frame']} frames; the local agent's host {DEMO_AGENT_HOST} runs them"
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
