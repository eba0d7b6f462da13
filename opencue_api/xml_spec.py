"""Cuebot's XML job spec (cjsl, DTD versions 1.5 to 1.15), read into cuesched's JSON job spec.

pyoutline (and so cuesubmit) sends the spec as XML to `JobInterface.LaunchSpec` and
`LaunchSpecAndWait`; Cuebot parses it with a validating parser (service/JobSpec.java). Here it
becomes the same JSON spec the API and `manage.py submit_job` take (dispatch/jobs/spec.py), which
`dispatch.jobs.submit.submit_job` validates and writes: one way to submit.

Safety. The spec comes from anyone who reaches the port, so it is parsed by expat directly with
no entity ever expanded: an entity declaration (an entity bomb, an external entity) or an internal
DTD subset is refused, parameter entities are never parsed, and the DTD named in the DOCTYPE is
only read for its version, never fetched. The document is at most MAX_SPEC_BYTES.

Each element is read as its DTD version defines it: one the version does not have is refused (a
1.10 spec with <priority>, which arrived in 1.11), as are missing required ones. Every field is
honoured or refused with a message that names it; none is dropped. <autoeat> is the JSON spec's
`auto_eat`; <env> keys become the JSON spec's job and layer `env`; <depends> of the kinds the
JSON spec has (JOB_ON_JOB, JOB_ON_LAYER, LAYER_ON_JOB, LAYER_ON_LAYER, FRAME_BY_FRAME, within the
spec or on a job already launched) become layer `depends`. What cuesched cannot do yet is
refused, not ignored: <localbook>, <outputs> with paths, Post layers (Cuebot makes them a second
job that waits for this one) and depends of or on single frames (JOB_ON_FRAME, LAYER_ON_FRAME, FRAME_ON_*,
PREVIOUS_FRAME, LAYER_ON_SIM_FRAME) or on any frame (anyframe).

The names are Cuebot's: the job is `<show>-<shot>-<user>_<name>` lowercased (conformJobName),
shot and layer names are lowercased with dashes as underscores (conformName).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from xml.etree.ElementTree import Element, TreeBuilder
from xml.parsers import expat

MAX_SPEC_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 16  # the DTD's deepest path is spec/job/layers/layer/env/key
VERSIONS = tuple(f"1.{n}" for n in range(5, 16))
DOCTYPE_RE = re.compile(r"cjsl-(\d+\.\d+)\.dtd$")
NAME_RE = re.compile(r"^[\w.-]{3,}$")  # Cuebot's JobSpec.NAME_REGEX
TRUE = {"true", "yes", "1", "on"}  # Cuebot's Convert.stringToBool; anything else is false there
FALSE = {"false", "no", "0", "off"}
# Cuebot's core points: a value without a dot is hundredths of a core.
CORE_POINTS_MIN, CORE_POINTS_MAX = 10, 2400
# Cuebot's DependTypes the JSON spec can say: (who waits: the whole job or a layer, what it waits
# for: the whole other job, the whole other layer, or that layer frame by frame).
HONOURED = {
    "JOB_ON_JOB": ("job", "job"),
    "JOB_ON_LAYER": ("job", "layer"),
    "LAYER_ON_JOB": ("layer", "job"),
    "LAYER_ON_LAYER": ("layer", "layer"),
    "FRAME_BY_FRAME": ("layer", "frame"),
}
DEPEND_TYPES = (
    "LAYER_ON_SIM_FRAME PREVIOUS_FRAME JOB_ON_JOB JOB_ON_LAYER JOB_ON_FRAME LAYER_ON_JOB LAYER_ON_FRAME "
    "LAYER_ON_LAYER FRAME_ON_JOB FRAME_ON_LAYER FRAME_ON_FRAME FRAME_BY_FRAME"
).split()


class XmlSpecError(ValueError):
    """The XML spec cannot be launched; `errors` lists every reason, each naming its element."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


# --- the DTDs: each element's children, per version --------------------------------------------
# (name, since version, required, repeatable). Order is not checked; presence and counts are.


@dataclass(frozen=True)
class Child:
    name: str
    since: int = 5  # the minor version that introduced it
    required: bool = False
    many: bool = False
    until: int = 99  # required until this minor version (uid: required before 1.9)


