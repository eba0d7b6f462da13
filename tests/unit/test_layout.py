"""The layout tells the architecture: imports between the parts of `dispatch` go one way, downward.

Read from the modules' own `import` statements with `ast` (no import is executed), so a forbidden
import fails here before it can make the packages tangle. The order, lowest first:

    dispatch.models, dispatch.conf, accounting   the tables, the settings, the Store and its loops
    dispatch.engine                              feed, placement, booking, loop, completion, launcher
    dispatch.jobs                                spec, plan, frame ranges, the actions (submit,
                                                 controls, depends, host controls, audit), API,
                                                 tokens, job admin
    dispatch.hosts                               agents, launchers, the Celery app
    ops, cuesched_project, opencue_api           the console, the project, OpenCue's client API
    dispatch.lab                                 seeder, stress suite, fault relays

A module may import its own part and any part below it. Entry points (management commands, the
app config that registers launchers, the farm admin, project URLs) stand above all of them, and
nothing but an entry point, a test or the lab itself imports the lab.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANKS = {
    "dispatch.engine": 1,
    "dispatch.jobs": 2,
    "dispatch.hosts": 3,
    "ops": 3,
    "cuesched_project": 3,
    "opencue_api": 3,
    "dispatch.lab": 4,
}
ENTRY_POINTS = ("dispatch/apps.py", "dispatch/admin.py", "/management/commands/")
RUNTIME = ("dispatch", "accounting", "ops", "cuesched_project", "opencue_api")


def _rank(module: str) -> int:
    """0 for everything below the engine (models, conf, accounting, the package itself)."""
    for prefix, rank in RANKS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return 0


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
                base = ".".join([*package, base] if base else package)
            found.append((node.lineno, base))
            # `from dispatch import engine` imports the subpackage itself.
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names if base in RUNTIME)
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    if "/migrations/" in rel or any(marker in rel for marker in ENTRY_POINTS):
        return []
    module = _module_name(path)
    mine = _rank(module)
    out = []
    for line, target in imports_of(path.read_text() if source is None else source, module):
        if not target.startswith(("dispatch", "ops", "opencue_api")):
            continue
        if _rank(target) > mine:
            out.append(f"{rel}:{line} imports {target} (a part above {module.rsplit('.', 1)[0]})")
    return out


def runtime_files() -> list[Path]:
    return sorted(p for top in RUNTIME for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


def test_imports_go_downward_only() -> None:
    problems = [v for path in runtime_files() for v in violations(path)]
    assert problems == []


def runtime_sources() -> dict[str, str]:
    """module name -> its source, migrations left out."""
    return {_module_name(p): p.read_text() for p in runtime_files() if "/migrations/" not in p.as_posix()}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports, wherever the import is (function-level and
    TYPE_CHECKING imports included: a circle dodged by importing late is still a circle)."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in sources else node.module)
        graph[name] = {e for e in edges if e in sources and e != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_imports_run_one_way_with_no_circle() -> None:
    assert circles(import_graph(runtime_sources())) == []


def test_a_circle_is_caught_even_through_a_type_checking_import() -> None:
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    sources = runtime_sources()
    sources["accounting.history"] += "\nif TYPE_CHECKING:\n    from accounting.service import AccountingService\n"
    sources["dispatch.jobs.services"] += "\n\ndef late() -> None:\n    from dispatch.jobs import spec_lookup\n"
    assert circles(import_graph(sources)) == [
        ["accounting.history", "accounting.service"],
        ["dispatch.jobs.services", "dispatch.jobs.spec_lookup"],
    ]


def test_every_part_of_dispatch_says_what_it_owns() -> None:
    for part in ("engine", "jobs", "hosts", "lab"):
        doc = ast.get_docstring(ast.parse((ROOT / "dispatch" / part / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 2, part


@pytest.mark.parametrize(
    ("where", "line", "forbidden"),
    [
        ("dispatch/engine/loop.py", "from dispatch.hosts.agent import queue_name", True),
        ("dispatch/engine/feed.py", "from dispatch.jobs.spec import load_spec", True),
        ("dispatch/jobs/controls.py", "import dispatch.hosts.launchers.q2", True),
        ("dispatch/jobs/audit.py", "from dispatch.hosts.agent import queue_name", True),
        ("dispatch/jobs/submit.py", "from ops import why", True),
        ("dispatch/models/jobs.py", "from dispatch.engine import loop", True),
        ("accounting/service.py", "from dispatch.lab.seeding import seed_farm", True),
        ("ops/why.py", "from dispatch.lab import stress", True),
        ("dispatch/hosts/agent.py", "from dispatch.engine.completion import complete", False),
        ("dispatch/lab/stress/harness.py", "from dispatch.hosts.agent import queue_name", False),
        ("dispatch/management/commands/stress.py", "from dispatch.lab import stress", False),
    ],
)
def test_a_forbidden_import_is_caught(where: str, line: str, forbidden: bool) -> None:
    path = ROOT / where
    assert bool(violations(path, path.read_text() + "\n" + line + "\n")) is forbidden
