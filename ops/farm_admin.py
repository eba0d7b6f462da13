"""The farm lists of the ops console: hosts, jobs, frames and procs, with their controls.

The admin's raw lists showed field names, centicores and KB, had no order and no host state,
could do nothing and never refreshed. These subclasses of the `dispatch.admin` classes replace
their registrations (imported once from `ops.admin`) with:

* titles in words and values in cores and GB, a default order, a host state that says what a
  host does (up/down, open/locked, draining with N running, drained, not pinging);
* a reason column on the job list, computed for the whole page in ONE query (`REASONS_SQL`):
  the first of paused, finished, show inactive, waiting on dependency, at job cap, folder full,
  show at burst, no host can ever run it, no host fits now;
* actions that call `dispatch.jobs.controls` and `dispatch.jobs.host_controls` (and nothing
  else), each behind its permission:
  job pause/resume/retry/eat/priority and frame retry/eat (`ops.control_jobs`), job and frame
  kill (`ops.kill_work`), host lock/unlock/drain (`ops.control_hosts`); the destructive ones
  (kill, eat, drain) go through a confirmation page first;
* a results table that refreshes itself in place, and holds still while rows are selected.

Every list runs a fixed number of queries whatever its page size: related rows come in the
page's own query (select_related or subqueries), the reasons in one more.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection
from django.db.models import Case, Count, Exists, IntegerField, OuterRef, Prefetch, QuerySet, Subquery, Sum, Value, When
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from accounting.units import format_cap
from dispatch import admin as dispatch_admin
from dispatch import conf as dispatch_conf
from dispatch.jobs.action_base import JobNotFound
from dispatch.jobs.controls import (
    MAX_PRIORITY,
    eat_frames,
    kill_frames,
    kill_job,
    pause_job,
    resume_job,
    retry_frames,
    set_priority,
)
from dispatch.jobs.host_controls import drain_hosts, lock_hosts, unlock_hosts
from dispatch.models import FarmAction, Frame, Host, Job, Proc, WaitingHost
from ops import permissions
from ops.admin_views import refresh_seconds
from ops.readonly_admin import ReadOnlyAdmin

CENTI = 100
KB_PER_GB = 1024 * 1024


def cores(centicores: int | None) -> str:
    """Whole cores, with one decimal only when a value is fractional (a 0.5-core booking)."""
    if centicores is None:
        return "—"
    value = centicores / CENTI
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def gigabytes(kb: int | None) -> str:
    if kb is None:
        return "—"
    value = kb / KB_PER_GB
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def age(then: Any) -> str:
    if then is None:
        return "—"
    seconds = max(0, int((timezone.now() - then).total_seconds()))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    return f"{seconds // 3600} h ago"


class PriorityForm(ActionForm):
    """The admin's action bar, with the value the priority action needs."""

    # Text, checked by the action: an invalid value must say so, not read as "no action selected".
    priority = forms.CharField(required=False, label="priority", widget=forms.TextInput(attrs={"size": 8}))


class FarmListMixin:
    """Refreshing results, the console's own permission checks for the actions, and no raw forms.

    Farm rows (jobs, frames, hosts, procs) change only through `dispatch.jobs`' actions, with
    their audit row, for every role, the superuser included: a raw form could set a job
    FINISHED under running frames (booked cores left under a finished job, no audit), and a
    raw delete of a job fails on its job_resource row (500). So there is no add, change or
    delete form here; a row's page is the console's own (`console_url`), else read-only.
    """

    change_list_template = "ops/farm_change_list.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def console_url(self, object_id: str) -> str | None:
        """The console page of a row, which its change URL leads to (None: the read-only view)."""
        return None

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        url = self.console_url(object_id)
        if url is not None:
            return HttpResponseRedirect(url)
        return super().change_view(request, object_id, form_url, extra_context)  # type: ignore[misc]

    def has_control_jobs_permission(self, request: HttpRequest) -> bool:
        return permissions.can_control_jobs(request.user)

    def has_kill_work_permission(self, request: HttpRequest) -> bool:
        return permissions.can_kill_work(request.user)

    def has_control_hosts_permission(self, request: HttpRequest) -> bool:
        return permissions.can_control_hosts(request.user)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # An action the user may not run is refused (403, nothing changed), not answered 200 with
        # "no action selected" (the admin's answer to an action it does not offer this user).
        action = request.POST.get("action") if request.method == "POST" else None
        if action and action not in self.get_actions(request):  # type: ignore[attr-defined]
            raise PermissionDenied(f"the action {action!r} needs a role you do not have")
        # Titled by what the list is ("Jobs"), not "Select job to view" (no row has a raw form).
        title = str(self.model._meta.verbose_name_plural).capitalize()  # type: ignore[attr-defined]
        extra = {"title": title, **(extra_context or {}), "farm_refresh_ms": int(refresh_seconds() * 1000)}
        return super().changelist_view(request, extra)  # type: ignore[misc]


