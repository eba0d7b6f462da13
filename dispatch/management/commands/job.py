"""`manage.py job ACTION JOB ...`: control a job by id or name (calls dispatch.jobs.controls, .depends).

job pause JOB | job resume JOB | job kill JOB
job retry JOB [FRAME ...] [--layer L]     DEAD frames (all, or the named ones) run again
job eat JOB [FRAME ...] [--layer L]       WAITING/DEAD/DEPEND frames done without running
job priority JOB N
job max-cores JOB N [--yes]               whole cores, -1 for unlimited; 0 books nothing (needs --yes)
job auto-eat JOB on|off                   failed frames EATEN instead of retried (max retries 0; off: 1)
job show JOB                              state, counters and caps as JSON
job depend JOB --on-job OTHER [--on-layer L] [--layer L] [--type job|layer|frame]
                                          JOB (or its layer L) waits for OTHER (or its layer)
job undepend JOB --on-job OTHER [...]     drop that dependency (same arguments)
"""

from __future__ import annotations

import getpass
import json
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from dispatch.jobs.action_base import JobActionResult, JobNotFound, resolve_job
from dispatch.jobs.api import describe_job
from dispatch.jobs.controls import (
    eat_frames,
    kill_job,
    pause_job,
    resume_job,
    retry_frames,
    set_auto_eat,
    set_max_cores,
    set_priority,
)
from dispatch.jobs.depends import DEPEND_KIND_NAMES, add_depend, drop_depend


class Command(BaseCommand):
    help = (
        "Pause, resume, kill, retry, eat, set the priority, max cores or auto-eat of a job (by id or name), "
        "or add or drop its dependency on another job."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        for name, text in (("pause", "stop starting frames"), ("resume", "start frames again"),
                           ("kill", "finish the job now; its running frames are killed (booked until they end)"),
                           ("show", "print the job as JSON")):  # fmt: skip
            sub.add_parser(name, help=text).add_argument("job", help="job id or name")
        for name, text in (("retry", "run DEAD frames again"), ("eat", "mark frames done without running")):
            p = sub.add_parser(name, help=text)
            p.add_argument("job", help="job id or name")
            p.add_argument("frames", nargs="*", help="frame names (0001-layer) or ids; default: all")
            p.add_argument("--layer", help="only this layer")
        p = sub.add_parser("priority", help="set the dispatch priority")
        p.add_argument("job", help="job id or name")
        p.add_argument("value", type=int)
        p = sub.add_parser("max-cores", help="set the job's core cap in whole cores (-1 unlimited, 0 books nothing)")
        p.add_argument("job", help="job id or name")
        p.add_argument("value", type=int)
        p.add_argument("--yes", action="store_true", help="confirm a max of 0: the job books nothing more")
        p = sub.add_parser(
            "auto-eat", help="eat the job's failed frames instead of retrying them (Cuebot's auto-eat), or stop"
        )
        p.add_argument("job", help="job id or name")
        p.add_argument(
            "value", choices=("on", "off"), help="on: failed frames EATEN, max retries 0; off: max retries 1"
        )
        for name, text in (
            ("depend", "make the job (or one of its layers) wait for another job or layer"),
            ("undepend", "drop a dependency added with depend (or the spec); same arguments"),
        ):
            p = sub.add_parser(name, help=text)
            p.add_argument("job", help="the waiting job's id or name")
            p.add_argument("--on-job", required=True, help="the job waited for (id or name)")
            p.add_argument("--on-layer", help="a layer of that job (default: the whole job)")
            p.add_argument("--layer", help="only this layer of JOB waits (default: the whole job)")
            p.add_argument(
                "--type",
                choices=DEPEND_KIND_NAMES,
                help="job (the whole job), layer (the whole layer) or frame (frame by frame, needs both "
                "layers); default: layer when --on-layer is given, else job",
            )

    def handle(self, *args: Any, action: str, job: str, **options: Any) -> None:
        actor = f"cli:{getpass.getuser()}"
        try:
            target = resolve_job(job)
            if action == "show":
                self.stdout.write(json.dumps(describe_job(target), indent=2))
                return
            if action in ("pause", "resume", "kill"):
                run = {"pause": pause_job, "resume": resume_job, "kill": kill_job}[action]
                result = run(target, actor=actor)
            elif action in ("retry", "eat"):
                run_frames = retry_frames if action == "retry" else eat_frames
                result = run_frames(target, options["frames"] or None, layer=options["layer"], actor=actor)
            elif action in ("depend", "undepend"):
                run_depend = add_depend if action == "depend" else drop_depend
                result = run_depend(
                    target,
                    options["on_job"],
                    layer=options["layer"],
                    on_layer=options["on_layer"],
                    kind=options["type"],
                    actor=actor,
                )
            elif action == "priority":
                result = set_priority(target, options["value"], actor=actor)
            elif action == "auto-eat":
                result = set_auto_eat(target, options["value"] == "on", actor=actor)
            else:
                result = set_max_cores(
                    target, options["value"], actor=actor, confirm_stop=bool(options.get("yes"))
                )
        except JobNotFound as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:
            hint = ["run it again with --yes to confirm"] if getattr(exc, "code", None) == "confirm_stop" else []
            raise CommandError("; ".join([*exc.messages, *hint])) from None
        self.stdout.write(_describe(target.str_name, result))


def _describe(name: str, result: JobActionResult) -> str:
    d = result.detail
    if result.action in ("pause", "resume"):
        done = "paused" if result.action == "pause" else "resumed"
        return f"{name}: {done}" if result.changed else f"{name}: already {done}"
    if result.action == "kill":
        if d["killing"]:
            return (
                f"{name}: killing {d['killing']} running frame(s) ({d['eaten']} frames eaten); their cores stay "
                "booked until their hosts report them ended (`job show` counts them under \"killing\")"
            )
        return f"{name}: killed (no frame was running, {d['eaten']} frames eaten)"
    if result.action == "retry":
        return f"{name}: {result.changed} frames to retry" + (" (job reopened)" if d.get("reopened") else "")
    if result.action == "eat":
        return f"{name}: {result.changed} frames eaten" + (" (job finished)" if d.get("finished") else "")
    if result.action == "depend":
        what = _dependency(d)
        if d.get("satisfied"):
            return f"{name}: depends on {what}, already satisfied (it is done): nothing waits"
        return f"{name}: depends on {what}; {result.changed} waiting frame(s) now DEPEND"
    if result.action == "undepend":
        return f"{name}: no longer depends on {_dependency(d)}; {result.changed} frame(s) released to WAITING"
    if result.action == "auto_eat":
        state = "on" if d["auto_eat"] else "off"
        if not result.changed:
            return f"{name}: auto-eat {state} (unchanged)"
        eaten = ": its failed frames are eaten" if d["auto_eat"] else ""
        return f"{name}: auto-eat {state} (max retries {d['max_retries']}){eaten}"
    if result.action == "priority":
        return f"{name}: priority {d['priority']}" + ("" if result.changed else " (unchanged)")
    warnings = "".join(f"\nwarning: {w}" for w in d.get("warnings", ()))
    return f"{name}: max cores {d['max_cores']}" + ("" if result.changed else " (unchanged)") + warnings


def _dependency(d: dict[str, Any]) -> str:
    on = f"layer {d['on_layer']} of job {d['on_job_name']}" if d.get("on_layer") else f"job {d['on_job_name']}"
    er = f" (layer {d['layer']})" if d.get("layer") else ""
    how = " frame by frame" if d.get("type") == "FRAME_BY_FRAME" else ""
    return f"{on}{how}{er}"
