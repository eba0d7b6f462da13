"""`manage.py run_agent --host NAME [--transport q2|celery]`: the host agent of one render host.

Registers the host, requeues what a previous agent of the host left running, starts the
heartbeat thread, then consumes the host's own queue until
SIGINT/SIGTERM: a django-q2 cluster (ORM broker: the database is the queue) or a Celery worker
(RabbitMQ). Each runs up to `--slots` frames at once (default: the host's whole cores).

A stop (SIGTERM, SIGINT, or the transport ending by itself) leaves no frame RUNNING behind:
the host goes DOWN, its running frames are ended and requeued, its queued ones requeued
(`agent.stop_host_work`), and the agent prints what it did.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import conf
from dispatch.hosts.agent import (
    Heartbeat,
    HostSpec,
    StopReport,
    default_host_name,
    queue_name,
    register_host,
    release_previous_runs,
    stop_host_work,
)


def _memory(value: str) -> int:
    """`64G`, `512M` or KB: memory in KB."""
    text = value.strip().upper()
    scale = {"G": 1024 * 1024, "M": 1024, "K": 1}.get(text[-1:], None)
    number = text[:-1] if scale else text
    try:
        return int(float(number) * (scale or 1))
    except ValueError:
        raise ValueError(f"memory must be like 64G, 512M or a number of KB, got {value!r}") from None


class Command(BaseCommand):
    help = "Run the host agent: register the host, heartbeat, run the frames booked on it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=None, help="Host name (default: this machine's short name).")
        parser.add_argument("--transport", choices=("q2", "celery"), default="q2")
        parser.add_argument("--alloc", default=None, help="Allocation name (required for a new host).")
        parser.add_argument("--cores", type=int, default=None, help="Whole cores (default: os.cpu_count()).")
        parser.add_argument("--memory", type=_memory, default=None, help="Memory, e.g. 64G (default: MemTotal).")
        parser.add_argument("--gpus", type=int, default=0)
        parser.add_argument("--gpu-memory", type=_memory, default=0)
        parser.add_argument("--os", default=None, help="OS tag (default: platform.system().lower()).")
        parser.add_argument("--tags", default="", help="Manual tags, separated by spaces, commas or '|'.")
        parser.add_argument("--slots", type=int, default=None, help="Frames run at once (default: whole cores).")
        parser.add_argument("--heartbeat", type=float, default=None, help="Seconds between pings.")

    def handle(self, *args: Any, **opts: Any) -> None:
        tags = tuple(t for t in opts["tags"].replace(",", " ").replace("|", " ").split() if t)
        spec = HostSpec(
            name=opts["host"] or default_host_name(),
            alloc=opts["alloc"],
            cores=opts["cores"],
            memory_kb=opts["memory"],
            gpus=opts["gpus"],
            gpu_memory_kb=opts["gpu_memory"],
            os=opts["os"],
            tags=tags,
        )
        try:
            pk_host = register_host(spec)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        requeued = release_previous_runs(pk_host)
        if requeued:
            self.stdout.write(f"{requeued} frame(s) left running by this host's previous agent are WAITING again")
        slots = max(1, opts["slots"] or spec.resolved_cores())
        queue = queue_name(spec.name)
        heartbeat = Heartbeat(pk_host, spec, opts["heartbeat"])
        self.stdout.write(
            f"agent for host {spec.name}: queue {queue} over {opts['transport']}, {slots} slots, "
            f"logs under {conf.agent_log_root()}"
        )
        self._stopped: StopReport | None = None
        try:
            if opts["transport"] == "q2":
                self._run_q2(queue, slots, heartbeat, pk_host, spec.name)
            else:
                heartbeat.start()
                self._run_celery(queue, slots, spec.name, heartbeat, pk_host)
        finally:
            heartbeat.stop()
            if self._stopped is None:  # the transport ended on its own (or failed): same cleanup
                self._stopped = stop_host_work(pk_host, spec.name)
            # What the scheduler booked here before it saw the host DOWN: the transport may have
            # started some of those runs while it stopped; they are ended the same way.
            late = stop_host_work(pk_host, spec.name)
            self._stopped.requeued_queued += late.requeued_queued
            self._stopped.requeued_running += late.requeued_running
            self._stopped.still_running += late.still_running
            self.stdout.write(f"agent for host {spec.name} stopped: {self._stopped.summary()}")
            self.stdout.flush()

    def _end_work(self, heartbeat: Heartbeat, pk_host: str, host: str) -> None:
        """Stop pinging (a ping would bring the host back UP), then end or requeue its frames."""
        heartbeat.stop()
        self.stderr.write(f"agent for host {host}: ending or requeueing the frames booked on it")
        self._stopped = stop_host_work(pk_host, host)

    def _run_q2(self, queue: str, slots: int, heartbeat: Heartbeat, pk_host: str, host: str) -> None:
        from django_q.brokers import get_broker
        from django_q.cluster import Cluster
        from django_q.conf import Conf

        # The cluster's size is a class setting read by the sentinel it forks.
        Conf.WORKERS = slots
        Conf.QUEUE_LIMIT = slots
        Conf.CLUSTER_NAME = queue
        cluster = Cluster(broker=get_broker(queue))
        # Cluster installs handlers that stop it from inside the handler; a second signal (Ctrl-C
        # reaches the whole process group, then the demo's terminate) would nest a second stop
        # in the first. Ours only ask; the main thread stops the cluster once.
        stop = threading.Event()

        def _ask_stop(signum: int, _frame: object) -> None:
            if not stop.is_set():
                self.stderr.write(f"received {signal.Signals(signum).name}, stopping the agent")
            stop.set()

        signal.signal(signal.SIGTERM, _ask_stop)
        signal.signal(signal.SIGINT, _ask_stop)
        cluster.start()
        # Pings start once the cluster's processes are forked, so none of them inherits the
        # heartbeat's database connection (a child freeing its copy would close the socket).
        heartbeat.start()
        while cluster.sentinel is not None and cluster.sentinel.is_alive() and not stop.wait(0.5):
            pass
        # Before the cluster stops: its workers wait for the frames they run, and those end
        # only once their procs are released (a frame may run for hours).
        try:
            self._end_work(heartbeat, pk_host, host)
        finally:  # the database may be gone: the cluster stops all the same (procs stay counted)
            if cluster.sentinel is not None and cluster.sentinel.is_alive():
                cluster.stop()  # workers finish the (now ended) frames they run, then exit

    def _run_celery(self, queue: str, slots: int, host: str, heartbeat: Heartbeat, pk_host: str) -> None:
        from dispatch.hosts.celery_app import app

        def _stop(signum: int, _frame: object) -> None:
            if self._stopped is None:
                self.stderr.write(f"received {signal.Signals(signum).name}, stopping the agent")
                # The frames run in this process's worker threads: end them while they can
                # still see their procs go, before the worker is torn down.
                self._end_work(heartbeat, pk_host, host)
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        worker = app.Worker(
            queues=[queue],
            concurrency=slots,
            pool="threads",
            hostname=f"cuesched-agent@{host}",
            loglevel="INFO",
            without_gossip=True,
            without_mingle=True,
            without_heartbeat=True,
        )
        worker.start()
