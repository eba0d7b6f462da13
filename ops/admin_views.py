"""The console's own admin pages (mounted by `ops.admin.ConsoleAdmin.get_urls`).

Every page is server-rendered and works without JavaScript; the live pages refresh their
`data-live` sections every few seconds with a tiny inline script (a `<noscript>` meta
refresh otherwise). Reads: the scheduler's published view and the database. Writes: only
through `accounting.actions`, on POST, after the permission check; CSRF is Django's.
"""

from __future__ import annotations

import datetime as dt
from itertools import islice
from typing import Any

from django.contrib import admin, messages
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.http import require_http_methods

from accounting import actions
from accounting.units import centicores_to_cores, format_cap
from cuesched_project import conf
from dispatch.models import Alloc, FarmAction, Folder, Job, Show, Subscription
from ops import counters, freshness, permissions, status, why
from ops.forms import AuditFilterForm, FlipForm, KillSwitchForm
from ops.fullest import RECENT_RUNS_MINUTES, fullest_folders, recent_frame_ends
from ops.models import (
    FolderCapEvent,
    JobCapEvent,
    KillSwitchEvent,
    LimitRecordEvent,
    ShowManagedEvent,
    SubscriptionCapEvent,
)


def refresh_seconds() -> float:
    """How often the live sections of a console page refresh themselves."""
    return conf.env_float("CUESCHED_OPS_REFRESH_SECONDS", 5.0)


def _context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    context = admin.site.each_context(request)
    context.update(
        title=title,
        refresh_ms=int(refresh_seconds() * 1000),
        is_nav_sidebar_enabled=False,
        can_flip=permissions.can_flip(request.user),
        can_edit_caps=permissions.can_edit_caps(request.user),
        can_set_kill_switch=permissions.can_set_kill_switch(request.user),
        **extra,
    )
    return context


def _scheduler_context(view: dict[str, Any] | None) -> dict[str, Any]:
    sched = status.scheduler_status(view)
    listener = (view or {}).get("listener") or {}
    recompute = (view or {}).get("recompute")
    loops = (view or {}).get("loops") or {}
    dispatch = ((view or {}).get("extra") or {}).get("dispatch")
    return {
        "sched": sched,
        "listener": listener,
        "recompute": recompute,
        "recompute_ago": (status.ago(recompute["at"]) if recompute.get("at") else "bootstrap seed only")
        if recompute
        else "never",
        "loops": [{"name": k, **v, "ago": status.ago(v.get("last_run"))} for k, v in sorted(loops.items())],
        "dispatch": dispatch,
        "frames_ended": recent_frame_ends(),
        "frames_ended_minutes": RECENT_RUNS_MINUTES,
        "cuebot_mode": (view or {}).get("cuebot_mode"),
        "started_ago": status.ago((view or {}).get("started_at")),
        **freshness.scheduler_ages(view),
    }


_VERTEX_WORDS = {"sub": "subscription", "folder": "folder", "job": "job"}
_FIELD_WORDS = {"burst": "burst", "max_cores": "max cores", "max_gpus": "max GPUs"}


