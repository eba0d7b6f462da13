"""Cuebot's search criteria as one WHERE clause: every list given narrows the result.

JobSearchCriteria, HostSearchCriteria and FrameSearchCriteria share their shape (exact values,
regular expressions and substrings of the name), so their SQL is built here, once, with every
value a parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from opencue_api.rpc import BadRequest


class Where:
    def __init__(self) -> None:
        self.clauses: list[str] = []
        self.params: dict[str, Any] = {}

    def add(self, clause: str, **params: Any) -> None:
        self.clauses.append(clause)
        self.params.update(params)

    def any_of(self, column: str, values: Iterable[Any], key: str) -> None:
        """`column` is one of `values`; nothing when the list is empty."""
        wanted = list(values)
        if wanted:
            self.add(f"{column} = ANY(%({key})s)", **{key: wanted})

    def names(self, column: str, regexes: Iterable[str], substrings: Iterable[str]) -> None:
        """`column` matches one of the regexes and contains one of the substrings (Cuebot's regex
        and substr lists); a regex that does not compile is the client's error, named."""
        patterns = list(regexes)
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise BadRequest(f"regex: {pattern!r} is not a regular expression ({exc})") from None
            self.params[f"re{i}"] = pattern
        if patterns:
            self.clauses.append("(" + " OR ".join(f"{column} ~ %(re{i})s" for i in range(len(patterns))) + ")")
        texts = list(substrings)
        for i, text in enumerate(texts):
            self.params[f"sub{i}"] = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        if texts:
            self.clauses.append("(" + " OR ".join(f"{column} LIKE %(sub{i})s" for i in range(len(texts))) + ")")

    def sql(self) -> str:
        return " AND ".join(self.clauses) or "true"
