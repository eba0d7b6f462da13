"""Browser tests: headless Chromium driven by pytest-playwright against pytest-django's live server.

The browser is the Debian `chromium` package at /usr/bin/chromium; Playwright never downloads
one. Without it, every test marked `browser` is skipped with the reason. Select them with
`pytest -m browser` (they also run in the default `pytest` run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"


def _django_order(item: pytest.Item) -> int:
    """pytest-django's order: database tests in a rolled-back transaction, then transactional ones
    (which flush every table when they end), then tests without a database."""
    marker = item.get_closest_marker("django_db")
    fixtures = getattr(item, "fixturenames", [])
    if (marker is not None and marker.kwargs.get("transaction")) or {"transactional_db", "live_server"} & set(fixtures):
        return 1
    return 0 if marker is not None or "db" in fixtures else 2


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-playwright parametrizes these tests with a session-scoped browser name, and pytest
    # then regroups session-parametrized tests after pytest-django has ordered the run: the
    # browser tests (transactional) would run, and flush, before database tests that expect
    # what the migrations wrote. Put every test back in pytest-django's order (a stable sort).
    items.sort(key=_django_order)
    if os.path.exists(CHROMIUM):
        return
    skip = pytest.mark.skip(reason=f"{CHROMIUM} is missing: install the Debian package (apt-get install chromium)")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_ARGS, "headless": True}


@pytest.fixture(scope="session")
def base_url(live_server: Any) -> str:
    """The live server, so pages can be opened by path (this also replaces pytest-playwright's own
    `base_url`, an instance-method fixture that pytest 9 deprecates, which would fail the run)."""
    return str(live_server.url)


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict[str, Any]) -> dict[str, Any]:
    return {**browser_context_args, "viewport": {"width": 1400, "height": 1000}}


@pytest.fixture(scope="session", autouse=True)
def _django_beside_playwright() -> Iterator[None]:
    """Playwright's sync API keeps an asyncio loop on the test thread for the whole session, which
    Django's async-safety check takes for async code; the test thread only ever runs sync code."""
    old = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if old is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = old


@pytest.fixture
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
