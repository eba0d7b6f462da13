"""Host choice: an in-memory view of the bookable hosts, indexed by tag and idle cores.

The view is a hint, never the truth: every booking is still guarded in the database (idle
never below zero, host OPEN), and a host whose guard fails is re-read. It is loaded from the
database periodically and corrected from the RETURNING of the dispatcher's and the
completion path's own writes, so between reloads it tracks this process's bookings exactly.
Only the dispatch loop's thread touches it: no lock.

Placement rules (reference §3.6): the host is UP and OPEN and has pinged within the lost-host
timeout (a silent host is not given new work), in the job's facility, in an
allocation the show has room on; one of its tags (host_tag.str_tag) is one of the layer's
tags; the job's OS is NULL or equal to host_stat.str_os; idle cores, effective memory
(LEAST(host.int_mem_idle, host_stat.int_mem_free)), GPUs and GPU memory cover the frame; a
frame that asks no GPU meets the GPU-host rule (`gpu_hosts`). Among those, the host whose
booking strands the least (`scoring`, the Rust scheduler's E-PVM score over cores, memory and
GPUs) wins by default; `tightest` (fewest idle cores) and `loosest` are the other policies.

The index is tag -> idle whole cores -> (idle memory in whole GB, idle GPUs) -> hosts. Hosts in
one cell score nearly alike, so a search scores one host per cell, tightest cores first, and
stops at a perfect score or after `candidates` cells: the cost of a choice grows with the
shapes of idle hosts, not with their number.

What a host's numbers decide for a frame (its size, whether its cores, memory and GPUs cover
the frame, and its score) is a pure function of those numbers and the frame's demand, and a
drain meets the same few host states again and again (hosts of one shape, booked alike): the
view remembers it per demand (`HostView._shape`), so a search re-checks only what can differ
between two hosts of the same numbers (facility, OS, the allocation's room, the GPU-host rule)
and `stranding_score` runs once per state, not once per host visited. A search walks only the
idle-core columns that hold hosts of its tags (issue 32: the same choices, in under a third of
the time at 1,200 hosts).
"""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from dispatch.engine import gpu_hosts, sizing
from dispatch.engine.scoring import DEFAULT_WEIGHTS, Weights, stranding_score

logger = logging.getLogger(__name__)

CENTI = 100
KB_PER_GB = 1024 * 1024
THREAD_MODE_ALL = sizing.THREAD_MODE_ALL
FIT_POLICIES = ("scored", "tightest", "loosest")

# The index's cell of a host: (idle whole cores, (idle memory in whole GB, idle GPUs)).
Cell = tuple[int, int]

# What a host's numbers decide for one demand: (whole cores it would book, 0 if the numbers
# refuse the frame; its score under the scored policy, else 0.0). See `HostView._shape`.
Shape = tuple[int, float]
_REFUSED: Shape = (0, 0.0)
# The remembered shapes, all demands together, are dropped past this many (a few MB): the
# numbers a long-running view meets (agents report free memory to the KB) are unbounded.
MEMO_MAX = 20_000

# A dispatch worker's share of the farm, (index, count). Hosts and jobs are dealt out by the
# hash of their id, so two workers never pick the same frame or the same host: what they
# share is only the accounting (subscriptions, folders, the Store).
Shard = tuple[int, int]
ALL = (0, 1)


def in_shard(column: str) -> str:
    """SQL: the row whose id `column` belongs to the shard in %(shard)s of %(shards)s (see shard_params)."""
    return f"mod(hashtext({column}) & 2147483647, %(shards)s) = %(shard)s"


def shard_params(shard: Shard) -> dict[str, int]:
    return {"shard": shard[0], "shards": shard[1]}