def confirmed(
    request: HttpRequest, objects: list[Any], action: str, question: str, consequence: str
) -> HttpResponse | None:
    """None once the operator confirmed on the page this returns the first time (a POST with
    `confirm`); the page lists what the action touches and posts the same selection back."""
    if request.POST.get("confirm") == "yes":
        return None
    return render(
        request,
        "ops/farm_confirm.html",
        {
            **admin.site.each_context(request),
            "title": question,
            "objects": objects[:200],
            "more": max(0, len(objects) - 200),
            "consequence": consequence,
            "action": action,
            "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "priority": request.POST.get("priority", ""),
        },
    )


def _report(modeladmin: admin.ModelAdmin, request: HttpRequest, done: str, errors: list[str]) -> None:
    modeladmin.message_user(request, done, messages.SUCCESS)
    for error in errors[:10]:
        modeladmin.message_user(request, error, messages.ERROR)


def _each_job(
    modeladmin: admin.ModelAdmin, request: HttpRequest, jobs: Iterable[Job], run: Callable[[Job], int], done: str
) -> None:
    """One action call (one transaction) per job: one bad job does not undo the others."""
    total, count, errors = 0, 0, []
    for job in jobs:
        count += 1
        try:
            total += run(job)
        except (ValidationError, JobNotFound) as exc:
            errors.append(f"{job.str_name}: {'; '.join(getattr(exc, 'messages', [str(exc)]))}")
    jobs_word = "job" if count == 1 else "jobs"
    _report(modeladmin, request, f"{done}: {total} (over {count} selected {jobs_word})", errors)


# --- jobs ------------------------------------------------------------------------------------

