"""docs/opencue-clients.md's table of calls is the server's: every call it names as served is one
a servicer answers, every call it names as UNIMPLEMENTED is one none answers, and no call of a
served interface is missing from either column. So the page cannot promise a call the server
does not answer, nor forget one a client would find refused."""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings

from opencue_api.server import SERVICERS

PAGE = Path(settings.BASE_DIR) / "docs" / "opencue-clients.md"
ROW = re.compile(r"^\| `(\w+)` \|(.*?)\|(.*?)\|$", re.M)
NAME = re.compile(r"`(\w+)`")


def _proto_base(servicer: type) -> type:
    return next(b for b in servicer.__mro__ if b.__module__.startswith("opencue_proto"))


def _calls(base: type) -> set[str]:
    return {name for name, value in vars(base).items() if not name.startswith("_") and callable(value)}


def _served_section() -> str:
    text = PAGE.read_text()
    start = text.index("## What is served")
    return text[start : text.index("\n## ", start + 1)]


def test_the_served_table_is_every_call_of_every_served_interface() -> None:
    rows = {
        m.group(1): (set(NAME.findall(m.group(2))), set(NAME.findall(m.group(3))))
        for m in ROW.finditer(_served_section())
    }
    for _add, servicer in SERVICERS:
        base = _proto_base(servicer)
        interface = base.__name__.removesuffix("Servicer")
        assert interface in rows, f"{interface} is served but has no row in {PAGE.name}"
        calls = _calls(base)
        served = {name for name in calls if getattr(servicer, name) is not getattr(base, name)}
        listed_served, listed_refused = rows.pop(interface)
        assert listed_served == served, f"{interface}: served {sorted(served)}, the page says {sorted(listed_served)}"
        assert listed_refused == calls - served, (
            f"{interface}: UNIMPLEMENTED {sorted(calls - served)}, the page says {sorted(listed_refused)}"
        )
    assert not rows, f"rows for interfaces the server does not serve: {sorted(rows)}"


def test_the_interfaces_not_served_at_all_are_listed() -> None:
    import importlib
    import inspect
    import pkgutil

    import opencue_proto

    every = set()
    for module in pkgutil.iter_modules(opencue_proto.__path__):
        if module.name.endswith("_grpc"):
            for name, value in vars(importlib.import_module(f"opencue_proto.{module.name}")).items():
                if name.endswith("Servicer") and inspect.isclass(value):
                    every.add(name.removesuffix("Servicer"))
    served = {_proto_base(s).__name__.removesuffix("Servicer") for _add, s in SERVICERS}
    section = _served_section()
    paragraph = section[section.index("Not served at all") :].split("\n\n")[0]
    listed = set(NAME.findall(paragraph.split("(`RqdInterface`")[0].split(": ", 1)[1]))
    rqd_side = {"RqdInterface", "RqdReportInterface", "RunningFrame"}
    assert listed == every - served - rqd_side
    assert rqd_side <= every