# Every bookable host with its tags; effective memory is computed in Python from both columns,
# because our own bookings move int_mem_idle but not the agent-reported int_mem_free.
HOSTS_SQL = f"""
SELECT h.pk_host, h.str_name, h.pk_alloc, a.pk_facility, hs.str_os, h.int_thread_mode,
       h.int_cores, h.int_cores_idle, h.int_mem_idle, hs.int_mem_free, hs.int_mem_total,
       h.int_gpus_idle, h.int_gpu_mem_idle, hs.int_gpu_mem_free,
       COALESCE((SELECT array_agg(DISTINCT t.str_tag) FROM host_tag t WHERE t.pk_host = h.pk_host),
                '{{}}'::text[])
FROM host h
JOIN host_stat hs ON hs.pk_host = h.pk_host
JOIN alloc a ON a.pk_alloc = h.pk_alloc
WHERE h.str_lock_state = 'OPEN' AND hs.str_state = 'UP'
  AND hs.ts_ping >= now() - make_interval(secs => %(stale_after)s)
  AND {in_shard('h.pk_host')}
"""
HOSTS_BY_ID_SQL = HOSTS_SQL + " AND h.pk_host = ANY(%(hosts)s::text[])"
# Hosts whose idle resources changed lately: every booking, completion and give-back stamps
# host.ts_last_updated. The window overlaps the previous read, so a transaction that commits
# after a read with an older now() is still seen by the next one.
HOSTS_CHANGED_SQL = HOSTS_SQL + " AND h.ts_last_updated >= now() - make_interval(secs => %(window)s)"


def parse_tags(raw: str | None) -> frozenset[str]:
    """Layer tags: `|`-separated, spaces removed, empty entries dropped (reference §1)."""
    if not raw:
        return frozenset()
    return frozenset(t for t in raw.replace(" ", "").split("|") if t)


@dataclass(slots=True)
class HostRec:
    """One bookable host. Cores in centicores, memory in KB."""

    pk: str
    name: str
    alloc: str
    facility: str
    os: str | None
    thread_mode: int
    tags: tuple[str, ...]
    cores_total: int
    cores_idle: int
    mem_idle: int
    mem_free: int
    mem_total: int
    gpus_idle: int
    gpu_mem_idle: int
    gpu_mem_free: int

    @property
    def mem_effective(self) -> int:
        return min(self.mem_idle, self.mem_free)

    @property
    def gpu_mem_effective(self) -> int:
        return min(self.gpu_mem_idle, self.gpu_mem_free)

    @property
    def idle_whole_cores(self) -> int:
        return self.cores_idle // CENTI


@dataclass(frozen=True, slots=True)
class Demand:
    """What one frame of a layer asks for; cores as stored on the layer (centicores)."""

    cores_min: int
    cores_max: int
    mem: int
    gpus: int
    gpu_mem: int
    threadable: bool

    @property
    def index_floor(self) -> int:
        """The least idle whole cores a host can have and still take the frame."""
        return sizing.asked_cores(self)


