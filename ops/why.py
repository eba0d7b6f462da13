"""Why is this job (or this WAITING frame) not booking?

Two sources, both shown:

* **the scheduler's own record**: the dispatch loop publishes its most recent rejection per
  job in the live view (`extra.dispatch.blocked[job] = {reason, message, unblock, at}`);
  when present it is the authoritative answer for the scheduler's last attempt;
* **computed from the database now**, the same rules the feed and placement apply: job not
  PENDING or paused, show inactive, no WAITING frame, frames waiting on dependencies, a
  start-after time, job/folder/subscription caps reached (Store figures for managed shows,
  trigger-kept figures otherwise, with SUM(proc) beside them), and no bookable host (UP,
  OPEN, pinged recently, one of the layer's tags, the job's facility and OS, enough idle
  cores, memory and GPUs, on an allocation the show still has burst room on), and the GPU-host
  rule's reserve (a frame without a GPU leaves 1 GPU, 1 core, 4 GB and 4 GB of GPU memory on
  a GPU host; the scheduler's record also says when waiting GPU frames made a host decline).

Each reason has numbers and what would unblock it. Blockers that never clear come first and
say so ("No host can ever run a frame of layer ..."): no host carries the layer's tags, none is
in the job's facility/OS, or none is large enough in total (cores, memory, GPUs, GPU memory)
whatever it runs now; waiting or freeing hosts would not help, so the advice is to add hosts or
change the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from accounting.licences import limit_max_problem, limit_max_sql
from accounting.triggers import CUEBOT_ACCOUNTS
from accounting.units import centicores_to_cores
from dispatch import conf as dispatch_conf
from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.feed import FRAME_READY
from dispatch.engine.placement import Demand, parse_tags

CENTI = 100
KB_PER_GB = 1024 * 1024
_SIZED_LAYERS = 20  # ready layers sized on their hosts (one host query each); the rest by what they ask

JOB_SQL = """
SELECT j.pk_job, j.str_name, j.str_state, j.b_paused, j.pk_show, s.str_name, s.b_scheduler_managed, s.b_active,
       j.pk_folder, f.str_name, j.pk_facility, j.str_os,
       jr.int_max_cores, jr.int_max_gpus, jr.int_cores, jr.int_gpus,
       fr.int_max_cores, fr.int_max_gpus, fr.int_cores, fr.int_gpus,
       js.int_waiting_count, js.int_running_count, js.int_depend_count
FROM job j JOIN show s ON s.pk_show = j.pk_show JOIN folder f ON f.pk_folder = j.pk_folder
JOIN job_resource jr ON jr.pk_job = j.pk_job JOIN folder_resource fr ON fr.pk_folder = j.pk_folder
JOIN job_stat js ON js.pk_job = j.pk_job
WHERE j.pk_job = %(job)s
"""
# Layers with WAITING frames: how many, how many are ready (no unmet dependency), and the demand.
LAYERS_SQL = f"""
SELECT l.pk_layer, l.str_name, l.str_tags, l.int_cores_min, l.int_mem_min, l.int_gpus_min, l.int_gpu_mem_min,
       l.b_threadable, l.ts_start_after, l.ts_start_after > now(),
       COUNT(*) AS waiting, COUNT(*) FILTER (WHERE {FRAME_READY}) AS ready, l.int_cores_max
FROM layer l JOIN frame f ON f.pk_layer = l.pk_layer AND f.str_state = 'WAITING'
WHERE l.pk_job = %(job)s AND (%(layer)s::text IS NULL OR l.pk_layer = %(layer)s)
GROUP BY l.pk_layer
ORDER BY MIN(l.int_dispatch_order), l.pk_layer
"""
BOOKED_SQL = """
SELECT COALESCE(SUM(p.int_cores_reserved) FILTER (WHERE p.pk_job = %(job)s), 0)::bigint,
       COALESCE(SUM(p.int_gpus_reserved) FILTER (WHERE p.pk_job = %(job)s), 0)::bigint,
       COALESCE(SUM(p.int_cores_reserved), 0)::bigint, COALESCE(SUM(p.int_gpus_reserved), 0)::bigint
