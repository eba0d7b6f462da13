"""Running the suite: the chosen phases in order, each reporting whatever another did."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.registry import PHASES
from dispatch.lab.stress.report import PhaseReport


def phase_runner(name: str) -> Callable[[StressConfig], PhaseReport]:
    """`phase_<name>` of the phase's module (registry.py says which phases there are)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
    runner: Callable[[StressConfig], PhaseReport] = getattr(
        importlib.import_module(f"{__package__}.{name}"), f"phase_{name}"
    )
    return runner


def run_stress(cfg: StressConfig, emit: Callable[[str], None] = print) -> list[PhaseReport]:
    """Run the chosen phases in order; every phase reports, even after another failed."""
    reports = []
    for name in cfg.phases:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
        try:
            report = phase_runner(name)(cfg)
        except Exception as exc:
            report = PhaseReport(name=name, failed=[f"phase raised {type(exc).__name__}: {exc}"])
        for line in report.lines():
            emit(line)
        reports.append(report)
    return reports
