"""The job spec a pipeline tool writes (JSON), and its validation into a plan the submit writes.

    {
      "show": "demo", "name": "demo-sh010-light_v3", "user": "alice",
      "folder": "lighting", "facility": "local", "dept": "lighting", "shot": "sh010",
      "priority": 100, "max_retries": 3, "os": "linux", "max_cores": 200, "max_gpus": 4,
      "paused": false,
      "layers": [
        {"name": "sim", "command": "sim -s #FRAME_START# -e #FRAME_END#", "range": "1-100",
         "chunk_size": 10, "cores": 4, "memory": "8GB"},
        {"name": "render", "command": "render -f #IFRAME# #JOB#", "range": "1-100x1",
         "cores": 2, "memory": "16GB", "gpus": 1, "gpu_memory": "8GB", "tags": ["gpu"],
         "threadable": true, "depends": [{"layer": "sim", "type": "frame"}]},
        {"name": "movie", "command": "make_movie", "range": "1", "memory": "512MB",
         "depends": [{"layer": "render", "type": "layer"}]}
      ]
    }

Required: `show`, `name`, `layers`, and per layer `name`, `command`, `range`. Everything else
has a default:

* `user`: the submitter (the API's token user, the command's `--user` or login name);
* `folder`: the show's default folder (b_default, else its only top-level folder). A folder
  is never created here: a misspelt name would otherwise start an uncapped folder that
  escapes its group's caps. A nested folder may be named by path (`"lighting/hero"`);
* `facility`: the default facility (b_default), else the only one; `dept`: the folder's,
  else the default one, else the only one;
* `priority`: the folder's job priority if it sets one, else 1; `max_retries`: 3;
* `paused` and `auto_eat`: false. An auto-eat job's failed frame is EATEN instead of retried or
  DEAD, which releases what waits for it (dispatch.engine.completion); its `max_retries` is kept
  as given (Cuebot's launch zeroes nothing either), and counts for nothing while auto-eat is on;
* `max_cores` (whole cores) / `max_gpus`: the folder's job caps if it sets them, else the
  show's `int_default_max_cores` / `int_default_max_gpus`; -1 means unlimited;
* layer `chunk_size` 1, `cores` 1 (whole cores; 0 the whole host, -N all but N; a threadable
  frame may book more, its memory's share of the host: dispatch.engine.sizing), `max_cores` 0
  (none), `memory` "4GB", `gpus` 0,
  `gpu_memory` "0GB", `threadable` true, `depends` none;
* layer `tags` (a list, or one string joined by `|`): the tags of the allocations the show
  subscribes to in the job's facility, so the layer can run on any host the show may use;
* layer `services` (a list of service names, first that exists wins): none. The layer's unset
  fields (cores, memory, GPUs, GPU memory, tags, threadable, timeouts) come from the show's
  override of that service, else the service, else Cuebot's `default` service, as Cuebot's own
  submit sets them (dispatch.jobs.services); an explicit field wins. A layer naming no service
  gets the `default` service too, which cuesched seeds with the defaults above (no tags: the
  allocations' tags); they are also the fallback of a database without a `default` row;
* layer `timeout` and `timeout_llu` (whole minutes, 0 none): the service's, else 0.
  A frame running longer than `timeout`, or whose log is silent longer than
  `timeout_llu`, is killed and DEAD (not retried; EATEN in an auto-eat job);
* layer `limits` (a list of licence limit names, e.g. `["arnold"]`): none. Every frame of the
  layer holds one of each while it runs (one per host for a host limit); a frame starts only
  when every limit has room. Each name must be an existing limit: none is created here.

Memory takes a unit (KB, MB, GB, TB, binary: 1GB = 1024 MB; "1.5GB" is fine): a bare number
is an error, since MB-versus-KB mistakes are the costliest kind. A dependency is
`{"layer": NAME, "type": "frame" | "layer"}`: `frame` (frame by frame) lets frame N start once
the other layer's frame N is done; `layer` waits for the whole other layer (dispatch.models.depends).
With `"job": NAME` the layer is another job's (`{"job": J, "layer": L, "type": "frame" | "layer"}`),
and `{"job": J, "type": "job"}` waits for the whole job J (Cuebot's LAYER_ON_JOB). J is looked up
by name, in any state: an unknown job or layer is an error; a dependency on a job already FINISHED
(or a layer or frame already done) is written satisfied and holds nothing.

Validation reports every error at once, each naming its field, and writes nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from dispatch.jobs.frameset import Chunk, FrameRangeError, chunk_frames, parse_frames
from dispatch.jobs.plan import DependPlan, JobPlan, LayerPlan, SpecError
from dispatch.jobs.spec_lookup import (
    alloc_tags,
    apply_service_defaults,
    one_by_name,
    resolve_folder,
    resolve_limits,
    resolve_other_jobs,
)
from dispatch.models import Dept, Facility, Job, Show
from dispatch.models.depends import FRAME_BY_FRAME, LAYER_ON_JOB, LAYER_ON_LAYER

CENTICORES_PER_CORE = 100
UNLIMITED = -1
KB_PER_UNIT = {"K": 1, "M": 1024, "G": 1024**2, "T": 1024**3}
MAX_MEMORY_KB = 1024**4  # 1 PB: anything larger is a typo
MAX_FRAMES_PER_JOB = 200_000  # frame rows (after chunking) one submission may write
MAX_LAYERS = 500
MAX_CORES = 100_000
DEFAULT_MEMORY_KB = 4 * 1024**2
DEFAULT_MAX_RETRIES = 3

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
USER_RE = re.compile(r"^[A-Za-z0-9_.@+\-]+$")
TAG_RE = re.compile(r"^[^|\s]+$")
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])(?:i?B)?\s*$", re.IGNORECASE)

DEPEND_KINDS = {"frame": FRAME_BY_FRAME, "layer": LAYER_ON_LAYER, "job": LAYER_ON_JOB}

JOB_KEYS = {
    "show": "show name (required)",
    "name": "job name (required, unique)",
    "layers": "list of layers (required)",
    "user": "owner",
    "folder": "folder (group) name or path",
    "facility": "facility name",
    "dept": "department name",
    "shot": "shot",
    "priority": "dispatch priority",
    "max_retries": "retries per frame",
    "os": "required host OS",
    "max_cores": "job core cap (whole cores, -1 unlimited)",
    "max_gpus": "job GPU cap (-1 unlimited)",
    "paused": "submit paused",
    "auto_eat": "eat failed frames instead of retrying them (Cuebot's auto-eat)",
    "email": "who to mail about the job (recorded; cuesched sends no mail)",
    "env": "environment variables of every frame (name -> string)",
    "uid": "the owner's numeric user id (RQD's RunFrame.uid)",
}
LAYER_KEYS = {
    "name",
    "type",
    "command",
    "range",
    "chunk_size",
    "cores",
    "max_cores",
    "memory",
    "gpus",
    "gpu_memory",
    "tags",
    "threadable",
    "depends",
    "limits",
    "services",
    "timeout",
    "timeout_llu",
    "env",
}
# Cuebot's LayerType a layer may be submitted as; a Post layer is a job of its own in Cuebot.
LAYER_TYPES = ("Render", "Util")
EMAIL_RE = re.compile(r"^[^\s@]+@[^\s@]+$")
SERVICE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,36}$")  # Cuebot's service.str_name is VARCHAR(36)
MAX_SERVICES_LEN = 128  # layer.str_services
# The layer fields a Cuebot service fills in when the spec leaves them out.
SERVICE_FIELDS = ("cores", "memory", "gpus", "gpu_memory", "tags", "threadable", "timeout", "timeout_llu")
# Timeouts in whole minutes, as Cuebot's job spec (<timeout>, <timeout_llu>); 0 is none. At most
# 30 days: a frame that may run longer has no timeout worth the name.
MAX_TIMEOUT_MINUTES = 30 * 24 * 60
DEPEND_KEYS = {"job", "layer", "type"}
# `env` (job and layer): Cuebot's job_env / layer_env hold keys and values of up to 2048
# characters; a name is a POSIX environment variable name, and one map's text stays well under
# the kernel's limits for a process's environment.
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ENV_VARS = 256
MAX_ENV_NAME = 256
MAX_ENV_VALUE = 2048
MAX_ENV_BYTES = 64 * 1024
MAX_UID = 2**31 - 1  # RunFrame.uid is an int32


def load_spec(text: str | bytes) -> dict[str, Any]:
    """Decode a spec document; a SpecError says where the JSON is broken."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(["the spec is not UTF-8 text"]) from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError([f"the spec is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"]) from None
    if not isinstance(spec, dict):
        raise SpecError([f"the spec must be a JSON object, not {type(spec).__name__}"])
    return spec


