"""The Celery app of the `celery` transport: RabbitMQ, one queue per host, no result backend.

Late acks with prefetch 1: a worker takes one frame at a time per slot and acknowledges it
only after the frame ended and its completion was written, so a worker that dies mid-frame
leaves the message to be delivered again (the run's advisory lock and the proc check in
`dispatch.hosts.agent.run_frame` make a second delivery of a finished or running frame a no-op).
No result backend: the agent writes the frame's end to the database itself.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from dispatch import conf

RUN_FRAME = "cuesched.run_frame"

app = Celery("cuesched")
app.conf.update(
    broker_url=conf.celery_broker_url(),
    result_backend=None,
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    broker_connection_timeout=5,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_default_queue="cuesched.default",
)


@app.task(name=RUN_FRAME)
def run_frame(pk_proc: str, host: str) -> dict[str, Any]:
    from dispatch.hosts.agent import run_frame as agent_run_frame

    return agent_run_frame(pk_proc, host)
