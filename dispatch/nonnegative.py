"""CHECK constraints on the amounts that can never be negative, and the rows that break them.

Why: every counter is SUM(proc), so a proc with `int_gpus_reserved = -4` is not "a strange row",
it is a writer taking 4 GPUs back from everybody else on its keys: 8 real GPUs then run under a
max of 4 and every cap check reads the total. The triggers add what a row says; only the
database can refuse the row. So every reserved and used amount of `proc` and every cap or share
where a negative number means nothing is constrained here, on a plain database (migration
`dispatch.0019_nonnegative_amounts`) and on an adopted Cuebot one (adoption adds the same
constraints to Cuebot's tables after checking the rows, see dispatch/adoption.py).

Left out on purpose, each for its reason (docs/concepts.md, "Non-negative amounts"):

- folder and job `int_max_cores` / `int_max_gpus`: -1 (any negative, for Cuebot) is unlimited;
- `subscription.int_burst`: a negative burst books nothing (fails closed), Cuebot's reading too;
- `limit_record.int_max_value`: -1 is unlimited in cuesched, "nothing runs" beside Cuebot;
- the usage counters (`int_cores` / `int_gpus` of subscription, folder_resource, job_resource,
  layer_resource, point): a release must never fail. A counter a trigger-less write left LOW goes
  below zero on the next release; refusing that release would leave a finished frame booked. The
  recompute and the reconcile find such counters and raise the integrity alarm instead;
- host idle amounts: a plain database has `c_host_idle_not_negative` from the model, and beside
  Cuebot its own verify_host_resources trigger refuses a negative idle amount.

A constraint is added only after counting the rows that would break it: a migration or an
adoption over bad rows fails with a message naming them and the fix, never with a bare
`check constraint ... is violated by some row`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Amount:
    """One CHECK constraint: `column >= 0` (or `> 0`) on `table`, and why a negative is wrong."""

    table: str
    column: str
    reason: str
    positive: bool = False  # `> 0` instead of `>= 0`

    @property
    def name(self) -> str:
        if self.positive:
            return "c_proc_cores_positive"  # the model's constraint, Cuebot's before_insert_proc rule
        return f"c_{self.table}_{self.column.removeprefix('int_')}_nonneg"

    @property
    def condition(self) -> str:
        return f"{self.column} {'>' if self.positive else '>='} 0"

    @property
    def pk(self) -> str:
        return f"pk_{self.table}"


_RESERVED = "what a running frame holds; a negative amount cancels other procs' use on every key it books"
_USED = "a measured use, reported by the agent; a negative one is a broken report"
AMOUNTS: tuple[Amount, ...] = (
    Amount("proc", "int_cores_reserved", "a proc always books cores (Cuebot's before_insert_proc)", positive=True),
    Amount("proc", "int_gpus_reserved", _RESERVED),
    Amount("proc", "int_mem_reserved", _RESERVED),
    Amount("proc", "int_mem_pre_reserved", _RESERVED),
    Amount("proc", "int_gpu_mem_reserved", _RESERVED),
    Amount("proc", "int_gpu_mem_pre_reserved", _RESERVED),
    Amount("proc", "int_mem_used", _USED),
    Amount("proc", "int_mem_max_used", _USED),
    Amount("proc", "int_virt_used", _USED),
    Amount("proc", "int_virt_max_used", _USED),
    Amount("proc", "int_gpu_mem_used", _USED),
    Amount("proc", "int_gpu_mem_max_used", _USED),
    Amount(
        "subscription",
        "int_size",
        "the share a show is guaranteed; a negative size makes its tier negative, served before every other show",
    ),
)
# Added to an adopted Cuebot database's own tables (adoption never adds other constraints there).
ADOPTED_NAMES = frozenset(a.name for a in AMOUNTS)
SAMPLE = 10


class NegativeAmountsError(RuntimeError):
    """Rows that a constraint about to be added would refuse; nothing was changed."""


@dataclass(frozen=True)
class Violation:
    amount: Amount
    count: int
    sample: tuple[tuple[str, int], ...]  # (primary key, value), at most SAMPLE

    def line(self) -> str:
        a = self.amount
        rows = ", ".join(f"{pk} ({value})" for pk, value in self.sample)
        more = f" and {self.count - len(self.sample)} more" if self.count > len(self.sample) else ""
        fix = (
            f"DELETE FROM {a.table} WHERE NOT ({a.condition})"
            if a.positive
            else f"UPDATE {a.table} SET {a.column} = 0 WHERE {a.column} < 0"
        )
        return (
            f"{a.table}.{a.column}: {self.count} row(s) break {a.name} ({a.condition}: {a.reason}): "
            f"{a.pk} {rows}{more}; fix them first, e.g. {fix}"
        )


def _columns(cursor: Any, table: str) -> set[str]:
    cursor.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
        [f"public.{table}"],
    )
    return {r[0] for r in cursor.fetchall()}


def _present(cursor: Any, amounts: tuple[Amount, ...]) -> list[Amount]:
    """The amounts whose table and column exist (a Cuebot schema before V11 has no GPU columns)."""
    cols: dict[str, set[str]] = {}
    out = []
    for a in amounts:
        if a.table not in cols:
            cols[a.table] = _columns(cursor, a.table)
        if a.column in cols[a.table] and a.pk in cols[a.table]:
            out.append(a)
    return out


def existing(cursor: Any) -> set[tuple[str, str]]:
    """(table, constraint name) of the CHECK constraints of this module already installed."""
    cursor.execute(
        "SELECT c.relname, k.conname FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND k.contype = 'c'"
    )
    return {(t, n) for t, n in cursor.fetchall()}


def violations(cursor: Any, amounts: tuple[Amount, ...] = AMOUNTS) -> list[Violation]:
    """Every row that one of `amounts` would refuse, counted, with a few primary keys each."""
    out = []
    for a in _present(cursor, amounts):
        cursor.execute(f"SELECT count(*) FROM {a.table} WHERE NOT ({a.condition})")
        count = int(cursor.fetchone()[0])
        if count:
            cursor.execute(
                f"SELECT {a.pk}, {a.column} FROM {a.table} WHERE NOT ({a.condition}) ORDER BY {a.pk} LIMIT {SAMPLE}"
            )
            out.append(Violation(a, count, tuple((str(pk), int(v)) for pk, v in cursor.fetchall())))
    return out


def describe(found: list[Violation]) -> str:
    return (
        f"{sum(v.count for v in found)} row(s) hold a negative amount that cuesched's CHECK constraints refuse "
        "(each would cancel other rows' use in every counter summed over it): " + " | ".join(v.line() for v in found)
    )


def add_sql(a: Amount) -> list[str]:
    """The DDL of one constraint with its reason as the constraint's comment."""
    comment = f"cuesched: {a.condition}: {a.reason}".replace("'", "''")
    return [
        f"ALTER TABLE {a.table} ADD CONSTRAINT {a.name} CHECK ({a.condition})",
        f"COMMENT ON CONSTRAINT {a.name} ON {a.table} IS '{comment}'",
    ]


def install(cursor: Any, amounts: tuple[Amount, ...] = AMOUNTS) -> list[str]:
    """Add every missing constraint of `amounts`, after checking the rows; returns the names added.

    Raises NegativeAmountsError naming the rows (nothing added) when any would break one. The
    rows are counted in the same transaction that adds the constraints, under the ACCESS
    EXCLUSIVE lock ADD CONSTRAINT takes, so no row can slip in between the count and the check.
    """
    have = existing(cursor)
    todo = [a for a in _present(cursor, amounts) if (a.table, a.name) not in have]
    for table in sorted({a.table for a in todo}):
        cursor.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")
    found = violations(cursor, tuple(todo))
    if found:
        raise NegativeAmountsError(describe(found))
    for a in todo:
        for sql in add_sql(a):
            cursor.execute(sql)
    return [a.name for a in todo]


def uninstall(cursor: Any) -> None:
    """Drop this module's constraints (the migration's reverse), keeping the model's cores check."""
    for a in AMOUNTS:
        if not a.positive:
            cursor.execute(f"ALTER TABLE {a.table} DROP CONSTRAINT IF EXISTS {a.name}")