def parse_memory(value: Any, *, allow_zero: bool = False) -> int:
    """'4GB' / '512MB' / '1.5G' / '2048KB' -> KB (binary units, rounded up). ValueError says why."""
    if isinstance(value, bool) or isinstance(value, int | float):
        raise ValueError(f"{value!r} has no unit: write e.g. '4GB' or '512MB'")
    if not isinstance(value, str):
        raise ValueError(f"must be a string with a unit such as '4GB', not {value!r}")
    m = _MEMORY_RE.match(value)
    if m is None:
        if re.fullmatch(r"\s*\d+(\.\d+)?\s*", value):
            raise ValueError(f"{value!r} has no unit: write e.g. '4GB' or '512MB'")
        raise ValueError(f"{value!r} is not a memory size: write a number and KB, MB, GB or TB, e.g. '4GB'")
    kb = math.ceil(float(m.group(1)) * KB_PER_UNIT[m.group(2).upper()])
    if kb <= 0 and not allow_zero:
        raise ValueError(f"{value!r} must be more than 0")
    if kb > MAX_MEMORY_KB:
        raise ValueError(f"{value!r} is more than 1 PB")
    return kb


# --- field readers: each appends its message to `errors` and returns a value or None -------------


class _Reader:
    def __init__(self, data: dict[str, Any], where: str, errors: list[str]) -> None:
        self.data = data
        self.where = where
        self.errors = errors

    def error(self, key: str | None, message: str) -> None:
        self.errors.append(f"{self.where}{'.' + key if key else ''}: {message}")

    def text(
        self, key: str, *, required: bool = False, max_len: int = 4000, pattern: re.Pattern[str] | None = None
    ) -> str | None:
        value = self.data.get(key)
        if value is None:
            if required:
                self.error(key, "is required")
            return None
        if not isinstance(value, str):
            self.error(key, f"must be a string, not {value!r}")
            return None
        if not value.strip():
            self.error(key, "must not be empty")
            return None
        if len(value) > max_len:
            self.error(key, f"is longer than {max_len} characters")
            return None
        if pattern is not None and not pattern.match(value):
            self.error(key, f"{value!r} may only contain letters, digits and {_allowed(pattern)}")
            return None
        return value

    def integer(self, key: str, default: int | None, *, low: int, high: int, hint: str = "") -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(key, f"must be a whole number, not {value!r}")
            return None
        if not low <= value <= high:
            self.error(key, hint or f"must be between {low} and {high}, not {value}")
            return None
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.error(key, f"must be true or false, not {value!r}")
            return default
        return value

    def unknown_keys(self, allowed: set[str] | dict[str, str]) -> None:
        for key in sorted(set(self.data) - set(allowed)):
            self.error(None, f"unknown field {key!r} (known: {', '.join(sorted(allowed))})")


