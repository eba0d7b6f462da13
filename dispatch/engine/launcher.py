"""Launchers: how a committed booking becomes a running frame, behind one small interface.

The dispatch loop calls `launch` after the booking transaction commits, and settles each
booking from its answer (confirm, or compensate then roll back). Completions come back one
of two ways:

* a launcher whose frames end in this process (the simulated one) hands them to the loop
  through `poll_completions`, and the loop writes them through the completion path;
* a launcher driving remote host agents (q2, celery: an agent runs the command and reports
  its exit status) lets the agent's side write the completion itself through
  `dispatch.engine.completion.complete` and returns nothing from `poll_completions`.

Launchers register by name, so `run_scheduler --launcher NAME` finds them. The built-in ones
live on the host side (`dispatch.hosts.launchers`) and register when the app is ready
(`dispatch.apps`), so the engine never imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import psycopg

    from dispatch.engine.booking import Booking
    from dispatch.engine.completion import Completion
    from dispatch.engine.kills import RunKill


class Launcher(Protocol):
    name: str

    def launch(self, bookings: Sequence[Booking]) -> list[tuple[Booking, str]]:
        """Start the frames; return the bookings that could not be started, with a reason.

        Called after commit, outside any transaction. Must not raise for one bad booking:
        a failure is returned, and the loop compensates it.
        """
        ...

    def poll_completions(self) -> list[Completion]:
        """Completions ready for the loop to write (never blocks)."""
        ...

    def next_due(self) -> float | None:
        """Seconds until the next completion is expected, if the launcher knows (for the loop's sleep)."""
        ...

    def running(self) -> int:
        """Frames this launcher started whose completion it has not handed over yet."""
        ...

    def kill(self, runs: Sequence[RunKill]) -> None:
        """Send each run's kill to its host now (`dispatch.engine.kills`); never raises for one run.

        The proc stays booked: the run's own completion report, recorded as killed, releases it.
        Called from the kill sender's thread (not the loop's), again every few seconds until the
        proc is gone, so a kill that did not get through is simply sent again."""
        ...

    def heartbeat(self, conn: psycopg.Connection) -> None:
        """Called before each lost-host sweep. Real agents heartbeat host_stat.ts_ping themselves
        and do nothing here; a launcher whose hosts have no agent (simulated) pings for them."""
        ...

    def abandon(self) -> list[str]:
        """Forget the frames that run inside this process and return their procs.

        Called once when the scheduler stops: frames that end in this process (simulated) would
        never be completed by anyone else, so the loop requeues them. A launcher whose frames
        run on agents returns [] (the agent completes or requeues them itself)."""
        ...

    def close(self) -> None: ...


_REGISTRY: dict[str, Callable[..., Launcher]] = {}


def register(name: str) -> Callable[[Callable[..., Launcher]], Callable[..., Launcher]]:
    def deco(factory: Callable[..., Launcher]) -> Callable[..., Launcher]:
        _REGISTRY[name] = factory
        return factory

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_launcher(name: str, **options: Any) -> Launcher:
    """Build the launcher registered as `name` with its options."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown launcher {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**options)