CHILDREN: dict[str, tuple[Child, ...]] = {
    "spec": (
        Child("facility"),
        Child("dept"),
        Child("show", required=True),
        Child("shot", required=True),
        Child("user", required=True),
        Child("email"),
        Child("uid", required=True, until=9),
        Child("job", many=True),
        Child("depends", many=True),
    ),
    "job": (
        Child("paused"),
        Child("priority", since=11),
        Child("maxretries"),
        Child("maxcores", since=13),
        Child("maxgpus", since=13),
        Child("autoeat"),
        Child("localbook", since=8),
        Child("os", since=6),
        Child("env", many=True),
        Child("layers"),
    ),
    "layers": (Child("layer", required=True, many=True),),
    "layer": (
        Child("cmd", required=True),
        Child("range", required=True),
        Child("chunk", required=True),
        Child("cores"),
        Child("threadable"),
        Child("memory"),
        Child("gpus", since=12),
        Child("gpu", since=7),
        Child("gpu_memory", since=12),
        Child("timeout", since=10),
        Child("timeout_llu", since=10),
        Child("tags"),
        Child("limits"),
        Child("env", many=True),
        Child("services"),
        Child("outputs", since=14, many=True),
    ),
    "limits": (Child("limit", required=True, many=True),),
    "services": (Child("service", required=True, many=True),),
    "outputs": (Child("output", many=True),),
    "env": (Child("key", many=True),),
    "depends": (Child("depend", many=True),),
    "depend": (
        Child("depjob", required=True),
        Child("deplayer"),
        Child("depframe"),
        Child("onjob", required=True),
        Child("onlayer"),
        Child("onframe"),
    ),
}
ATTRIBUTES: dict[str, tuple[set[str], set[str]]] = {  # element: (required, optional)
    "job": ({"name"}, set()),
    "layer": ({"name", "type"}, set()),
    "key": ({"name"}, set()),
    "output": ({"name"}, set()),
    "depend": ({"type"}, {"anyframe"}),
    "localbook": ({"host", "cores", "memory", "threads", "gpu"}, {"gpus", "gpu_memory"}),
}


# --- parsing -----------------------------------------------------------------------------------


@dataclass
class _Doctype:
    name: str | None = None
    system_id: str | None = None