def _allowed(pattern: re.Pattern[str]) -> str:
    return {NAME_RE.pattern: "_ . -", USER_RE.pattern: "_ . @ + -"}.get(pattern.pattern, "no spaces")


def _cores(reader: _Reader) -> int | None:
    """A layer's `cores`: N >= 1 whole cores, 0 the whole host, -N all but N of the host's cores.

    A fraction is refused, not rounded: cuesched books whole cores, and a silent round would
    charge the show something the spec did not say (dispatch.engine.sizing books the rest).
    """
    value = reader.data.get("cores")
    if isinstance(value, float) and not value.is_integer():
        reader.error(
            "cores",
            f"{value!r} is a fraction of a core, which cuesched cannot book: give whole cores "
            "(N >= 1, 0 for the whole host, -N for all but N of the host's cores)",
        )
        return None
    return reader.integer(
        "cores",
        1,
        low=-(MAX_CORES - 1),
        high=MAX_CORES,
        hint=f"must be a whole number of cores from 1 to {MAX_CORES}, 0 (the whole host) or -N (all but N)",
    )


def _cap(reader: _Reader, key: str, *, centi: bool) -> int | None:
    """A job cap: -1 (unlimited) or >= 1; returns what the column stores."""
    value = reader.integer(key, None, low=-1, high=10**7, hint="must be -1 (unlimited) or a number >= 1")
    if value is None:
        return None
    if value == 0:
        reader.error(key, "must be -1 (unlimited) or a number >= 1; 0 would book nothing, so the job would never run")
        return None
    if value < 0:
        return UNLIMITED
    return value * CENTICORES_PER_CORE if centi else value


