"""The JSON API's services routes: Cuebot's services and the shows' overrides of them.

Why here and not in dispatch.jobs.api with the other routes: every change goes through
ops.service_actions (one audited action each, the console's own), and dispatch.jobs sits below
ops (tests/unit/test_layout.py), so these views stand in ops and borrow the API's plumbing (token
auth, JSON errors, the body reader) from dispatch.jobs.api. The routes are listed with the
others in dispatch.jobs.api.ROUTES and docs/api.md; the project's URLs route them (before the
API's catch-all).

Units are the job spec's: cores in cores (to the hundredth), memory as a size ("8GB"),
timeouts in minutes; the tables keep Cuebot's (centicores, KB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db.models import Q
from django.http import HttpRequest, JsonResponse
from django.urls import re_path

from dispatch.jobs.api import ApiError, api_view, json_body
from dispatch.jobs.spec import parse_memory
from dispatch.models import Service, Show, ShowService
from ops import service_actions
from ops.units import memory_kb as memory_text

# The JSON fields of a service, in the job spec's words and units, and the column each sets.
SERVICE_FIELDS = {
    "name": "str_name",
    "threadable": "b_threadable",
    "cores": "int_cores_min",
    "max_cores": "int_cores_max",
    "memory": "int_mem_min",
    "gpus": "int_gpus_min",
    "max_gpus": "int_gpus_max",
    "gpu_memory": "int_gpu_mem_min",
    "tags": "str_tags",
    "timeout": "int_timeout",
    "timeout_llu": "int_timeout_llu",
    "min_memory_increase": "int_min_memory_increase",
}
_MEMORY_FIELDS = ("memory", "gpu_memory", "min_memory_increase")


def _service_cores(value: int) -> int | float:
    return value // 100 if value % 100 == 0 else value / 100


def describe_service(row: Service | ShowService) -> dict[str, Any]:
    """A service or an override as the API answers it: cores in cores, memory as a size and in KB."""
    out: dict[str, Any] = {"id": row.pk, "name": row.str_name}
    if isinstance(row, ShowService):
        out["show"] = row.show.str_name
    out.update(
        {
            "threadable": row.b_threadable,
            "cores": _service_cores(row.int_cores_min),
            "max_cores": _service_cores(row.int_cores_max),
            "memory": memory_text(row.int_mem_min),
            "memory_kb": row.int_mem_min,
            "gpus": row.int_gpus_min,
            "max_gpus": row.int_gpus_max,
            "gpu_memory": memory_text(row.int_gpu_mem_min),
            "gpu_memory_kb": row.int_gpu_mem_min,
            "tags": row.tags,
            "timeout": row.int_timeout,
            "timeout_llu": row.int_timeout_llu,
            "min_memory_increase": memory_text(row.int_min_memory_increase),
            "min_memory_increase_kb": row.int_min_memory_increase,
        }
    )
    return out


def service_values(body: dict[str, Any]) -> dict[str, Any]:
    """A JSON body in the spec's units -> the columns' values; a 400 lists every bad field."""
    errors: list[str] = []
    unknown = sorted(set(body) - set(SERVICE_FIELDS))
    if unknown:
        errors.append(f"unknown fields {unknown} (fields: {sorted(SERVICE_FIELDS)})")
    values: dict[str, Any] = {}
    for key, value in body.items():
        column = SERVICE_FIELDS.get(key)
        if column is None:
            continue
        if key in _MEMORY_FIELDS:
            try:
                values[column] = parse_memory(value, allow_zero=key == "gpu_memory")
            except ValueError as exc:
                errors.append(f"{key}: {exc}")
        elif key in ("cores", "max_cores"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                errors.append(f"{key}: must be a number of cores (e.g. 2 or 0.5), not {value!r}")
            elif value < 0:
                errors.append(f"{key}: {value} must not be negative")
            elif abs(round(value * 100) - value * 100) > 1e-6:
                errors.append(f"{key}: {value} is finer than a hundredth of a core")
            else:
                values[column] = round(value * 100)
        else:
            values[column] = value
    if errors:
        raise ApiError(400, *errors)
    return values


def _may_edit_services(user: AbstractBaseUser) -> None:
    if not (user.is_superuser or user.has_perm("ops.edit_caps")):  # type: ignore[attr-defined]
        raise ApiError(403, f"user {user.get_username()!r} may not change services (needs ops.edit_caps)")


def _service_call(call: Callable[[], service_actions.Changed]) -> service_actions.Changed:
    try:
        return call()
    except service_actions.NotFound as exc:
        raise ApiError(404, str(exc)) from None
    except ValidationError as exc:
        raise ApiError(400, *exc.messages) from None


def _service_row(ref: str) -> Service:
    row = Service.objects.filter(Q(pk=ref) | Q(str_name=ref)).first()
    if row is None:
        raise ApiError(404, f"no service {ref!r}")
    return row


def _show_of(ref: str) -> Show:
    show = Show.objects.filter(Q(pk=ref) | Q(str_name=ref)).first()
    if show is None:
        raise ApiError(404, f"no show {ref!r}")
    return show


def _override_row(show: Show, ref: str) -> ShowService:
    row = ShowService.objects.select_related("show").filter(Q(pk=ref) | Q(str_name=ref), show=show).first()
    if row is None:
        raise ApiError(404, f"show {show.str_name!r} has no override of service {ref!r}")
    return row


@api_view("GET", "POST")
def services(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """GET /api/services: every service by name; POST: create one (audited)."""
    if request.method == "GET":
        return JsonResponse({"services": [describe_service(s) for s in Service.objects.order_by("str_name")]})
    _may_edit_services(user)
    values = service_values(json_body(request, required=True))
    done = _service_call(lambda: service_actions.create_service(values, actor=user))
    return JsonResponse(describe_service(Service.objects.get(pk=done.pk)), status=201)


@api_view("GET", "POST", "DELETE")
def service_detail(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/services/<id or name>; POST {fields}: change them; DELETE: delete it (audited)."""
    row = _service_row(ref)
    if request.method == "GET":
        return JsonResponse(describe_service(row))
    _may_edit_services(user)
    if request.method == "DELETE":
        done = _service_call(lambda: service_actions.delete_service(row.pk, actor=user))
        return JsonResponse({"id": done.pk, "name": done.name, "deleted": True})
    body = json_body(request, required=True)
    if not body:
        raise ApiError(400, f"send the fields to change (fields: {sorted(SERVICE_FIELDS)})")
    values = service_values(body)
    done = _service_call(lambda: service_actions.update_service(row.pk, values, actor=user))
    return JsonResponse({**describe_service(Service.objects.get(pk=row.pk)), "changed": done.changed})