def parse_xml(text: str | bytes) -> tuple[Element, str]:
    """The document's root element and its cjsl version; XmlSpecError if unsafe or malformed."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    if len(data) > MAX_SPEC_BYTES:
        raise XmlSpecError([f"spec: {len(data)} bytes, more than the {MAX_SPEC_BYTES} a spec may have"])
    builder = TreeBuilder()
    doctype = _Doctype()
    depth = 0
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)

    def refuse(message: str) -> None:
        raise XmlSpecError([message])

    def start_doctype(name: str, system_id: str | None, public_id: str | None, internal: int) -> None:
        doctype.name, doctype.system_id = name, system_id
        if internal:
            refuse("spec: the DOCTYPE has an internal subset; a job spec names its DTD and declares nothing")

    def entity_decl(name: str, *_args: Any) -> None:
        refuse(f"spec: the document declares the entity {name!r}; entities are refused (no expansion, no fetching)")

    def external_ref(*_args: Any) -> int:
        refuse("spec: the document refers to an external entity; entities are refused")
        return 0

    def start(tag: str, attrs: dict[str, str]) -> None:
        nonlocal depth
        depth += 1
        if depth > MAX_DEPTH:
            refuse(f"spec: elements nested deeper than {MAX_DEPTH}")
        builder.start(tag, attrs)

    def end(tag: str) -> None:
        nonlocal depth
        depth -= 1
        builder.end(tag)

    parser.StartDoctypeDeclHandler = start_doctype
    parser.EntityDeclHandler = entity_decl
    parser.UnparsedEntityDeclHandler = entity_decl
    parser.ExternalEntityRefHandler = external_ref
    # With an external DTD named, expat skips a reference to an undeclared entity silently.
    parser.SkippedEntityHandler = lambda name, _param: refuse(
        f"spec: the document refers to the entity {name!r}; entities are refused (no expansion, no fetching)"
    )
    parser.NotationDeclHandler = lambda name, *_a: refuse(f"spec: the document declares the notation {name!r}")
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = builder.data
    try:
        parser.Parse(data, True)
    except expat.ExpatError as exc:
        raise XmlSpecError(
            [f"spec: not well-formed XML: {expat.ErrorString(exc.code)} at line {exc.lineno}, column {exc.offset}"]
        ) from None
    root = builder.close()
    if root.tag != "spec":
        raise XmlSpecError([f"spec: the root element is <{root.tag}>, not <spec>"])
    found = DOCTYPE_RE.search(doctype.system_id or "")
    if doctype.name != "spec" or found is None:
        raise XmlSpecError(
            [
                'spec: no <!DOCTYPE spec PUBLIC "SPI Cue  Specification Language" ".../cjsl-1.N.dtd">: '
                f"the DTD names the spec's version ({VERSIONS[0]} to {VERSIONS[-1]})"
            ]
        )
    version = found.group(1)
    if version not in VERSIONS:
        known = f"{VERSIONS[0]} to {VERSIONS[-1]}"
        raise XmlSpecError([f"spec: version {version} (from the DOCTYPE); cuesched reads {known}"])
    return root, version


# --- reading the tree into JSON specs -----------------------------------------------------------


@dataclass
class LaunchPlan:
    """The JSON specs of the XML's jobs, in order, and the spec's user (who the audit says asked)."""

    user: str
    version: str
    jobs: list[dict[str, Any]] = field(default_factory=list)


class _Read:
    def __init__(self, version: str) -> None:
        self.minor = int(version.split(".")[1])
        self.version = version
        self.errors: list[str] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{where}: {message}")

    def check(self, el: Element, where: str) -> None:
        """The element's children, and their attributes, as this version's DTD defines them."""
        allowed = {c.name: c for c in CHILDREN.get(el.tag, ()) if c.since <= self.minor}
        counts: dict[str, int] = {}
        for child in el:
            if child.tag not in allowed:
                later = CHILDREN_BY.get(el.tag, {}).get(child.tag)
                why = f"arrived in cjsl 1.{later.since}" if later else f"is not in <{el.tag}> in the DTD"
                self.error(where, f"<{child.tag}> {why} (this spec is cjsl {self.version})")
                continue
            counts[child.tag] = counts.get(child.tag, 0) + 1
            required, optional = ATTRIBUTES.get(child.tag, (set(), set()))
            for attr in sorted(set(child.attrib) - required - optional):
                self.error(where, f"unknown attribute {attr!r} of <{child.tag}>")
            for attr in sorted(required - set(child.attrib)):
                self.error(where, f"<{child.tag}> needs the attribute {attr!r}")
            if child.tag not in CHILDREN and len(child):
                self.error(where, f"<{child.tag}> holds text, not <{child[0].tag}>")
        for name, c in allowed.items():
            n = counts.get(name, 0)
            if n == 0 and c.required and self.minor < c.until:
                self.error(where, f"<{name}> is required")
            if n > 1 and not c.many:
                self.error(where, f"<{name}> is given {n} times")

    def text(self, el: Element | None) -> str | None:
        """An element's trimmed text (Cuebot's getChildTextTrim): None when absent."""
        if el is None:
            return None
        return (el.text or "").strip()

    def child_text(self, parent: Element, name: str) -> str | None:
        return self.text(parent.find(name))

    def integer(self, raw: str | None, where: str, *, low: int | None = None) -> int | None:
        if raw is None:
            return None
        if not re.fullmatch(r"[+-]?\d+", raw):
            self.error(where, f"{raw!r} is not a whole number")
            return None
        value = int(raw)
        if low is not None and value < low:
            self.error(where, f"must be {low} or more, not {value}")
            return None
        return value

    def flag(self, raw: str | None, where: str) -> bool | None:
        if raw is None:
            return None
        if raw.lower() in TRUE:
            return True
        if raw.lower() in FALSE:
            return False
        self.error(where, f"{raw!r} is not true or false (True, False, yes, no, 1, 0, on, off)")
        return None

    def name(self, raw: str | None, where: str, what: str) -> str | None:
        """Cuebot's conformName: at least 3 characters, dashes as underscores, lowercase."""
        if raw is None or not raw:
            self.error(where, f"the {what} name is empty")
            return None
        conformed = raw.replace("-", "_").lower()
        if len(raw) < 3 or not NAME_RE.match(conformed):
            self.error(where, f"the {what} name {raw!r} must be at least 3 of letters, digits, '_', '.' and '-'")
            return None
        return conformed