class HostView:
    """Bookable hosts indexed by tag, then by whole idle cores, then by idle memory and GPUs."""

    def __init__(
        self,
        fit: str = "scored",
        *,
        stale_after: float = 300.0,
        shard: Shard = ALL,
        candidates: int = 64,
        gpu_backfill: bool = False,
        weights: Weights = DEFAULT_WEIGHTS,
    ) -> None:
        if fit not in FIT_POLICIES:
            raise ValueError(f"host fit policy must be one of {', '.join(FIT_POLICIES)}, got {fit!r}")
        self.fit = fit
        self.stale_after = stale_after
        self.shard = shard
        self.candidates = max(1, candidates)
        self.gpu_backfill = gpu_backfill
        self.weights = weights
        self.hosts: dict[str, HostRec] = {}
        self._by_tag: dict[str, dict[int, dict[Cell, set[str]]]] = {}
        # Per tag, the idle whole cores that have hosts, in order: a search walks these, not
        # every number from the frame's floor to the biggest host (most hold no host of a tag).
        self._columns: dict[str, list[int]] = {}
        self._max_cores = 0
        # Bumped by every change other than `take`: while it holds, a host `find` chose for a
        # layer is still that layer's best choice as long as it fits (see `fits`).
        self.generation = 0
        # The GPU layers waiting this cycle (`set_gpu_wants`), and why GPU hosts declined the
        # frame of the last `find` (reason -> hosts), for the why-not-booking record.
        self.gpu_wants = gpu_hosts.NO_WANTS
        self.gpu_declined: dict[str, int] = {}
        # Demand -> host numbers -> Shape (see `_shape`), for the sizing rule and weights in
        # `_memo_for`: the lab swaps `sizing.size` for a run (dispatch.lab.placement_loop).
        self._memo: dict[Demand, dict[tuple[int, ...], Shape]] = {}
        self._memo_for: tuple[object, Weights] | None = None
        self._memo_size = 0

    @property
    def keeps_hint(self) -> bool:
        """Whether a host `find` chose stays the layer's choice while it fits (see `fits`)."""
        return self.fit != "loosest"

    def set_gpu_wants(self, wants: gpu_hosts.GpuWants) -> None:
        """The GPU work waiting this cycle: while it wants a GPU host, no CPU frame goes there."""
        self.gpu_wants = wants
        self.generation += 1

    # -- loading --------------------------------------------------------------------------
    def load(self, conn: psycopg.Connection) -> None:
        """Replace the whole view from the database (bookable hosts only)."""
        with conn.cursor() as cur:
            cur.execute(HOSTS_SQL, {"stale_after": self.stale_after, **shard_params(self.shard)})
            rows = cur.fetchall()
        self.replace(_host_from_row(row) for row in rows)

    def replace(self, hosts: Iterable[HostRec]) -> None:
        """Replace the whole view with these hosts (what `load` read; benchmarks build their own)."""
        self.hosts.clear()
        self._by_tag.clear()
        self._columns.clear()
        self._max_cores = 0
        self.generation += 1
        for host in hosts:
            self._put(host)

    def reload_hosts(self, conn: psycopg.Connection, pks: Iterable[str]) -> None:
        """Re-read some hosts (after a failed guard); a host no longer bookable leaves the view."""
        wanted = list(set(pks))
        if not wanted:
            return
        with conn.cursor() as cur:
            cur.execute(
                HOSTS_BY_ID_SQL,
                {"stale_after": self.stale_after, "hosts": wanted, **shard_params(self.shard)},
            )
            rows = cur.fetchall()
        self.generation += 1
        for pk in wanted:
            self._drop(pk)
        for row in rows:
            self._put(_host_from_row(row))

    def refresh_changed(self, conn: psycopg.Connection, window: float) -> int:
        """Re-read the hosts changed in the last `window` seconds; returns how many gained idle cores.

        What the loop's own completions free it already knows (`set_ledger`); this is for the
        rest: frames that host agents completed themselves (the q2 and celery launchers), kills
        and releases by ops. Without it a host freed by its agent waited for the next full
        reload (`host_refresh_interval`, 10 s) before it could be booked again.
        """
        with conn.cursor() as cur:
            cur.execute(
                HOSTS_CHANGED_SQL,
                {"stale_after": self.stale_after, "window": window, **shard_params(self.shard)},
            )
            rows = cur.fetchall()
        gained = 0
        for row in rows:
            host = _host_from_row(row)
            old = self.hosts.get(host.pk)
            if old is not None and (old.cores_idle, old.mem_idle, old.gpus_idle, old.gpu_mem_idle) == (
                host.cores_idle,
                host.mem_idle,
                host.gpus_idle,
                host.gpu_mem_idle,
            ):
                continue
            if old is None or host.idle_whole_cores > old.idle_whole_cores:
                gained += 1
            self.generation += 1
            self._drop(host.pk)
            self._put(host)
        return gained

    # -- choice ---------------------------------------------------------------------------
    def find(
        self,
        demand: Demand,
        tags: Iterable[str],
        *,
        facility: str,
        os: str | None,
        room: Callable[[str], int],
        exclude: set[str] | None = None,
    ) -> tuple[HostRec, int] | None:
        """The best host for one frame and the whole cores it would book there, or None.

        `room(alloc)` gives the whole cores the show may still book on an allocation. Afterwards
        `gpu_declined` says how many GPU hosts the GPU-host rule made decline the frame.
        """
        self.gpu_declined = {}
        by_tag = self._by_tag
        buckets = []
        columns = []
        for t in tags:
            by_cores = by_tag.get(t)
            if by_cores:
                buckets.append(by_cores)
                columns.append(self._columns[t])
        if not buckets:
            return None
        floor = demand.index_floor
        max_cores = self._max_cores
        if floor > max_cores:
            return None
        # The idle whole cores from the floor to the biggest host, tightest first, that hold a
        # host of one of the tags (the others would be passed over anyway).
        present = columns[0] if len(columns) == 1 else sorted(set().union(*columns))
        keys = present[bisect_left(present, floor) : bisect_right(present, max_cores)]  # a copy
        if self.fit == "loosest":
            keys.reverse()
        scored = self.fit == "scored"
        candidates = self.candidates
        hosts = self.hosts
        shape_of = self._fits
        memo = self._memo_of(demand)
        # A cell whose hosts all have less memory than the frame asks is passed over unread.
        least_gb = demand.mem // KB_PER_GB
        seen: set[str] = set()
        best: tuple[HostRec, int] | None = None
        best_score = float("inf")
        cells = 0
        for k in keys:
            for by_cores in buckets:
                by_cell = by_cores.get(k)
                if not by_cell:
                    continue
                for (mem_gb, _gpus), pks in by_cell.items():
                    if mem_gb < least_gb or not pks:
                        continue
                    for pk in pks:
                        if pk in seen:
                            continue
                        seen.add(pk)
                        host = hosts[pk]
                        cores, score = shape_of(host, demand, facility, os, room, memo)
                        if not cores or (exclude is not None and pk in exclude):
                            continue
                        if not scored:
                            return host, cores
                        if score < best_score:
                            best, best_score = (host, cores), score
                        cells += 1
                        break  # one host per cell: its neighbours score alike
                    if best is not None and (best_score <= 0.0 or cells >= candidates):
                        return best
        return best

    def score(self, host: HostRec, demand: Demand, cores: int) -> float:
        """What booking the frame (`cores` whole cores) on this host strands; lower is better."""
        idle = (host.cores_idle, host.mem_effective, host.gpus_idle, host.gpu_mem_effective)
        ask = (cores * CENTI, demand.mem, demand.gpus, demand.gpu_mem)
        return stranding_score(idle, ask, self.weights)

    def fits(self, host: HostRec, demand: Demand, *, facility: str, os: str | None, room: Callable[[str], int]) -> int:
        """Whole cores the frame would book on this host now, 0 if it does not fit.

        With the tightest-fit policy, a host `find` returned for a layer stays the layer's best
        choice while it fits and `generation` has not moved: `take` only ever lowers the idle
        cores of the host it books, so every host a tighter search would visit first was
        visited already and still fails. With the scored policy the same holds of the score:
        booking a frame lowers the host's idle resources and the frames it could still take
        together, so its score for the same layer does not change, and no other host's does
        (exactly for a frame of fixed cores; a threadable frame sized from memory may book a
        little more as the host's idle memory falls, Cuebot's rule, and `_fits` sizes it anew).
        The loop uses this to place a layer's next frame without a search.
        """
        if self.hosts.get(host.pk) is not host:
            return 0
        return self._fits(host, demand, facility, os, room, self._memo_of(demand))[0]

    def _fits(
        self,
        host: HostRec,
        demand: Demand,
        facility: str,
        os: str | None,
        room: Callable[[str], int],
        memo: dict[tuple[int, ...], Shape],
    ) -> Shape:
        """(whole cores the frame would book on this host, its score), (0, 0.0) if it does not fit.

        The rules in their order: facility, OS, what the host's numbers decide (`_shape`,
        remembered in `memo`), the allocation's room, then the GPU-host rule, the only one
        that counts a decline in `gpu_declined`.
        """
        if host.facility != facility:
            return _REFUSED
        if os is not None and host.os != os:
            return _REFUSED
        key = (
            host.cores_idle,
            host.cores_total,
            host.mem_idle,
            host.mem_free,
            host.thread_mode,
            host.gpus_idle,
            host.gpu_mem_idle,
            host.gpu_mem_free,
        )
        shape = memo.get(key)
        if shape is None:
            shape = self._shape(host, demand, memo, key)
        cores = shape[0]
        if not cores or room(host.alloc) < cores:
            return _REFUSED
        if demand.gpus == 0 and host.gpus_idle > 0:
            mem_effective = host.mem_effective
            gpu_mem_effective = host.gpu_mem_effective
            declined = gpu_hosts.decline_cpu_frame(
                cores=cores * CENTI,
                mem=demand.mem,
                gpu_mem=demand.gpu_mem,
                cores_idle=host.cores_idle,
                mem_idle=mem_effective,
                gpu_mem_idle=gpu_mem_effective,
                gpu_wanted=self.gpu_wants.want(host.tags, host.facility, host.os, host.gpus_idle, gpu_mem_effective),
                backfill=self.gpu_backfill,
            )
            if declined is not None:
                self.gpu_declined[declined] = self.gpu_declined.get(declined, 0) + 1
                return _REFUSED
        return shape

    def _shape(self, host: HostRec, demand: Demand, memo: dict[tuple[int, ...], Shape], key: tuple[int, ...]) -> Shape:
        """What the host's numbers (`key`: its idle and total cores, memory, GPUs, thread mode)
        decide for the frame, remembered in `memo`: the thread-mode rule, the cores it would book
        (`sizing.size`, which reads only those numbers), whether its idle cores, memory, GPUs and
        GPU memory cover them, and with the scored policy the stranding score."""
        shape = _REFUSED
        if demand.threadable or host.thread_mode != THREAD_MODE_ALL:
            cores = sizing.size(demand, host)[0]  # cores from memory, thread mode, min/max (dispatch.engine.sizing)
            if (
                cores > 0
                and cores * CENTI <= host.cores_idle
                and cores * CENTI <= host.cores_total
                and demand.mem <= host.mem_effective
                and demand.gpus <= host.gpus_idle
                and demand.gpu_mem <= host.gpu_mem_effective
            ):
                shape = (cores, self.score(host, demand, cores) if self.fit == "scored" else 0.0)
        if self._memo_size >= MEMO_MAX:
            self._memo.clear()
            memo.clear()
            self._memo[demand] = memo
            self._memo_size = 1
        memo[key] = shape
        self._memo_size += 1
        return shape

    def _memo_of(self, demand: Demand) -> dict[tuple[int, ...], Shape]:
        """The remembered shapes of one demand; all are forgotten if the sizing rule or weights changed."""
        if self._memo_for is None or self._memo_for[0] is not sizing.size or self._memo_for[1] is not self.weights:
            self._memo.clear()
            self._memo_size = 0
            self._memo_for = (sizing.size, self.weights)
        memo = self._memo.get(demand)
        if memo is None:
            if self._memo_size >= MEMO_MAX:
                self._memo.clear()
                self._memo_size = 0
            memo = self._memo[demand] = {}
            self._memo_size += 1  # a demand counts too: a view meets new layers for as long as it runs
        return memo

    # -- bookkeeping ----------------------------------------------------------------------
    def take(self, host: HostRec, cores: int, mem: int, gpus: int, gpu_mem: int) -> None:
        """Reserve in memory what a booking about to be written will take (centicores, KB)."""
        old = _cell(host)
        host.cores_idle -= cores
        host.mem_idle -= mem
        host.mem_free -= mem
        host.gpus_idle -= gpus
        host.gpu_mem_idle -= gpu_mem
        host.gpu_mem_free -= gpu_mem
        self._reindex(host, old)

    def give(self, pk: str, cores: int, mem: int, gpus: int, gpu_mem: int) -> None:
        """Undo a `take` whose write did not happen."""
        host = self.hosts.get(pk)
        if host is None:
            return
        self.generation += 1
        old = _cell(host)
        host.cores_idle += cores
        host.mem_idle += mem
        host.mem_free = min(host.mem_free + mem, host.mem_total) if host.mem_total else host.mem_free + mem
        host.gpus_idle += gpus
        host.gpu_mem_idle += gpu_mem
        host.gpu_mem_free += gpu_mem
        self._reindex(host, old)

    def set_ledger(self, rows: Sequence[Sequence[Any]], freed_mem: dict[str, int] | None = None) -> None:
        """Adopt the idle values a guarded UPDATE ... RETURNING gave back.

        rows: (pk_host, cores_idle, mem_idle, gpus_idle, gpu_mem_idle). `freed_mem` (KB per
        host) is memory a completion gave back, added to the cached free memory, since the
        agent's next report is what really refreshes int_mem_free.
        """
        if rows:
            self.generation += 1
        for pk, cores_idle, mem_idle, gpus_idle, gpu_mem_idle in rows:
            host = self.hosts.get(pk)
            if host is None:
                continue
            old = _cell(host)
            # GPU memory a completion gave back goes back into the cached free GPU memory too,
            # as `take` took it from both (no agent report refreshes it between two reloads).
            host.gpu_mem_free += max(0, gpu_mem_idle - host.gpu_mem_idle)
            host.cores_idle = cores_idle
            host.mem_idle = mem_idle
            host.gpus_idle = gpus_idle
            host.gpu_mem_idle = gpu_mem_idle
            if freed_mem and pk in freed_mem:
                host.mem_free = min(host.mem_free + freed_mem[pk], host.mem_total or host.mem_free + freed_mem[pk])
            self._reindex(host, old)

    def drop(self, pk: str) -> None:
        self.generation += 1
        self._drop(pk)

    # -- index internals ------------------------------------------------------------------
    def _put(self, host: HostRec) -> None:
        self.hosts[host.pk] = host
        k, cell = _cell(host)
        self._max_cores = max(self._max_cores, host.cores_total // CENTI)
        for tag in host.tags:
            self._add(tag, self._by_tag.setdefault(tag, {}), k, cell, host.pk)

    def _drop(self, pk: str) -> None:
        host = self.hosts.pop(pk, None)
        if host is None:
            return
        k, cell = _cell(host)
        for tag in host.tags:
            by_cores = self._by_tag.get(tag)
            if by_cores is not None:
                self._discard(tag, by_cores, k, cell, pk)

    def _reindex(self, host: HostRec, old: tuple[int, Cell]) -> None:
        new = _cell(host)
        if new == old:
            return
        for tag in host.tags:
            by_cores = self._by_tag[tag]
            self._discard(tag, by_cores, old[0], old[1], host.pk)
            self._add(tag, by_cores, new[0], new[1], host.pk)

    def _add(self, tag: str, by_cores: dict[int, dict[Cell, set[str]]], k: int, cell: Cell, pk: str) -> None:
        by_cell = by_cores.get(k)
        if by_cell is None:
            by_cell = by_cores[k] = {}
            insort(self._columns.setdefault(tag, []), k)
        bucket = by_cell.get(cell)
        if bucket is None:
            bucket = by_cell[cell] = set()
        bucket.add(pk)

    def _discard(self, tag: str, by_cores: dict[int, dict[Cell, set[str]]], k: int, cell: Cell, pk: str) -> None:
        by_cell = by_cores.get(k)
        if by_cell is None:
            return
        bucket = by_cell.get(cell)
        if bucket is not None:
            bucket.discard(pk)
            if not bucket:
                del by_cell[cell]  # cells come and go with memory: an empty one must not be scanned
                if not by_cell:
                    del by_cores[k]  # nor an empty column
                    self._columns[tag].remove(k)


def _cell(host: HostRec) -> tuple[int, Cell]:
    """Where a host sits in the index: its idle whole cores, then (idle memory GB, idle GPUs)."""
    mem = min(host.mem_idle, host.mem_free)  # host.mem_effective, without the property's call
    return host.cores_idle // CENTI, ((mem if mem > 0 else 0) // KB_PER_GB, host.gpus_idle)


def _host_from_row(row: Sequence[Any]) -> HostRec:
    (pk, name, alloc, facility, os, thread_mode, cores, cores_idle, mem_idle, mem_free, mem_total,
     gpus_idle, gpu_mem_idle, gpu_mem_free, tags) = row  # fmt: skip
    return HostRec(
        pk=pk,
        name=name,
        alloc=alloc,
        facility=facility,
        os=os,
        thread_mode=thread_mode,
        tags=tuple(tags),
        cores_total=cores,
        cores_idle=cores_idle,
        mem_idle=mem_idle,
        mem_free=mem_free,
        mem_total=mem_total,
        gpus_idle=gpus_idle,
        gpu_mem_idle=gpu_mem_idle,
        gpu_mem_free=gpu_mem_free,
    )
