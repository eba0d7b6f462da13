"""Placement's decisions pinned (issue 32): `HostView.find` and `fits` against a plain reference.

Placement is a hot loop that gets optimised; what it decides must not move. The reference here
is the search as it stood before that work (dispatch/engine/placement.py at a316f64), written
plainly over the view's own index: the same cells in the same order (so ties between equal
hosts break the same way), each host checked by the rules one after the other, sized by
`sizing.size` and scored by `stranding_score`, one host per cell, stopping at a perfect score
or after `candidates` cells. Random farms (mixed cores, memory, GPUs, tags, facilities, OS,
thread modes, allocations) meet thousands of random demands (threadable or not, fractional,
whole-host and all-but-N cores, max cores, GPUs, GPU memory) under every policy, with the
view updated between searches as the loop updates it (take, give, ledger rows, drops, GPU
wants). Every answer must be the same host object, the same cores and the same GPU-host
declines; a search that finds nothing is checked against every host of the view too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.gpu_hosts import GpuWant, GpuWants
from dispatch.engine.placement import CENTI, KB_PER_GB, Demand, HostRec, HostView
from dispatch.engine.scoring import stranding_score

GB = KB_PER_GB
TAGS = ("general", "render", "sim", "gpu", "comp")
FACILITIES = ("f1", "f2")
ALLOCS = ("a1", "a2", "a3")


# -- the reference ---------------------------------------------------------------------------
def ref_fits(
    view: HostView,
    host: HostRec,
    demand: Demand,
    facility: str,
    os: str | None,
    room: Callable[[str], int],
    declined: dict[str, int],
) -> int:
    """Whole cores the frame books on the host, 0 if a rule refuses it (declines counted)."""
    mem_eff = min(host.mem_idle, host.mem_free)
    gpu_mem_eff = min(host.gpu_mem_idle, host.gpu_mem_free)
    if host.facility != facility or (os is not None and host.os != os):
        return 0
    if not demand.threadable and host.thread_mode == sizing.THREAD_MODE_ALL:
        return 0
    cores = sizing.size(demand, host)[0]
    if cores <= 0 or cores * CENTI > host.cores_idle or cores * CENTI > host.cores_total:
        return 0
    if demand.mem > mem_eff or demand.gpus > host.gpus_idle or demand.gpu_mem > gpu_mem_eff:
        return 0
    if room(host.alloc) < cores:
        return 0
    if demand.gpus == 0 and host.gpus_idle > 0:
        why = gpu_hosts.decline_cpu_frame(
            cores=cores * CENTI,
            mem=demand.mem,
            gpu_mem=demand.gpu_mem,
            cores_idle=host.cores_idle,
            mem_idle=mem_eff,
            gpu_mem_idle=gpu_mem_eff,
            gpu_wanted=view.gpu_wants.want(host.tags, host.facility, host.os, host.gpus_idle, gpu_mem_eff),
            backfill=view.gpu_backfill,
        )
        if why is not None:
            declined[why] = declined.get(why, 0) + 1
            return 0
    return cores


def ref_score(view: HostView, host: HostRec, demand: Demand, cores: int) -> float:
    mem_eff, gpu_mem_eff = min(host.mem_idle, host.mem_free), min(host.gpu_mem_idle, host.gpu_mem_free)
    idle = (host.cores_idle, mem_eff, host.gpus_idle, gpu_mem_eff)
    return stranding_score(idle, (cores * CENTI, demand.mem, demand.gpus, demand.gpu_mem), view.weights)


def ref_find(
    view: HostView,
    demand: Demand,
    tags: tuple[str, ...],
    facility: str,
    os: str | None,
    room: Callable[[str], int],
    exclude: set[str] | None,
) -> tuple[tuple[HostRec, int] | None, dict[str, int]]:
    """The search before issue 32's optimisation, over the view's index: (choice, declines)."""
    declined: dict[str, int] = {}
    buckets = [view._by_tag[t] for t in tags if view._by_tag.get(t)]
    if not buckets:
        return None, declined
    # The largest host the view has held (it never shrinks): the last column of the index.
    keys = list(range(sizing.asked_cores(demand), view._max_cores + 1))
    if view.fit == "loosest":
        keys.reverse()
    seen: set[str] = set()
    best: tuple[HostRec, int] | None = None
    best_score = float("inf")
    cells = 0
    for k in keys:
        for by_cores in buckets:
            for (mem_gb, _gpus), pks in (by_cores.get(k) or {}).items():
                if mem_gb < demand.mem // GB:
                    continue
                for pk in pks:
                    if pk in seen:
                        continue
                    seen.add(pk)
                    host = view.hosts[pk]
                    cores = ref_fits(view, host, demand, facility, os, room, declined)
                    if not cores or (exclude is not None and pk in exclude):
                        continue
                    if view.fit != "scored":
                        return (host, cores), declined
                    score = ref_score(view, host, demand, cores)
                    if score < best_score:
                        best, best_score = (host, cores), score
                    cells += 1
                    break
                if best is not None and (best_score <= 0.0 or cells >= view.candidates):
                    return best, declined
    return best, declined


# -- random farms and demands ----------------------------------------------------------------
def random_shape(rng: random.Random) -> tuple[int, int, int, int, int]:
    """(cores, memory KB, GPUs, GPU memory KB, thread mode) of one kind of host."""
    gpus = rng.choice((0, 0, 0, 1, 2, 4))
    return (
        rng.choice((1, 2, 4, 8, 16, 24, 32, 48, 64, 96)) * CENTI,
        rng.choice((2, 8, 16, 32, 64, 96, 128, 256)) * GB + rng.choice((0, 0, 0, rng.randrange(GB))),
        gpus,
        gpus * rng.choice((8, 16, 24)) * GB,
        rng.choice((0, 0, 0, sizing.THREAD_MODE_ALL, sizing.THREAD_MODE_VARIABLE)),
    )


def random_host(rng: random.Random, i: int, shapes: list[tuple[int, int, int, int, int]]) -> HostRec:
    """A host of one of the farm's kinds; most are as the kind is, the others differ in a number
    or two (busy cores, memory or GPUs, the agent's report, more cores, the thread mode), so hosts of
    the same numbers and hosts that differ in one of them are both common."""
    cores, mem, gpus, gpu_mem, thread_mode = rng.choice(shapes)

    def some(n: int) -> int:
        return rng.randrange(n + 1) if n > 0 and rng.random() < 0.25 else 0

    busy_mem = some(mem)
    mem_idle = mem - busy_mem
    gpu_mem_idle = gpu_mem - some(gpu_mem)
    return HostRec(
        pk=f"h{i}",
        name=f"h{i}",
        alloc=rng.choice(ALLOCS),
        facility=rng.choice(FACILITIES) if rng.random() < 0.2 else FACILITIES[0],
        os=rng.choice(("linux", "linux", "linux", "centos", None)),
        thread_mode=thread_mode if rng.random() < 0.8 else rng.choice((0, 1, 2)),
        tags=tuple(rng.sample(TAGS, rng.randint(1, 3))),
        # A bigger host with as many cores idle as this kind has, now and then.
        cores_total=cores + some(4) * CENTI,
        cores_idle=cores - rng.choice((0, some(cores), some(cores // CENTI) * CENTI)),
        mem_idle=mem_idle,
        mem_total=mem,
        # The agent's report may be below or above the ledger's idle memory.
        mem_free=rng.choice(
            (mem_idle, mem_idle, max(0, mem_idle - some(4 * GB)), mem_idle + some(4 * GB), min(mem_idle, mem // 2))
        ),
        gpus_idle=gpus - some(gpus),
        gpu_mem_idle=gpu_mem_idle,
        gpu_mem_free=rng.choice((gpu_mem_idle, gpu_mem_idle, gpu_mem, max(0, gpu_mem_idle - some(12 * GB)))),
    )


def random_demand(rng: random.Random) -> Demand:
    gpus = rng.choice((0, 0, 0, 0, 1, 2))
    return Demand(
        cores_min=rng.choice((0, -100, -400, 50, 100, 100, 100, 150, 200, 250, 400, 800, 1600)),
        cores_max=rng.choice((0, 0, 0, 100, 200, 400, 800)),
        mem=rng.choice((0, 1, 2, 2, 4, 8, 16, 32, 64)) * GB + rng.choice((0, 0, rng.randrange(GB))),
        gpus=gpus,
        gpu_mem=(gpus * rng.choice((4, 8, 16)) * GB) if gpus else rng.choice((0, 0, 0, 2 * GB)),
        threadable=rng.random() < 0.6,
    )


def random_wants(rng: random.Random) -> GpuWants:
    return GpuWants(
        GpuWant(
            frozenset(rng.sample(TAGS, rng.randint(1, 2))),
            FACILITIES[0],
            rng.choice((None, "linux")),
            rng.choice((1, 2)),
            rng.choice((4, 8)) * GB,
        )
        for _ in range(rng.randint(0, 2))
    )


@pytest.mark.parametrize("fit", ["scored", "tightest", "loosest"])
@pytest.mark.parametrize("seed", range(4))
def test_find_and_fits_decide_as_the_reference_through_bookings_and_give_backs(fit: str, seed: int) -> None:
    rng = random.Random(f"{fit}-{seed}")
    searches = nothing_found = 0
    for _farm in range(6):
        view = HostView(fit, candidates=rng.choice((1, 2, 4, 8, 64)), gpu_backfill=rng.random() < 0.3)
        shapes = [random_shape(rng) for _ in range(rng.randint(2, 8))]
        view.replace([random_host(rng, i, shapes) for i in range(rng.randint(1, 150))])
        demands = [random_demand(rng) for _ in range(12)]  # layers repeat their shape
        taken: list[tuple[str, int, int, int, int]] = []
        for _step in range(150):
            demand = rng.choice(demands)
            tags = tuple(rng.sample(TAGS, rng.randint(1, 3)))
            facility = FACILITIES[0] if rng.random() < 0.9 else FACILITIES[1]
            os = rng.choice((None, None, "linux", "centos"))
            rooms = {a: rng.choice((0, 2, 8, 1000)) if rng.random() < 0.3 else 1000 for a in ALLOCS}
            room = rooms.__getitem__
            exclude = set(rng.sample(sorted(view.hosts), min(3, len(view.hosts)))) if rng.random() < 0.1 else None

            expected, declined = ref_find(view, demand, tags, facility, os, room, exclude)
            found = view.find(demand, tags, facility=facility, os=os, room=room, exclude=exclude)
            searches += 1
            assert (found is None) == (expected is None), (demand, tags)
            if found is not None and expected is not None:
                assert found[0] is expected[0] and found[1] == expected[1], (demand, tags, found, expected)
            assert view.gpu_declined == declined
            if found is None:
                nothing_found += 1
                # Plainly: no host of the view with one of the tags would take the frame.
                assert not any(
                    set(h.tags) & set(tags)
                    and ref_fits(view, h, demand, facility, os, room, {})
                    and (exclude is None or h.pk not in exclude)
                    for h in view.hosts.values()
                )
            # The loop's hint: the same host asked again, and a few others.
            others = rng.sample(list(view.hosts.values()), min(3, len(view.hosts)))
            for host in ([found[0]] if found is not None else []) + others:
                declined_before = dict(view.gpu_declined)
                want = ref_fits(view, host, demand, facility, os, room, declined_before)
                assert view.fits(host, demand, facility=facility, os=os, room=room) == want
                assert view.gpu_declined == declined_before

            # Move the view as the loop does.
            r = rng.random()
            if found is not None and r < 0.6:
                host, cores = found
                amounts = (cores * CENTI, demand.mem, demand.gpus, demand.gpu_mem)
                view.take(host, *amounts)
                taken.append((host.pk, *amounts))
            elif taken and r < 0.75:
                view.give(*taken.pop(rng.randrange(len(taken))))
            elif r < 0.8 and view.hosts:
                host = rng.choice(list(view.hosts.values()))
                # The ledger's row is the host's state: none of its reservations is undone after it.
                taken = [t for t in taken if t[0] != host.pk]
                view.set_ledger(
                    [(host.pk, host.cores_total, host.mem_total, host.gpus_idle, host.gpu_mem_idle)],
                    {host.pk: rng.randrange(2 * GB)} if rng.random() < 0.5 else None,
                )
            elif r < 0.82 and len(view.hosts) > 1:
                pk = rng.choice(sorted(view.hosts))
                taken = [t for t in taken if t[0] != pk]
                view.drop(pk)
            elif r < 0.87:
                view.set_gpu_wants(random_wants(rng))
    assert searches == 6 * 150
    assert 0 < nothing_found < searches  # both answers were exercised
