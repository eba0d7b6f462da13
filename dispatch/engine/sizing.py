"""How many whole cores one frame books on one host: Cuebot's rule, cores from memory.

A cap stands for a share of the farm. A frame that takes 127 GB of a 128 GB host leaves its
other cores unable to run anything, so charging it the 1 core its layer asks would let a show
hold far more of the farm than its burst says. Cuebot (`VirtualProc.build`, `getCoreSpan`)
and the Rust scheduler both book a threadable frame the cores its memory strands; this module
is that rule, as one pure function of the layer's demand and the host's state, so placement,
the dispatch loop and the why-not page all size a frame the same way.

The rule, for a threadable layer asking `min` cores (>= 1) on a host with `total` cores:

1. thread mode ALL: every idle whole core;
2. otherwise, if the host's idle memory minus the frame's memory is 1.5 GB or less (Cuebot's
   `MEM_STRANDED_THRESHHOLD`): every idle whole core, since nothing else could use them;
3. otherwise Cuebot's core span: `Math.round(mem / (idle_mem / total))`, rounded half up, with
   the ledger's idle memory (host.int_mem_idle), so a frame on a partly full host gets more;
4. thread mode VARIABLE: at least 2 (a host with one idle whole core refuses the frame);
5. at least `min` (a fraction rounded up); then at most the layer's max cores (layer.int_cores_max,
   0 = none), never below `min`;
6. at most the host's idle whole cores (never below `min`: the host refuses instead).

`cores` 0 books the whole host (all its cores, so the frame waits for an idle host) and a
negative N all but N of them (a host with N or fewer cores refuses it). A non-threadable layer
books 1 core whatever it asks. The job's and folder's max cores and the subscription's burst
never shrink the result: they refuse the booking (dispatch.engine.loop, the Store).

Where this differs from Cuebot, and why:

* Cuebot books a negative request only on a wholly idle host (`canHandleNegativeCoresRequest`);
  here all but N needs total - N idle cores, the cores it takes, no more: the same booking on
  an idle host, and a host with N busy cores is not kept empty for no reason.
* Cuebot's stranded-core pick-up (`host.strandedCores`, rebooking a host after a frame leaves
  cores its memory stranded) is not done: steps 2 and 3 already give those cores to the frame
  that strands them, at booking time, and a transient per-host bonus decided outside the
  booking would be one more input the Store's check and the why-not page could not see.
* Cuebot's "selfish services" (every idle core for listed services) is not configured here.

The Rust scheduler sizes on total memory, truncates instead of rounding, skips the memory
span on VARIABLE hosts, and shrinks a frame to the job's remaining cores; the issue pins
Cuebot's rounding, idle memory, and refusal over shrinking, so those are not followed.
"""

from __future__ import annotations

from typing import Protocol

CENTI = 100
KB_PER_GB = 1024 * 1024
# Cuebot's Dispatcher.MEM_STRANDED_THRESHHOLD (CueUtil.GB + CueUtil.MB512), in KB.
MEM_STRANDED_KB = KB_PER_GB + 512 * 1024

THREAD_MODE_AUTO = 0
THREAD_MODE_ALL = 1
THREAD_MODE_VARIABLE = 2

# What decided a booking's size (cores > 0) ...
SINGLE = "single"  # non-threadable: 1 core
ASKED = "asked"  # the layer's own min cores
MEMORY = "memory"  # the frame's memory share of the host
STRANDED = "stranded"  # it would leave 1.5 GB or less of memory: every idle core
THREAD_ALL = "thread_all"  # host in thread mode ALL: every idle core
VARIABLE = "variable"  # host in thread mode VARIABLE: at least 2
MAX = "max"  # clamped to the layer's max cores
IDLE = "idle"  # the memory share is more than the idle cores: all of them
WHOLE_HOST = "whole_host"  # cores 0
ALL_BUT = "all_but"  # cores -N
# ... or why the host refuses the frame (cores == 0).
NO_IDLE_CORE = "no_idle_core"
BELOW_MIN = "below_min"
VARIABLE_ONE_CORE = "variable_one_core"
HOST_NOT_IDLE = "host_not_idle"
HOST_TOO_SMALL = "host_too_small"

REFUSALS = frozenset({NO_IDLE_CORE, BELOW_MIN, VARIABLE_ONE_CORE, HOST_NOT_IDLE, HOST_TOO_SMALL})


class LayerDemand(Protocol):
    """What sizing reads of a layer (placement.Demand): centicores and KB, as stored."""

    @property
    def cores_min(self) -> int: ...
    @property
    def cores_max(self) -> int: ...
    @property
    def mem(self) -> int: ...
    @property
    def threadable(self) -> bool: ...


class HostState(Protocol):
    """What sizing reads of a host (placement.HostRec): centicores and KB, the ledger's values."""

    @property
    def cores_total(self) -> int: ...
    @property
    def cores_idle(self) -> int: ...
    @property
    def mem_idle(self) -> int: ...
    @property
    def thread_mode(self) -> int: ...


def asked_cores(demand: LayerDemand) -> int:
    """The whole cores a layer's frame asks for at least (its floor on any host; 0/negative: 1).

    A fraction of a core above one is rounded up: the spec gives whole cores, but a service
    (Cuebot's `service.int_cores_min`, edited to the hundredth) may give 2.5, and a frame must
    never book below its layer's minimum (3, not 2)."""
    if not demand.threadable or demand.cores_min <= 0:
        return 1
    return max(1, _whole_up(demand.cores_min))


