"""The job page and the frame page: what a wrangler lives in (job → layer → frame, with logs).

The job page: the job's state and caps, its layers with a progress bar each (done, running,
waiting, depending, dead), its dependencies both ways, and its frames in pages of
`FRAMES_PER_PAGE`, filterable by state and layer, with memory (reserved, max RSS) and run time
per frame. The frame page: the same figures for one frame, why it is not booking, and its log,
tailed live while the frame runs (`frame_log`: text/plain from a byte offset, the API's rule).

Reads only; every control on these pages posts to `act`, which checks the role and calls
`dispatch.jobs.controls` (pause, resume, retry, eat, kill, kill frames, priority, auto-eat) or
`dispatch.jobs.depends` (add or drop a dependency on another job) or
`set_max_cores`: one durable transaction each with its `FarmAction` audit row, as the farm
lists and the API do. Every query is bounded by the page (a job's layers, one page of frames,
the grouped dependencies), whatever the size of the farm.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from dispatch.jobs import api
from dispatch.jobs.action_base import JobActionResult
from dispatch.jobs.controls import (
    MAX_PRIORITY,
    eat_frames,
    kill_frames,
    kill_job,
    pause_job,
    resume_job,
    retry_frames,
    set_auto_eat,
    set_max_cores,
    set_priority,
)
from dispatch.jobs.depends import add_depend, drop_depend
from dispatch.models import Frame, Job, JobMem, Layer, LayerMem
from dispatch.models.jobs import FRAME_STATES
from ops import permissions
from ops.admin_views import _context, why_summary
from ops.units import cores, local_time, memory_kb, run_time

FRAMES_PER_PAGE = 100
# The bar's segments, in the order they are drawn, with the stat column each one counts.
SEGMENTS = (
    ("done", ("int_succeeded_count", "int_eaten_count")),
    ("running", ("int_running_count",)),
    ("waiting", ("int_waiting_count",)),
    ("depend", ("int_depend_count",)),
    ("dead", ("int_dead_count",)),
)
FINISHED_FRAME_STATES = ("SUCCEEDED", "EATEN", "DEAD")

DEPENDS_ON_SQL = """
SELECT d.str_type, j.pk_job, j.str_name, lo.str_name, le.str_name,
       COUNT(*) FILTER (WHERE d.b_active), COUNT(*)
FROM depend d JOIN job j ON j.pk_job = d.pk_job_depend_on
LEFT JOIN layer lo ON lo.pk_layer = d.pk_layer_depend_on
LEFT JOIN layer le ON le.pk_layer = d.pk_layer_depend_er
WHERE d.pk_job_depend_er = %s
GROUP BY 1, 2, 3, 4, 5 ORDER BY 3, 4, 5 LIMIT 50
"""
DEPENDED_ON_BY_SQL = """
SELECT d.str_type, j.pk_job, j.str_name, lo.str_name, le.str_name,
       COUNT(*) FILTER (WHERE d.b_active), COUNT(*)
FROM depend d JOIN job j ON j.pk_job = d.pk_job_depend_er
LEFT JOIN layer lo ON lo.pk_layer = d.pk_layer_depend_on
LEFT JOIN layer le ON le.pk_layer = d.pk_layer_depend_er
WHERE d.pk_job_depend_on = %s
GROUP BY 1, 2, 3, 4, 5 ORDER BY 3, 4, 5 LIMIT 50
"""


@dataclass
class Segment:
    name: str
    count: int
    percent: float


def progress(stat: Any) -> list[Segment]:
    """The bar of a layer or job: each state's share of its frames (empty when it has none)."""
    if stat is None or not stat.int_total_count:
        return []
    total = stat.int_total_count
    out = []
    for name, columns in SEGMENTS:
        count = sum(getattr(stat, c) for c in columns)
        if count:
            out.append(Segment(name, count, round(100 * count / total, 2)))
    return out


def _job_or_404(pk: str) -> Job:
    job = Job.objects.select_related("show", "folder", "stat", "resource").filter(pk=pk).first()
    if job is None:
        raise Http404("no such job")
    return job


def _depends(job: Job) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    with connection.cursor() as cur:
        for key, sql in (("on", DEPENDS_ON_SQL), ("by", DEPENDED_ON_BY_SQL)):
            cur.execute(sql, [job.pk])
            out[key] = [
                {
                    "type": kind.replace("_", " ").lower(),
                    "job": other,
                    "job_name": name,
                    "layer_on": layer_on,
                    "layer_er": layer_er,
                    "active": active,
                    "total": total,
                }
                for kind, other, name, layer_on, layer_er, active, total in cur.fetchall()
            ]
    return out


