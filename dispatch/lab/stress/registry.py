"""The phases of the stress suite, in the order they run: the one place a phase is registered.

A phase is a module of this package named after it, whose `phase_<name>(cfg)` returns its
`PhaseReport`; adding one is writing that module and adding its row here. The letters name its
farm (`<prefix>_<letters>`), distinct for every phase so that no phase purges another's rows.
This module holds names only (the configuration reads them); `suite.phase_runner` imports a
phase's module when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str  # also its module's name
    letters: str  # its farm's prefix: `<prefix>_<letters>`


REGISTRY: tuple[Phase, ...] = (
    Phase("drain", "d"),
    Phase("saturation", "s"),
    # The perturbations: the older ones use their first two letters, the integrity phases their own.
    Phase("straddle", "st"),
    Phase("drops", "dr"),
    Phase("listener_kill", "li"),
    Phase("caps", "ca"),
    Phase("flip", "fl"),
    Phase("sigkill", "si"),
    Phase("outside_writers", "ow"),
    Phase("outside_managed", "om"),
    Phase("split_brain", "sb"),
    Phase("listener_wedge", "lw"),
    Phase("flip_roundtrip", "fr"),
    Phase("fairshare", "fs"),
    Phase("stall", "sl"),
    Phase("stopped_holder", "sh"),
    Phase("slow_listener", "sw"),
    Phase("memory_mix", "mm"),
    Phase("frame_life", "lf"),
)

PHASES: tuple[str, ...] = tuple(p.name for p in REGISTRY)
PERTURBATIONS = PHASES[2:]
PHASE_LETTERS: dict[str, str] = {p.name: p.letters for p in REGISTRY}
