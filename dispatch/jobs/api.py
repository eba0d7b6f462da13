"""The JSON API: submit, list and control jobs with a per-user bearer token (plain Django views).

Routes (under /api/, see dispatch/jobs/urls.py; each with or without a trailing slash; the
full contract with examples is docs/api.md):

| method | path | body or query | answer |
|---|---|---|---|
| GET | /api/jobs | ?show, state, user, name, limit, offset | 200 a page of jobs |
| POST | /api/jobs | a job spec (dispatch.jobs.spec) | 201 {"job": id, "name": ..., "frames": n} |
| GET | /api/jobs/<id or name> | | 200 the job: state, counts, caps, layers |
| GET | /api/jobs/<id or name>/layers | ?limit, offset | 200 a page of its layers |
| GET | /api/jobs/<id or name>/frames | ?layer, state, limit, offset | 200 a page of its frames |
| GET | /api/jobs/<id or name>/frames/<id or name>/log | ?offset (bytes) | 200 text/plain, or a JSON 404 |
| POST | /api/jobs/<id or name>/pause, resume, kill | none or {} | 200 {"job", "action", "changed", ...} |
| POST | /api/jobs/<id or name>/retry, eat | none, or {"frames": [names or ids], "layer": name} | 200 |
| POST | /api/jobs/<id or name>/priority | {"priority": n} | 200 |
| POST | /api/jobs/<id or name>/max-cores | {"max_cores": whole cores, -1 unlimited, 0 with "confirm": true} | 200 |
| POST | /api/jobs/<id or name>/depend, undepend | {"on_job", "on_layer", "layer", "type"} | 200 |
| GET | /api/limits | | 200 {"limits": [{"id", "name", "max", "host_limit", "running", ...}]} |
| POST | /api/limits | {"name": ..., "max": n (-1 unlimited), "host_limit": false} | 201 the limit |
| GET | /api/limits/<id or name> | | 200 the limit and its use |
| POST | /api/limits/<id or name> | {"max": n} and/or {"host_limit": bool} | 200 the limit, "changed", "warnings" |
| GET | /api/services | | 200 {"services": [{"id", "name", "cores", "memory", "tags", "timeout", ...}]} |
| POST | /api/services | {"name", "threadable", "cores", "memory": "8GB", "tags", ...} | 201 the service |
| GET, POST, DELETE | /api/services/<id or name> | POST: the fields to change | 200 the service ("changed") |
| GET | /api/shows/<id or name>/services | | 200 {"show", "services": [the show's overrides]} |
| POST | /api/shows/<id or name>/services | {"name": service, fields over the service's} | 201 the override |
| GET, POST, DELETE | /api/shows/<show>/services/<id or service name> | POST: the fields to change | 200 |

A page is `{"count", "limit", "offset", "next", "previous", "results"}` (`next` and `previous`
are the URLs of the neighbouring pages, or null), in a stable order so that paging through a
list that is not written meanwhile sees every row once.

Every error is `{"errors": ["...", ...]}`, on every path under /api/: 400 bad body, spec or
query (all reasons), 401 no valid token (`Authorization: Bearer <token>`, made by `manage.py
api_token USER`), 403 not allowed, 404 no such job, action or route, 405 wrong method, 500 a
bug (logged with its traceback), 503 the database is unreachable. A 4xx answer writes nothing.
Each write is one durable transaction, so after a 500 or 503 it happened whole or not at all:
read the job to know which.

Who may do what: any active user with a token may submit (as themselves; as another user
only with the rights below) and read jobs; a user controls their own jobs
(job.str_user == username); staff and holders of `dispatch.change_job` control any job.
Licence limits are read by any token user and created or changed by holders of
`ops.edit_caps` (the console's cap editors): a limit is a cap of every show. Services and the
shows' overrides of them likewise (ops.service_actions: every change audited): a service sets
what every layer naming it books.

Only token authentication is accepted (session cookies are ignored), so the views are
CSRF-exempt: a bearer token is never sent by a browser on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import SuspiciousOperation, ValidationError
from django.db import DataError, OperationalError
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from accounting import actions as cap_actions
from accounting.units import centicores_to_cores_cap, gpus_cap
from dispatch.jobs import logs as frame_logs
from dispatch.jobs.action_base import JobActionResult, JobNotFound, resolve_job
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
from dispatch.jobs.depends import add_depend, drop_depend
from dispatch.jobs.plan import SpecError
from dispatch.jobs.spec import load_spec
from dispatch.jobs.submit import submit_job
from dispatch.jobs.tokens import user_for_token
from dispatch.models import Frame, Job, JobResource, JobStat, Layer, LayerStat, LimitRecord, Proc
from dispatch.models.jobs import FRAME_STATES, JOB_STATES

logger = logging.getLogger(__name__)

CONTROL_PERMISSION = "dispatch.change_job"
COUNTS = ("waiting", "running", "dead", "depend", "eaten", "succeeded", "total")
# A page of a list: `limit` rows from `offset`. The cap keeps one answer (a frame row is ~300
# bytes of JSON) well under a megabyte, and one COUNT plus one indexed page query per request.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
JOB_FILTERS = ("show", "state", "user", "name")
FRAME_FILTERS = ("layer", "state")
# Every route, for the 404 of an unknown path (and docs/api.md, which tests/unit/test_docs.py checks).
ROUTES = (
    "GET /api/jobs",
    "POST /api/jobs",
    "GET /api/jobs/<job>",
    "GET /api/jobs/<job>/layers",
    "GET /api/jobs/<job>/frames",
    "GET /api/jobs/<job>/frames/<frame>/log",
    "POST /api/jobs/<job>/pause",
    "POST /api/jobs/<job>/resume",
    "POST /api/jobs/<job>/kill",
    "POST /api/jobs/<job>/retry",
    "POST /api/jobs/<job>/eat",
    "POST /api/jobs/<job>/priority",
    "POST /api/jobs/<job>/max-cores",
    "POST /api/jobs/<job>/auto-eat",
    "POST /api/jobs/<job>/depend",
    "POST /api/jobs/<job>/undepend",
    "GET /api/limits",
    "POST /api/limits",
    "GET /api/limits/<limit>",
    "POST /api/limits/<limit>",
    "GET /api/services",
    "POST /api/services",
    "GET /api/services/<service>",
    "POST /api/services/<service>",
    "DELETE /api/services/<service>",
    "GET /api/shows/<show>/services",
    "POST /api/shows/<show>/services",
    "GET /api/shows/<show>/services/<service>",
    "POST /api/shows/<show>/services/<service>",
    "DELETE /api/shows/<show>/services/<service>",
)


class ApiError(Exception):
    def __init__(self, status: int, *errors: str) -> None:
        super().__init__("; ".join(errors))
        self.status = status
        self.errors = list(errors)


def may_control_any(user: AbstractBaseUser) -> bool:
    return bool(user.is_staff or user.has_perm(CONTROL_PERMISSION))


def may_control(user: AbstractBaseUser, job: Job) -> bool:
    return job.str_user == user.get_username() or may_control_any(user)


def _authenticate(request: HttpRequest) -> AbstractBaseUser:
    header = request.headers.get("Authorization", "").strip()
    scheme, _, token = header.partition(" ")
    if not header:
        raise ApiError(401, "an API token is required: send 'Authorization: Bearer <token>'")
    if scheme.lower() != "bearer":
        # A token was sent, in another scheme (`Token cst_...`, or no scheme at all): say so,
        # rather than that no token came.
        what = f"the {scheme[:20]!r} scheme" if token.strip() else "no scheme"
        raise ApiError(401, f"the Authorization header uses {what}: send 'Authorization: Bearer <token>'")
    if not token.strip():
        raise ApiError(401, "the Authorization header has no token after 'Bearer'")
    user = user_for_token(token.strip())
    if user is None:
        raise ApiError(401, "the API token is not valid")
    return user


def json_body(request: HttpRequest, *, required: bool) -> dict[str, Any]:
    if not request.body.strip():
        if required:
            raise ApiError(400, "the request body is empty: send a JSON object")
        return {}
    try:
        return load_spec(request.body)
    except SpecError as exc:
        raise ApiError(400, *exc.errors) from None


def error_response(exc: ApiError, methods: tuple[str, ...] = ()) -> JsonResponse:
    response = JsonResponse({"errors": exc.errors}, status=exc.status)
    if exc.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="cuesched"'
    if exc.status == 405:
        response["Allow"] = ", ".join(methods)
    return response


def unexpected_error(request: HttpRequest, exc: BaseException) -> JsonResponse:
    """A bug or a lost database, as JSON: a client of the API never has to parse an HTML page.

    The traceback goes to the log, not to the client (it may show SQL or settings)."""
    if isinstance(exc, SuspiciousOperation):  # e.g. a body over DATA_UPLOAD_MAX_MEMORY_SIZE: the client's fault
        logger.warning("api: %s %s: refused: %s", request.method, request.path, exc)
        return error_response(ApiError(400, f"the request was refused: {exc}"))
    if isinstance(exc, DataError):  # a value PostgreSQL cannot hold (a NUL byte, out of range): bad input
        logger.warning("api: %s %s: refused: %s", request.method, request.path, exc)
        return error_response(ApiError(400, f"the request holds a value the database cannot store: {exc}"))
    if isinstance(exc, OperationalError):
        logger.warning("api: %s %s: the database is unavailable: %s", request.method, request.path, exc)
        return error_response(ApiError(503, "the database is unavailable: try again shortly"))
    logger.error("api: %s %s failed", request.method, request.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error ({type(exc).__name__}); the server log has the details"))


def api_view(*methods: str) -> Callable[[Callable[..., JsonResponse]], Callable[..., JsonResponse]]:
    """Method check, token authentication and the error format, around one view."""

    def deco(view: Callable[..., JsonResponse]) -> Callable[..., JsonResponse]:
        @csrf_exempt
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
            try:
                if request.method not in methods:
                    raise ApiError(405, f"use {' or '.join(methods)} here, not {request.method}")
                user = _authenticate(request)
                return view(request, user, *args, **kwargs)
            except ApiError as exc:
                return error_response(exc, methods)
            except Exception as exc:  # every failure answers JSON; the log has the traceback
                return unexpected_error(request, exc)

        wrapped.__name__ = view.__name__
        wrapped.__doc__ = view.__doc__
        wrapped.methods = methods  # type: ignore[attr-defined]  # read by the docs test (docs/api.md)
        return wrapped

    return deco


def _job(ref: str) -> Job:
    try:
        return resolve_job(ref)
    except JobNotFound as exc:
        raise ApiError(404, str(exc)) from None


@csrf_exempt
def not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """Any other path under /api/: a JSON 404 naming the routes (no token needed to learn them)."""
    return error_response(ApiError(404, f"no API route {request.path!r}; routes: {', '.join(ROUTES)}"))


@api_view("GET", "POST")
def jobs(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """/api/jobs: GET lists jobs, POST submits one."""
    if request.method == "POST":
        return submit(request, user)
    return list_jobs(request)


def submit(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """POST /api/jobs: validate and write a job spec."""
    spec = json_body(request, required=True)
    username = user.get_username()
    owner = spec.get("user")
    if isinstance(owner, str) and owner != username and not may_control_any(user):
        raise ApiError(403, f"user {username!r} may not submit jobs as {owner!r}")
    try:
        result = submit_job(spec, user=username, actor=user)
    except SpecError as exc:
        raise ApiError(400, *exc.errors) from None
    return JsonResponse({"job": result.job_id, "name": result.name, "frames": result.frames}, status=201)


@api_view("GET")
def job_detail(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/jobs/<id or name>: the job's state, counters and caps, per layer too."""
    job = _job(ref)
    return JsonResponse(describe_job(job))


