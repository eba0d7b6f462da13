"""Record a run's host-view calls, replay them on any tree: placement's cost alone, same inputs (issue 32).

A drain's placement cost is hard to read from the drain: the booking and completion
transactions dominate its wall, and the machine's load moves it by a third from one run to the
next. This records every call one process makes on its `HostView`s (the hosts put in and
dropped, takes, give-backs, ledger rows, GPU wants, and each `find` and `fits` with its demand,
tags, the room of every allocation at that moment, its exclusions and its answer) and replays
them on a fresh view, timing only `find` and `fits` and counting `stranding_score` calls. The
replay also checks every answer against the recorded one, so a change to placement that
claims the same decisions can be held to them on a real drain's inputs.

It uses only `HostView`'s long-standing methods, so one trace can be replayed in an older tree
too, for an A/B: run this file with the tree to measure as the current directory (it imports
`dispatch` from there), under one `PYTHONHASHSEED` for both sides (ties between equal hosts
follow set order)::

    cd <old tree> && PYTHONHASHSEED=0 DATABASE_URL=... .venv/bin/python <this file> record /tmp/t.pkl -- --hosts 1200
    cd <tree>     && PYTHONHASHSEED=0 .venv/bin/python <this file> replay /tmp/t.pkl --rounds 3

Lab only: nothing in the scheduler imports it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

if __name__ == "__main__":  # the tree to measure is the current directory, not this file's
    sys.path.insert(0, os.getcwd())

Op = tuple[Any, ...]


def _rooms(view: Any, room: Callable[[str], int]) -> dict[str, int]:
    return {a: room(a) for a in {h.alloc for h in view.hosts.values()}}


def _room_of(rooms: dict[str, int]) -> Callable[[str], int]:
    return lambda alloc: rooms.get(alloc, 0)


@contextmanager
def recording() -> Iterator[list[Op]]:
    """Every HostView call made in this process until the block ends, as replayable operations."""
    from dispatch.engine.placement import HostView

    trace: list[Op] = []
    names = ("_put", "_drop", "replace", "take", "give", "set_ledger", "set_gpu_wants", "find", "fits")
    saved = {name: getattr(HostView, name) for name in names}

    def _put(self: Any, host: Any) -> None:
        trace.append(("put", dataclasses.astuple(host)))
        saved["_put"](self, host)

    def _drop(self: Any, pk: str) -> None:
        trace.append(("drop", pk))
        saved["_drop"](self, pk)

    def replace(self: Any, hosts: Any) -> None:
        trace.append(("clear",))
        saved["replace"](self, hosts)

    def take(self: Any, host: Any, *amounts: int) -> None:
        trace.append(("take", host.pk, amounts))
        saved["take"](self, host, *amounts)

    def give(self: Any, pk: str, *amounts: int) -> None:
        trace.append(("give", pk, amounts))
        saved["give"](self, pk, *amounts)

    def set_ledger(self: Any, rows: Any, freed_mem: Any = None) -> None:
        trace.append(("ledger", [tuple(r) for r in rows], dict(freed_mem) if freed_mem else None))
        saved["set_ledger"](self, rows, freed_mem)

    def set_gpu_wants(self: Any, wants: Any) -> None:
        trace.append(("wants", wants))
        saved["set_gpu_wants"](self, wants)

    def find(
        self: Any, demand: Any, tags: Any, *, facility: str, os: str | None, room: Any, exclude: Any = None
    ) -> Any:
        tags = tuple(tags)
        rooms = _rooms(self, room)
        found = saved["find"](self, demand, tags, facility=facility, os=os, room=room, exclude=exclude)
        answer = None if found is None else (found[0].pk, found[1])
        excluded = None if exclude is None else set(exclude)
        trace.append(("find", demand, tags, facility, os, rooms, excluded, answer, dict(self.gpu_declined)))
        return found

    def fits(self: Any, host: Any, demand: Any, *, facility: str, os: str | None, room: Any) -> int:
        rooms = _rooms(self, room)
        cores = saved["fits"](self, host, demand, facility=facility, os=os, room=room)
        trace.append(("fits", host.pk, demand, facility, os, rooms, cores))
        return cores

    patched = {"_put": _put, "_drop": _drop, "replace": replace, "take": take, "give": give}
    patched |= {"set_ledger": set_ledger, "set_gpu_wants": set_gpu_wants, "find": find, "fits": fits}
    for name, fn in patched.items():
        setattr(HostView, name, fn)
    try:
        yield trace
    finally:
        for name, fn in saved.items():
            setattr(HostView, name, fn)


@dataclasses.dataclass
class Replay:
    finds: int
    fits: int
    mismatches: int
    score_calls: int
    seconds: float  # in find and fits only


def replay(trace: list[Op], fit: str = "scored", candidates: int = 64) -> Replay:
    """Apply the trace to a fresh view; time find and fits, count stranding_score, check answers."""
    from dispatch.engine import placement
    from dispatch.engine.placement import HostRec, HostView

    calls = [0]
    scoring = placement.stranding_score

    def counted(*args: Any, **kwargs: Any) -> float:
        calls[0] += 1
        return scoring(*args, **kwargs)

    placement.stranding_score = counted  # type: ignore[assignment]
    view = HostView(fit, candidates=candidates)
    clock = time.perf_counter
    finds = fits = mismatches = 0
    seconds = 0.0
    try:
        for op in trace:
            kind = op[0]
            if kind == "find":
                _, demand, tags, facility, os_, rooms, exclude, answer, declined = op
                room = _room_of(rooms)
                t0 = clock()
                found = view.find(demand, tags, facility=facility, os=os_, room=room, exclude=exclude)
                seconds += clock() - t0
                finds += 1
                got = None if found is None else (found[0].pk, found[1])
                mismatches += got != answer or view.gpu_declined != declined
            elif kind == "fits":
                _, pk, demand, facility, os_, rooms, cores = op
                host = view.hosts.get(pk)
                if host is None:
                    mismatches += 1
                    continue
                room = _room_of(rooms)
                t0 = clock()
                got_cores = view.fits(host, demand, facility=facility, os=os_, room=room)
                seconds += clock() - t0
                fits += 1
                mismatches += got_cores != cores
            elif kind == "put":
                view._put(HostRec(*op[1]))
            elif kind == "drop":
                view._drop(op[1])
            elif kind == "clear":
                view.replace(())
            elif kind == "take":
                view.take(view.hosts[op[1]], *op[2])
            elif kind == "give":
                view.give(op[1], *op[2])
            elif kind == "ledger":
                view.set_ledger(op[1], op[2])
            elif kind == "wants":
                view.set_gpu_wants(op[1])
    finally:
        placement.stranding_score = scoring
    return Replay(finds, fits, mismatches, calls[0], seconds)


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cuesched_project.settings")
    import django

    django.setup()
    if len(argv) >= 2 and argv[0] == "record":
        from django.core.management import call_command

        extra = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        with recording() as trace:
            call_command("bench_dispatch", "--runtime", "0", *extra)
        with open(argv[1], "wb") as out:
            pickle.dump(trace, out)
        print(f"recorded {len(trace)} calls to {argv[1]}")
        return 0
    if len(argv) >= 2 and argv[0] == "replay":
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
        with open(argv[1], "rb") as f:
            trace = pickle.load(f)
        runs = [replay(trace) for _ in range(rounds)]
        first = runs[0]
        print(
            f"finds {first.finds}, fits {first.fits}, mismatches {first.mismatches}, stranding_score calls "
            f"{first.score_calls}; find+fits ms median {1000 * statistics.median(r.seconds for r in runs):.1f} "
            f"(runs {', '.join(f'{1000 * r.seconds:.1f}' for r in runs)})"
        )
        return 1 if first.mismatches else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