CHILDREN_BY = {tag: {c.name: c for c in kids} for tag, kids in CHILDREN.items()}


def _memory(r: _Read, raw: str | None, where: str) -> str | None:
    """Cuebot's convertMemoryInput: a number and m (MB) or g (GB); a bare number is GB. Returned as
    the JSON spec's memory string, which refuses 0 and sizes over 1 PB."""
    if raw is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([mg])?b?", raw.strip().lower())
    if m is None:
        r.error(where, f"{raw!r} is not a memory size (a number and m or g, e.g. '512m', '16g'; a bare number is GB)")
        return None
    return f"{m.group(1)}{'MB' if m.group(2) == 'm' else 'GB'}"


def _cores(r: _Read, raw: str | None, where: str) -> int | None:
    """Cuebot's <cores>: with a dot, cores ("4.0"); without, core points (hundredths: "400" is 4).
    cuesched books whole cores, so a fraction is refused where Cuebot would round or reset it."""
    if raw is None:
        return None
    try:
        points = round(float(raw) * 100) if "." in raw else int(raw)
    except ValueError:
        r.error(where, f"{raw!r} is not a number of cores ('4.0' is 4 cores; '400', without a dot, is 400 core points)")
        return None
    if 0 < points < CORE_POINTS_MIN or points > CORE_POINTS_MAX:
        r.error(
            where,
            f"{raw!r} is {points} core points: a frame asks {CORE_POINTS_MIN} to {CORE_POINTS_MAX} "
            "(0 the whole host, negative all but that many)",
        )
        return None
    if points % 100:
        r.error(where, f"{raw!r} is {points / 100:g} cores: cuesched books whole cores (write e.g. '4.0')")
        return None
    return points // 100


def conform_job_name(show: str, shot: str, user: str, name: str) -> str | None:
    """Cuebot's conformJobName: `<show>-<shot>-<user>_<suffix>` lowercased; None if the suffix is bad."""
    prefix = f"{show}-{shot}-{user}_"
    suffix = name
    if suffix.startswith(prefix):
        suffix = suffix[len(prefix) - 1 :]
    suffix = re.sub(r"_{2,}", "_", suffix.lower()).replace("-", "_")
    if not NAME_RE.match(suffix):
        return None
    suffix = re.sub(r"^_+", "", suffix)
    prefix = re.sub(r"_+$", "", prefix)
    return f"{prefix}_{suffix}".lower()


def _env(r: _Read, parent: Element, where: str) -> dict[str, str]:
    """<env><key name="X">value</key></env> as the JSON spec's `env` (Cuebot's handleEnvironmentTag:
    the value trimmed). The JSON spec's check decides which names and values are good, so its
    message names the variable; here only a name given twice, which Cuebot's map would let the
    later value win silently, is refused."""
    out: dict[str, str] = {}
    for env in parent.findall("env"):
        for key in env.findall("key"):
            name = key.get("name")
            if name is None:
                continue  # r.check has refused the key for its missing name
            if name in out:
                r.error(where, f"<env> sets {name!r} more than once")
            out[name] = r.text(key) or ""
    return out