def frame_row(frame: Frame, now: dt.datetime) -> dict[str, Any]:
    """A frame as the tables show it: cores, GB/MB, run time, local times."""
    return {
        "pk": frame.pk_frame,
        "name": frame.str_name,
        "layer": frame.layer.str_name if "layer" in frame._state.fields_cache else "",
        "state": frame.str_state.lower(),
        "running": frame.str_state == "RUNNING",
        "host": frame.str_host or "—",
        "cores": cores(frame.int_cores) if frame.int_cores else "—",
        "reserved": memory_kb(frame.int_mem_reserved) if frame.int_mem_reserved else "—",
        "max_rss": memory_kb(frame.int_mem_max_used) if frame.int_mem_max_used else "—",
        "run_time": run_time(frame.ts_started, frame.ts_stopped, now, frame.str_state == "RUNNING"),
        "started": local_time(frame.ts_started),
        "stopped": local_time(frame.ts_stopped),
        "retries": frame.int_retries,
        "exit": frame.int_exit_status if frame.int_exit_status >= 0 else "—",
        "waiting": frame.str_state == "WAITING",
        "dead": frame.str_state == "DEAD",
    }


def _controls(request: HttpRequest) -> dict[str, bool]:
    return {
        "can_control_jobs": permissions.can_control_jobs(request.user),
        "can_kill_work": permissions.can_kill_work(request.user),
    }


