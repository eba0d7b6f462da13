"""The stress suite's registry is the one list of phases: each one registered runs, none runs unregistered.

A phase is a module of dispatch/lab/stress/ named after it with a `phase_<name>(cfg)`; the
registry names it and its farm's letters. Imports only: no phase runs here (the integration
test tests/integration/test_stress.py runs them all at small size).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dispatch.lab import stress
from dispatch.lab.stress.registry import PHASE_LETTERS, PHASES, REGISTRY
from dispatch.lab.stress.suite import phase_runner

PACKAGE = Path(stress.__file__).parent


def test_every_registered_phase_has_its_module_and_runner() -> None:
    for name in PHASES:
        runner = phase_runner(name)
        assert runner.__name__ == f"phase_{name}"
        assert Path(inspect.getfile(runner)) == PACKAGE / f"{name}.py"


def test_every_phase_module_is_registered() -> None:
    defined = {
        node.name.removeprefix("phase_")
        for path in PACKAGE.glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("phase_") and node.name != "phase_runner"
    }
    assert defined == set(PHASES)


def test_every_phase_farm_has_letters_of_its_own() -> None:
    assert len(REGISTRY) == len(PHASES) == len(set(PHASES))
    assert sorted(PHASE_LETTERS) == sorted(PHASES)
    assert len(set(PHASE_LETTERS.values())) == len(PHASES)


def test_an_unknown_phase_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown phase 'nope'; choose from drain, saturation"):
        phase_runner("nope")