def _layer(r: _Read, el: Element, job: str, where: str) -> dict[str, Any] | None:
    r.check(el, where)
    layer_type = el.get("type")
    if layer_type is not None and layer_type.upper() not in ("RENDER", "UTIL", "POST"):
        r.error(where, f"type {layer_type!r} is not Render, Util or Post")
    elif layer_type is not None and layer_type.upper() == "POST":
        r.error(
            where,
            "type Post: Cuebot makes Post layers a second job of its own that waits for this one; "
            "cuesched launches only the jobs the spec names (make it a second <job> with a JOB_ON_JOB "
            "depend on this one, or a Render layer that depends on the others)",
        )
    out: dict[str, Any] = {"type": (layer_type or "Render").capitalize()}
    name = r.name(el.get("name"), where, "layer")
    if name is not None:
        out["name"] = name
    for key, tag in (("command", "cmd"), ("range", "range")):
        value = r.child_text(el, tag)
        if value:
            out[key] = value
        elif el.find(tag) is not None:
            r.error(where, f"<{tag}> is empty")
    chunk = r.integer(r.child_text(el, "chunk"), f"{where} <chunk>", low=1)
    if chunk is not None:
        out["chunk_size"] = chunk
    cores = _cores(r, r.child_text(el, "cores"), f"{where} <cores>")
    if cores is not None:
        out["cores"] = cores
    threadable = r.flag(r.child_text(el, "threadable"), f"{where} <threadable>")
    if threadable is not None:
        out["threadable"] = threadable
    memory = _memory(r, r.child_text(el, "memory"), f"{where} <memory>")
    if memory is not None:
        out["memory"] = memory
    gpus = r.integer(r.child_text(el, "gpus"), f"{where} <gpus>", low=0)
    if gpus is not None:
        out["gpus"] = gpus
    # <gpu> is 1.7's GPU memory, deprecated by <gpu_memory> (1.12), which wins when both are given.
    for tag in ("gpu", "gpu_memory"):
        gpu_memory = _memory(r, r.child_text(el, tag), f"{where} <{tag}>")
        if gpu_memory is not None:
            out["gpu_memory"] = gpu_memory
    for tag in ("timeout", "timeout_llu"):
        minutes = r.integer(r.child_text(el, tag), f"{where} <{tag}>", low=0)
        if minutes is not None:
            out[tag] = minutes
    tags = r.child_text(el, "tags")
    if tags:
        # Cuebot's determineTags: spaces dropped, split on '|', each a name of 3 or more of [\w.-].
        out["tags"] = [t for t in tags.replace(" ", "").split("|") if t]
        for tag in out["tags"]:
            if not NAME_RE.match(tag):
                r.error(f"{where} <tags>", f"{tag!r} is not a tag (at least 3 of letters, digits, '_', '.' and '-')")
    for box in el:
        if box.tag in ("limits", "services", "outputs", "env"):
            r.check(box, f"{where} <{box.tag}>")
    for key, container, item in (("limits", "limits", "limit"), ("services", "services", "service")):
        box = el.find(container)
        if box is not None:
            names = list(dict.fromkeys(t for t in (r.text(i) for i in box.findall(item)) if t))
            if names:
                out[key] = names
    outputs = [o for box in el.findall("outputs") for o in box.findall("output")]
    if outputs:
        r.error(where, f"<outputs> names {len(outputs)} output(s): cuesched does not record layer outputs yet")
    env = _env(r, el, where)
    if env:
        out["env"] = env
    return out


def _job(r: _Read, el: Element, head: dict[str, Any], names: tuple[str, str, str]) -> dict[str, Any]:
    raw_name = el.get("name") or ""
    where = f"job {raw_name!r}"
    r.check(el, where)
    spec: dict[str, Any] = dict(head)
    show, shot, user = names
    name = conform_job_name(show, shot, user, raw_name) if raw_name else None
    if name is None:
        r.error(where, f"the job name {raw_name!r} must be at least 3 of letters, digits, '_', '.' and '-'")
    else:
        spec["name"] = name
    paused = r.flag(r.child_text(el, "paused"), f"{where} <paused>")
    if paused is not None:
        spec["paused"] = paused
    # Cuebot's JobSpec: isAutoEat = stringToBool(<autoeat>); insertJob writes it with <maxretries>
    # as given (only JobDao.updateAutoEat, the later control, zeroes the retries).
    auto_eat = r.flag(r.child_text(el, "autoeat"), f"{where} <autoeat>")
    if auto_eat is not None:
        spec["auto_eat"] = auto_eat
    for key, tag, low in (("priority", "priority", 0), ("max_retries", "maxretries", 0)):
        value = r.integer(r.child_text(el, tag), f"{where} <{tag}>", low=low)
        if value is not None:
            spec[key] = value
    for key, tag in (("max_cores", "maxcores"), ("max_gpus", "maxgpus")):
        value = r.integer(r.child_text(el, tag), f"{where} <{tag}>")
        if value is not None:
            spec[key] = value
    if el.find("localbook") is not None:
        r.error(where, "<localbook>: cuesched has no local booking (a job runs on the farm's hosts)")
    for box in el.findall("env"):
        r.check(box, f"{where} <env>")
    os_name = r.child_text(el, "os")
    if os_name:
        spec["os"] = os_name
    env = _env(r, el, where)
    if env:
        spec["env"] = env
    layers = el.find("layers")
    if layers is None:
        r.error(where, "has no <layers>")
    else:
        r.check(layers, f"{where} <layers>")
        spec["layers"] = []
        for i, layer in enumerate(layers.findall("layer")):
            lw = f"{where} layer {layer.get('name') or i}"
            out = _layer(r, layer, spec.get("name", raw_name), lw)
            if out is not None:
                spec["layers"].append(out)
    return spec