# --- the layers -----------------------------------------------------------------------------


@dataclass
class _LayerDraft:
    """What the dependency check needs of a layer, whether or not its other fields are valid:
    the graph is checked in the same pass as the fields, so one submission lists every error."""

    name: str | None
    referenced: list[str]  # every layer its depends name, valid entry or not
    plan: LayerPlan | None  # None when the layer has errors of its own


def _plan_layer(data: Any, index: int, errors: list[str]) -> _LayerDraft:
    if not isinstance(data, dict):
        errors.append(f"layers[{index}]: must be an object, not {data!r}")
        return _LayerDraft(name=None, referenced=[], plan=None)
    name = data.get("name")
    where = f"layer {name!r}" if isinstance(name, str) and name.strip() else f"layers[{index}]"
    r = _Reader(data, where, errors)
    before = len(errors)
    r.unknown_keys(LAYER_KEYS)
    name = r.text("name", required=True, max_len=200, pattern=NAME_RE)
    command = r.text("command", required=True)
    range_spec = r.text("range", required=True)
    chunk_size = r.integer("chunk_size", 1, low=1, high=1_000_000, hint="must be a whole number >= 1")
    cores = _cores(r)
    max_cores = r.integer(
        "max_cores", None, low=0, high=MAX_CORES, hint=f"must be 0 (no max) or a whole number of cores to {MAX_CORES}"
    )
    if cores is not None and cores > 0 and max_cores and max_cores < cores:
        r.error("max_cores", f"is {max_cores}, below the layer's cores ({cores}): a frame books at least `cores`")
    gpus = r.integer("gpus", 0, low=0, high=1000)
    threadable = r.flag("threadable", True)
    memory = _memory(r, "memory", DEFAULT_MEMORY_KB, allow_zero=False)
    gpu_memory = _memory(r, "gpu_memory", 0, allow_zero=True)
    tags = _tags(r)
    depends, referenced = _depends(r)
    limits = _limits(r)
    services = _services(r)
    timeout_hint = f"must be a whole number of minutes from 0 (none) to {MAX_TIMEOUT_MINUTES}"
    timeout = r.integer("timeout", 0, low=0, high=MAX_TIMEOUT_MINUTES, hint=timeout_hint)
    timeout_llu = r.integer("timeout_llu", 0, low=0, high=MAX_TIMEOUT_MINUTES, hint=timeout_hint)
    layer_type = data.get("type", "Render")
    if layer_type not in LAYER_TYPES:
        r.error("type", f"must be one of {', '.join(LAYER_TYPES)}, not {layer_type!r}")
    env = _env(r)
    chunks: list[Chunk] = []
    if range_spec is not None:
        try:
            frames = parse_frames(range_spec)
        except FrameRangeError as exc:
            r.error("range", str(exc))
        else:
            if chunk_size is not None:
                chunks = chunk_frames(frames, chunk_size)
    if len(errors) > before:
        # A name with errors of its own is still the name its dependents use: not "unknown" too.
        raw_name = data.get("name")
        draft_name = raw_name if isinstance(raw_name, str) and raw_name.strip() else None
        return _LayerDraft(name=draft_name, referenced=referenced, plan=None)
    assert name and command and range_spec and chunk_size and cores is not None and memory is not None
    assert gpus is not None and gpu_memory is not None and tags is not None and depends is not None
    assert limits is not None and services is not None and timeout is not None and timeout_llu is not None
    assert env is not None
    plan = LayerPlan(
        name=name,
        command=command,
        range=range_spec.strip(),
        chunk_size=chunk_size,
        cores=cores * CENTICORES_PER_CORE,
        cores_max=(max_cores or 0) * CENTICORES_PER_CORE,
        memory=memory,
        gpus=gpus,
        gpu_memory=gpu_memory,
        tags=tags,
        threadable=threadable,
        depends=depends,
        chunks=chunks,
        order=index + 1,
        limits=limits,
        services=services,
        timeout=timeout,
        timeout_llu=timeout_llu,
        type=layer_type,
        env=env,
        explicit=frozenset(k for k in (*SERVICE_FIELDS, "max_cores") if data.get(k) is not None),
    )
    return _LayerDraft(name=name, referenced=referenced, plan=plan)