# One query for the page's jobs: booked cores from proc (the record of truth), the smallest frame
# still waiting, room on the show's subscriptions, and whether any host could ever (or can now)
# take a waiting frame. The first blocker in the CASE order is the job's reason.
REASONS_SQL = """
WITH page AS (
  SELECT j.pk_job, j.pk_show, j.pk_folder, j.pk_facility, j.str_os, j.str_state, j.b_paused
  FROM job j WHERE j.pk_job = ANY(%(ids)s::text[])
), jb AS (
  SELECT p.pk_job, SUM(p.int_cores_reserved) AS c FROM proc p
  WHERE p.pk_job IN (SELECT pk_job FROM page) AND NOT p.b_local GROUP BY p.pk_job
), fb AS (
  SELECT j.pk_folder, SUM(p.int_cores_reserved) AS c FROM proc p JOIN job j ON j.pk_job = p.pk_job
  WHERE j.pk_folder IN (SELECT pk_folder FROM page) AND NOT p.b_local GROUP BY j.pk_folder
), su AS (
  SELECT p.pk_show, h.pk_alloc, SUM(p.int_cores_reserved) AS c FROM proc p JOIN host h ON h.pk_host = p.pk_host
  WHERE p.pk_show IN (SELECT pk_show FROM page) AND NOT p.b_local GROUP BY p.pk_show, h.pk_alloc
), sb AS (
  SELECT s.pk_show, MAX(s.int_burst - COALESCE(su.c, 0)) AS room, COUNT(*) AS subs
  FROM subscription s LEFT JOIN su ON su.pk_show = s.pk_show AND su.pk_alloc = s.pk_alloc
  WHERE s.pk_show IN (SELECT pk_show FROM page) GROUP BY s.pk_show
), wl AS (
  SELECT l.pk_job, l.pk_layer, pg.pk_facility, pg.str_os,
         regexp_split_to_array(replace(COALESCE(l.str_tags, ''), ' ', ''), '\\|') AS tags,
         CASE WHEN l.b_threadable AND l.int_cores_min > 0 THEN GREATEST(100, l.int_cores_min / 100 * 100)
              ELSE 100 END AS need, l.int_mem_min AS mem, l.int_gpus_min AS gpus, l.int_gpu_mem_min AS gpu_mem
  FROM layer l JOIN layer_stat ls ON ls.pk_layer = l.pk_layer JOIN page pg ON pg.pk_job = l.pk_job
  WHERE ls.int_waiting_count > 0
), tc AS (
  -- Per tag (and facility, OS), the largest host and the most any bookable host has free, one
  -- resource at a time: a layer that exceeds one of these fits no host (exact in that
  -- direction); one within each maximum but on no single host reads "ready" here, and the
  -- why-not-booking page, which checks host by host, gives the exact answer.
  SELECT t.str_tag::text AS tag, a.pk_facility AS facility, hs.str_os AS os,
         MAX(h.int_cores) AS cores, MAX(h.int_mem) AS mem, MAX(h.int_gpus) AS gpus, MAX(h.int_gpu_mem) AS gpu_mem,
         MAX(h.int_cores_idle) FILTER (WHERE b.ok) AS cores_idle,
         MAX(LEAST(h.int_mem_idle, hs.int_mem_free)) FILTER (WHERE b.ok) AS mem_free,
         MAX(h.int_gpus_idle) FILTER (WHERE b.ok) AS gpus_idle,
         MAX(LEAST(h.int_gpu_mem_idle, hs.int_gpu_mem_free)) FILTER (WHERE b.ok) AS gpu_mem_free
  FROM host_tag t JOIN host h ON h.pk_host = t.pk_host JOIN host_stat hs ON hs.pk_host = h.pk_host
  JOIN alloc a ON a.pk_alloc = h.pk_alloc
  CROSS JOIN LATERAL (SELECT h.str_lock_state = 'OPEN' AND hs.str_state = 'UP'
                             AND hs.ts_ping >= now() - make_interval(secs => %(stale_after)s) AS ok) b
  WHERE t.str_tag IN (SELECT unnest(wl.tags) FROM wl)
  GROUP BY 1, 2, 3
), fit AS (
  SELECT wl.pk_job, MIN(wl.need) AS need,
         COALESCE(bool_or(tc.cores >= wl.need AND tc.mem >= wl.mem AND tc.gpus >= wl.gpus
                          AND tc.gpu_mem >= wl.gpu_mem), false) AS ever,
         COALESCE(bool_or(tc.cores_idle >= wl.need AND tc.mem_free >= wl.mem AND tc.gpus_idle >= wl.gpus
                          AND tc.gpu_mem_free >= wl.gpu_mem), false) AS now
  FROM wl LEFT JOIN tc ON tc.tag = ANY(wl.tags) AND tc.facility = wl.pk_facility
                          AND (wl.str_os IS NULL OR tc.os = wl.str_os)
  GROUP BY wl.pk_job
)
SELECT pg.pk_job,
  CASE
    WHEN pg.str_state <> 'PENDING' THEN 'finished'
    WHEN pg.b_paused THEN 'paused'
    WHEN NOT s.b_active THEN 'show inactive'
    WHEN js.int_waiting_count = 0 AND js.int_depend_count > 0 THEN 'waiting on dependency'
    WHEN js.int_waiting_count = 0 THEN 'nothing waiting'
    WHEN fit.pk_job IS NULL THEN 'waiting on dependency'
    WHEN NOT fit.ever THEN 'no host can ever run it'
    WHEN jr.int_max_cores >= 0 AND COALESCE(jb.c, 0) + fit.need > jr.int_max_cores THEN 'at job cap'
    WHEN fr.int_max_cores >= 0 AND COALESCE(fb.c, 0) + fit.need > fr.int_max_cores THEN 'folder full'
    WHEN sb.pk_show IS NULL THEN 'no subscription'
    WHEN sb.room < fit.need THEN 'show at burst'
    WHEN NOT fit.now THEN 'no host fits now'
    ELSE 'ready'
  END,
  COALESCE(jb.c, 0), jr.int_max_cores, COALESCE(fb.c, 0), fr.int_max_cores
FROM page pg
JOIN show s ON s.pk_show = pg.pk_show
JOIN job_stat js ON js.pk_job = pg.pk_job
JOIN job_resource jr ON jr.pk_job = pg.pk_job
JOIN folder_resource fr ON fr.pk_folder = pg.pk_folder
LEFT JOIN jb ON jb.pk_job = pg.pk_job
LEFT JOIN fb ON fb.pk_folder = pg.pk_folder
LEFT JOIN sb ON sb.pk_show = pg.pk_show
LEFT JOIN fit ON fit.pk_job = pg.pk_job
"""