# --- lists ----------------------------------------------------------------------------------


def _query(request: HttpRequest, filters: tuple[str, ...]) -> tuple[dict[str, str], int, int]:
    """The filters given, and the page (limit, offset); a 400 lists every bad parameter at once."""
    errors: list[str] = []
    known = (*filters, "limit", "offset")
    for key in sorted(set(request.GET) - set(known)):
        errors.append(f"unknown query parameter {key!r} (known: {', '.join(known)})")
    given = {key: request.GET[key] for key in filters if request.GET.get(key, "") != ""}

    def number(key: str, default: int, low: int, high: int) -> int:
        raw = request.GET.get(key, "")
        if raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            errors.append(f"{key} must be a whole number from {low} to {high}, not {raw!r}")
            return default
        return value

    limit = number("limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    offset = number("offset", 0, 0, 10**9)
    if errors:
        raise ApiError(400, *errors)
    return given, limit, offset


def _states(raw: str | None, known: tuple[str, ...], errors: list[str]) -> list[str] | None:
    """`state=RUNNING` or `state=WAITING,DEAD` (any case); None when not filtered."""
    if raw is None:
        return None
    states = [s.strip().upper() for s in raw.split(",") if s.strip()]
    bad = [s for s in states if s not in known]
    if bad or not states:
        errors.append(f"state: {', '.join(map(repr, bad)) or repr(raw)} is not a state (states: {', '.join(known)})")
    return states


def _page(
    request: HttpRequest, rows: QuerySet[Any], limit: int, offset: int, render: Callable[[Any], Any]
) -> JsonResponse:
    count = rows.count()
    results = [render(row) for row in rows[offset : offset + limit]]

    def link(to: int) -> str:
        params = request.GET.copy()
        params["limit"] = str(limit)
        params["offset"] = str(to)
        return f"{request.path}?{urlencode(sorted(params.items()))}"

    return JsonResponse(
        {
            "count": count,
            "limit": limit,
            "offset": offset,
            "next": link(offset + limit) if offset + limit < count else None,
            "previous": link(max(0, offset - limit)) if offset > 0 else None,
            "results": results,
        }
    )


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def list_jobs(request: HttpRequest) -> JsonResponse:
    """GET /api/jobs: jobs, newest first, filtered by show, state, user (exact) and name (part of it)."""
    given, limit, offset = _query(request, JOB_FILTERS)
    errors: list[str] = []
    states = _states(given.get("state"), JOB_STATES, errors)
    if errors:
        raise ApiError(400, *errors)
    rows = (
        Job.objects.select_related("resource", "stat")
        .annotate(killing=Count("procs", filter=Q(procs__ts_kill__isnull=False)))
        .order_by("-ts_started", "pk_job")
    )
    if "show" in given:
        rows = rows.filter(str_show=given["show"])
    if "user" in given:
        rows = rows.filter(str_user=given["user"])
    if "name" in given:
        rows = rows.filter(str_name__icontains=given["name"])
    if states is not None:
        rows = rows.filter(str_state__in=states)
    return _page(request, rows, limit, offset, summarize_job)


def _killing(job: Job) -> int:
    """Running frames of the job whose kill was asked for and whose end is not reported yet."""
    count = getattr(job, "killing", None)
    if count is None:
        count = Proc.objects.filter(job=job, ts_kill__isnull=False).count()
    return int(count)


def _job_fields(job: Job, resource: JobResource | None) -> dict[str, Any]:
    """What a job's list entry and its detail answer share, caps in whole cores.

    `killing` counts the frames still being killed: their procs stay booked (and their cores
    counted) until their hosts report the runs ended; a killed job reads FINISHED at once."""
    return {
        "job": job.pk_job,
        "name": job.str_name,
        "show": job.str_show,
        "user": job.str_user,
        "state": job.str_state,
        "killing": _killing(job),
        "paused": job.b_paused,
        "auto_eat": job.b_autoeat,
        "priority": resource.int_priority if resource else None,
        # Whole cores; -1 for unlimited, whichever way the database stores it (Cuebot's is 2**31-1).
        "max_cores": centicores_to_cores_cap(resource.int_max_cores) if resource else None,
        "max_gpus": gpus_cap(resource.int_max_gpus) if resource else None,
    }


def summarize_job(job: Job) -> dict[str, Any]:
    resource: JobResource | None = getattr(job, "resource", None)
    stat: JobStat | None = getattr(job, "stat", None)
    return {
        **_job_fields(job, resource),
        "frames": _counts(stat),
        "started": _time(job.ts_started),
        "stopped": _time(job.ts_stopped),
    }


@api_view("GET")
def job_layers(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/jobs/<id or name>/layers: the job's layers in dispatch order, with frame counts."""
    job = _job(ref)
    _, limit, offset = _query(request, ())
    stats = {s.layer_id: s for s in LayerStat.objects.filter(job=job)}
    rows = Layer.objects.filter(job=job).order_by("int_dispatch_order", "str_name", "pk_layer")
    return _page(request, rows, limit, offset, lambda layer: describe_layer(layer, stats.get(layer.pk_layer)))


@api_view("GET")
def job_frames(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/jobs/<id or name>/frames: the job's frames by layer then number, by layer and state."""
    job = _job(ref)
    given, limit, offset = _query(request, FRAME_FILTERS)
    errors: list[str] = []
    states = _states(given.get("state"), FRAME_STATES, errors)
    layer = None
    if "layer" in given:
        layer = Layer.objects.filter(job=job, str_name=given["layer"]).first()
        if layer is None:
            errors.append(f"layer: the job has no layer {given['layer']!r}")
    if errors:
        raise ApiError(400, *errors)
    rows = (
        Frame.objects.filter(job=job)
        .select_related("layer")
        .annotate(killing=Exists(Proc.objects.filter(frame=OuterRef("pk"), ts_kill__isnull=False)))
        .order_by("int_layer_order", "int_number", "pk_frame")
    )
    if layer is not None:
        rows = rows.filter(layer=layer)
    if states is not None:
        rows = rows.filter(str_state__in=states)
    return _page(request, rows, limit, offset, describe_frame)


def frame_log_of(job: Job, ref: str) -> tuple[Frame, frame_logs.FrameLog]:
    """The job's frame by id or name, and where its log is (ValueError: no such frame)."""
    frame = (
        Frame.objects.filter(job=job, pk=ref).select_related("layer").first()
        or Frame.objects.filter(job=job, str_name=ref).select_related("layer").first()
    )
    if frame is None:
        raise ValueError(f"the job has no frame {ref!r}")
    show = job.show.str_name  # the agent's log tree names the show as the show table does
    return frame, frame_logs.find_log(show, job.str_name, frame.layer.str_name, frame.int_number, frame.str_name)


def log_offset(raw: str | None) -> int:
    """`?offset=N`: a whole number of bytes, 0 or more (ValueError with the reason)."""
    if raw in (None, ""):
        return 0
    if not raw.isdigit():
        raise ValueError(f"offset must be a whole number of bytes, 0 or more (got {raw!r})")
    return int(raw)


def log_response(log: frame_logs.FrameLog, offset: int) -> HttpResponse:
    """The log from `offset` as text/plain; the headers say where the next read starts."""
    assert log.path is not None
    chunk = frame_logs.read_from(log.path, offset)
    response = HttpResponse(chunk.data, content_type="text/plain; charset=utf-8")
    response["X-Log-Offset"] = str(chunk.offset)
    response["X-Log-Next-Offset"] = str(chunk.end)
    response["X-Log-Size"] = str(chunk.size)
    response["Cache-Control"] = "no-store"
    return response


@api_view("GET")
def frame_log(request: HttpRequest, user: AbstractBaseUser, ref: str, frame_ref: str) -> HttpResponse:
    """GET /api/jobs/<job>/frames/<frame>/log[?offset=N]: the log as text/plain, from byte N."""
    job = _job(ref)
    try:
        offset = log_offset(request.GET.get("offset"))
        frame, log = frame_log_of(job, frame_ref)
    except ValueError as exc:
        status = 404 if "no frame" in str(exc) else 400
        raise ApiError(status, str(exc)) from None
    if log.path is None:
        places = ", ".join(str(p) for p in log.looked_at)
        raise ApiError(404, f"no log for frame {frame.str_name} (yet): looked at {places}")
    try:
        return log_response(log, offset)
    except OSError as exc:
        raise ApiError(404, f"the log of frame {frame.str_name} cannot be read here: {exc.strerror}") from None


def describe_frame(frame: Frame) -> dict[str, Any]:
    return {
        "frame": frame.pk_frame,
        "name": frame.str_name,
        "layer": frame.layer.str_name,
        "number": frame.int_number,
        "state": frame.str_state,
        # A RUNNING frame whose kill was asked for: its proc stays booked until its run has ended.
        "killing": bool(getattr(frame, "killing", False)),
        "exit_status": frame.int_exit_status,
        "retries": frame.int_retries,
        "host": frame.str_host,
        "started": _time(frame.ts_started),
        "stopped": _time(frame.ts_stopped),
    }


def _counts(stat: JobStat | LayerStat | None) -> dict[str, int]:
    if stat is None:
        return dict.fromkeys(COUNTS, 0)
    return {name: getattr(stat, f"int_{name}_count") for name in COUNTS}


def describe_layer(layer: Layer, stat: LayerStat | None) -> dict[str, Any]:
    return {
        "id": layer.pk_layer,
        "name": layer.str_name,
        "range": layer.str_range,
        "chunk_size": layer.int_chunk_size,
        "cores": layer.int_cores_min // 100 if layer.int_cores_min > 0 else layer.int_cores_min,
        "tags": layer.str_tags,
        "frames": _counts(stat),
    }


def describe_job(job: Job) -> dict[str, Any]:
    resource = JobResource.objects.filter(job=job).first()
    stats = {s.layer_id: s for s in LayerStat.objects.filter(job=job)}
    layers = [
        describe_layer(layer, stats.get(layer.pk_layer))
        for layer in Layer.objects.filter(job=job).order_by("int_dispatch_order", "str_name")
    ]
    return {
        **_job_fields(job, resource),
        "frames": _counts(JobStat.objects.filter(job=job).first()),
        "layers": layers,
    }


def _frames_args(body: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(body) - {"frames", "layer"})
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}: expected 'frames' and/or 'layer'")
    frames = body.get("frames")
    if frames is not None and (not isinstance(frames, list) or not all(isinstance(f, str) for f in frames)):
        raise ApiError(400, "frames must be a list of frame names or ids")
    layer = body.get("layer")
    if layer is not None and not isinstance(layer, str):
        raise ApiError(400, "layer must be a layer name")
    return {"frames": frames, "layer": layer}


def _one_field(body: dict[str, Any], key: str) -> Any:
    if set(body) != {key}:
        raise ApiError(400, f'send {{"{key}": <whole number>}}')
    return body[key]


DEPEND_FIELDS = {"on_job", "on_layer", "layer", "type"}


def _depend(job: Job, body: dict[str, Any], user: AbstractBaseUser, *, drop: bool) -> JobActionResult:
    """{"on_job": J, "on_layer": L, "layer": L, "type": "job" | "layer" | "frame"}: `on_job` required."""
    unknown = sorted(set(body) - DEPEND_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}: expected {', '.join(sorted(DEPEND_FIELDS))}")
    if not isinstance(body.get("on_job"), str) or not body["on_job"]:
        raise ApiError(400, '"on_job" (the job to wait for, by id or name) is required')
    for key in ("on_layer", "layer", "type"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise ApiError(400, f'"{key}" must be a string')
    run = drop_depend if drop else add_depend
    return run(
        job, body["on_job"], layer=body.get("layer"), on_layer=body.get("on_layer"), kind=body.get("type"), actor=user
    )


def _set_auto_eat(job: Job, body: dict[str, Any], user: AbstractBaseUser) -> JobActionResult:
    """{"auto_eat": true | false}: a failed frame is EATEN instead of retried (max retries 0 / 1)."""
    if set(body) != {"auto_eat"} or not isinstance(body["auto_eat"], bool):
        raise ApiError(400, 'send {"auto_eat": true} or {"auto_eat": false}')
    return set_auto_eat(job, body["auto_eat"], actor=user)


def _set_max_cores(job: Job, body: dict[str, Any], user: AbstractBaseUser) -> JobActionResult:
    """{"max_cores": N}; 0 books nothing and needs {"max_cores": 0, "confirm": true} (one meaning of 0)."""
    confirm = body.get("confirm", False)
    if not isinstance(confirm, bool):
        raise ApiError(400, '"confirm" must be true or false')
    fields = {k: v for k, v in body.items() if k != "confirm"}
    return set_max_cores(job, _one_field(fields, "max_cores"), actor=user, confirm_stop=confirm)


ACTIONS: dict[str, Callable[[Job, dict[str, Any], AbstractBaseUser], JobActionResult]] = {
    "pause": lambda job, body, user: pause_job(job, actor=user),
    "resume": lambda job, body, user: resume_job(job, actor=user),
    "kill": lambda job, body, user: kill_job(job, actor=user),
    "retry": lambda job, body, user: retry_frames(job, actor=user, **_frames_args(body)),
    "eat": lambda job, body, user: eat_frames(job, actor=user, **_frames_args(body)),
    "priority": lambda job, body, user: set_priority(job, _one_field(body, "priority"), actor=user),
    "max-cores": lambda job, body, user: _set_max_cores(job, body, user),
    "auto-eat": lambda job, body, user: _set_auto_eat(job, body, user),
    "depend": lambda job, body, user: _depend(job, body, user, drop=False),
    "undepend": lambda job, body, user: _depend(job, body, user, drop=True),
}
_NO_BODY = {"pause", "resume", "kill"}
_BODY_REQUIRED = {"priority", "max-cores", "auto-eat", "depend", "undepend"}


@api_view("POST")
def job_action(request: HttpRequest, user: AbstractBaseUser, ref: str, action: str) -> JsonResponse:
    """POST /api/jobs/<id or name>/<action>: one control, if the user may control the job."""
    run = ACTIONS.get(action)
    if run is None:
        raise ApiError(404, f"unknown action {action!r} (actions: {', '.join(ACTIONS)})")
    body = json_body(request, required=action in _BODY_REQUIRED)
    if action in _NO_BODY and body:
        raise ApiError(400, f"{action} takes no fields")
    job = _job(ref)
    if not may_control(user, job):
        raise ApiError(403, f"user {user.get_username()!r} may not {action} job {job.str_name!r} of {job.str_user!r}")
    try:
        result = run(job, body, user)
    except ValidationError as exc:
        # Say how to confirm, in this interface's words (the action's message is the CLI's too).
        confirm = getattr(exc, "code", None) == "confirm_stop"
        hint = ['send {"max_cores": 0, "confirm": true} to confirm'] if confirm else []
        raise ApiError(400, *exc.messages, *hint) from None
    return JsonResponse({"job": result.job_id, "action": action, "changed": result.changed, **result.detail})


# --- licence limits -----------------------------------------------------------------------

LIMIT_FIELDS = {"name", "max", "host_limit"}


def _limit_row(ref: str) -> dict[str, Any]:
    for row in cap_actions.limit_use():
        if ref in (row["id"], row["name"]):
            return row
    raise ApiError(404, f"no limit {ref!r}")


def _may_edit_limits(user: AbstractBaseUser) -> None:
    if not (user.is_superuser or user.has_perm("ops.edit_caps")):  # type: ignore[attr-defined]
        raise ApiError(403, f"user {user.get_username()!r} may not change licence limits (needs ops.edit_caps)")


@api_view("GET", "POST")
def limits(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """GET /api/limits: every limit and its use; POST: create one (audited like a cap change)."""
    if request.method == "GET":
        return JsonResponse({"limits": cap_actions.limit_use()})
    _may_edit_limits(user)
    body = json_body(request, required=True)
    unknown = set(body) - LIMIT_FIELDS
    if unknown:
        raise ApiError(400, f"unknown fields {sorted(unknown)} (fields: {sorted(LIMIT_FIELDS)})")
    try:
        result = cap_actions.create_limit(
            body.get("name"), body.get("max", -1), host_limit=body.get("host_limit", False), actor=user
        )
    except ValidationError as exc:
        raise ApiError(400, *exc.messages) from None
    return JsonResponse(_limit_row(result.target), status=201)


@api_view("GET", "POST")
def limit_detail(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/limits/<id or name>: one limit; POST {"max"} / {"host_limit"}: change it."""
    row = _limit_row(ref)
    if request.method == "GET":
        return JsonResponse(row)
    _may_edit_limits(user)
    body = json_body(request, required=True)
    if not body or set(body) - {"max", "host_limit"}:
        raise ApiError(400, 'send {"max": <whole number, -1 unlimited>} and/or {"host_limit": true | false}')
    try:
        result = cap_actions.set_limit(
            row["id"], max_value=body.get("max"), host_limit=body.get("host_limit"), actor=user
        )
    except ValidationError as exc:
        raise ApiError(400, *exc.messages) from None
    except LimitRecord.DoesNotExist:
        raise ApiError(404, f"no limit {ref!r}") from None
    return JsonResponse({**_limit_row(row["id"]), "changed": result.changed, "warnings": result.warnings})