def cap_key_names(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Names for the Store's cap keys (job and folder ids, "show:alloc"): at most three queries."""
    wanted: dict[str, set[str]] = {"job": set(), "folder": set(), "show": set(), "alloc": set()}
    for vertex, key in keys:
        if vertex == "sub" and ":" in key:
            show, alloc = key.split(":", 1)
            wanted["show"].add(show)
            wanted["alloc"].add(alloc)
        elif vertex in ("job", "folder"):
            wanted[vertex].add(key)
    models = {"job": Job, "folder": Folder, "show": Show, "alloc": Alloc}
    found: dict[str, dict[str, str]] = {
        name: dict(model.objects.filter(pk__in=wanted[name]).values_list("pk", "str_name")) if wanted[name] else {}
        for name, model in models.items()
    }
    names = {}
    for vertex, key in keys:
        if vertex == "sub" and ":" in key:
            show, alloc = key.split(":", 1)
            names[(vertex, key)] = f"{found['show'].get(show, show)} @ {found['alloc'].get(alloc, alloc)}"
        else:
            names[(vertex, key)] = found.get(vertex, {}).get(key, key)
    return names


def _recent_caps(view: dict[str, Any] | None, limit: int = 12) -> list[dict[str, Any]]:
    """The cap changes the scheduler applied, named (not by id) and in cores (-1: unlimited)."""
    recs = list(islice(reversed((view or {}).get("recent_caps") or []), limit))
    names = cap_key_names([(v, k) for v, k, _f, _val, _at in recs])
    return [
        {
            "vertex": _VERTEX_WORDS.get(v, v),
            "key": k,
            "name": names.get((v, k), k),
            "field": _FIELD_WORDS.get(f, f),
            "value": "unlimited" if v != "sub" and isinstance(val, int) and val < 0 else val,
            "unit": "GPUs" if "gpus" in f else "cores",
            "ago": status.ago(at),
        }
        for v, k, f, val, at in recs
    ]


# --- pages --------------------------------------------------------------------------------


def overview(request: HttpRequest) -> HttpResponse:
    view = status.view_for(request)
    shows = counters.farm_overview(view)
    published = (view or {}).get("managed_shows") or {}
    fullest = fullest_folders()
    for show in shows:
        show.fullest_folder = fullest.get(show.pk)  # type: ignore[attr-defined]
        show.flip = status.flip_status(view, show.pk, show.managed)  # type: ignore[attr-defined]
        show.published = show.pk in published  # type: ignore[attr-defined]
    context = _context(
        request,
        "Farm overview",
        live_page=True,
        shows=shows,
        recent_caps=_recent_caps(view),
        recent_audit=list(islice(audit_events(), 10)),
        **_scheduler_context(view),
    )
    return render(request, "ops/overview.html", context)


def show_live(request: HttpRequest, pk: str) -> HttpResponse:
    view = status.view_for(request)
    try:
        data = counters.show_counters(view, pk)
    except IndexError as exc:
        raise Http404("no such show") from exc
    context = _context(
        request,
        f"Live counters: {data.name}",
        live_page=True,
        show=data,
        flip=status.flip_status(view, pk, data.managed),
        **_scheduler_context(view),
    )
    return render(request, "ops/show.html", context)


@require_http_methods(["GET", "POST"])
def flip(request: HttpRequest, pk: str) -> HttpResponse:
    permissions.require(permissions.can_flip(request.user))
    show = Show.objects.filter(pk=pk).only("pk_show", "str_name", "b_scheduler_managed").first()
    if show is None:
        raise Http404("no such show")
    if request.method == "POST":
        form = FlipForm(request.POST)
        if form.is_valid():
            target = form.cleaned_data["managed"]
            result = actions.flip_show(pk, target, actor=request.user)
            owner = "the scheduler's Store" if target else "the database"
            if result.changed:
                messages.success(request, f"Show {show.str_name}: accounting now owned by {owner}.")
            else:
                messages.info(request, f"Show {show.str_name} was already owned by {owner}; nothing changed.")
            for warning in result.warnings:
                messages.warning(request, warning)
            return HttpResponseRedirect(reverse("admin:ops_show_live", args=[pk]))
    target = request.GET.get("managed", "true" if not show.b_scheduler_managed else "false") == "true"
    n_procs, cc, gpus = actions.show_procs(pk)
    view = status.view_for(request)
    context = _context(
        request,
        f"Flip {show.str_name}",
        show=show,
        target=target,
        form=FlipForm(initial={"managed": "true" if target else "false", "confirm": True}),
        procs=n_procs,
        proc_cores=centicores_to_cores(cc),
        proc_gpus=gpus,
        subs=counters.sub_rows(view, pk),
        ttl=conf.managed_shows_ttl(),
        notify_on=status.notifications_on(),
        sched=status.scheduler_status(view),
    )
    return render(request, "ops/flip_confirm.html", context)


def flip_many(request: HttpRequest, shows: list[Show], target: bool) -> HttpResponse | None:
    """The change-list action: a confirmation page, then one flip per show (each its own transaction)."""
    permissions.require(permissions.can_flip(request.user))
    if request.POST.get("confirm") == "yes":
        done = 0
        for show in shows:
            result = actions.flip_show(show.pk, target, actor=request.user)
            done += result.changed
            for warning in result.warnings:
                messages.warning(request, f"{show.str_name}: {warning}")
        owner = "the scheduler's Store" if target else "the database"
        messages.success(request, f"{done} show(s) flipped to {owner}; {len(shows) - done} already were.")
        return None
    rows = []
    for show in shows:
        n, cc, gpus = actions.show_procs(show.pk)
        rows.append({"show": show, "procs": n, "cores": centicores_to_cores(cc), "gpus": gpus})
    context = _context(
        request,
        "Flip shows",
        rows=rows,
        target=target,
        ttl=conf.managed_shows_ttl(),
        notify_on=status.notifications_on(),
        action=request.POST.get("action"),
        selected=[s.pk for s in shows],
        action_checkbox_name=admin.helpers.ACTION_CHECKBOX_NAME,
    )
    return render(request, "ops/flip_many_confirm.html", context)


def why_summary(job: str, frame: str | None) -> str:
    """The main reason in one line with a link to the full page (for the job and frame forms)."""
    view = status.read_view()
    try:
        result = why.explain_frame(frame, view) if frame else why.explain_job(job, view)
    except LookupError:
        return ""
    url = reverse("admin:ops_frame_why", args=[frame]) if frame else reverse("admin:ops_job_why", args=[job])
    primary = result.primary
    if primary is None:
        return ""
    css = "clear" if primary.code == "ok" else "blocked"
    return format_html(
        '<div class="ops-why {}" style="margin:0"><div class="reason" style="font-size:14px">{}</div>'
        '<div class="unblock">{} <a href="{}">details…</a></div></div>',
        css,
        primary.message,
        primary.unblock,
        url,
    )


def why_job(request: HttpRequest, pk: str) -> HttpResponse:
    view = status.view_for(request)
    try:
        result = why.explain_job(pk, view)
    except LookupError as exc:
        raise Http404("no such job") from exc
    return render(request, "ops/why.html", _context(request, f"Why is {result.job_name} not booking?", why=result))


def why_frame(request: HttpRequest, pk: str) -> HttpResponse:
    view = status.view_for(request)
    try:
        result = why.explain_frame(pk, view)
    except LookupError as exc:
        raise Http404("no such frame") from exc
    name = (result.frame or {}).get("name", pk)
    return render(request, "ops/why.html", _context(request, f"Why is frame {name} not booking?", why=result))


@require_http_methods(["GET", "POST"])
def kill_switch(request: HttpRequest) -> HttpResponse:
    """The kill switch: anyone who views the console reads it; only operators change it (POST)."""
    permissions.require(permissions.can_view(request.user))
    if request.method == "POST":
        permissions.require(permissions.can_set_kill_switch(request.user))
        form = KillSwitchForm(request.POST)
        if form.is_valid():
            result = actions.set_notifications(form.cleaned_data["enabled"], actor=request.user)
            state = "on" if form.cleaned_data["enabled"] else "OFF"
            messages.success(request, f"Accounting notifications are {state}.")
            for warning in result.warnings:
                messages.warning(request, warning)
            return HttpResponseRedirect(reverse("admin:ops_console_overview"))
    target = request.GET.get("enabled", "false" if status.notifications_on() else "true") == "true"
    from accounting.admin import OFF_MEANS

    context = _context(
        request,
        "Notifications kill switch",
        target=target,
        off_means=OFF_MEANS,
        notify_on=status.notifications_on(),
        form=KillSwitchForm(initial={"enabled": "true" if target else "false", "confirm": True}),
    )
    return render(request, "ops/kill_switch_confirm.html", context)


# --- the audit trail ----------------------------------------------------------------------

EVENT_KINDS = {
    "sub": (SubscriptionCapEvent, ["int_burst", "int_size"]),
    "folder": (FolderCapEvent, ["int_max_cores", "int_max_gpus"]),
    "job": (JobCapEvent, ["int_max_cores", "int_max_gpus"]),
    "flip": (ShowManagedEvent, ["b_scheduler_managed"]),
    "kill_switch": (KillSwitchEvent, ["notify_enabled"]),
    "limit": (LimitRecordEvent, ["int_max_value", "b_host_limit"]),
}
COLUMN_LABELS = {
    "int_burst": "burst",
    "int_size": "size",
    "int_max_cores": "max cores",
    "int_max_gpus": "max GPUs",
    "b_scheduler_managed": "managed",
    "notify_enabled": "notifications",
    "int_max_value": "licence max",
    "b_host_limit": "per host",
}


def shown_value(column: str, value: Any) -> str:
    if value is None:
        return "—"
    if column == "b_scheduler_managed":
        return "scheduler" if value else "database"
    if column == "notify_enabled":
        return "on" if value else "OFF"
    if column == "int_max_value":
        # Negative is unlimited on cuesched's schema only: beside Cuebot nothing runs (licences.limit_max).
        return f"{value}: unlimited (beside Cuebot: nothing runs)" if value < 0 else f"{value} licences"
    if column == "b_host_limit":
        return "yes" if value else "no"
    if column in ("int_burst", "int_size"):
        return f"{centicores_to_cores(value)} cores"
    return format_cap(value, gpus=column != "int_max_cores")


def target_names(kind: str, events: list[Any]) -> dict[str, str]:
    """Readable names of the objects a batch of events is about (rows may be gone: then the id)."""
    if kind == "sub":
        ids = {e.pk_subscription for e in events}
        rows = Subscription.objects.filter(pk__in=ids).values_list("pk", "show__str_name", "alloc__str_name")
        return {pk: f"{show} @ {alloc}" for pk, show, alloc in rows}
    if kind == "folder":
        return dict(Folder.objects.filter(pk__in={e.folder_id for e in events}).values_list("pk", "str_name"))
    if kind == "job":
        return dict(Job.objects.filter(pk__in={e.job_id for e in events}).values_list("pk", "str_name"))
    return {}


def event_target(kind: str, event: Any, names: dict[str, str] | None = None) -> tuple[str, str]:
    """A label and an admin link for the object an event is about."""
    names = names if names is not None else target_names(kind, [event])
    if kind == "sub":
        pk = event.pk_subscription
        return f"subscription {names.get(pk, pk)}", reverse("admin:dispatch_subscription_change", args=[pk])
    if kind == "folder":
        pk = event.folder_id
        return f"folder {names.get(pk, pk)}", reverse("admin:dispatch_folder_change", args=[pk])
    if kind == "job":
        pk = event.job_id
        return f"job {names.get(pk, pk)}", reverse("admin:dispatch_job_change", args=[pk])
    if kind == "kill_switch":
        return "accounting notifications", reverse("admin:ops_kill_switch")
    if kind == "limit":
        return f"limit {event.str_name}", reverse("admin:dispatch_limitrecord_change", args=[event.pk_limit_record])
    return f"show {event.str_name}", reverse("admin:ops_show_live", args=[event.pk_show])


def _matching(kind: str, q: str) -> Q:
    """Events whose object's id or name contains `q`."""
    if kind == "flip":
        return Q(pk_show__icontains=q) | Q(str_name__icontains=q)
    if kind == "kill_switch":
        # One object, named on the page "accounting notifications" (the kill switch).
        named = any(q.lower() in name for name in ("accounting notifications", "kill switch"))
        return Q() if named else Q(pk__in=[])
    if kind == "limit":
        return Q(pk_limit_record__icontains=q) | Q(str_name__icontains=q)
    if kind == "sub":
        shows = Show.objects.filter(Q(str_name__icontains=q) | Q(pk__icontains=q)).values("pk")
        return Q(pk_subscription__icontains=q) | Q(show__in=shows)
    if kind == "folder":
        folders = Folder.objects.filter(Q(str_name__icontains=q) | Q(pk__icontains=q)).values("pk")
        return Q(pk_folder_resource__icontains=q) | Q(folder__in=folders)
    jobs = Job.objects.filter(Q(str_name__icontains=q) | Q(pk__icontains=q)).values("pk")
    return Q(pk_job_resource__icontains=q) | Q(job__in=jobs)


def audit_events(
    kind: str = "",
    who: str = "",
    q: str = "",
    days: int | None = None,
    limit: int = 200,
    people: bool = False,
) -> list[dict[str, Any]]:
    """The merged audit trail, newest first: one entry per changed column, the first `limit`.

    `people`: only the changes someone asked for by name (console, CLI, API), not those of
    scripts and seeders that write the tables directly (recorded with their database role).
    """
    out: list[dict[str, Any]] = []
    for name, (model, columns) in EVENT_KINDS.items():
        if kind and kind != name:
            continue
        qs = model.objects.select_related("pgh_context")
        if who:
            qs = qs.filter(Q(db_role__icontains=who) | Q(pgh_context__metadata__username__icontains=who))
        if q:
            qs = qs.filter(_matching(name, q))
        if days:
            qs = qs.filter(pgh_created_at__gte=timezone.now() - dt.timedelta(days=days))
        if people:
            qs = qs.filter(pgh_context__metadata__has_key="username")
        events = list(qs.order_by("-pgh_created_at", "-pgh_id")[:limit])
        names = target_names(name, events)
        for event in events:
            meta = event.pgh_context.metadata if event.pgh_context_id else {}
            label, url = event_target(name, event, names)
            for column in columns:
                old, new = getattr(event, f"old_{column}"), getattr(event, column)
                if old == new:
                    continue
                out.append(
                    {
                        "at": event.pgh_created_at,
                        "kind": name,
                        "object": label,
                        "url": url,
                        "field": COLUMN_LABELS[column],
                        "old": shown_value(column, old),
                        "new": shown_value(column, new),
                        "user": meta.get("username") or "",
                        "action": meta.get("action") or "",
                        "role": event.db_role,
                    }
                )
    if not kind or kind == "farm":
        out += farm_action_events(who=who, q=q, days=days, limit=limit, people=people)
    out.sort(key=lambda e: e["at"], reverse=True)
    return out[:limit]


_FARM_TARGET_URLS = {"job": "admin:dispatch_job_change", "frame": "admin:dispatch_job_change",
                     "host": "admin:dispatch_host_change"}  # fmt: skip


def farm_action_events(
    who: str = "", q: str = "", days: int | None = None, limit: int = 200, people: bool = False
) -> list[dict[str, Any]]:
    """The job, frame and host controls (dispatch.jobs.audit writes a FarmAction row in each
    control's transaction) as audit entries: what was done, to what, how many rows, by whom.
    A frame control's target is its job (the row names the job)."""
    qs = FarmAction.objects.all()
    if who:
        qs = qs.filter(str_username__icontains=who)
    if q:
        qs = qs.filter(Q(str_target__icontains=q) | Q(str_target_name__icontains=q))
    if days:
        qs = qs.filter(ts_created__gte=timezone.now() - dt.timedelta(days=days))
    if people:
        qs = qs.exclude(str_username="")
    out = []
    for row in qs.order_by("-ts_created", "-id")[:limit]:
        kind = row.str_target_kind
        target = "job" if kind == "frame" else kind
        out.append(
            {
                "at": row.ts_created,
                "kind": "farm",
                "object": f"{target} {row.str_target_name or row.str_target}",
                "url": reverse(_FARM_TARGET_URLS[kind], args=[row.str_target]),
                "field": f"{kind} control",
                "old": "",
                "new": f"{row.str_action} ({row.int_changed} changed)",
                "user": row.str_username,
                "action": row.str_action,
                "role": "",
            }
        )
    return out


AUDIT_PAGE_SIZE = 200
AUDIT_MAX_PAGE = 500  # 100,000 entries back; older ones are reached with the filters


def audit_page(filters: dict[str, Any], page: int, per_page: int = AUDIT_PAGE_SIZE) -> dict[str, Any]:
    """One page of the trail, newest first, and whether older entries exist.

    Every page is read fresh from the newest entry (each table's first page x per_page + 1
    rows): an entry recorded meanwhile shifts the pages by one rather than hiding any, and the
    page says which entries it shows, so nothing drops off silently.
    """
    upto = page * per_page
    entries = audit_events(**filters, limit=upto + 1)
    shown = entries[upto - per_page : upto]
    return {
        "events": shown,
        "page": page,
        "first": upto - per_page + 1 if shown else 0,
        "last": upto - per_page + len(shown),
        "has_next": len(entries) > upto,
        "has_previous": page > 1,
    }


def audit(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None)
    filters: dict[str, Any] = {}
    if form.is_valid():
        filters = {k: v for k, v in form.cleaned_data.items() if v and k != "page"}
    page = form.cleaned_data.get("page") if form.is_valid() else None
    paging = audit_page(filters, min(page or 1, AUDIT_MAX_PAGE))
    query = request.GET.copy()
    query.pop("page", None)
    context = _context(request, "Audit trail", form=form, query=query.urlencode(), **paging)
    return render(request, "ops/audit.html", context)
