"""The docs cannot promise what the code does not have.

Every `manage.py <command> --option` written in `docs/*.md` or the README (fenced code blocks
and inline code) is checked against the parser Django really builds for that command; every
setting and metric named in `docs/reference.md` must exist in the code; and the generated
reference must match what `manage.py docs_reference` renders now.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command, get_commands
from django.core.management.base import CommandError

from cuesched_project import docgen
from ops.units import memory_kb

ROOT = Path(settings.BASE_DIR)
DOC_FILES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# `manage.py CMD ...` or `./dev manage CMD ...`, up to a shell operator or the end of the line.
INVOCATION = re.compile(r"(?:manage\.py|\./dev\s+manage)\s+([^\n]*)")
SHELL_STOP = re.compile(r"\s(?:&&|\|\|?|;|>|2>|#)\s|\s\\$")
# A setting name; a trailing `_` or `*` is a family (`CUESCHED_SIM_*`), not a name.
SETTING = re.compile(r"\b((?:CUESCHED|DJANGO)_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL)\b(?![_*])")
METRIC = re.compile(r"`(cuesched_[a-z0-9_]+)`")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)((?:::\w+)+)")


def code_spans(text: str) -> list[str]:
    """Fenced blocks line by line, then inline code outside them."""
    spans: list[str] = []
    for block in FENCED.findall(text):
        spans.extend(block.splitlines())
    spans.extend(INLINE.findall(FENCED.sub("", text)))
    return spans


def invocations(text: str) -> list[tuple[str, list[str]]]:
    """(command, options) for every manage.py line; placeholders like `<command>` are skipped."""
    found = []
    for span in code_spans(text):
        pieces = SHELL_STOP.split(f" {span} ")
        for match in (m for piece in pieces for m in INVOCATION.finditer(piece)):
            tokens = match.group(1).split()
            if not tokens or not re.fullmatch(r"[a-z][a-z0-9_]*", tokens[0]):
                continue
            options = []
            for token in tokens[1:]:
                token = token.strip("[]()|,.")
                if token == "--":
                    break
                if token.startswith("-") and len(token) > 1:
                    options.append(token.split("=", 1)[0])
            found.append((tokens[0], options))
    return found


def problems(text: str) -> list[str]:
    commands = get_commands()
    out = []
    for command, options in invocations(text):
        if command not in commands:
            out.append(f"unknown command {command!r}")
            continue
        known = docgen.options_of(command)
        out.extend(f"{command}: unknown option {option!r}" for option in options if option not in known)
    return out


def test_the_checker_catches_an_unknown_command_and_an_unknown_option() -> None:
    text = (
        "Run `manage.py run_scheduler --managed-only --no-such-flag` then\n"
        "```sh\n./dev manage store_status --json && manage.py no_such_command --phases all\n```\n"
        "and `manage.py <command>` is a placeholder.\n"
    )
    assert invocations(text) == [
        ("store_status", ["--json"]),
        ("no_such_command", ["--phases"]),
        ("run_scheduler", ["--managed-only", "--no-such-flag"]),
    ]
    assert problems(text) == ["unknown command 'no_such_command'", "run_scheduler: unknown option '--no-such-flag'"]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_manage_py_line_in_the_docs_names_real_commands_and_options(path: Path) -> None:
    assert problems(path.read_text()) == []


def test_the_docs_do_name_commands() -> None:
    # Guards the checker itself: if the regexes stopped matching, every page would pass empty.
    named = {command for path in DOC_FILES for command, _ in invocations(path.read_text())}
    assert {"run_scheduler", "store_status", "docs_reference"} <= named


def test_reference_names_only_settings_and_metrics_that_exist() -> None:
    text = docgen.REFERENCE_PATH.read_text()
    settings_named = set(SETTING.findall(text))
    metrics_named = set(METRIC.findall(text))
    assert settings_named - docgen.setting_names() == set()
    assert metrics_named - docgen.metric_names() == set()
    # And the reference is complete: every setting and metric the code has is in it.
    assert docgen.setting_names() <= settings_named
    assert {m.name for m in docgen.metrics()} <= metrics_named


def test_every_page_names_only_settings_that_exist() -> None:
    known = docgen.setting_names()
    for path in DOC_FILES:
        unknown = set(SETTING.findall(path.read_text())) - known
        assert unknown == set(), f"{path.name} names settings the code never reads: {sorted(unknown)}"


def test_fallback_descriptions_name_settings_the_code_reads() -> None:
    assert set(docgen.FALLBACK_DOCS) <= docgen.setting_names()


def test_reference_is_current() -> None:
    call_command("docs_reference", "--check")


def test_check_fails_on_a_stale_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text(docgen.render().replace("cuesched_bookings_total", "cuesched_bookings_old"))
    monkeypatch.setattr(docgen, "REFERENCE_PATH", stale)
    with pytest.raises(CommandError, match="stale"):
        call_command("docs_reference", "--check")
    call_command("docs_reference")
    call_command("docs_reference", "--check")


def test_every_test_a_page_names_exists() -> None:
    missing = []
    for path in DOC_FILES:
        for file, parts in TEST_REF.findall(path.read_text()):
            source = ROOT / file
            text = source.read_text() if source.exists() else ""
            for name in parts.strip(":").split("::"):
                if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^{name}\s*=", text, re.M):
                    missing.append(f"{path.name}: {file}::{name}")
    assert missing == []


LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    broken = []
    for path in DOC_FILES:
        text = FENCED.sub("", path.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, mailto:
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target}")
                continue
            if fragment and dest.suffix == ".md":
                anchors = {anchor(h) for h in HEADING.findall(FENCED.sub("", dest.read_text()))}
                if fragment not in anchors:
                    broken.append(f"{path.name}: {target}")
    assert broken == []


# --- docs/jobs.md and docs/api.md against the code ---------------------------------------------

JOBS_DOC = ROOT / "docs" / "jobs.md"
API_DOC = ROOT / "docs" / "api.md"
FIELD_ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|", re.M)


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of the same or a higher level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def test_jobs_doc_documents_exactly_the_spec_fields() -> None:
    from dispatch.jobs import spec

    text = JOBS_DOC.read_text()
    for heading, keys in (
        ("Job fields", spec.JOB_KEYS),
        ("Layer fields", spec.LAYER_KEYS),
        ("Dependencies", spec.DEPEND_KEYS),
    ):
        documented = set(FIELD_ROW.findall(section(text, heading)))
        assert documented == set(keys), (heading, sorted(set(keys) - documented), sorted(documented - set(keys)))
    assert set(re.findall(r"`#([A-Z_]+)#`", section(text, "Command tokens"))) == set(spec_tokens())


def spec_tokens() -> tuple[str, ...]:
    from dispatch.jobs.frameset import TOKENS

    return TOKENS


def test_jobs_doc_states_the_limits_the_code_enforces() -> None:
    from dispatch.jobs import frameset, spec

    text = JOBS_DOC.read_text()
    for value in (spec.MAX_LAYERS, spec.MAX_FRAMES_PER_JOB, spec.MAX_CORES, frameset.DEFAULT_MAX_FRAMES):
        assert f"{value:,}" in text, value
    # A layer's memory is its service's: the seeded `default` service's for one naming none; the
    # spec's own default is only the fallback of a database without that row.
    seed = importlib.import_module("dispatch.migrations.0041_services_seed")
    (default_kb,) = [mem for _pk, name, _t, _c, mem, _tags in seed.CUEBOT_SERVICES if name == "default"]
    assert f"(`default`: {memory_kb(default_kb)})" in section(text, "Layer fields")
    assert f"{spec.DEFAULT_MEMORY_KB // 1024**2} GB" in section(text, "Services")
    assert f"| {spec.DEFAULT_MAX_RETRIES} |" in section(text, "Job fields")


def test_jobs_doc_examples_are_specs_with_only_known_fields() -> None:
    from dispatch.jobs import spec

    blocks = re.findall(r"^```json\n(.*?)^```", JOBS_DOC.read_text(), re.S | re.M)
    assert len(blocks) >= 2
    for block in blocks:
        doc = spec.load_spec(block)
        assert set(doc) <= set(spec.JOB_KEYS) and {"show", "name", "layers"} <= set(doc)
        for layer in doc["layers"]:
            assert set(layer) <= spec.LAYER_KEYS
            for dep in layer.get("depends", []):
                # `layer` and `type`; `job` too for another job's layer, `job` and `type` for a whole job.
                assert set(dep) <= spec.DEPEND_KEYS and "type" in dep and ({"layer", "job"} & set(dep))


ROUTE_HEADING = re.compile(r"^### `([A-Z]+) (/api/[^`]*)`", re.M)
CURL = re.compile(r"^curl\b.*$", re.M)


def route_regex(route: str) -> re.Pattern[str]:
    pattern = re.escape(route)
    for placeholder in ("<job>", "<limit>", "<frame>", "<service>", "<show>"):
        pattern = pattern.replace(re.escape(placeholder), "[^/]+")
    return re.compile("^" + pattern + "/?$")


def curl_calls(text: str) -> list[tuple[str, str, list[str]]]:
    """(method, path, query parameter names) of every curl line in the fenced blocks."""
    from urllib.parse import parse_qs, urlsplit

    calls = []
    for block in FENCED.findall(text):
        for line in CURL.findall(block):
            method = re.search(r"-X\s+([A-Z]+)", line)
            url = re.search(r"https?://[^\s\"']+", line)
            assert url, line
            parts = urlsplit(url.group(0))
            verb = method.group(1) if method else ("POST" if "--data" in line else "GET")
            calls.append((verb, parts.path, sorted(parse_qs(parts.query))))
    return calls


def test_api_doc_has_a_section_for_every_route_and_no_other() -> None:
    from dispatch.jobs import api

    headings = {f"{method} {path}" for method, path in ROUTE_HEADING.findall(API_DOC.read_text())}
    assert headings == set(api.ROUTES)


def test_every_route_the_api_lists_is_served_with_its_method() -> None:
    from django.urls import resolve

    from dispatch.jobs import api

    actions = set()
    for route in api.ROUTES:
        method, path = route.split(" ", 1)
        for placeholder, value in (
            ("<job>", "some-job"),
            ("<limit>", "some-limit"),
            ("<frame>", "some-frame"),
            ("<service>", "some-service"),
            ("<show>", "some-show"),
        ):
            path = path.replace(placeholder, value)
        match = resolve(path)
        assert method in getattr(match.func, "methods", ()), route
        if "action" in match.kwargs:
            actions.add(match.kwargs["action"])
    assert actions == set(api.ACTIONS)  # every action has its route, and no route names a non-action


def test_every_curl_example_calls_a_documented_route_with_known_parameters() -> None:
    from dispatch.jobs import api

    text = API_DOC.read_text()
    calls = curl_calls(text)
    params = {"GET /api/jobs": api.JOB_FILTERS, "GET /api/jobs/<job>/frames": api.FRAME_FILTERS}
    called = set()
    for method, path, query in calls:
        routes = [r for r in api.ROUTES if r.startswith(method + " ") and route_regex(r.split(" ", 1)[1]).match(path)]
        # The most specific route (a literal segment beats <job>): /api/jobs/x/frames is frames.
        routes.sort(key=lambda r: r.count("<job>") - len(r))
        assert routes, (method, path)
        called.add(routes[0])
        allowed = {*params.get(routes[0], ()), "limit", "offset"} if routes[0].startswith("GET") else set()
        assert set(query) <= allowed, (method, path, query)
    assert called == set(api.ROUTES), sorted(set(api.ROUTES) - called)  # an example for every route
    for name in (*api.JOB_FILTERS, *api.FRAME_FILTERS):
        assert f"`{name}`" in text, name
    assert f"1 to {api.MAX_LIMIT}" in text and f"default {api.DEFAULT_LIMIT}" in text


def test_the_readme_links_the_job_and_api_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/jobs.md)" in readme and "(docs/api.md)" in readme
