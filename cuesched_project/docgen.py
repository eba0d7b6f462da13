"""Render `docs/reference.md` from the code itself, so the reference cannot drift.

Three sources, each read from what the program really runs:

* commands: every management command of a local app (an installed app whose code lives in
  this repository), from the parser Django builds for it (`create_parser`), minus the options
  every Django command has;
* metrics: every collector in `accounting.metrics`, with its exposed name, labels and help;
* settings: every cuesched environment variable (`CUESCHED_*`, `DJANGO_*`, `DATABASE_URL`)
  the code reads, found by walking the source (calls of
  the `cuesched_project.conf` accessors `env_float/env_int/env_bool/env_str`, and
  `os.environ.get`), with its default as written and the docstring of the accessor that reads
  it. No second registry to keep in step: adding an accessor adds a row.

`manage.py docs_reference` writes the file; `--check` fails when it is stale.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from django.apps import apps
from django.conf import settings
from django.core.management import get_commands, load_command_class

REFERENCE_PATH = Path(settings.BASE_DIR) / "docs" / "reference.md"

# Options every Django command has; listed once in the page, not per command.
DJANGO_COMMON_OPTIONS = frozenset(
    {
        "-h",
        "--help",
        "--version",
        "-v",
        "--verbosity",
        "--settings",
        "--pythonpath",
        "--traceback",
        "--no-color",
        "--force-color",
        "--skip-checks",
    }
)

# What a variable does, for the few read where no docstring or comment says it (settings.py
# dictionaries, undocumented accessors). A test fails if a name here is no longer read anywhere.
FALLBACK_DOCS = {
    "CUESCHED_LOG_LEVEL": "Root log level of every process (Python logging level name).",
    "CUESCHED_LOST_HOST_SWEEP_INTERVAL": "How often the dispatch loop looks for lost hosts.",
    "CUESCHED_PGDATA": "Data directory of the embedded PostgreSQL (used only when DATABASE_URL is unset); "
    "default `.cuesched/pgdata` in the checkout.",
    "CUESCHED_SIM_RUNTIME_MAX": "Upper bound of a simulated frame's runtime (see CUESCHED_SIM_RUNTIME_MIN).",
    "CUESCHED_SIM_SEED": "Seed of the simulated launcher's random draws (runtimes, failures); empty: random.",
    "DJANGO_ALLOWED_HOSTS": "Comma-separated host names the web admin answers to.",
    "DJANGO_DEBUG": "Django debug mode; set it false in production.",
    "DJANGO_SECRET_KEY": "Django secret key; the default is for development only, set your own in production.",
}

# The environment variables that are settings of ours (the rest, like TMPDIR, are the system's).
OUR_PREFIXES = ("CUESCHED_", "DJANGO_", "DATABASE_URL")

# Functions whose first argument names an environment variable, and how they read it.
_ACCESSORS = {"env_float": "float", "env_int": "int", "env_bool": "bool", "env_str": "str", "_env_bool": "bool"}


# --------------------------------------------------------------------------- commands


def local_apps() -> list[str]:
    """Installed apps whose code is in this repository (not Django's, not a library's)."""
    base = Path(settings.BASE_DIR).resolve()
    names = []
    for config in apps.get_app_configs():
        path = Path(config.path).resolve()
        if path.is_relative_to(base) and ".venv" not in path.parts:
            names.append(config.name)
    return names


def local_commands() -> dict[str, str]:
    """Command name -> app, for the local apps."""
    ours = set(local_apps())
    return {name: app for name, app in sorted(get_commands().items()) if app in ours}


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """Without cuesched's variables, so a default read from the environment renders as the code's."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("CUESCHED_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser `manage.py <name>` really uses."""
    app = get_commands()[name]
    return load_command_class(app, name).create_parser("manage.py", name)


@dataclass(frozen=True)
class Option:
    flags: str
    metavar: str
    default: str
    help: str
    group: str


def command_options(parser: argparse.ArgumentParser) -> list[Option]:
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings and set(action.option_strings) <= DJANGO_COMMON_OPTIONS:
                continue
            if isinstance(action, argparse._SubParsersAction):
                continue  # rendered as sub-commands, see `subcommands`
            if isinstance(action, argparse._StoreConstAction | argparse._StoreTrueAction | argparse._StoreFalseAction):
                metavar = ""
            elif isinstance(action, argparse.BooleanOptionalAction):
                metavar = ""
            else:
                metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
                if isinstance(metavar, tuple):
                    metavar = " ".join(metavar)
            default = action.default
            shown_default = "" if default in (None, False, argparse.SUPPRESS) else repr(default)
            flags = ", ".join(action.option_strings) if action.option_strings else action.dest
            title = group.title or ""
            if title in {"options", "optional arguments", "positional arguments"}:
                title = ""
            rows.append(Option(flags, str(metavar), shown_default, _one_line(action.help or ""), title))
    return rows


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Sub-command name -> (help, parser), for a command built on argparse sub-parsers."""
    found: dict[str, tuple[str, argparse.ArgumentParser]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for sub, sub_parser in action.choices.items():
                found[sub] = (helps.get(sub, ""), sub_parser)
    return found


def options_of(name: str) -> set[str]:
    """Every option string `manage.py <name>` accepts, its sub-commands' included."""
    parser = command_parser(name)
    known = set(parser._option_string_actions)
    for _help, sub_parser in subcommands(parser).values():
        known |= set(sub_parser._option_string_actions)
    return known


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class MetricDoc:
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


def metrics() -> list[MetricDoc]:
    from accounting import metrics as module

    rows = []
    for collector in module.REGISTRY._collector_to_names:
        kind = getattr(collector, "_type", "")
        name = collector._name
        exposed = f"{name}_total" if kind == "counter" else name
        rows.append(MetricDoc(exposed, kind, tuple(collector._labelnames), collector._documentation))
    return sorted(rows, key=lambda m: m.name)


def metric_names() -> set[str]:
    """Every name a scrape can show, including the histogram series and counter `_created`."""
    from accounting import metrics as module

    names: set[str] = set()
    for collector_names in module.REGISTRY._collector_to_names.values():
        names.update(collector_names)
    return names


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SettingDoc:
    name: str
    kind: str
    default: str
    doc: str
    where: str


def _source_files() -> Iterator[Path]:
    base = Path(settings.BASE_DIR)
    for app in [*local_apps(), "cuesched_project"]:
        root = base / app.replace(".", "/")
        for path in sorted(root.rglob("*.py")):
            if "migrations" in path.parts or path.name == "docgen.py":
                continue
            yield path


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if func.attr == "get" and isinstance(func.value, ast.Attribute) and func.value.attr == "environ":
            return "os.environ.get"
        return func.attr
    return ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _comment_above(lines: list[str], lineno: int) -> str:
    """`#` comment lines right above a statement (for settings read outside an accessor)."""
    out: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        text = lines[index].strip().lstrip("#").strip()
        if text.startswith("---"):  # a section rule, not a description
            break
        out.insert(0, text)
        index -= 1
    return " ".join(out)


def settings_docs() -> list[SettingDoc]:
    found: dict[str, SettingDoc] = {}
    base = Path(settings.BASE_DIR)
    for path in _source_files():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            call = _call_name(node.func)
            if call not in _ACCESSORS and call != "os.environ.get":
                continue
            if not node.args or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
                continue
            name = node.args[0].value
            if not name.startswith(OUR_PREFIXES):
                continue  # a system variable (TMPDIR, HOME): not a cuesched setting
            default = ast.get_source_segment(source, node.args[1]) if len(node.args) > 1 else ""
            kind = _ACCESSORS.get(call, "str")
            doc = ""
            where = path.relative_to(base).as_posix()
            parent = parents.get(node)
            while parent is not None:
                if isinstance(parent, ast.Call) and _call_name(parent.func) == "add_argument":
                    for keyword in parent.keywords:
                        if keyword.arg == "help" and isinstance(keyword.value, ast.Constant):
                            doc = str(keyword.value.value)
                    flag = parent.args[0].value if parent.args and isinstance(parent.args[0], ast.Constant) else ""
                    where += f" (default of `{flag}`)"
                    break
                if isinstance(parent, ast.FunctionDef):
                    doc = inspect.cleandoc(ast.get_docstring(parent) or "")
                    where += f": `{parent.name}()`"
                    break
                if isinstance(parent, ast.stmt) and isinstance(parents.get(parent), ast.Module):
                    doc = _comment_above(lines, parent.lineno)
                    break
                parent = parents.get(parent)
            doc = _one_line(doc) or FALLBACK_DOCS.get(name, "")
            previous = found.get(name)
            # A name read in two places (an accessor and a command's default) keeps the accessor.
            if previous is None or (not previous.doc and doc):
                found[name] = SettingDoc(name, kind, default or "", doc, where)
    return sorted(found.values(), key=lambda s: s.name)


def setting_names() -> set[str]:
    return {s.name for s in settings_docs()}


# --------------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    with _clean_environment():
        return _render()


def _render() -> str:
    out: list[str] = [
        "# Reference",
        "",
        "<!-- GENERATED by `manage.py docs_reference` from the code (cuesched_project/docgen.py). "
        "Do not edit by hand: a test fails when this file is stale. -->",
        "",
        "Generated from the code: the management commands from their own argument parsers, the metrics "
        "from `accounting.metrics.REGISTRY`, the settings from every environment variable the source reads. "
        "Regenerate with `manage.py docs_reference`; `manage.py docs_reference --check` exits non-zero when "
        "this file is stale.",
        "",
        "- [Management commands](#management-commands)",
        "- [Metrics](#metrics)",
        "- [Settings and environment variables](#settings-and-environment-variables)",
        "",
        "## Management commands",
        "",
        "Run as `./dev manage <command>` or `.venv/bin/python manage.py <command>`. Every command also takes "
        "Django's common options (`-h`, `-v {0,1,2,3}`, `--settings`, `--pythonpath`, `--traceback`, "
        "`--no-color`, `--force-color`, `--skip-checks`, `--version`), not repeated below.",
        "",
    ]
    commands = local_commands()
    out.append("| command | app | what |")
    out.append("|---|---|---|")
    for name, app in commands.items():
        parser = command_parser(name)
        out.append(f"| [`{name}`](#{name}) | {app} | {_cell(_one_line(parser.description or ''))} |")
    out.append("")
    for name, app in commands.items():
        parser = command_parser(name)
        out.append(f"### {name}")
        out.append("")
        out.append(f"`manage.py {name}` ({app}). {_one_line(parser.description or '')}")
        out.append("")
        options = command_options(parser)
        subs = subcommands(parser)
        if not options and not subs:
            out.append("No options of its own.")
            out.append("")
            continue
        if subs:
            out.append("| sub-command | arguments and options | what |")
            out.append("|---|---|---|")
            for sub, (sub_help, sub_parser) in subs.items():
                args = ", ".join(
                    f"`{o.flags}{' ' + o.metavar if o.metavar and o.flags.startswith('-') else ''}`"
                    + (f" ({_cell(o.help)})" if o.help else "")
                    for o in command_options(sub_parser)
                )
                out.append(f"| `{sub}` | {args} | {_cell(sub_help)} |")
            out.append("")
        if not options:
            continue
        has_groups = any(o.group for o in options)
        header = (
            "| option | value | default | help |" if not has_groups else "| option | value | default | group | help |"
        )
        out.append(header)
        out.append("|---|---|---|---|" + ("---|" if has_groups else ""))
        for o in options:
            cells = [f"`{o.flags}`", f"`{o.metavar}`" if o.metavar else "", _cell(o.default), _cell(o.help)]
            if has_groups:
                cells.insert(3, _cell(o.group))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += [
        "## Metrics",
        "",
        "Served by `manage.py run_scheduler` on `127.0.0.1:<--metrics-port>/metrics` (Prometheus text format; "
        "port 0 disables). Counters are exposed with the `_total` suffix shown here; histograms add "
        "`_bucket`, `_sum` and `_count` series.",
        "",
        "| metric | type | labels | help |",
        "|---|---|---|---|",
    ]
    for m in metrics():
        labels = ", ".join(f"`{label}`" for label in m.labels)
        out.append(f"| `{m.name}` | {m.kind} | {labels} | {_cell(m.help)} |")
    out += [
        "",
        "## Settings and environment variables",
        "",
        "Every environment variable the code reads. cuesched's own knobs (`CUESCHED_*`) are read through the "
        "accessors in `cuesched_project/conf.py` and `dispatch/conf.py` at call time: the environment first, "
        "then a Django setting of the same name, then the default shown; those read in "
        "`cuesched_project/settings.py` or `embedded_db.py` come from the environment only. An empty value "
        "counts as unset. "
        "Booleans accept `1`, `true`, `yes`, `on` (any case); anything else is false. Durations are seconds.",
        "",
        "| variable | type | default | read by | what |",
        "|---|---|---|---|---|",
    ]
    for s in settings_docs():
        default = f"`{s.default}`" if s.default else ""
        out.append(f"| `{s.name}` | {s.kind} | {_cell(default)} | {_cell(s.where)} | {_cell(s.doc)} |")
    out.append("")
    return "\n".join(out)


def is_stale(path: Path = REFERENCE_PATH) -> bool:
    return not path.exists() or path.read_text() != render()
