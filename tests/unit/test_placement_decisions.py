"""Placement's decisions pinned (issue 32): `HostView.find` and `fits` against a plain reference.

Placement is a hot loop that gets optimised; what it decides must not move. `RefView` here is
the host view as it stood before that work (dispatch/engine/placement.py at a316f64), kept
plainly and apart: its own copies of the hosts, its own index (tag -> idle whole cores ->
(idle GB, idle GPUs) -> hosts, kept by the same steps, so its cells and hosts come in the same
order and ties between equal hosts break the same way), and the search over it: every number
of idle cores from the frame's floor up, each host checked by the rules one after the other,
sized by `sizing.size` and scored by `stranding_score`, one host per cell, stopping at a
perfect score or after `candidates` cells. Random farms (a few kinds of host, mixed cores,
memory, GPUs, tags, facilities, OS, thread modes, allocations, and hosts that differ from
their kind in a number or two) meet thousands of random demands (threadable or not,
fractional, whole-host and all-but-N cores, max cores, GPUs, GPU memory) under every policy,
with both views moved alike between searches as the loop moves its own (take, give, ledger
rows, drops, GPU wants). Every answer must be the same host, the same cores and the same
GPU-host declines; a search that finds nothing is checked against every host too.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from dispatch.engine import gpu_hosts, placement, sizing
from dispatch.engine.gpu_hosts import GpuWant, GpuWants
from dispatch.engine.placement import CENTI, KB_PER_GB, Demand, HostRec, HostView
from dispatch.engine.scoring import DEFAULT_WEIGHTS, stranding_score

GB = KB_PER_GB
TAGS = ("general", "render", "sim", "gpu", "comp")
FACILITIES = ("f1", "f2")
ALLOCS = ("a1", "a2", "a3")


# -- the reference ---------------------------------------------------------------------------
def mem_eff(host: HostRec) -> int:
    return min(host.mem_idle, host.mem_free)


def gpu_mem_eff(host: HostRec) -> int:
    return min(host.gpu_mem_idle, host.gpu_mem_free)


def ref_cell(host: HostRec) -> tuple[int, tuple[int, int]]:
    return host.cores_idle // CENTI, (max(mem_eff(host), 0) // GB, host.gpus_idle)


class RefView:
    """The host view before issue 32's optimisation: index, bookkeeping and search, plainly."""

    def __init__(self, fit: str, candidates: int, gpu_backfill: bool) -> None:
        self.fit, self.candidates, self.gpu_backfill = fit, candidates, gpu_backfill
        self.gpu_wants = gpu_hosts.NO_WANTS
        self.hosts: dict[str, HostRec] = {}
        self.by_tag: dict[str, dict[int, dict[tuple[int, int], set[str]]]] = {}
        self.max_cores = 0

    # The index.
    def put(self, host: HostRec) -> None:
        self.hosts[host.pk] = host
        k, cell = ref_cell(host)
        self.max_cores = max(self.max_cores, host.cores_total // CENTI)
        for tag in host.tags:
            self.by_tag.setdefault(tag, {}).setdefault(k, {}).setdefault(cell, set()).add(host.pk)

    def unindex(self, host: HostRec, k: int, cell: tuple[int, int]) -> None:
        for tag in host.tags:
            by_cell = self.by_tag.get(tag, {}).get(k)
            if by_cell is not None and cell in by_cell:
                by_cell[cell].discard(host.pk)
                if not by_cell[cell]:
                    del by_cell[cell]

    def moved(self, host: HostRec, old: tuple[int, tuple[int, int]]) -> None:
        new = ref_cell(host)
        if new != old:
            self.unindex(host, *old)
            for tag in host.tags:
                self.by_tag[tag].setdefault(new[0], {}).setdefault(new[1], set()).add(host.pk)

    # What the loop does to the view.
    def drop(self, pk: str) -> None:
        host = self.hosts.pop(pk, None)
        if host is not None:
            self.unindex(host, *ref_cell(host))

    def take(self, pk: str, cores: int, mem: int, gpus: int, gpu_mem: int) -> None:
        host = self.hosts[pk]
        old = ref_cell(host)
        host.cores_idle -= cores
        host.mem_idle -= mem
        host.mem_free -= mem
        host.gpus_idle -= gpus
        host.gpu_mem_idle -= gpu_mem
        host.gpu_mem_free -= gpu_mem
        self.moved(host, old)

    def give(self, pk: str, cores: int, mem: int, gpus: int, gpu_mem: int) -> None:
        host = self.hosts.get(pk)
        if host is None:
            return
        old = ref_cell(host)
        host.cores_idle += cores
        host.mem_idle += mem
        host.mem_free = min(host.mem_free + mem, host.mem_total) if host.mem_total else host.mem_free + mem
        host.gpus_idle += gpus
        host.gpu_mem_idle += gpu_mem
        host.gpu_mem_free += gpu_mem
        self.moved(host, old)

    def set_ledger(self, rows: Sequence[Sequence[Any]], freed_mem: dict[str, int] | None) -> None:
        for pk, cores_idle, mem_idle, gpus_idle, gpu_mem_idle in rows:
            host = self.hosts.get(pk)
            if host is None:
                continue
            old = ref_cell(host)
            host.gpu_mem_free += max(0, gpu_mem_idle - host.gpu_mem_idle)
            host.cores_idle, host.mem_idle, host.gpus_idle, host.gpu_mem_idle = (
                cores_idle,
                mem_idle,
                gpus_idle,
                gpu_mem_idle,
            )
            if freed_mem and pk in freed_mem:
                host.mem_free = min(host.mem_free + freed_mem[pk], host.mem_total or host.mem_free + freed_mem[pk])
            self.moved(host, old)

    # The rules and the search.
    def fits(
        self, host: HostRec, demand: Demand, facility: str, os: str | None, room: Callable[[str], int], declined: dict
    ) -> int:
        """Whole cores the frame books on the host, 0 if a rule refuses it (declines counted)."""
        if host.facility != facility or (os is not None and host.os != os):
            return 0
        if not demand.threadable and host.thread_mode == sizing.THREAD_MODE_ALL:
            return 0
        cores = sizing.size(demand, host)[0]
        if cores <= 0 or cores * CENTI > host.cores_idle or cores * CENTI > host.cores_total:
            return 0
        if demand.mem > mem_eff(host) or demand.gpus > host.gpus_idle or demand.gpu_mem > gpu_mem_eff(host):
            return 0
        if room(host.alloc) < cores:
            return 0
        if demand.gpus == 0 and host.gpus_idle > 0:
            why = gpu_hosts.decline_cpu_frame(
                cores=cores * CENTI,
                mem=demand.mem,
                gpu_mem=demand.gpu_mem,
                cores_idle=host.cores_idle,
                mem_idle=mem_eff(host),
                gpu_mem_idle=gpu_mem_eff(host),
                gpu_wanted=self.gpu_wants.want(host.tags, host.facility, host.os, host.gpus_idle, gpu_mem_eff(host)),
                backfill=self.gpu_backfill,
            )
            if why is not None:
                declined[why] = declined.get(why, 0) + 1
                return 0
        return cores

    def score(self, host: HostRec, demand: Demand, cores: int) -> float:
        idle = (host.cores_idle, mem_eff(host), host.gpus_idle, gpu_mem_eff(host))
        return stranding_score(idle, (cores * CENTI, demand.mem, demand.gpus, demand.gpu_mem), DEFAULT_WEIGHTS)

    def find(
        self,
        demand: Demand,
        tags: Iterable[str],
        facility: str,
        os: str | None,
        room: Callable[[str], int],
        exclude: set[str] | None,
    ) -> tuple[tuple[str, int] | None, dict[str, int]]:
        """(the chosen host's pk and cores, or None; the GPU hosts' declines)."""
        declined: dict[str, int] = {}
        buckets = [self.by_tag[t] for t in tags if self.by_tag.get(t)]
        if not buckets:
            return None, declined
        keys = list(range(sizing.asked_cores(demand), self.max_cores + 1))
        if self.fit == "loosest":
            keys.reverse()
        seen: set[str] = set()
        best: tuple[str, int] | None = None
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
                        host = self.hosts[pk]
                        cores = self.fits(host, demand, facility, os, room, declined)
                        if not cores or (exclude is not None and pk in exclude):
                            continue
                        if self.fit != "scored":
                            return (pk, cores), declined
                        score = self.score(host, demand, cores)
                        if score < best_score:
                            best, best_score = (pk, cores), score
                        cells += 1
                        break
                    if best is not None and (best_score <= 0.0 or cells >= self.candidates):
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
    against_reference(fit, seed)


def test_the_same_decisions_when_the_view_forgets_what_it_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view that drops its remembered host shapes every few entries, in the middle of searches."""
    monkeypatch.setattr(placement, "MEMO_MAX", 7, raising=False)  # raising: the test runs before issue 32 too
    for view in against_reference("scored", 0):
        remembered = getattr(view, "_memo", {})
        assert len(remembered) + sum(len(shapes) for shapes in remembered.values()) <= 7


def test_a_swapped_sizing_rule_is_used_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab swaps `sizing.size` for a run (dispatch.lab.placement_loop): nothing sized before holds."""
    view = HostView("scored")
    host = HostRec(
        pk="h", name="h", alloc="a1", facility="f1", os="linux", thread_mode=0, tags=("general",),
        cores_total=3200, cores_idle=3200, mem_idle=64 * GB, mem_free=64 * GB, mem_total=64 * GB,
        gpus_idle=0, gpu_mem_idle=0, gpu_mem_free=0,
    )  # fmt: skip
    view.replace([host])
    demand = Demand(cores_min=100, cores_max=0, mem=16 * GB, gpus=0, gpu_mem=0, threadable=True)
    room = {a: 1000 for a in ALLOCS}.__getitem__
    before = view.fits(host, demand, facility=host.facility, os=None, room=room)
    assert before == sizing.size(demand, host)[0] > 1  # its memory's share of the host
    monkeypatch.setattr(sizing, "size", lambda _demand, _host: (1, sizing.ASKED))
    assert view.fits(host, demand, facility=host.facility, os=None, room=room) == 1
    found = view.find(demand, host.tags, facility=host.facility, os=None, room=room)
    assert found is not None and found[1] == 1


def against_reference(fit: str, seed: int) -> list[HostView]:
    """Six random farms, 150 searches each, the view and the reference moved alike: the views."""
    rng = random.Random(f"{fit}-{seed}")
    views = []
    searches = nothing_found = 0
    for _farm in range(6):
        candidates, backfill = rng.choice((1, 2, 4, 8, 64)), rng.random() < 0.3
        view = HostView(fit, candidates=candidates, gpu_backfill=backfill)
        views.append(view)
        ref = RefView(fit, candidates, backfill)
        shapes = [random_shape(rng) for _ in range(rng.randint(2, 8))]
        farm = [random_host(rng, i, shapes) for i in range(rng.randint(1, 150))]
        view.replace(farm)
        for host in farm:
            ref.put(dataclasses.replace(host))  # its own copy, moved by its own bookkeeping
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

            expected, declined = ref.find(demand, tags, facility, os, room, exclude)
            found = view.find(demand, tags, facility=facility, os=os, room=room, exclude=exclude)
            searches += 1
            assert (None if found is None else (found[0].pk, found[1])) == expected, (demand, tags)
            assert view.gpu_declined == declined
            if found is None:
                nothing_found += 1
                # Plainly: no host with one of the tags would take the frame (the search stops at
                # the biggest host's cores: one given back more than it has lies past them).
                assert not any(
                    set(h.tags) & set(tags)
                    and h.cores_idle // CENTI <= ref.max_cores
                    and ref.fits(h, demand, facility, os, room, {})
                    and (exclude is None or h.pk not in exclude)
                    for h in ref.hosts.values()
                )
            # The loop's hint: the same host asked again, and a few others.
            others = rng.sample(sorted(view.hosts), min(3, len(view.hosts)))
            for pk in ([found[0].pk] if found is not None else []) + others:
                declined_before = dict(view.gpu_declined)
                want = ref.fits(ref.hosts[pk], demand, facility, os, room, declined_before)
                assert view.fits(view.hosts[pk], demand, facility=facility, os=os, room=room) == want
                assert view.gpu_declined == declined_before

            # Move both views as the loop moves its own.
            r = rng.random()
            if found is not None and r < 0.6:
                host, cores = found
                amounts = (cores * CENTI, demand.mem, demand.gpus, demand.gpu_mem)
                view.take(host, *amounts)
                ref.take(host.pk, *amounts)
                taken.append((host.pk, *amounts))
            elif taken and r < 0.75:
                back = taken.pop(rng.randrange(len(taken)))
                view.give(*back)
                ref.give(*back)
            elif r < 0.8 and view.hosts:
                host = view.hosts[rng.choice(sorted(view.hosts))]
                # The ledger's row is the host's state: none of its reservations is undone after it.
                taken = [t for t in taken if t[0] != host.pk]
                rows = [(host.pk, host.cores_total, host.mem_total, host.gpus_idle, host.gpu_mem_idle)]
                freed = {host.pk: rng.randrange(2 * GB)} if rng.random() < 0.5 else None
                view.set_ledger(rows, freed)
                ref.set_ledger(rows, freed)
            elif r < 0.82 and len(view.hosts) > 1:
                pk = rng.choice(sorted(view.hosts))
                taken = [t for t in taken if t[0] != pk]
                view.drop(pk)
                ref.drop(pk)
            elif r < 0.87:
                wants = random_wants(rng)
                view.set_gpu_wants(wants)
                ref.gpu_wants = wants
            elif r < 0.9:
                # Many frames on one host: a column of idle cores empties and fills again.
                pk = rng.choice(sorted(view.hosts))
                host = view.hosts[pk]
                amounts = (host.cores_idle // CENTI * CENTI, 0, 0, 0)
                view.take(host, *amounts)
                ref.take(pk, *amounts)
                taken.append((pk, *amounts))
            elif r < 0.91:
                # A give-back the view never took (its ledger row came first): idle may pass the total.
                back = (rng.choice(sorted(view.hosts)), rng.randrange(4) * CENTI, rng.randrange(4 * GB), 0, 0)
                view.give(*back)
                ref.give(*back)
        # Both views' bookkeeping kept the hosts alike.
        assert view.hosts.keys() == ref.hosts.keys()
        for pk, host in view.hosts.items():
            assert dataclasses.astuple(host) == dataclasses.astuple(ref.hosts[pk])
    assert searches == 6 * 150
    assert 0 < nothing_found < searches  # both answers were exercised
    return views