def _whole_up(centicores: int) -> int:
    return -(-centicores // CENTI)


def core_span(mem: int, mem_idle: int, total_cores: int) -> int:
    """Cuebot's getCoreSpan: the frame's memory over the host's idle memory per core, rounded.

    `idle_memory / total_cores` is a Java long division, then `Math.round` rounds the quotient
    half up; (2a + b) // 2b is that rounding exactly for non-negative integers.
    """
    per_core = mem_idle // total_cores
    if per_core <= 0:
        return 1 << 30  # no memory per core left: the memory strands every core
    return (2 * mem + per_core) // (2 * per_core)


def size(demand: LayerDemand, host: HostState) -> tuple[int, str]:
    """(whole cores the frame books on the host, the rule that decided it); (0, refusal) if none.

    Cheap and allocation-free on the hot path: placement calls it for every candidate host.
    """
    idle = host.cores_idle // CENTI
    if not demand.threadable:
        return (1, SINGLE) if idle >= 1 else (0, NO_IDLE_CORE)
    total = host.cores_total // CENTI
    if demand.cores_min <= 0:
        # 0: the whole host; -N: all but N (truncated toward zero, as centicores are).
        want = total + int(demand.cores_min / CENTI)
        if want <= 0:
            return 0, HOST_TOO_SMALL
        if want > idle:
            return 0, HOST_NOT_IDLE
        return want, (WHOLE_HOST if want == total else ALL_BUT)
    if idle < 1:
        return 0, NO_IDLE_CORE
    asked = asked_cores(demand)
    mode = host.thread_mode
    if mode == THREAD_MODE_ALL:
        cores, rule = idle, THREAD_ALL
    else:
        if host.mem_idle - demand.mem <= MEM_STRANDED_KB:
            cores, rule = idle, STRANDED
        else:
            cores, rule = core_span(demand.mem, host.mem_idle, total), MEMORY
        if mode == THREAD_MODE_VARIABLE and cores <= 2:
            if idle < 2:
                return 0, VARIABLE_ONE_CORE
            cores, rule = 2, VARIABLE
    if cores < asked:
        cores, rule = asked, ASKED
    cores_max = demand.cores_max // CENTI
    if demand.cores_max > 0 and cores > cores_max:
        cores, rule = max(asked, cores_max), MAX
    if cores > idle:
        if idle < asked:
            return 0, BELOW_MIN
        cores, rule = idle, IDLE
    return cores, rule


def _gb(kb: int) -> str:
    value = kb / KB_PER_GB
    return f"{value:.0f} GB" if value == int(value) or value >= 10 else f"{value:.1f} GB"


def _n(count: int, what: str = "core") -> str:
    return f"{count} {what}" + ("" if count == 1 else "s")


def describe(demand: LayerDemand, host: HostState, name: str = "the host") -> str:
    """One sentence for ops: what the frame asks, what it books on this host, and why.

    "asks 1 core, books 8 on h1: its 32 GB are 8 cores' share of the host's 128 GB idle memory
    over 32 cores" - the why-not page and the loop's published reasons say this, so a job capped
    at 4 cores whose frames book 8 is not a mystery.
    """
    cores, rule = size(demand, host)
    total = host.cores_total // CENTI
    idle = host.cores_idle // CENTI
    if demand.threadable and demand.cores_min == 0:
        ask = "asks the whole host (cores 0)"
    elif demand.threadable and demand.cores_min < 0:
        ask = f"asks all but {_n(-int(demand.cores_min / CENTI))} (cores {int(demand.cores_min / CENTI)})"
    else:
        ask = f"asks {_n(max(1, _whole_up(demand.cores_min)) if demand.cores_min > 0 else 1)}"
    if rule in REFUSALS:
        why = {
            NO_IDLE_CORE: "it has no idle whole core",
            BELOW_MIN: f"it has {_n(idle)} idle",
            VARIABLE_ONE_CORE: "it is in thread mode VARIABLE with one idle core, and a threadable frame "
            "takes at least 2 there",
            HOST_NOT_IDLE: f"that is {_n(total + int(demand.cores_min / CENTI))} and it has {_n(idle)} idle",
            HOST_TOO_SMALL: f"it has only {_n(total)}",
        }[rule]
        return f"{ask}: {name} refuses it, {why}"
    books = f"{ask}, books {cores} on {name}"
    if rule == MEMORY:
        share = f"{cores} cores'" if cores != 1 else "1 core's"
        return (
            f"{books}: its {_gb(demand.mem)} are {share} share of the host's {_gb(host.mem_idle)} idle memory "
            f"over {_n(total)}"
        )
    reason = {
        SINGLE: "the layer is not threadable, so it takes 1 core whatever it asks",
        ASKED: "",
        STRANDED: f"it would leave {_gb(max(host.mem_idle - demand.mem, 0))} of the host's memory (1.5 GB or less), "
        "so it takes every idle core",
        THREAD_ALL: "the host is in thread mode ALL, so it takes every idle core",
        VARIABLE: "the host is in thread mode VARIABLE, where a threadable frame takes at least 2",
        MAX: f"the rule gives more, clamped to the layer's max cores ({cores})",
        IDLE: f"its memory share is more than the host's {_n(idle)} idle, so it takes them all",
        WHOLE_HOST: f"all the host's {_n(total)}",
        ALL_BUT: f"all but {_n(total - cores)} of the host's {total}",
    }[rule]
    return f"{books}: {reason}" if reason else books