def job_page(request: HttpRequest, pk: str) -> HttpResponse:
    job = _job_or_404(pk)
    layers = list(
        Layer.objects.filter(job=job).select_related("stat", "mem").order_by("int_dispatch_order", "str_name")
    )
    job_mem = JobMem.objects.filter(job=job).values_list("int_max_rss", flat=True).first()
    state = request.GET.get("state", "").upper()
    layer_pk = request.GET.get("layer", "")
    frames = Frame.objects.filter(job=job).select_related("layer")
    if state in FRAME_STATES:
        frames = frames.filter(str_state=state)
    else:
        state = ""
    if layer_pk:
        frames = frames.filter(layer_id=layer_pk)
    frames = frames.order_by("int_layer_order", "int_number", "pk_frame")
    paginator = Paginator(frames, FRAMES_PER_PAGE)
    page = paginator.get_page(request.GET.get("page"))
    now = timezone.now()
    stat = getattr(job, "stat", None)
    counts = {s.lower(): 0 for s in FRAME_STATES}
    if stat is not None:
        for s in counts:
            counts[s] = getattr(stat, f"int_{s}_count", 0) or 0
    # The state filter's links, with the job_stat counts (the frame triggers keep them exact).
    filters = [("", "all", stat.int_total_count if stat else 0)] + [
        (s, s.lower(), counts[s.lower()]) for s in ("RUNNING", "WAITING", "DEPEND", "DEAD", "SUCCEEDED", "EATEN")
    ]
    resource = getattr(job, "resource", None)
    context = _context(
        request,
        f"Job {job.str_name}",
        job=job,
        job_state=("paused" if job.b_paused else "pending") if job.str_state == "PENDING" else job.str_state.lower(),
        job_progress=progress(stat),
        job_stat=stat,
        priority=resource.int_priority if resource else "—",
        max_cores=("unlimited" if resource.int_max_cores < 0 else cores(resource.int_max_cores)) if resource else "—",
        max_cores_value=(resource.int_max_cores // 100 if resource.int_max_cores >= 0 else -1) if resource else "",
        booked_cores=_booked_cores(job.pk),
        job_max_rss=memory_kb(job_mem) if job_mem else "—",
        started=local_time(job.ts_started),
        stopped=local_time(job.ts_stopped),
        layers=[
            {
                "layer": layer,
                "stat": getattr(layer, "stat", None),
                "progress": progress(getattr(layer, "stat", None)),
                "cores": cores(layer.int_cores_min),
                "memory": memory_kb(layer.int_mem_min),
                # layer_mem: the largest max RSS of its frames' runs, beside what a frame reserves.
                "max_rss": _max_rss(getattr(layer, "mem", None)),
                "selected": layer.pk == layer_pk,
            }
            for layer in layers
        ],
        depends=_depends(job),
        frames=[frame_row(f, now) for f in page.object_list],
        page=page,
        state_filter=state,
        layer_filter=layer_pk,
        filters=filters,
        why=why_summary(job.pk, None) if job.str_state == "PENDING" else "",
        **_controls(request),
    )
    return render(request, "ops/job.html", context)


def _max_rss(mem: LayerMem | None) -> str:
    return memory_kb(mem.int_max_rss) if mem is not None and mem.int_max_rss else "—"


def _booked_cores(job: str) -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT COALESCE(SUM(int_cores_reserved), 0) FROM proc WHERE pk_job = %s AND NOT b_local", [job])
        (cc,) = cur.fetchone()
    return cores(int(cc))


def frame_page(request: HttpRequest, pk: str) -> HttpResponse:
    frame = Frame.objects.select_related("layer", "job", "job__show").filter(pk=pk).first()
    if frame is None:
        raise Http404("no such frame")
    row = frame_row(frame, timezone.now())
    _found, log = api.frame_log_of(frame.job, frame.pk)
    context = _context(
        request,
        f"Frame {frame.str_name}",
        frame=frame,
        row=row,
        job=frame.job,
        log_path=str(log.path) if log.path else "",
        log_places=[str(p) for p in log.looked_at],
        log_url=reverse("admin:ops_frame_log", args=[frame.pk]),
        why=why_summary(frame.job_id, frame.pk) if frame.str_state == "WAITING" else "",
        gpu=frame.int_gpus,
        gpu_mem=memory_kb(frame.int_gpu_mem_reserved) if frame.int_gpu_mem_reserved else "",
        **_controls(request),
    )
    return render(request, "ops/frame.html", context)


def frame_log(request: HttpRequest, pk: str) -> HttpResponse:
    """The frame's log as text/plain from ?offset=N (the console's tail; the API's rule and
    headers). A JSON 404 when there is none (yet), with the frame's state so the tail knows
    whether to keep asking."""
    frame = Frame.objects.select_related("job", "job__show").filter(pk=pk).first()
    if frame is None:
        return JsonResponse({"errors": ["no such frame"]}, status=404)
    try:
        offset = api.log_offset(request.GET.get("offset"))
    except ValueError as exc:
        return JsonResponse({"errors": [str(exc)]}, status=400)
    _found, log = api.frame_log_of(frame.job, frame.pk)
    if log.path is None:
        places = ", ".join(str(p) for p in log.looked_at)
        return JsonResponse({"errors": [f"no log (yet): looked at {places}"], "state": frame.str_state}, status=404)
    try:
        response = api.log_response(log, offset)
    except OSError as exc:
        return JsonResponse({"errors": [f"the log cannot be read here: {exc.strerror}"]}, status=404)
    response["X-Frame-State"] = frame.str_state
    return response


# --- controls ---------------------------------------------------------------------------------

JOB_CONTROLS = {
    "pause": ("control_jobs", lambda job, scope, actor: pause_job(job, actor=actor), "Job paused"),
    "resume": ("control_jobs", lambda job, scope, actor: resume_job(job, actor=actor), "Job resumed"),
    "retry": ("control_jobs", lambda job, scope, actor: retry_frames(job, **scope, actor=actor),
              "Dead frames back to waiting"),
    "eat": ("control_jobs", lambda job, scope, actor: eat_frames(job, **scope, actor=actor),
            "Frames eaten (done without running)"),
    "kill": ("kill_work", lambda job, scope, actor: kill_job(job, actor=actor),
             "Job killed; running frames stopped and released"),
    # Cuebot's auto-eat: a failed frame is EATEN instead of retried (max retries 0; off: 1).
    "auto_eat_on": ("control_jobs", lambda job, scope, actor: set_auto_eat(job, True, actor=actor),
                    "Auto-eat on (failed frames are eaten, max retries 0)"),
    "auto_eat_off": ("control_jobs", lambda job, scope, actor: set_auto_eat(job, False, actor=actor),
                     "Auto-eat off (max retries 1)"),
}  # fmt: skip
_ROLE_CHECKS = {
    "control_jobs": permissions.can_control_jobs,
    "kill_work": permissions.can_kill_work,
    "edit_caps": permissions.can_edit_caps,
}


def _scope(request: HttpRequest) -> dict[str, Any]:
    frames = request.POST.getlist("frame")
    layer = request.POST.get("layer") or None
    return {"frames": frames or None, "layer": layer}


def _kill_frames(job: Job, request: HttpRequest) -> JobActionResult:
    """Kill the posted frames, or the running frames of the posted layer."""
    frames = request.POST.getlist("frame")
    layer = request.POST.get("layer")
    if not frames and layer:
        frames = list(Frame.objects.filter(job=job, layer_id=layer, str_state="RUNNING").values_list("pk", flat=True))
        if not frames:
            raise ValidationError("the layer has no running frame to kill")
    if not frames:
        raise ValidationError("choose the frames to kill")
    return kill_frames(job, frames, actor=request.user)


def _result_text(done: str, result: JobActionResult) -> str:
    n = result.changed
    text = f"{done}: {n} {'row' if n == 1 else 'rows'} changed"
    if result.action in ("retry", "eat", "kill_frames"):
        text = f"{done}: {n} {'frame' if n == 1 else 'frames'}"
    if result.action == "depend":
        text = f"{done}: {n} waiting {'frame' if n == 1 else 'frames'} now depending"
        if result.detail.get("satisfied"):
            text = f"{done}: already satisfied (what it waits for is done), nothing waits"
    if result.action == "undepend":
        text = f"{done}: {n} {'frame' if n == 1 else 'frames'} released to waiting"
    if result.detail.get("finished"):
        text += "; the job has nothing left to run and is finished"
    if result.detail.get("reopened"):
        text += "; the job is open again"
    return text


@require_POST
def act(request: HttpRequest, pk: str) -> HttpResponse:
    """One control of the job page or the frame page; back to the page it came from."""
    job = _job_or_404(pk)
    action = request.POST.get("action", "")
    back = request.POST.get("next") or reverse("admin:ops_job", args=[job.pk])
    if not back.startswith("/admin/"):
        back = reverse("admin:ops_job", args=[job.pk])
    if action == "kill_frames":
        permissions.require(permissions.can_kill_work(request.user))
        run, done = (lambda: _kill_frames(job, request)), "Frames killed (back to waiting, no retry counted)"
    elif action == "priority":
        permissions.require(permissions.can_control_jobs(request.user))
        raw = request.POST.get("priority", "").strip()
        if not raw.isdigit() or int(raw) > MAX_PRIORITY:
            messages.error(request, f"Priority is a whole number from 0 to {MAX_PRIORITY} (got {raw!r}).")
            return HttpResponseRedirect(back)
        run, done = (lambda: set_priority(job, int(raw), actor=request.user)), f"Priority set to {raw}"
    elif action == "max_cores":
        permissions.require(permissions.can_edit_caps(request.user))
        raw = request.POST.get("max_cores", "").strip()
        try:
            value = int(raw)
        except ValueError:
            messages.error(request, f"Max cores is a whole number of cores, -1 for unlimited (got {raw!r}).")
            return HttpResponseRedirect(back)
        confirm = request.POST.get("confirm") == "yes"
        run = lambda: set_max_cores(job, value, actor=request.user, confirm_stop=confirm)  # noqa: E731
        done = f"Max cores set to {'unlimited' if value < 0 else f'{value} cores'}"
    elif action in ("depend", "undepend"):
        permissions.require(permissions.can_control_jobs(request.user))
        run_depend = add_depend if action == "depend" else drop_depend
        fields = {k: (request.POST.get(k) or "").strip() or None for k in ("on_job", "layer", "on_layer", "type")}
        if fields["on_job"] is None:
            messages.error(request, "Name the job to wait on. Nothing was changed.")
            return HttpResponseRedirect(back)
        run = lambda: run_depend(  # noqa: E731
            job, fields["on_job"], layer=fields["layer"], on_layer=fields["on_layer"], kind=fields["type"],
            actor=request.user,
        )  # fmt: skip
        done = "Dependency added" if action == "depend" else "Dependency dropped"
    elif action in JOB_CONTROLS:
        role, call, done = JOB_CONTROLS[action]
        permissions.require(_ROLE_CHECKS[role](request.user))
        scope = _scope(request) if action in ("retry", "eat") else {}
        run = lambda: call(job, scope, request.user)  # noqa: E731
    else:
        messages.error(request, f"Unknown action {action!r}: nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        result = run()
    except ValidationError as exc:
        confirm = getattr(exc, "code", None) == "confirm_stop"
        hint = " Tick 'confirm' beside the value to stop it booking." if confirm else ""
        messages.error(request, "; ".join(exc.messages) + ". Nothing was changed." + hint)
        return HttpResponseRedirect(back)
    messages.success(request, _result_text(done, result))
    for warning in (result.detail or {}).get("warnings", []) or []:
        messages.warning(request, warning)
    return HttpResponseRedirect(back)
