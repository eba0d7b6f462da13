"""`manage.py demo` (what `./dev run` runs): migrate, seed a small farm once, print a login, serve.

Beside the web server it starts the scheduler (`run_scheduler --launcher q2`) and one local
host agent (`run_agent --host demo_agent`, django-q2 on the database: no broker service), so
the demo's frames really run (`echo rendering <frame>`, then a short sleep) and go WAITING ->
RUNNING -> SUCCEEDED in the admin. The seeded hosts have no agent: the seed marks them DOWN
(`run_agent --host demo_h3 --cores 8 --memory 32G` brings one up), and the local agent's host
carries every demo tag, so it can run every layer.

Nothing it starts may outlive it, whatever fails: both ports (web, scheduler metrics) are
checked before anything starts or changes; the web server, scheduler and agent are children
in their own process groups that a supervisor stops together as soon as one of them exits
or the command is interrupted (Ctrl-C, SIGTERM), and that the kernel signals if the command
itself dies. The admin password is made on the first run and kept (see `admin_login`).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from cuesched_project import conf as cue_conf
from dispatch import conf
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


def background_processes(metrics_port: int | None = None) -> list[BackgroundProcess]:
    """The scheduler (q2 launcher) and one local agent for the demo host."""
    manage = [sys.executable, "manage.py"]
    tags = [alloc_name(DEMO_SPEC.prefix, i) for i in range(1, DEMO_SPEC.allocs)]
    tags += [manual_tag(DEMO_SPEC.prefix, i) for i in range(DEMO_SPEC.manual_tags)]
    scheduler = [*manage, "run_scheduler", "--launcher", "q2"]
    if metrics_port is not None:
        scheduler += ["--metrics-port", str(metrics_port)]
    return [
        BackgroundProcess(
            "scheduler",
            scheduler,
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


def web_process(addr: str) -> BackgroundProcess:
    """The admin's web server, a child like the others.

    Not `call_command("runserver")` in this process: on a bind error runserver calls
    `os._exit(1)`, which skips every `finally` here, and the scheduler and agent started
    beside it were left running with no parent. As a child, its death is just one more
    exit the supervisor sees. No autoreloader: it would re-run the server in a grandchild.
    """
    return BackgroundProcess("web", [sys.executable, "manage.py", "runserver", addr, "--noreload"])


# Linux: a child asks the kernel for SIGTERM when this process dies, however it dies
# (SIGKILL, os._exit, a crash): the last line of defence against an orphaned scheduler.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (in use, not permitted), or None when it can.

    Binds the way runserver and the metrics server do (SO_REUSEADDR), so a port held only
    by TIME_WAIT connections reads as free, as it is for them.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def parse_addr(addr: str) -> tuple[str, int]:
    """`ip:port`, `port` or `[v6]:port` as runserver takes them."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", addr
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise CommandError(f"--addr takes ip:port, got {addr!r}") from None
    if not 0 < number < 65536:
        raise CommandError(f"--addr port must be 1..65535, got {number}")
    return host, number


STOP_TIMEOUT = 30.0  # seconds a child has to stop after SIGTERM (the agent ends its frames first)


def _stop(started: list[tuple[str, subprocess.Popen[bytes]]], write: Callable[[str], Any]) -> None:
    """SIGTERM every child, then SIGKILL each child's process group once it is done or after
    STOP_TIMEOUT.

    The SIGTERM goes to the child alone, not its group: the agent's q2 cluster processes
    die at once on one, while the agent itself first ends or requeues its frames and then
    stops its cluster in order."""
    for _name, popen in reversed(started):
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for name, popen in reversed(started):
        try:
            popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            write(f"{name} (pid {popen.pid}) did not stop within {STOP_TIMEOUT:.0f}s; killing it")
        # Its whole group: the agent's q2 cluster processes die with it, not after it.
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait()


def _tolerant(write: Callable[[str], Any]) -> Callable[[str], None]:
    """A write that cannot fail: `./dev run | tee log` and a Ctrl-C kill tee too, and a stop
    that raised on its first progress line used to skip the kill of the children's groups."""

    def tolerant(line: str) -> None:
        try:
            write(line)
        except (OSError, ValueError):  # EPIPE, or a stream already closed
            pass

    return tolerant


