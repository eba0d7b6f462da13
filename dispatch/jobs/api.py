"""The JSON API: submit jobs and control them with a per-user bearer token (plain Django views).

Routes (under /api/, see dispatch/jobs/urls.py):

| method | path | body | answer |
|---|---|---|---|
| POST | /api/jobs | a job spec (dispatch.jobs.spec) | 201 {"job": id, "name": ..., "frames": n} |
| GET | /api/jobs/<id or name> | | 200 the job: state, counts, caps, layers |
| POST | /api/jobs/<id or name>/pause, resume, kill | none or {} | 200 {"job", "action", "changed", ...} |
| POST | /api/jobs/<id or name>/retry, eat | none, or {"frames": [names or ids], "layer": name} | 200 |
| POST | /api/jobs/<id or name>/priority | {"priority": n} | 200 |
| POST | /api/jobs/<id or name>/max-cores | {"max_cores": whole cores, -1 unlimited} | 200 |
| GET | /api/limits | | 200 {"limits": [{"id", "name", "max", "host_limit", "running", ...}]} |
| POST | /api/limits | {"name": ..., "max": n (-1 unlimited), "host_limit": false} | 201 the limit |
| GET | /api/limits/<id or name> | | 200 the limit and its use |
| POST | /api/limits/<id or name> | {"max": n} and/or {"host_limit": bool} | 200 the limit, "changed", "warnings" |

Every error is `{"errors": ["...", ...]}`: 400 bad body or spec (all reasons), 401 no valid
token (`Authorization: Bearer <token>`, made by `manage.py api_token USER`), 403 not allowed,
404 no such job or action, 405 wrong method. Nothing is written on any error.

Who may do what: any active user with a token may submit (as themselves; as another user
only with the rights below) and read jobs; a user controls their own jobs
(job.str_user == username); staff and holders of `dispatch.change_job` control any job.
Licence limits are read by any token user and created or changed by holders of
`ops.edit_caps` (the console's cap editors): a limit is a cap of every show.

Only token authentication is accepted (session cookies are ignored), so the views are
CSRF-exempt: a bearer token is never sent by a browser on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from accounting import actions as cap_actions
from dispatch.jobs import actions
from dispatch.jobs.spec import SpecError, load_spec
from dispatch.jobs.tokens import user_for_token
from dispatch.models import Job, JobResource, JobStat, Layer, LayerStat, LimitRecord

CONTROL_PERMISSION = "dispatch.change_job"
COUNTS = ("waiting", "running", "dead", "depend", "eaten", "succeeded", "total")


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
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "an API token is required: send 'Authorization: Bearer <token>'")
    user = user_for_token(token.strip())
    if user is None:
        raise ApiError(401, "the API token is not valid")
    return user


def _body(request: HttpRequest, *, required: bool) -> dict[str, Any]:
    if not request.body.strip():
        if required:
            raise ApiError(400, "the request body is empty: send a JSON object")
        return {}
    try:
        return load_spec(request.body)
    except SpecError as exc:
        raise ApiError(400, *exc.errors) from None


def _api(*methods: str) -> Callable[[Callable[..., JsonResponse]], Callable[..., JsonResponse]]:
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
                response = JsonResponse({"errors": exc.errors}, status=exc.status)
                if exc.status == 401:
                    response["WWW-Authenticate"] = 'Bearer realm="cuesched"'
                if exc.status == 405:
                    response["Allow"] = ", ".join(methods)
                return response

        wrapped.__name__ = view.__name__
        wrapped.__doc__ = view.__doc__
        return wrapped

    return deco


def _job(ref: str) -> Job:
    try:
        return actions.resolve_job(ref)
    except actions.JobNotFound as exc:
        raise ApiError(404, str(exc)) from None


@_api("POST")
def submit(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """POST /api/jobs: validate and write a job spec."""
    spec = _body(request, required=True)
    username = user.get_username()
    owner = spec.get("user")
    if isinstance(owner, str) and owner != username and not may_control_any(user):
        raise ApiError(403, f"user {username!r} may not submit jobs as {owner!r}")
    try:
        result = actions.submit_job(spec, user=username, actor=user)
    except SpecError as exc:
        raise ApiError(400, *exc.errors) from None
    return JsonResponse({"job": result.job_id, "name": result.name, "frames": result.frames}, status=201)


@_api("GET")
def job_detail(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/jobs/<id or name>: the job's state, counters and caps, per layer too."""
    job = _job(ref)
    return JsonResponse(describe_job(job))