def _depends(r: _Read, root: Element, jobs: list[dict[str, Any]], names: tuple[str, str, str]) -> None:
    """<depends> onto the depending layers' `depends` (Cuebot's handleDependTag, then
    DependManagerService.createDepend(BuildableDependency)): what the JSON spec can say is
    honoured, the rest refused naming the depend.

    Cuebot reads <depjob> and <onjob> through conformJobName (so either a job of this spec or one
    already on the farm of the same show, shot and user, by suffix or full name), <deplayer> and
    <onlayer> through conformLayerName. The type alone says which of them a depend uses: a
    JOB_ON_* depend has no <deplayer>, the whole depending job waits; a *_ON_JOB one no <onlayer>.

    A job-level depend (JOB_ON_JOB, JOB_ON_LAYER) goes onto every layer of the depending job. In
    Cuebot it puts every frame of that job in DEPEND and releases them all when what it waits for
    is done; the JSON spec's dependencies are per layer with the same release (the other job
    FINISHED, or the other layer done), and every layer of the job is in this spec, so the same
    dependency on each of them holds exactly the same frames until exactly the same event. The
    depend table then has one row per layer (LAYER_ON_JOB, LAYER_ON_LAYER) instead of Cuebot's one
    JOB_ON_* row.
    """
    by_name = {j.get("name"): j for j in jobs}
    for box in root.findall("depends"):
        r.check(box, "<depends>")
        for i, dep in enumerate(box.findall("depend")):
            kind = (dep.get("type") or "").upper()
            where = f"depend {i + 1} ({kind or 'no type'})"
            r.check(dep, where)
            if kind not in DEPEND_TYPES:
                r.error(where, f"type {dep.get('type')!r} is not one of {', '.join(DEPEND_TYPES)}")
                continue
            if kind not in HONOURED:
                r.error(
                    where,
                    "cuesched's job spec has no dependency of or on single frames (nor on the previous "
                    f"frame); it honours {', '.join(HONOURED)}",
                )
                continue
            if r.flag(dep.get("anyframe"), f"{where} anyframe"):
                r.error(where, "anyframe true: cuesched has no any-frame dependency (it waits for the whole layer)")
                continue
            item = _depend_item(r, dep, kind, where, by_name, names)
            if item is None:
                continue
            er_job, er_layer, wanted = item
            job = by_name[er_job]
            layers = job.get("layers", [])
            if er_layer is not None:
                layers = [lay for lay in layers if lay.get("name") == er_layer]
                if not layers:
                    r.error(where, f"job {er_job!r} has no layer {er_layer!r}")
                    continue
            for layer in layers:
                depends = layer.setdefault("depends", [])
                if wanted not in depends:  # the same wait given twice is one wait
                    depends.append(dict(wanted))