def _env(r: _Reader) -> dict[str, str] | None:
    """`env`: an object of environment variable names to string values (None: it has errors)."""
    value = r.data.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        r.error("env", f"must be an object of variable names to strings, not {value!r}")
        return None
    before = len(r.errors)
    if len(value) > MAX_ENV_VARS:
        r.error("env", f"has {len(value)} variables; at most {MAX_ENV_VARS}")
    size = 0
    for key, val in value.items():
        if len(key) > MAX_ENV_NAME:
            r.error("env", f"variable name {key[:40]!r}... is longer than {MAX_ENV_NAME} characters")
        elif not ENV_NAME_RE.match(key):
            r.error(
                "env",
                f"{key!r} is not an environment variable name (a letter or _, then letters, digits and _)",
            )
        if not isinstance(val, str):
            r.error(f"env.{key}", f'must be a string, not {val!r} (write numbers and flags quoted, e.g. "1")')
            continue
        if len(val) > MAX_ENV_VALUE:
            r.error(f"env.{key}", f"is longer than {MAX_ENV_VALUE} characters")
        elif "\x00" in val:
            r.error(f"env.{key}", "contains a NUL character, which no environment can hold")
        size += len(key.encode()) + len(val.encode()) + 2
    if size > MAX_ENV_BYTES:
        r.error("env", f"holds {size} bytes of names and values; at most {MAX_ENV_BYTES}")
    return None if len(r.errors) > before else dict(value)


def _limits(r: _Reader) -> list[str] | None:
    """Names of licence limits every frame of the layer holds while it runs (each must exist)."""
    value = r.data.get("limits")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        r.error("limits", f"must be a list of limit names, not {value!r}")
        return None
    out: list[str] = []
    for item in value:
        name = item.strip()
        if len(name) > 255:
            r.error("limits", f"{name[:40]!r}... is longer than 255 characters")
            return None
        if name not in out:
            out.append(name)
    return out


def _services(r: _Reader) -> list[str] | None:
    """Service names in order, repeats dropped (Cuebot's JobSpec drops them too)."""
    value = r.data.get("services")
    if value is None:
        return []
    items = value if isinstance(value, list) else None
    if not items or not all(isinstance(v, str) and SERVICE_RE.match(v) for v in items):
        r.error("services", f"must be a non-empty list of service names (1-36 of letters, digits, _.-), not {value!r}")
        return None
    names = list(dict.fromkeys(items))
    if len(",".join(names)) > MAX_SERVICES_LEN:
        r.error("services", f"are longer than {MAX_SERVICES_LEN} characters joined")
        return None
    return names


def _memory(r: _Reader, key: str, default: int, *, allow_zero: bool) -> int | None:
    value = r.data.get(key)
    if value is None:
        return default
    try:
        return parse_memory(value, allow_zero=allow_zero)
    except ValueError as exc:
        r.error(key, str(exc))
        return None


def _tags(r: _Reader) -> list[str] | None:
    """[] means 'not given' (the submit fills in the show's allocation tags)."""
    value = r.data.get("tags")
    if value is None:
        return []
    if isinstance(value, str):
        items: list[Any] = [t.strip() for t in value.split("|")]
    elif isinstance(value, list):
        items = value
    else:
        r.error("tags", f"must be a list of tags or a string of tags joined by '|', not {value!r}")
        return None
    tags: list[str] = []
    for item in items:
        if not isinstance(item, str) or not TAG_RE.match(item) or len(item) > 45:
            r.error("tags", f"{item!r} is not a tag (1-45 characters, no spaces or '|')")
            return None
        if item not in tags:
            tags.append(item)
    if not tags:
        r.error("tags", "is empty: leave it out to use the show's allocation tags")
        return None
    return tags


DEPEND_FORM = '{"layer": NAME, "type": "frame" | "layer"} or {"job": NAME, ["layer": NAME,] "type": ...}'


