"""The stress suite: the production path under load and faults, each phase audited.

Every phase seeds its own farm with `seed_farm` (prefix `<prefix>_<phase letters>`), runs the
real runtime against it (accounting service with listener, recompute and limit loops; the
dispatch loop; the simulated launcher; completions through the release triggers), applies
its perturbation while frames book, then audits and purges. A cap watchdog on its own
connection samples SUM(proc) against every cap of the phase's farm throughout.

Why each phase exists:
- drain: throughput and exactness when capacity exceeds demand (>= 90% must book).
- saturation: the caps, not the hosts, stop the bookings; they must stop exactly there.
- straddle / drops / listener_kill / caps / flip / sigkill: the failure modes of
  accounting-design.md §6 under load, each one must end with the Store equal to SUM(proc)
  and no cap ever exceeded.
- outside_writers (issue 15): writers that are not the scheduler (scripts, a DBA, a Cuebot)
  move hosts and jobs, resize and insert procs, delete and re-create subscriptions, reopen
  jobs and flip shows under a REPEATABLE READ writer, beside a managed and an unmanaged show:
  every change must reach the side that owns the show exactly once.
- split_brain / listener_wedge / flip_roundtrip (issue 16): a second scheduler taking over
  after the first's lock session is killed (the lease must fence the first), the listener's
  path frozen while caps drop (the heartbeat deadline must bound the stale caps), and a show
  flipped out and back faster than the managed-shows tick (its generation must force a seed).

The watchdog's breach rule: a key over its current cap is a breach unless its cap was
lowered during the phase and every proc of the key was decided before the decrease reached
the Store (`proc.ts_dispatched`, stamped by the dispatcher just before the Store's check,
against the listener's `recent_caps` time, stamped just after the cap was applied): those
procs were legal when booked, and the scheduler never preempts. `proc.ts_booked` (the
INSERT) is not used: in a batch of hundreds it can follow the decision by tens of
milliseconds, which made bookings checked against the old cap look like breaches.
A write from outside the scheduler can also take a managed key over its cap (nothing in the
database checks a managed show's caps: the Store does, for the scheduler's own bookings), so
keys an outside write added to are judged the same way: over the cap is a breach only if the
key's newest booking was decided after the Store surely had that write (`adding`).

The package: one module per phase (named after it, registered in `registry.py`, the one list of
phases), and what the phases share: `config` (sizes), `watchdog` (the cap watchdog and what it
judges by), `audit` (the invariants every phase ends with), `harness` (running a phase in
process: seed, runtime, perturb, audit, purge), `report` (a phase's report) and `suite`
(`run_stress`, the phases in order). Adding a phase: a module with `phase_<name>(cfg)`, a row in
the registry, and its small sizes in `config.small` if the defaults are too big for the tests.
"""

from __future__ import annotations

from dispatch.lab.stress.config import StressConfig, small
from dispatch.lab.stress.harness import QUIET_LOOPS, env
from dispatch.lab.stress.registry import PHASE_LETTERS, PHASES
from dispatch.lab.stress.report import PhaseReport
from dispatch.lab.stress.suite import run_stress
from dispatch.lab.stress.watchdog import Breach, CapWatchdog

__all__ = [
    "PHASES",
    "PHASE_LETTERS",
    "QUIET_LOOPS",
    "Breach",
    "CapWatchdog",
    "PhaseReport",
    "StressConfig",
    "env",
    "run_stress",
    "small",
]