FROM proc p JOIN job j ON j.pk_job = p.pk_job
WHERE j.pk_folder = %(folder)s AND NOT p.b_local
"""
SUBS_SQL = """
SELECT sub.pk_alloc, a.str_name, sub.int_burst, sub.int_cores,
       COALESCE((SELECT SUM(p.int_cores_reserved) FROM proc p JOIN host h ON h.pk_host = p.pk_host
                 WHERE p.pk_show = sub.pk_show AND h.pk_alloc = sub.pk_alloc AND NOT p.b_local), 0)::bigint
FROM subscription sub JOIN alloc a ON a.pk_alloc = sub.pk_alloc
WHERE sub.pk_show = %(show)s
ORDER BY a.str_name
"""
# Every host that carries one of the layer's tags, with what placement checks.
HOSTS_SQL = """
SELECT h.pk_host, h.str_name, h.pk_alloc, a.pk_facility, hs.str_os, hs.str_state, h.str_lock_state,
       hs.ts_ping >= now() - make_interval(secs => %(stale_after)s),
       h.int_cores, h.int_cores_idle, LEAST(h.int_mem_idle, hs.int_mem_free), h.int_gpus_idle,
       LEAST(h.int_gpu_mem_idle, hs.int_gpu_mem_free), h.int_thread_mode, h.int_mem_idle
FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host JOIN alloc a ON a.pk_alloc = h.pk_alloc
WHERE EXISTS (SELECT 1 FROM host_tag t WHERE t.pk_host = h.pk_host AND t.str_tag = ANY(%(tags)s::text[]))
"""
# The licence limits of layers, with their use (the triggers' count, what every writer checks).
LAYER_LIMITS_SQL = f"""
SELECT ll.pk_layer, r.str_name, r.int_running, r.int_max_value, r.b_host_limit,
       {limit_max_sql("r.int_max_value")}, {CUEBOT_ACCOUNTS}
FROM layer_limit ll JOIN limit_record r ON r.pk_limit_record = ll.pk_limit_record
WHERE ll.pk_layer = ANY(%(layers)s::text[])
ORDER BY ll.pk_layer, r.str_name
"""
# Whatever their state, lock or load: can any host carrying one of the tags EVER run a frame of the
# layer? Sizes are totals (int_cores, int_mem, int_gpus), not idle amounts: a blocker found here
# does not clear by waiting, only by adding hosts or changing the layer.
CAPACITY_SQL = """
WITH tagged AS (
  SELECT h.int_cores, h.int_mem, h.int_gpus, h.int_gpu_mem,
         (a.pk_facility = %(facility)s AND (%(os)s::text IS NULL OR hs.str_os = %(os)s)) AS placed
  FROM host h JOIN host_stat hs ON hs.pk_host = h.pk_host JOIN alloc a ON a.pk_alloc = h.pk_alloc
  WHERE EXISTS (SELECT 1 FROM host_tag t WHERE t.pk_host = h.pk_host AND t.str_tag = ANY(%(tags)s::text[]))
)
SELECT COUNT(*), COUNT(*) FILTER (WHERE placed),
       COALESCE(MAX(int_cores) FILTER (WHERE placed), 0), COALESCE(MAX(int_mem) FILTER (WHERE placed), 0),
       COALESCE(MAX(int_gpus) FILTER (WHERE placed), 0), COALESCE(MAX(int_gpu_mem) FILTER (WHERE placed), 0),
       COUNT(*) FILTER (WHERE placed AND int_cores >= %(cores)s AND int_mem >= %(mem)s AND int_gpus >= %(gpus)s
                        AND int_gpu_mem >= %(gpu_mem)s)
FROM tagged
"""
FRAME_SQL = """
SELECT f.pk_frame, f.str_name, f.str_state, f.int_depend_count, f.pk_job, f.pk_layer, f.str_host,
       f.int_mem_reserved, f.int_mem_max_used, f.str_reason