def _depends(r: _Reader) -> tuple[list[DependPlan] | None, list[str]]:
    """The valid dependencies (None if any entry is bad), and every layer name of this job the
    entries give, bad entries included, so an unknown layer is reported together with the entry's
    other errors. An entry naming another `job` is checked against the database by `plan_job`."""
    value = r.data.get("depends")
    if value is None:
        return [], []
    if not isinstance(value, list):
        r.error("depends", f"must be a list of {DEPEND_FORM}, not {value!r}")
        return None, []
    out: list[DependPlan] = []
    referenced: list[str] = []
    ok = True
    for i, item in enumerate(value):
        d = _Reader(item if isinstance(item, dict) else {}, f"{r.where}.depends[{i}]", r.errors)
        if not isinstance(item, dict):
            d.error(None, f"must be {DEPEND_FORM}, not {item!r}")
            ok = False
            continue
        d.unknown_keys(DEPEND_KEYS)
        job = d.text("job", max_len=255) if "job" in item else None
        kind = item.get("type")
        whole_job = kind == "job"
        if whole_job and "layer" in item:
            d.error("layer", 'a "type": "job" dependency waits for the whole job: leave "layer" out, or use "layer"')
            on = None
            ok = False
        else:
            on = None if whole_job else d.text("layer", required=True, max_len=200)
        if on is not None and "job" not in item and on not in referenced:
            referenced.append(on)
        if kind not in DEPEND_KINDS:
            also = (
                ", 'layer' (the whole layer) or 'job' (the whole job)"
                if "job" in item
                else " or 'layer' (the whole layer)"
            )
            d.error("type", f"must be 'frame' (frame by frame){also}, not {kind!r}")
            ok = False
            continue
        if whole_job and "job" not in item:
            d.error("job", 'is required with "type": "job" (the job to wait for)')
            ok = False
            continue
        if "job" in item and job is None:
            ok = False
            continue
        if on is None and not whole_job:
            ok = False
            continue
        plan = DependPlan(on=on, kind=DEPEND_KINDS[kind], job=job)
        if any(p.on == on and p.job == job for p in out):
            what = f"job {job!r}" + (f" layer {on!r}" if on else "") if job else repr(on)
            d.error("layer" if on else "job", f"depends on {what} more than once")
            ok = False
            continue
        out.append(plan)
    return (out if ok else None), referenced


