"""Console pages of issue 20 part B: procs by age and last ping (stuck ones flagged), allocations.

Read-only pages, for every console viewer; each runs a fixed number of queries whatever its
page size. They refresh like the other live pages (the `data-live` sections).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from ops import allocations, procs
from ops.admin_views import _context

PAGE_SIZE = 200


def _int(raw: str | None, default: int, lo: int, hi: int) -> int:
    try:
        return max(lo, min(hi, int(raw or default)))
    except ValueError:
        return default


def procs_page(request: HttpRequest) -> HttpResponse:
    """Longest-silent procs first; `?stuck=1` keeps only the stuck ones."""
    stuck_only = request.GET.get("stuck") == "1"
    page = _int(request.GET.get("page"), 1, 1, 1_000_000)
    rows = procs.proc_rows(stuck_only=stuck_only, limit=PAGE_SIZE + 1, offset=(page - 1) * PAGE_SIZE)
    context = _context(
        request,
        "Procs by last ping",
        live_page=True,
        rows=rows[:PAGE_SIZE],
        has_next=len(rows) > PAGE_SIZE,
        page=page,
        stuck_only=stuck_only,
        stuck_total=procs.stuck_count(),
        stuck_after=procs.stuck_label(),
    )
    return render(request, "ops/procs.html", context)


def allocations_page(request: HttpRequest) -> HttpResponse:
    allocs, borrowers = allocations.allocations()
    context = _context(request, "Allocations", live_page=True, allocs=allocs, borrowers=borrowers)
    return render(request, "ops/allocations.html", context)