def _counts(stat: JobStat | LayerStat | None) -> dict[str, int]:
    if stat is None:
        return dict.fromkeys(COUNTS, 0)
    return {name: getattr(stat, f"int_{name}_count") for name in COUNTS}


def describe_job(job: Job) -> dict[str, Any]:
    resource = JobResource.objects.filter(job=job).first()
    stats = {s.layer_id: s for s in LayerStat.objects.filter(job=job)}
    layers = [
        {
            "id": layer.pk_layer,
            "name": layer.str_name,
            "range": layer.str_range,
            "chunk_size": layer.int_chunk_size,
            "cores": layer.int_cores_min // 100 if layer.int_cores_min > 0 else layer.int_cores_min,
            "tags": layer.str_tags,
            "frames": _counts(stats.get(layer.pk_layer)),
        }
        for layer in Layer.objects.filter(job=job).order_by("int_dispatch_order", "str_name")
    ]
    max_cores = resource.int_max_cores if resource else None
    return {
        "job": job.pk_job,
        "name": job.str_name,
        "show": job.str_show,
        "user": job.str_user,
        "state": job.str_state,
        "paused": job.b_paused,
        "priority": resource.int_priority if resource else None,
        "max_cores": (max_cores // 100 if max_cores > 0 else -1) if max_cores is not None else None,
        "max_gpus": resource.int_max_gpus if resource else None,
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


ACTIONS: dict[str, Callable[[Job, dict[str, Any], AbstractBaseUser], actions.JobActionResult]] = {
    "pause": lambda job, body, user: actions.pause_job(job, actor=user),
    "resume": lambda job, body, user: actions.resume_job(job, actor=user),
    "kill": lambda job, body, user: actions.kill_job(job, actor=user),
    "retry": lambda job, body, user: actions.retry_frames(job, actor=user, **_frames_args(body)),
    "eat": lambda job, body, user: actions.eat_frames(job, actor=user, **_frames_args(body)),
    "priority": lambda job, body, user: actions.set_priority(job, _one_field(body, "priority"), actor=user),
    "max-cores": lambda job, body, user: actions.set_max_cores(job, _one_field(body, "max_cores"), actor=user),
}
_NO_BODY = {"pause", "resume", "kill"}
_BODY_REQUIRED = {"priority", "max-cores"}


@_api("POST")
def job_action(request: HttpRequest, user: AbstractBaseUser, ref: str, action: str) -> JsonResponse:
    """POST /api/jobs/<id or name>/<action>: one control, if the user may control the job."""
    run = ACTIONS.get(action)
    if run is None:
        raise ApiError(404, f"unknown action {action!r} (actions: {', '.join(ACTIONS)})")
    body = _body(request, required=action in _BODY_REQUIRED)
    if action in _NO_BODY and body:
        raise ApiError(400, f"{action} takes no fields")
    job = _job(ref)
    if not may_control(user, job):
        raise ApiError(403, f"user {user.get_username()!r} may not {action} job {job.str_name!r} of {job.str_user!r}")
    try:
        result = run(job, body, user)
    except ValidationError as exc:
        raise ApiError(400, *exc.messages) from None
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


@_api("GET", "POST")
def limits(request: HttpRequest, user: AbstractBaseUser) -> JsonResponse:
    """GET /api/limits: every limit and its use; POST: create one (audited like a cap change)."""
    if request.method == "GET":
        return JsonResponse({"limits": cap_actions.limit_use()})
    _may_edit_limits(user)
    body = _body(request, required=True)
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


@_api("GET", "POST")
def limit_detail(request: HttpRequest, user: AbstractBaseUser, ref: str) -> JsonResponse:
    """GET /api/limits/<id or name>: one limit; POST {"max"} / {"host_limit"}: change it."""
    row = _limit_row(ref)
    if request.method == "GET":
        return JsonResponse(row)
    _may_edit_limits(user)
    body = _body(request, required=True)
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