def _check_graph(layers: list[_LayerDraft], names: set[str], errors: list[str]) -> None:
    """Unknown layers, self-dependencies and cycles, over every layer that has a name (`names`:
    the spec's layer names as written, a layer with errors of its own still counting as one)."""
    graph: dict[str, list[str]] = {}
    for layer in layers:
        if layer.name is None:
            continue
        for on in layer.referenced:
            if on not in names:
                known = ", ".join(sorted(names))
                errors.append(f"layer {layer.name!r}.depends: unknown layer {on!r} (layers: {known})")
            elif on == layer.name:
                errors.append(f"layer {layer.name!r}.depends: a layer cannot depend on itself")
            else:
                graph.setdefault(layer.name, []).append(on)
    for cycle in _cycles(graph):
        errors.append(f"dependency cycle: {' -> '.join(cycle)}")


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One path per distinct cycle (as a set of layers), found by depth-first search."""
    state: dict[str, int] = {}  # 1 on the stack, 2 finished
    stack: list[str] = []
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append(cycle)
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def plan_job(spec: Any, *, user: str | None) -> JobPlan:
    """Validate a decoded spec against the database; raises SpecError listing every problem.

    `user` is the owner when the spec names none. Reads only; the caller writes the plan
    (`dispatch.jobs.submit.submit_job`), in the same transaction so the checks still hold at commit.
    """
    errors: list[str] = []
    if not isinstance(spec, dict):
        raise SpecError([f"the spec must be a JSON object, not {type(spec).__name__}"])
    r = _Reader(spec, "job", errors)
    r.unknown_keys(JOB_KEYS)
    show_name = r.text("show", required=True, max_len=512)
    name = r.text("name", required=True, max_len=255, pattern=NAME_RE)
    owner = r.text("user", max_len=32, pattern=USER_RE)
    if owner is None and spec.get("user") is None:
        owner = user
        if owner is None:
            r.error("user", "is required (no submitting user is known)")
        elif not USER_RE.match(owner) or len(owner) > 32:
            r.error("user", f"the submitting user {owner!r} cannot own a job (up to 32 of letters, digits, _.@+-)")
            owner = None
    folder_path = r.text("folder", max_len=1000)
    facility_name = r.text("facility", max_len=36)
    dept_name = r.text("dept", max_len=36)
    shot = r.text("shot", max_len=64) or ""
    priority = r.integer("priority", None, low=0, high=1_000_000)
    max_retries = r.integer("max_retries", DEFAULT_MAX_RETRIES, low=0, high=100)
    os_name = r.text("os", max_len=12)
    max_cores = _cap(r, "max_cores", centi=True)
    max_gpus = _cap(r, "max_gpus", centi=False)
    paused = r.flag("paused", False)
    auto_eat = r.flag("auto_eat", False)
    email = r.text("email", max_len=256)
    if email is not None and not EMAIL_RE.match(email):
        r.error("email", f"{email!r} is not a mail address (name@domain)")
        email = None
    job_env = _env(r)
    uid = r.integer(
        "uid", None, low=1, high=MAX_UID, hint=f"must be a whole number from 1 to {MAX_UID} (RQD runs no frame as root)"
    )

    layers: list[LayerPlan] = []
    raw_layers = spec.get("layers")
    if raw_layers is None:
        r.error("layers", "is required: a list of at least one layer")
    elif not isinstance(raw_layers, list) or not raw_layers:
        r.error("layers", "must be a list of at least one layer")
    elif len(raw_layers) > MAX_LAYERS:
        r.error("layers", f"has more than {MAX_LAYERS} layers")
    else:
        names: dict[str, int] = {}
        drafts: list[_LayerDraft] = []
        for i, raw in enumerate(raw_layers):
            draft = _plan_layer(raw, i, errors)
            drafts.append(draft)
            raw_name = raw.get("name") if isinstance(raw, dict) else None
            if isinstance(raw_name, str):
                if raw_name in names:
                    errors.append(f"layers[{i}]: duplicate layer name {raw_name!r} (also layers[{names[raw_name]}])")
                else:
                    names[raw_name] = i
            if draft.plan is not None:
                layers.append(draft.plan)
        _check_graph(drafts, {d.name for d in drafts if d.name is not None}, errors)
        # Over the valid layers only: a lower bound when some are not, so still a true error.
        total = sum(len(layer.chunks) for layer in layers)
        if total > MAX_FRAMES_PER_JOB:
            r.error("layers", f"make {total} frames; one job may have at most {MAX_FRAMES_PER_JOB}")

    # The database: show, folder, facility, dept, name, default tags.
    show = folder = facility = dept = None
    if show_name is not None:
        show = Show.objects.filter(str_name=show_name).first()
        if show is None:
            errors.append(f"show: unknown show {show_name!r}")
        elif not show.b_active:
            errors.append(f"show: show {show_name!r} is not active")
    facility = one_by_name(Facility, facility_name, "facility", errors)
    if show is not None:
        folder = resolve_folder(show, folder_path, errors)
    if dept_name is None and folder is not None and folder.dept_id is not None:
        dept = Dept.objects.filter(pk=folder.dept_id).first()
    if dept is None:
        dept = one_by_name(Dept, dept_name, "dept", errors)
    if name is not None and Job.objects.filter(str_name=name).exists():
        errors.append(f"name: a job named {name!r} already exists")
    if show is not None:
        apply_service_defaults(layers, show.str_name)
    if show is not None and facility is not None and any(not layer.tags for layer in layers):
        tags = alloc_tags(show, facility)
        for layer in layers:
            if layer.tags:
                continue
            if tags:
                layer.tags = list(tags)
            else:
                errors.append(
                    f"layer {layer.name!r}.tags: none given, and show {show.str_name!r} subscribes to no "
                    f"allocation in facility {facility.str_name!r} to take them from"
                )
    resolve_limits(layers, errors)
    resolve_other_jobs(layers, name, errors)
    if errors:
        raise SpecError(errors)
    assert show is not None and folder is not None and facility is not None and dept is not None
    assert name is not None and owner is not None and max_retries is not None and job_env is not None

    if priority is None:
        priority = folder.int_job_priority if folder.int_job_priority >= 0 else 1
    if max_cores is None:
        max_cores = folder.int_job_max_cores if folder.int_job_max_cores >= 0 else show.int_default_max_cores
    if max_gpus is None:
        max_gpus = folder.int_job_max_gpus if folder.int_job_max_gpus >= 0 else show.int_default_max_gpus
    return JobPlan(
        name=name,
        user=owner,
        show=show,
        folder=folder,
        facility=facility,
        dept=dept,
        shot=shot,
        priority=priority,
        max_retries=max_retries,
        os=os_name,
        max_cores=max_cores,
        max_gpus=max_gpus,
        paused=paused,
        auto_eat=auto_eat,
        layers=layers,
        email=email,
        env=job_env,
        uid=uid,
    )