FROM frame f WHERE f.pk_frame = %(frame)s
"""
# Memory per layer, KB: what a frame reserves, the largest RSS a run reported (the layer's
# layer_mem, which every launcher's reports and completions raise, and its frames' last runs),
# and what the running frames use now. A layer whose frames use more
# than they reserve crowds its hosts; one that reserves far more than it uses books too few.
MEMORY_SQL = """
SELECT l.str_name, l.int_mem_min,
       GREATEST(COALESCE(MAX(f.int_mem_max_used), 0),
                COALESCE((SELECT MAX(lm.int_max_rss) FROM layer_mem lm WHERE lm.pk_layer = l.pk_layer), 0))::bigint,
       COUNT(*) FILTER (WHERE f.int_mem_max_used > 0),
       COALESCE((SELECT SUM(p.int_mem_used) FROM proc p WHERE p.pk_layer = l.pk_layer), 0)::bigint,
       COALESCE((SELECT MAX(p.int_mem_max_used) FROM proc p WHERE p.pk_layer = l.pk_layer), 0)::bigint
FROM layer l LEFT JOIN frame f ON f.pk_layer = l.pk_layer
WHERE l.pk_job = %(job)s
GROUP BY l.pk_layer
ORDER BY MIN(l.int_dispatch_order), l.str_name
"""


@dataclass(frozen=True)
class LayerMemory:
    """One layer's memory, KB; `measured` frames have a reported max RSS."""

    layer: str
    reserved: int
    max_rss: int
    measured: int
    running_rss: int
    running_max_rss: int

    @property
    def text(self) -> str:
        peak = max(self.max_rss, self.running_max_rss)
        if not peak:
            return f"{self.layer}: reserves {_gb(self.reserved)}; no memory reported yet"
        over = " - above its reservation" if peak > self.reserved else ""
        return (
            f"{self.layer}: reserves {_gb(self.reserved)}, max RSS {_gb(peak)} over {self.measured} frame(s){over}; "
            f"running now {_gb(self.running_rss)}"
        )


def layer_memory(job: str) -> list[LayerMemory]:
    return [LayerMemory(*row) for row in _all(MEMORY_SQL, {"job": job})]


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    unblock: str
    source: str = "computed"  # or "scheduler"
    at: float | None = None

    @property
    def ago(self) -> str:
        from ops.status import ago

        return ago(self.at)


@dataclass
class Why:
    job: str
    job_name: str
    show: str
    show_name: str
    managed: bool
    state: str
    running: int
    waiting: int
    reasons: list[Reason] = field(default_factory=list)
    recorded: Reason | None = None
    frame: dict[str, Any] | None = None
    memory: list[LayerMemory] = field(default_factory=list)
    # Per ready layer whose frames book more than they ask (cores from memory, thread mode):
    # "render: asks 1 core, books 8 on h1: its 32 GB are ..." (dispatch.engine.sizing).
    sizing: list[str] = field(default_factory=list)

    @property
    def primary(self) -> Reason | None:
        return self.recorded or (self.reasons[0] if self.reasons else None)

    @property
    def blocked(self) -> bool:
        return self.primary is not None and self.primary.code != "ok"