def supervise(processes: list[BackgroundProcess], write: Callable[[str], Any], poll: float = 0.2) -> int:
    """Start `processes`, wait until one of them exits (or this process is told to stop), stop
    them all; returns the exit status for the command.

    Each child leads its own process group, so a Ctrl-C at the terminal reaches only this
    process, which stops the children in order and waits for them: the agent then has the
    time to end or requeue its frames instead of dying half-way with the scheduler.
    """
    write = _tolerant(write)
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for proc in processes:
            write(f"starting {proc.name}: {' '.join(proc.argv)}")
            env = {**os.environ, **proc.env} if proc.env else None
            popen = subprocess.Popen(proc.argv, env=env, start_new_session=True, preexec_fn=_die_with_parent)
            started.append((proc.name, popen))
        while True:
            for name, popen in started:
                code = popen.poll()
                if code is not None:
                    write(f"{name} exited with status {code}; stopping the others")
                    return code or 1
            time.sleep(poll)
    except KeyboardInterrupt:
        write("interrupted; stopping")
        return 0
    finally:
        # A second Ctrl-C or SIGTERM must not cut the stop short and orphan what is left.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(started, write)
        write("stopped: " + ", ".join(f"{name} (pid {p.pid}, status {p.returncode})" for name, p in started))


class Command(BaseCommand):
    help = (
        "Check the ports, migrate, seed a demo farm when the database has no show, print an admin login "
        "(kept from the first run), serve the admin with a scheduler and a local agent beside it."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--addr", default=DEFAULT_ADDR, help=f"ip:port to serve on (default {DEFAULT_ADDR})")
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="the scheduler's /metrics port (env CUESCHED_METRICS_PORT, default 9090; 0 disables)",
        )
        parser.add_argument("--no-serve", action="store_true", help="set everything up, then exit")
        parser.add_argument(
            "--reset-admin", action="store_true", help="give the admin user a new password (printed and stored)"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        host, port = parse_addr(opts["addr"])
        metrics_port = opts["metrics_port"]
        if metrics_port is None:
            metrics_port = cue_conf.env_int("CUESCHED_METRICS_PORT", 9090)
        if not opts["no_serve"]:
            # Before anything starts or changes: a taken port used to surface only after the
            # scheduler and agent were up (and the admin password reset).
            taken = [
                f"{what} {h}:{p} cannot be listened on: {why}"
                for what, h, p in (("web server", host, port), ("scheduler metrics", "127.0.0.1", metrics_port))
                if p and (why := port_problem(h, p))
            ]
            if taken:
                raise CommandError(
                    "; ".join(taken) + ". Is another `./dev run` up? Stop it, or choose other ports "
                    "(--addr 127.0.0.1:8001, --metrics-port 9091 or 0). Nothing was started."
                )
        call_command("migrate", interactive=False, verbosity=0, stdout=self.stdout, stderr=self.stderr)
        self.stdout.write("database migrated")
        self.seed_if_empty()
        self.stdout.write(self.style.SUCCESS(admin_login(reset=opts["reset_admin"])), ending="\n")
        self.stdout.write(self.style.SUCCESS(f"admin URL:   http://{opts['addr']}/admin/\n"), ending="\n")
        if opts["no_serve"]:
            return
        # SIGTERM (a service manager, `timeout`) must unwind like Ctrl-C does, so the
        # children are stopped too instead of being orphaned.
        signal.signal(signal.SIGTERM, lambda _signum, _frame: _raise_interrupt())
        code = supervise([*background_processes(metrics_port), web_process(opts["addr"])], self.stdout.write)
        if code:
            raise CommandError("the demo stopped because one of its processes exited (see above)", returncode=code)

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


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def admin_login(*, reset: bool = False) -> str:
    """The admin login line to print, creating `admin` on the first run.

    The password is made once and kept in `conf.demo_password_file()` (mode 0600, one file
    per database), so a second `./dev run` prints the same login instead of silently
    changing it under an open browser session. A password changed by other means
    (`changepassword`) is left alone and said so; `reset` makes and prints a new one.
    """
    path = Path(conf.demo_password_file())
    stored = path.read_text().strip() if path.exists() else ""
    user_model = get_user_model()
    with transaction.atomic():
        user = user_model.objects.select_for_update().filter(username=ADMIN_USER).first()
        if user is not None and not reset:
            if stored and user.check_password(stored):
                return f"admin login: {ADMIN_USER} / {stored}  (kept from the first run; stored in {path})"
            return (
                f"admin login: {ADMIN_USER} / (unchanged: its password is not the one stored in {path}; "
                f"`./dev run --reset-admin` sets and prints a new one, `./dev manage changepassword {ADMIN_USER}` "
                "sets one of yours)"
            )
        created = user is None
        if created:
            user = user_model(username=ADMIN_USER)
        password = secrets.token_urlsafe(12)
        user.is_staff = True
        user.is_superuser = True
        user.is_active = True
        user.set_password(password)
        user.save()
        _store_password(path, password)  # inside the transaction: a failed write changes nothing
    if created:
        return f"admin login: {ADMIN_USER} / {password}  (new; stored in {path}, kept across runs)"
    return f"admin login: {ADMIN_USER} / {password}  (PASSWORD CHANGED by --reset-admin; stored in {path})"


def _store_password(path: Path, password: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    os.replace(tmp, path)