def _depend_item(
    r: _Read, dep: Element, kind: str, where: str, jobs: dict[Any, dict[str, Any]], names: tuple[str, str, str]
) -> tuple[str, str | None, dict[str, str]] | None:
    """(depending job, its depending layer or None for all, the JSON `depends` item), or None
    with the errors recorded."""
    er, on = HONOURED[kind]
    before = len(r.errors)
    for tag in ("depframe", "onframe"):
        if dep.find(tag) is not None:
            r.error(where, f"<{tag}>: a {kind} depend is not between frames (drop <{tag}>)")
    for tag, needed, use in (("deplayer", er == "layer", "LAYER_ON_"), ("onlayer", on != "job", "_ON_LAYER")):
        if needed and dep.find(tag) is None:
            r.error(where, f"<{tag}> is required: a {kind} depend names the layer")
        elif not needed and dep.find(tag) is not None:
            r.error(where, f"<{tag}>: a {kind} depend is of or on the whole job (for one layer, use a {use}* type)")
    er_job = conform_job_name(*names, r.child_text(dep, "depjob") or "")
    on_job = conform_job_name(*names, r.child_text(dep, "onjob") or "")
    for tag, value in (("depjob", er_job), ("onjob", on_job)):
        if value is None and dep.find(tag) is not None:
            r.error(f"{where} <{tag}>", f"{r.child_text(dep, tag)!r} is not a job name")
    er_layer = r.name(r.child_text(dep, "deplayer"), f"{where} <deplayer>", "layer") if er == "layer" else None
    on_layer = r.name(r.child_text(dep, "onlayer"), f"{where} <onlayer>", "layer") if on != "job" else None
    if len(r.errors) > before or er_job is None or on_job is None:
        return None
    if er_job not in jobs:
        r.error(
            where,
            f"job {er_job!r} is not a job of this spec: a spec's depends make its own jobs wait "
            "(a job already launched is made to wait by a depend on it, not by a spec)",
        )
        return None
    same = er_job == on_job
    if same and on == "job":
        r.error(where, f"job {er_job!r} would wait for itself, and never run")
        return None
    if same and er == "job":
        r.error(
            where,
            f"job {er_job!r} would wait for its own layer {on_layer!r}, which waits for itself "
            "(make the other layers wait with LAYER_ON_LAYER)",
        )
        return None
    item: dict[str, str] = {} if same else {"job": on_job}
    if on_layer is not None:
        item["layer"] = on_layer
    item["type"] = on
    return er_job, er_layer, item


def read_spec(text: str | bytes) -> LaunchPlan:
    """The XML spec as JSON job specs (not yet checked against the database: submit_job does that)."""
    root, version = parse_xml(text)
    r = _Read(version)
    r.check(root, "spec")
    for attr in sorted(root.attrib):
        r.error("spec", f"unknown attribute {attr!r} of <spec>")
    show = r.child_text(root, "show") or ""
    user = r.child_text(root, "user") or ""
    shot_raw = r.child_text(root, "shot")
    shot = r.name(shot_raw, "spec <shot>", "shot") if shot_raw is not None else None
    if not show:
        r.error("spec <show>", "is empty")
    if not user:
        r.error("spec <user>", "is empty")
    uid = r.integer(r.child_text(root, "uid"), "spec <uid>")
    if user == "root" or uid == 0:
        r.error("spec <user>", "cannot launch jobs as root (user root or uid 0), as in Cuebot")
    head: dict[str, Any] = {"show": show, "user": user}
    if shot is not None:
        head["shot"] = shot
    if uid is not None and uid != 0:
        head["uid"] = uid
    facility = r.child_text(root, "facility")
    if facility:
        head["facility"] = facility.lower()
    dept = r.child_text(root, "dept")
    if dept:
        head["dept"] = dept
    email = r.child_text(root, "email")
    if email:
        head["email"] = email
    names = (show, shot or "", user)
    jobs = [_job(r, el, head, names) for el in root.findall("job")]
    if not root.findall("job"):
        r.error("spec", "has no <job> to launch")
    seen: set[str] = set()
    for job in jobs:
        name = job.get("name")
        if name in seen:
            r.error(f"job {name!r}", "is given twice in the spec")
        seen.add(name)
    _depends(r, root, jobs, names)
    if r.errors:
        raise XmlSpecError(r.errors)
    return LaunchPlan(user=user, version=version, jobs=jobs)