def _one(sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()


def _all(sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def _gb(kb: int) -> str:
    value = kb / KB_PER_GB
    return f"{value:.0f} GB" if value >= 10 or value == int(value) else f"{value:.1f} GB"


def _whole_cores_needed(cores_min: int, threadable: bool) -> int:
    """The least whole cores one frame asks (placement's index floor; 0/negative: whole host, >= 1)."""
    return sizing.asked_cores(Demand(cores_min, 0, 0, 0, 0, threadable))


@dataclass(frozen=True)
class _HostNow:
    """What sizing reads of a HOSTS_SQL row: the ledger's cores and idle memory, the thread mode."""

    name: str
    cores_total: int
    cores_idle: int
    mem_idle: int
    thread_mode: int


def _host_now(h: tuple[Any, ...]) -> _HostNow:
    return _HostNow(name=h[1], cores_total=h[8], cores_idle=h[9], mem_idle=h[14], thread_mode=h[13])


def _layer_demand(layer: tuple[Any, ...]) -> Demand:
    _pk, _name, _tags, cores_min, mem_min, gpus_min, gpu_mem_min, threadable = layer[:8]
    return Demand(cores_min, layer[12] or 0, mem_min, gpus_min, gpu_mem_min, threadable)


def _sized(layer: tuple[Any, ...], facility: str, job_os: str | None) -> tuple[int, str] | None:
    """The least cores a frame of the layer books on a host that could take it now, and why.

    None when no bookable host of its tags has the memory: the host checks say why. A frame
    sized from its memory needs more room under the caps than its layer asks, so the caps are
    judged on this, as the dispatch loop judges them.
    """
    tags = sorted(parse_tags(layer[2]))
    if not tags:
        return None
    demand = _layer_demand(layer)
    best: tuple[int, str] | None = None
    for h in _all(HOSTS_SQL, {"tags": tags, "stale_after": dispatch_conf.lost_host_timeout()}):
        if not (h[5] == "UP" and h[6] == "OPEN" and h[7] and h[3] == facility and (job_os is None or h[4] == job_os)):
            continue
        if h[10] < demand.mem or h[11] < demand.gpus or h[12] < demand.gpu_mem:
            continue
        host = _host_now(h)
        cores, _rule = sizing.size(demand, host)
        if cores and (best is None or cores < best[0]):
            best = (cores, sizing.describe(demand, host, host.name))
    return best


def recorded_reason(view: dict[str, Any] | None, job: str) -> Reason | None:
    """The dispatch loop's most recent rejection for this job, if it publishes one."""
    blocked = (((view or {}).get("extra") or {}).get("dispatch") or {}).get("blocked") or {}
    entry = blocked.get(job)
    if not isinstance(entry, dict):
        return None
    return Reason(
        code=str(entry.get("reason", "blocked")),
        message=str(entry.get("message", "")),
        unblock=str(entry.get("unblock", "")),
        source="scheduler",
        at=entry.get("at"),
    )


def explain_job(job: str, view: dict[str, Any] | None, *, layer: str | None = None) -> Why:
    row = _one(JOB_SQL, {"job": job})
    if row is None:
        raise LookupError(job)
    (pk_job, name, state, paused, show, show_name, managed, active, folder, folder_name, facility, job_os,
     j_max, j_max_gpus, j_cores, j_gpus, f_max, f_max_gpus, f_cores, f_gpus,
     waiting, running, depend) = row  # fmt: skip
    why = Why(pk_job, name, show, show_name, managed, state, int(running), int(waiting))
    why.recorded = recorded_reason(view, job)
    why.memory = layer_memory(pk_job)
    add = why.reasons.append

    if state != "PENDING":
        add(Reason("not_pending", f"The job is {state}: only PENDING jobs book.", "Nothing to book."))
    if paused:
        add(Reason("paused", "The job is paused.", "Unpause the job."))
    if not active:
        add(Reason("show_inactive", f"Show {show_name} is inactive.", "Activate the show."))
    layers = _all(LAYERS_SQL, {"job": job, "layer": layer})
    if not layers:
        if depend:
            add(
                Reason(
                    "dependency",
                    f"No frame is WAITING: {depend} frame(s) wait on dependencies (DEPEND).",
                    "The frames they depend on must finish first.",
                )
            )
        elif state == "PENDING":
            add(Reason("no_waiting", f"No frame is WAITING ({running} running).", "Nothing left to book."))
        return _finish(why, view)
    ready_layers = [r for r in layers if r[11] > 0 and not r[9]]
    if not any(r[11] > 0 for r in layers):
        total = sum(r[10] for r in layers)
        add(
            Reason(
                "dependency",
                f"All {total} WAITING frame(s) have unmet dependencies.",
                "The frames they depend on must finish first.",
            )
        )
    elif not ready_layers:
        starts = min(r[8] for r in layers if r[8] is not None)
        add(
            Reason(
                "start_after",
                f"Every layer with ready frames starts after {starts:%Y-%m-%d %H:%M:%S} UTC.",
                "Wait, or clear the layer's start-after time.",
            )
        )
    if why.reasons:
        return _finish(why, view)
    # Blockers that never clear come before the limits and caps, which do: a GPU frame on a farm
    # without GPU hosts must not be told to wait for running frames.
    never = [_never_reason(r, facility, job_os) for r in ready_layers]
    if all(n is not None for n in never):
        why.reasons.append(never[0])  # type: ignore[arg-type]
        return _finish(why, view)
    ready_layers = [r for r, n in zip(ready_layers, never, strict=True) if n is None]

    _limit_reason(why, ready_layers)
    if why.reasons:
        return _finish(why, view)

    # Caps: the smallest frame of any ready layer is what must still fit, sized on the hosts
    # that could take it now (a 32 GB frame asking 1 core books 8 on a 128 GB, 32-core host).
    needs = []
    for r in ready_layers[:_SIZED_LAYERS]:
        asked = _whole_cores_needed(r[3], r[7])
        found = _sized(r, facility, job_os)
        if found is not None and found[0] != asked:
            why.sizing.append(f"Layer {r[1]}: {found[1]}.")
        needs.append(found[0] if found is not None else asked)
    need = min(needs + [_whole_cores_needed(r[3], r[7]) for r in ready_layers[_SIZED_LAYERS:]])
    sized_note = f" ({why.sizing[0][:-1]})" if why.sizing and len(ready_layers) == 1 else ""
    need_gpus = min(int(r[5]) for r in ready_layers)
    booked = _one(BOOKED_SQL, {"job": job, "folder": folder}) or (0, 0, 0, 0)
    db_job, db_job_gpus, db_folder, db_folder_gpus = (int(v) for v in booked)
    store_job = ((view or {}).get("job") or {}).get(job) if managed else None
    store_folder = ((view or {}).get("folder") or {}).get(folder) if managed else None
    job_cores = store_job["cores"] if store_job else centicores_to_cores(db_job if managed else j_cores)
    job_gpus = store_job["gpus"] if store_job else (db_job_gpus if managed else j_gpus)
    folder_cores = store_folder["cores"] if store_folder else centicores_to_cores(db_folder if managed else f_cores)
    folder_gpus = store_folder["gpus"] if store_folder else (db_folder_gpus if managed else f_gpus)
    _cap_reason(why, "job", f"job {name}", job_cores, j_max, need, centicores_to_cores(db_job), "max cores", sized_note)
    _cap_reason(
        why,
        "folder",
        f"folder {folder_name}",
        folder_cores,
        f_max,
        need,
        centicores_to_cores(db_folder),
        "max cores",
        sized_note,
    )
    if need_gpus > 0:
        _gpu_reason(why, "job", f"job {name}", job_gpus, j_max_gpus, need_gpus)
        _gpu_reason(why, "folder", f"folder {folder_name}", folder_gpus, f_max_gpus, need_gpus)

    subs = _all(SUBS_SQL, {"show": show})
    store_subs = (view or {}).get("sub") or {}
    room: dict[str, int] = {}
    sub_text = []
    for alloc, alloc_name, burst, t_cores, db_cc in subs:
        entry = store_subs.get(f"{show}:{alloc}") if managed else None
        used = entry["cores"] if entry else centicores_to_cores(db_cc if managed else t_cores)
        cap = centicores_to_cores(burst)
        room[alloc] = cap - used
        sub_text.append(f"{alloc_name} {used}/{cap}")
    if not subs:
        why.reasons.append(
            Reason(
                "no_subscription",
                f"Show {show_name} has no subscription: it may book on no allocation.",
                "Add a subscription with a burst for an allocation that has hosts.",
            )
        )
    elif all(r < need for r in room.values()):
        why.reasons.append(
            Reason(
                "subscription_burst",
                f"Subscription at burst: {', '.join(sub_text)} cores; the smallest frame needs {need}{sized_note}.",
                "Raise the burst, or wait for frames of this show to finish.",
            )
        )
    if why.reasons:
        return _finish(why, view)

    host_reason = _host_reason(ready_layers[0], facility, job_os, {a for a, r in room.items() if r >= need})
    if host_reason is not None:
        why.reasons.append(host_reason)
    return _finish(why, view)


def _limit_reason(why: Why, ready_layers: list[tuple[Any, ...]]) -> None:
    """Every ready layer holds a licence limit that is full: name them with their numbers."""
    full: dict[str, list[str]] = {}
    problems: set[str] = set()
    rows = _all(LAYER_LIMITS_SQL, {"layers": [r[0] for r in ready_layers]})
    for pk_layer, name, running, raw, host, max_read, cuebot in rows:
        if max_read >= 0 and running >= max_read:
            problem = limit_max_problem(name, raw, cuebot=cuebot)
            if problem is not None:
                problems.add(problem)
                full.setdefault(pk_layer, []).append(problem)
            else:
                full.setdefault(pk_layer, []).append(f"{name} {running}/{max_read} {'hosts' if host else 'frames'}")
    if not full or any(r[0] not in full for r in ready_layers):
        return
    names = sorted({text for texts in full.values() for text in texts})
    hint = "Raise the limit's max value, or wait for frames holding it to finish."
    if problems:
        hint = "Give the limit a max (a large number for unlimited beside Cuebot); " + hint
    why.reasons.append(
        Reason("limit_full", f"Every ready layer holds a licence limit that is full: {', '.join(names)}.", hint)
    )


def _cap_reason(
    why: Why, vertex: str, label: str, used: int, max_cc: int, need: int, db: int, what: str, note: str = ""
) -> None:
    if max_cc < 0:
        return
    cap = centicores_to_cores(max_cc)
    if used + need <= cap:
        return
    figures = f"{used}/{cap} cores" + ("" if used == db else f" (SUM(proc): {db})")
    if cap == 0:  # 0 books nothing: waiting never clears it
        why.reasons.append(
            Reason(
                f"{vertex}_max_cores",
                f"The {label}'s {what} is 0: it books nothing ({figures}).",
                f"Set the {vertex}'s max cores above 0, or to -1 for unlimited; waiting does not help.",
            )
        )
        return
    if used >= cap:
        message = f"The {label} is at its {what}: {figures}."
    else:
        message = f"The {label} has {cap - used} core(s) left under its {what} ({figures}); a frame needs {need}{note}."
    why.reasons.append(
        Reason(
            f"{vertex}_max_cores",
            message,
            f"Raise the {vertex}'s max cores, or wait for its running frames to finish.",
        )
    )


def _gpu_reason(why: Why, vertex: str, label: str, used: int, cap: int, need: int) -> None:
    if cap < 0 or used + need <= cap:
        return
    why.reasons.append(
        Reason(
            f"{vertex}_max_gpus",
            f"The {label} is at its max GPUs: {used}/{cap}; a frame needs {need}.",
            f"Raise the {vertex}'s max GPUs, or wait for its GPU frames to finish.",
        )
    )


def _host_reason(layer: tuple[Any, ...], facility: str, job_os: str | None, allocs: set[str]) -> Reason | None:
    """Narrow the hosts that carry a tag of the layer, rule by rule; report the rule that empties it."""
    _pk_layer, lname, str_tags, cores_min, mem_min, gpus_min, gpu_mem_min, threadable = layer[:8]
    tags = sorted(parse_tags(str_tags))
    need = _whole_cores_needed(cores_min, threadable)
    demand_ = _layer_demand(layer)
    demand = [f"{need} core(s)", f"{_gb(mem_min)} free"]
    if gpus_min:
        demand.append(f"{gpus_min} GPU(s)")
    tag_text = ", ".join(f"`{t}`" for t in tags) or "(none)"
    what = f"{' and '.join(demand)} and tag {tag_text}"
    unblock_free = "Wait for running frames to free a host, or add hosts with that tag."
    if not tags:
        return Reason("no_tags", f"Layer {lname} has no tags: no host can match it.", "Give the layer a host tag.")
    hosts = _all(HOSTS_SQL, {"tags": tags, "stale_after": dispatch_conf.lost_host_timeout()})
    steps: list[tuple[str, Any, str]] = [
        (
            f"no host carries tag {tag_text}",
            lambda h: True,
            "Tag hosts for this layer, or change the layer's tags.",
        ),
        (
            f"no UP and OPEN host with tag {tag_text} has pinged recently",
            lambda h: h[5] == "UP" and h[6] == "OPEN" and h[7],
            "Bring a host with that tag up, or unlock one.",
        ),
        (
            f"no UP/OPEN host with tag {tag_text} is in the job's facility" + (f" and runs {job_os}" if job_os else ""),
            lambda h: h[3] == facility and (job_os is None or h[4] == job_os),
            "Add hosts in this facility (and OS), or change the job's OS.",
        ),
        (
            f"no host with tag {tag_text} is on an allocation the show has burst room on",
            lambda h: h[2] in allocs,
            "Raise the burst of the show's subscription on the hosts' allocation, or subscribe it there.",
        ),
        (
            f"no host with tag {tag_text} has the idle cores a frame books there",
            lambda h: sizing.size(demand_, _host_now(h))[0] > 0,
            unblock_free,
        ),
        (f"no host with {what}", lambda h: h[10] >= mem_min, unblock_free),
        (f"no host with {what}", lambda h: h[11] >= gpus_min and h[12] >= gpu_mem_min, unblock_free),
    ]
    remaining = list(hosts)
    for text, keep, unblock in steps:
        before = remaining
        remaining = [h for h in remaining if keep(h)]
        if not remaining:
            detail = ""
            if before and "free" in text:
                best = max(h[10] for h in before)
                detail = f" ({len(before)} candidate host(s); the most free memory is {_gb(best)})"
            elif before and "idle cores" in text:
                most = max(before, key=lambda h: h[9])
                detail = f" ({len(before)} candidate host(s); {sizing.describe(demand_, _host_now(most), most[1])})"
            elif before:
                detail = f" ({len(before)} host(s) passed the previous checks)"
            return Reason("no_host", f"Layer {lname}: {text}{detail}.", unblock)
    if not gpus_min and not dispatch_conf.gpu_backfill():
        # The GPU-host rule's reserve (dispatch/engine/gpu_hosts.py). Its other half, GPU frames
        # waiting for the host, only the scheduler's record can say (`gpu_host_kept`).
        kept = [
            h
            for h in remaining
            if h[11] > 0
            and gpu_hosts.decline_cpu_frame(
                cores=sizing.size(demand_, _host_now(h))[0] * CENTI,
                mem=mem_min,
                gpu_mem=gpu_mem_min,
                cores_idle=h[9],
                mem_idle=h[10],
                gpu_mem_idle=h[12],
                gpu_wanted=False,
                backfill=False,
            )
        ]
        if len(kept) == len(remaining):
            return Reason(
                "gpu_host_kept",
                f"Layer {lname}: the {len(kept)} host(s) with room are GPU hosts, kept for GPU work: a frame "
                "without a GPU must leave 1 GPU, 1 core, 4 GB of memory and 4 GB of GPU memory free there.",
                "Add hosts without GPUs with that tag, or set CUESCHED_GPU_BACKFILL=1 to let CPU frames use all "
                "of an idle GPU host.",
            )
    return None


def _never_reason(layer: tuple[Any, ...], facility: str, job_os: str | None) -> Reason | None:
    """The layer's frames fit no host of the farm as it is, idle or not: say so, and why."""
    _pk_layer, lname, str_tags, cores_min, mem_min, gpus_min, gpu_mem_min, threadable = layer[:8]
    tags = sorted(parse_tags(str_tags))
    if not tags:
        return None  # _host_reason says it (no tags: no host can match)
    need = _whole_cores_needed(cores_min, threadable)
    params = {
        "tags": tags,
        "facility": facility,
        "os": job_os,
        "cores": need * CENTI,
        "mem": mem_min,
        "gpus": gpus_min,
        "gpu_mem": gpu_mem_min,
    }
    row = _one(CAPACITY_SQL, params)
    tagged, placed, max_cores, max_mem, max_gpus, max_gpu_mem, fitting = (int(v) for v in row or (0,) * 7)
    if fitting:
        return None
    tag_text = ", ".join(f"`{t}`" for t in tags)
    prefix = f"No host can ever run a frame of layer {lname}"
    if not tagged:
        return Reason(
            "never_tag",
            f"{prefix}: no host carries tag {tag_text}.",
            "Tag hosts for this layer, or change the layer's tags. Waiting will not help.",
        )
    if not placed:
        where = "the job's facility" + (f" with OS {job_os}" if job_os else "")
        return Reason(
            "never_os",
            f"{prefix}: none of the {tagged} host(s) with tag {tag_text} is in {where}.",
            "Add hosts in this facility (and OS), or change the job's OS. Waiting will not help.",
        )
    problems = []
    if need * CENTI > max_cores:
        problems.append(f"a frame needs {need} cores and the largest host has {max_cores // CENTI}")
    if mem_min > max_mem:
        problems.append(f"a frame needs {_gb(mem_min)} of memory and the largest host has {_gb(max_mem)}")
    if gpus_min > max_gpus:
        problems.append(
            f"a frame needs {gpus_min} GPU(s) and "
            + ("no host has a GPU" if max_gpus == 0 else f"the most any host has is {max_gpus}")
        )
    if gpu_mem_min > max_gpu_mem:
        most = _gb(max_gpu_mem)
        problems.append(f"a frame needs {_gb(gpu_mem_min)} of GPU memory and the most any host has is {most}")
    if not problems:
        problems.append("no single host has enough cores, memory and GPUs together")
    return Reason(
        "never_fits",
        f"{prefix} ({placed} host(s) with tag {tag_text}): {'; '.join(problems)}.",
        "Add hosts that large, or lower the layer's cores, memory or GPUs. Waiting will not help: "
        "freeing hosts does not make them bigger.",
    )


def _finish(why: Why, view: dict[str, Any] | None) -> Why:
    if not why.reasons and why.recorded is None:
        if view is None or view.get("stale"):
            why.reasons.append(
                Reason(
                    "scheduler_down",
                    "Nothing in the database blocks this job, but no scheduler is running (or its view is stale).",
                    "Start the scheduler (`manage.py run_scheduler`).",
                )
            )
        else:
            why.reasons.append(
                Reason(
                    "ok",
                    "Nothing blocks this job now: a frame fits its caps and a host; the scheduler books it on "
                    "its next cycle (higher-priority jobs go first).",
                    "",
                )
            )
    return why


def explain_frame(frame: str, view: dict[str, Any] | None) -> Why:
    row = _one(FRAME_SQL, {"frame": frame})
    if row is None:
        raise LookupError(frame)
    pk, name, state, depend_count, job, layer, host, mem_reserved, mem_max_used, reason = row
    info = {
        "reason": reason or "",
        "pk": pk,
        "name": name,
        "state": state,
        "depend": depend_count,
        "layer": layer,
        "host": host,
        "memory": f"max RSS {_gb(mem_max_used)} (reserved {_gb(mem_reserved)})" if mem_max_used else "",
    }
    if state != "WAITING":
        why = explain_job(job, view)
        where = f" on {host}" if host else ""
        why.reasons = [Reason("frame_state", f"Frame {name} is {state}{where}, not WAITING.", "Nothing to book.")]
        if reason:
            # Why its last run ended so (a timeout, a memory failure no host can fit): issue 29.
            why.reasons.insert(0, Reason("frame_end", f"Frame {name} is {state}: {reason}.", "Retry the frame."))
        why.recorded = None
    elif depend_count:
        why = explain_job(job, view)
        why.reasons.insert(
            0,
            Reason(
                "dependency",
                f"Frame {name} waits on {depend_count} unmet dependency(ies).",
                "The frames it depends on must finish first.",
            ),
        )
    else:
        why = explain_job(job, view, layer=layer)
    why.frame = info
    return why