REASON_CLASS = {"ready": "reason-ok", "nothing waiting": "reason-ok", "finished": "reason-ok"}
REASON_NEVER = {"no host can ever run it", "no subscription"}


def page_reasons(job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The reason per job of one list page, and the figures it rests on (centicores)."""
    if not job_ids:
        return {}
    with connection.cursor() as cur:
        cur.execute(REASONS_SQL, {"ids": job_ids, "stale_after": dispatch_conf.lost_host_timeout()})
        rows = cur.fetchall()
    out = {}
    for pk, reason, job_booked, job_max, folder_booked, folder_max in rows:
        detail = ""
        if reason == "at job cap":
            detail = f" ({cores(job_booked)}/{cores(job_max)} cores)"
        elif reason == "folder full":
            detail = f" ({cores(folder_booked)}/{cores(folder_max)} cores)"
        out[pk] = {"reason": reason, "text": reason + detail}
    return out


class JobListAdmin(FarmListMixin, dispatch_admin.JobAdmin):
    list_display = (
        "str_name",
        "show_name",
        "state",
        "reason",
        "priority",
        "frames_running",
        "frames_waiting",
        "frames_dead",
        "frames_total",
        "booked_cores",
        "max_cores",
        "ts_started",
        "console",
    )
    list_display_links = ("str_name",)
    list_select_related = ("show", "folder", "stat", "resource")
    # Active (PENDING) jobs first, then by priority: ordering by the state string put FINISHED first.
    ordering = (
        Case(When(str_state="PENDING", then=Value(0)), default=Value(1)).asc(),
        "-resource__int_priority",
        "str_name",
    )
    action_form = PriorityForm
    actions = (
        "pause_job_selected",
        "resume_job_selected",
        "retry_frames_selected",
        "eat_frames_selected",
        "kill_job_selected",
        "set_priority_selected",
    )

    def console_url(self, object_id: str) -> str | None:
        return reverse("admin:ops_job", args=[object_id])

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        booked = (
            Proc.objects.filter(job=OuterRef("pk"), b_local=False)
            .values("job")
            .annotate(c=Sum("int_cores_reserved"))
            .values("c")
        )
        return (
            super()
            .get_queryset(request)
            .annotate(booked_cc=Coalesce(Subquery(booked, output_field=IntegerField()), Value(0)))
            .annotate(killing=Exists(Proc.objects.filter(job=OuterRef("pk"), ts_kill__isnull=False)))
        )

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        cl = super().get_changelist_instance(request)
        jobs = list(cl.result_list)  # evaluates the page once; the template iterates the same cache
        reasons = page_reasons([j.pk for j in jobs])
        for job in jobs:
            job.page_reason = reasons.get(job.pk)
        return cl

    @admin.display(description="show", ordering="show__str_name")
    def show_name(self, obj: Job) -> str:
        return obj.show.str_name

    @admin.display(description="state", ordering="str_state")
    def state(self, obj: Job) -> str:
        if getattr(obj, "killing", False):
            return "killing"  # frames whose kill was sent run until their hosts report them ended
        if obj.str_state == "PENDING":
            return "paused" if obj.b_paused else "pending"
        return obj.str_state.lower()

    @admin.display(description="why not booking")
    def reason(self, obj: Job) -> str:
        info = getattr(obj, "page_reason", None)
        if info is None:
            return "—"
        css = REASON_CLASS.get(info["reason"], "reason-never" if info["reason"] in REASON_NEVER else "reason-wait")
        url = reverse("admin:ops_job_why", args=[obj.pk])
        return format_html('<a class="job-reason {}" href="{}">{}</a>', css, url, info["text"])

    @admin.display(description="priority", ordering="resource__int_priority")
    def priority(self, obj: Job) -> int:
        return obj.resource.int_priority

    @admin.display(description="running", ordering="stat__int_running_count")
    def frames_running(self, obj: Job) -> int:
        return obj.stat.int_running_count

    @admin.display(description="waiting", ordering="stat__int_waiting_count")
    def frames_waiting(self, obj: Job) -> int:
        return obj.stat.int_waiting_count

    @admin.display(description="dead", ordering="stat__int_dead_count")
    def frames_dead(self, obj: Job) -> int:
        return obj.stat.int_dead_count

    @admin.display(description="frames", ordering="stat__int_total_count")
    def frames_total(self, obj: Job) -> int:
        return obj.stat.int_total_count

    @admin.display(description="booked cores", ordering="booked_cc")
    def booked_cores(self, obj: Job) -> str:
        return cores(obj.booked_cc)

    @admin.display(description="max cores", ordering="resource__int_max_cores")
    def max_cores(self, obj: Job) -> str:
        return format_cap(obj.resource.int_max_cores)

    # The actions: each one calls dispatch.jobs.controls once per job (its own transaction).
    def _jobs(self, queryset: QuerySet[Job]) -> list[Job]:
        return list(queryset.select_related(None).only("pk_job", "str_name").order_by("pk_job"))

    @admin.action(description="Pause the selected jobs", permissions=["control_jobs"])
    def pause_job_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        run = lambda job: pause_job(job, actor=request.user).changed  # noqa: E731
        _each_job(self, request, self._jobs(queryset), run, "Jobs paused")

    @admin.action(description="Resume the selected jobs", permissions=["control_jobs"])
    def resume_job_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        run = lambda job: resume_job(job, actor=request.user).changed  # noqa: E731
        _each_job(self, request, self._jobs(queryset), run, "Jobs resumed")

    @admin.action(description="Retry the dead frames of the selected jobs", permissions=["control_jobs"])
    def retry_frames_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        run = lambda job: retry_frames(job, actor=request.user).changed  # noqa: E731
        _each_job(self, request, self._jobs(queryset), run, "Frames to retry")

    @admin.action(
        description="Eat the waiting, dead and depending frames of the selected jobs…", permissions=["control_jobs"]
    )
    def eat_frames_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        jobs = self._jobs(queryset)
        page = confirmed(
            request, jobs, "eat_frames_selected", f"Eat the frames of {len(jobs)} job(s)?",
            "Their WAITING, DEAD and DEPEND frames become EATEN (done without running); running frames go on.",
        )  # fmt: skip
        if page is not None:
            return page
        run = lambda job: eat_frames(job, actor=request.user).changed  # noqa: E731
        _each_job(self, request, jobs, run, "Frames eaten")
        return None

    @admin.action(description="Kill the selected jobs…", permissions=["kill_work"])
    def kill_job_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        jobs = self._jobs(queryset)
        page = confirmed(
            request, jobs, "kill_job_selected", f"Kill {len(jobs)} job(s)?",
            "Each job is FINISHED now: its running frames are stopped and released, nothing of it starts again.",
        )  # fmt: skip
        if page is not None:
            return page
        # Said in jobs and frames, each counted for what it is (the action's `changed` adds the
        # finished job, the eaten frames and the released procs together: "Frames moved: 6").
        killed, stopped, eaten, errors = 0, 0, 0, []
        for job in jobs:
            try:
                detail = kill_job(job, actor=request.user).detail
            except (ValidationError, JobNotFound) as exc:
                errors.append(f"{job.str_name}: {'; '.join(getattr(exc, 'messages', [str(exc)]))}")
                continue
            killed += int(bool(detail.get("finished")))
            stopped += int(detail.get("released", 0))
            eaten += int(detail.get("eaten", 0))
        already = len(jobs) - killed - len(errors)
        text = (
            f"Jobs killed: {killed} of {len(jobs)} selected"
            + (f" ({already} finished already)" if already > 0 else "")
            + f"; running frames stopped: {stopped}; frames that had not started, eaten: {eaten}"
        )
        _report(self, request, text, errors)
        return None

    @admin.action(description="Set the priority of the selected jobs (the value beside)", permissions=["control_jobs"])
    def set_priority_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        raw = request.POST.get("priority", "").strip()
        if not raw.isdigit() or int(raw) > MAX_PRIORITY:
            self.message_user(
                request,
                f"Give the priority, a whole number from 0 to {MAX_PRIORITY}, "
                f"in the field beside the action (got {raw!r}). Nothing was changed.",
                messages.ERROR,
            )
            return
        value = int(raw)
        run = lambda job: set_priority(job, value, actor=request.user).changed  # noqa: E731
        _each_job(self, request, self._jobs(queryset), run, f"Priority set to {value}")


# --- frames ----------------------------------------------------------------------------------


class FrameListAdmin(FarmListMixin, dispatch_admin.FrameAdmin):
    list_display = (
        "str_name",
        "job_name",
        "state",
        "host_name",
        "frame_cores",
        "frame_memory",
        "int_retries",
        "int_exit_status",
        "updated",
        "why",
    )
    # The page's jobs come in one more query (prefetch), not a join: joining 500,000 frames to
    # their jobs before the top-100 sort took 0.8 s where the frame scan alone takes 0.16 s.
    list_select_related = False
    ordering = ("-ts_updated", "pk_frame")
    actions = ("retry_selected", "eat_selected", "kill_selected")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Frame]:
        jobs = Job.objects.only("pk_job", "str_name")
        killing = Exists(Proc.objects.filter(frame=OuterRef("pk"), ts_kill__isnull=False))
        return super().get_queryset(request).prefetch_related(Prefetch("job", queryset=jobs)).annotate(killing=killing)

    def console_url(self, object_id: str) -> str | None:
        return reverse("admin:ops_frame", args=[object_id])

    @admin.display(description="job", ordering="job__str_name")
    def job_name(self, obj: Frame) -> str:
        return obj.job.str_name


    @admin.display(description="state", ordering="str_state")
    def state(self, obj: Frame) -> str:
        if obj.str_state == "RUNNING" and getattr(obj, "killing", False):
            return "killing"
        return obj.str_state.lower()

    @admin.display(description="host", ordering="str_host")
    def host_name(self, obj: Frame) -> str:
        return obj.str_host or "—"

    @admin.display(description="cores", ordering="int_cores")
    def frame_cores(self, obj: Frame) -> str:
        return cores(obj.int_cores) if obj.int_cores else "—"

    @admin.display(description="memory used (GB)", ordering="int_mem_max_used")
    def frame_memory(self, obj: Frame) -> str:
        return gigabytes(obj.int_mem_max_used) if obj.int_mem_max_used else "—"

    @admin.display(description="updated", ordering="ts_updated")
    def updated(self, obj: Frame) -> str:
        return age(obj.ts_updated)

    def _by_job(self, queryset: QuerySet[Frame]) -> tuple[list[Frame], dict[str, list[str]], dict[str, str]]:
        frames = list(queryset.select_related(None).only("pk_frame", "str_name", "job_id", "job__str_name"))
        by_job: dict[str, list[str]] = defaultdict(list)
        names: dict[str, str] = {}
        for f in frames:
            by_job[f.job_id].append(f.pk_frame)
        for pk, name in Job.objects.filter(pk__in=list(by_job)).values_list("pk_job", "str_name"):
            names[pk] = name
        return frames, dict(sorted(by_job.items())), names

    def _each(self, request: HttpRequest, queryset: QuerySet[Frame], run: Callable[..., Any], done: str) -> None:
        _frames, by_job, names = self._by_job(queryset)
        total, errors = 0, []
        for job_id, ids in by_job.items():
            try:
                total += run(job_id, ids).changed
            except (ValidationError, JobNotFound) as exc:
                errors.append(f"{names.get(job_id, job_id)}: {'; '.join(getattr(exc, 'messages', [str(exc)]))}")
        _report(self, request, f"{done}: {total} (over {sum(map(len, by_job.values()))} selected frames)", errors)

    @admin.action(description="Retry the selected frames (dead ones)", permissions=["control_jobs"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[Frame]) -> None:
        run = lambda job, ids: retry_frames(job, ids, actor=request.user)  # noqa: E731
        self._each(request, queryset, run, "Frames to retry")

    @admin.action(description="Eat the selected frames…", permissions=["control_jobs"])
    def eat_selected(self, request: HttpRequest, queryset: QuerySet[Frame]) -> HttpResponse | None:
        frames = list(queryset.select_related("job")[:201])
        page = confirmed(
            request, frames, "eat_selected", f"Eat {queryset.count()} frame(s)?",
            "WAITING, DEAD and DEPEND frames among them become EATEN (done without running); "
            "frames that depend on them may start.",
        )  # fmt: skip
        if page is not None:
            return page
        run = lambda job, ids: eat_frames(job, ids, actor=request.user)  # noqa: E731
        self._each(request, queryset, run, "Frames eaten")
        return None

    @admin.action(description="Kill the selected running frames…", permissions=["kill_work"])
    def kill_selected(self, request: HttpRequest, queryset: QuerySet[Frame]) -> HttpResponse | None:
        frames = list(queryset.select_related("job")[:201])
        page = confirmed(
            request, frames, "kill_selected", f"Kill {queryset.count()} frame(s)?",
            "The running ones are stopped and go back to WAITING (no retry counted); eat them to stop them for good.",
        )  # fmt: skip
        if page is not None:
            return page
        run = lambda job, ids: kill_frames(job, ids, actor=request.user)  # noqa: E731
        self._each(request, queryset, run, "Frames killed")
        return None


# --- hosts -----------------------------------------------------------------------------------


class HostListAdmin(FarmListMixin, dispatch_admin.HostAdmin):
    list_display = (
        "str_name",
        "state",
        "alloc_name",
        "cores_idle",
        "memory_idle",
        "gpus_idle",
        "running",
        "os",
        "last_ping",
    )
    list_select_related = ("alloc", "stat")
    ordering = ("str_name",)
    actions = ("lock_selected", "unlock_selected", "drain_selected")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Host]:
        running = Proc.objects.filter(host=OuterRef("pk")).values("host").annotate(n=Count("*")).values("n")
        return (
            super()
            .get_queryset(request)
            .annotate(running_procs=Coalesce(Subquery(running, output_field=IntegerField()), Value(0)))
        )

    @admin.display(description="state", ordering="str_lock_state")
    def state(self, obj: Host) -> str:
        stat = getattr(obj, "stat", None)
        up = stat.str_state.lower() if stat is not None else "no stats"
        parts = [up]
        if obj.str_lock_state == "OPEN":
            parts.append("open")
        else:
            lock = "nimby-locked" if obj.str_lock_state == "NIMBY_LOCKED" else "locked"
            parts.append(f"{lock}, draining ({obj.running_procs} running)" if obj.running_procs else f"{lock}, drained")
        if stat is not None and stat.str_state == "UP":
            silent = (timezone.now() - stat.ts_ping).total_seconds()
            if silent > dispatch_conf.lost_host_timeout():
                parts.append(f"not pinging ({age(stat.ts_ping)})")
        return " · ".join(parts)

    @admin.display(description="allocation", ordering="alloc__str_name")
    def alloc_name(self, obj: Host) -> str:
        return obj.alloc.str_name

    @admin.display(description="idle / total cores", ordering="int_cores_idle")
    def cores_idle(self, obj: Host) -> str:
        return f"{cores(obj.int_cores_idle)} / {cores(obj.int_cores)}"

    @admin.display(description="idle / total memory (GB)", ordering="int_mem_idle")
    def memory_idle(self, obj: Host) -> str:
        return f"{gigabytes(obj.int_mem_idle)} / {gigabytes(obj.int_mem)}"

    @admin.display(description="idle / total GPUs", ordering="int_gpus_idle")
    def gpus_idle(self, obj: Host) -> str:
        return f"{obj.int_gpus_idle} / {obj.int_gpus}" if obj.int_gpus else "—"

    @admin.display(description="running frames", ordering="running_procs")
    def running(self, obj: Host) -> int:
        return obj.running_procs

    @admin.display(description="OS", ordering="stat__str_os")
    def os(self, obj: Host) -> str:
        stat = getattr(obj, "stat", None)
        return (stat.str_os or "—") if stat is not None else "—"

    @admin.display(description="last ping", ordering="stat__ts_ping")
    def last_ping(self, obj: Host) -> str:
        stat = getattr(obj, "stat", None)
        return age(stat.ts_ping) if stat is not None else "—"

    def _run(self, request: HttpRequest, queryset: QuerySet[Host], run: Callable[..., Any], done: str) -> None:
        ids = list(queryset.values_list("pk_host", flat=True))
        try:
            result = run(ids, actor=request.user)
        except ValidationError as exc:
            _report(self, request, f"{done}: 0", list(exc.messages))
            return
        text = f"{done}: {len(result.changed)} (already so: {len(result.unchanged)})"
        if result.action == "drain":
            text += f"; {result.running} frame(s) still running finish there, nothing new starts"
        _report(self, request, text, [])

    @admin.action(description="Lock the selected hosts (nothing new books; running frames go on)",
                  permissions=["control_hosts"])  # fmt: skip
    def lock_selected(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        self._run(request, queryset, lock_hosts, "Hosts locked")

    @admin.action(description="Unlock the selected hosts", permissions=["control_hosts"])
    def unlock_selected(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        self._run(request, queryset, unlock_hosts, "Hosts unlocked")

    @admin.action(description="Drain the selected hosts…", permissions=["control_hosts"])
    def drain_selected(self, request: HttpRequest, queryset: QuerySet[Host]) -> HttpResponse | None:
        hosts = list(queryset.select_related(None)[:201])
        page = confirmed(
            request, hosts, "drain_selected", f"Drain {queryset.count()} host(s)?",
            "They are locked now: nothing new books there, the frames running there finish; the list says "
            "'drained' when the last one ends.",
        )  # fmt: skip
        if page is not None:
            return page
        self._run(request, queryset, drain_hosts, "Hosts draining")
        return None


# --- procs -----------------------------------------------------------------------------------


class ProcListAdmin(FarmListMixin, dispatch_admin.ProcAdmin):
    list_display = (
        "frame_name",
        "job_name",
        "host_name",
        "cores_reserved",
        "memory_reserved",
        "memory_used",
        "int_gpus_reserved",
        "booked",
    )
    list_select_related = ("host", "job", "frame")
    ordering = ("-ts_booked", "pk_proc")

    @admin.display(description="frame", ordering="frame__str_name")
    def frame_name(self, obj: Proc) -> str:
        return obj.frame.str_name

    @admin.display(description="job", ordering="job__str_name")
    def job_name(self, obj: Proc) -> str:
        return obj.job.str_name

    @admin.display(description="host", ordering="host__str_name")
    def host_name(self, obj: Proc) -> str:
        return obj.host.str_name

    @admin.display(description="cores", ordering="int_cores_reserved")
    def cores_reserved(self, obj: Proc) -> str:
        return cores(obj.int_cores_reserved)

    @admin.display(description="memory reserved (GB)", ordering="int_mem_reserved")
    def memory_reserved(self, obj: Proc) -> str:
        return gigabytes(obj.int_mem_reserved)

    @admin.display(description="memory used (GB)", ordering="int_mem_used")
    def memory_used(self, obj: Proc) -> str:
        return gigabytes(obj.int_mem_used)

    @admin.display(description="booked", ordering="ts_booked")
    def booked(self, obj: Proc) -> str:
        return age(obj.ts_booked)


# --- the audit rows of the controls ---------------------------------------------------------


class FarmActionAdmin(ReadOnlyAdmin):
    """Read-only: the rows are written by the actions, in the transaction of the change."""

    list_display = ("ts_created", "str_action", "str_target_kind", "str_target_name", "int_changed", "str_username")
    list_filter = ("str_action", "str_target_kind")
    search_fields = ("str_target_name", "str_target", "str_username")
    ordering = ("-ts_created", "-id")
    show_full_result_count = False


class WaitingHostAdmin(ReadOnlyAdmin):
    """Read-only: RQD hosts the gateway heard but does not know; `manage.py rqd_hosts admit`
    registers one (an audited action), so the list is where an operator sees who is waiting."""

    list_display = ("str_name", "str_address", "int_cores", "int_mem", "int_reports", "ts_first_seen", "ts_last_seen")
    search_fields = ("str_name", "str_address")
    ordering = ("str_name",)


def register(site: admin.AdminSite) -> None:
    """Put the farm lists in place of the plain `dispatch.admin` ones (called once by ops.admin)."""
    for model, cls in ((Job, JobListAdmin), (Frame, FrameListAdmin), (Host, HostListAdmin), (Proc, ProcListAdmin)):
        if site.is_registered(model):
            site.unregister(model)
        site.register(model, cls)
    if not site.is_registered(FarmAction):
        site.register(FarmAction, FarmActionAdmin)
    if not site.is_registered(WaitingHost):
        site.register(WaitingHost, WaitingHostAdmin)