@api_view("GET", "POST")
def show_services(request: HttpRequest, user: AbstractBaseUser, show_ref: str) -> JsonResponse:
    """GET /api/shows/<show>/services: the show's overrides; POST {"name": service, ...}: override one."""
    show = _show_of(show_ref)
    if request.method == "GET":
        rows = ShowService.objects.select_related("show").filter(show=show).order_by("str_name")
        return JsonResponse({"show": show.str_name, "services": [describe_service(r) for r in rows]})
    _may_edit_services(user)
    values = service_values(json_body(request, required=True))
    done = _service_call(lambda: service_actions.create_show_service(show.pk, values, actor=user))
    return JsonResponse(describe_service(ShowService.objects.select_related("show").get(pk=done.pk)), status=201)


@api_view("GET", "POST", "DELETE")
def show_service_detail(request: HttpRequest, user: AbstractBaseUser, show_ref: str, ref: str) -> JsonResponse:
    """GET /api/shows/<show>/services/<service>; POST {fields}: change it; DELETE: drop the override."""
    show = _show_of(show_ref)
    row = _override_row(show, ref)
    if request.method == "GET":
        return JsonResponse(describe_service(row))
    _may_edit_services(user)
    if request.method == "DELETE":
        done = _service_call(lambda: service_actions.delete_show_service(show.pk, row.pk, actor=user))
        return JsonResponse({"id": done.pk, "name": row.str_name, "show": show.str_name, "deleted": True})
    body = json_body(request, required=True)
    if not body:
        raise ApiError(400, f"send the fields to change (fields: {sorted(set(SERVICE_FIELDS) - {'name'})})")
    values = service_values(body)
    done = _service_call(lambda: service_actions.update_show_service(show.pk, row.pk, values, actor=user))
    fresh = ShowService.objects.select_related("show").get(pk=row.pk)
    return JsonResponse({**describe_service(fresh), "changed": done.changed})


# Included by the project's URLs under /api/, ahead of the API's own routes and their catch-all.
urlpatterns = [
    re_path(r"^services/?$", services, name="services"),
    re_path(r"^services/(?P<ref>[^/]+)/?$", service_detail, name="service"),
    re_path(r"^shows/(?P<show_ref>[^/]+)/services/?$", show_services, name="show-services"),
    re_path(r"^shows/(?P<show_ref>[^/]+)/services/(?P<ref>[^/]+)/?$", show_service_detail, name="show-service"),
]
