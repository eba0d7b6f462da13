"""The docs cannot promise what the code does not have.

Every `manage.py <command> --option` written in `docs/*.md` or the README (fenced code blocks
and inline code) is checked against the parser Django really builds for that command; every
setting and metric named in `docs/reference.md` must exist in the code; and the generated
reference must match what `manage.py docs_reference` renders now.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command, get_commands
from django.core.management.base import CommandError

from cuesched_project import docgen

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
