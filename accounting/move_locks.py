"""Move-lock indexes: a mover's UPDATE takes its row FOR UPDATE before it holds anything.

A mover (`UPDATE host SET pk_alloc`, `UPDATE job SET pk_folder / pk_dept / pk_show`) must wait for
the in-flight proc writers of the row it moves; they hold the row FOR KEY SHARE
(accounting.keylocks). PostgreSQL locks the target row of an UPDATE in the statement's own mode
first, before any BEFORE ROW trigger runs, and that mode is NO KEY UPDATE unless the statement
sets a *key* column (one of a unique index). So the mover held the row NO KEY UPDATE, which does
not wait for KEY SHARE, and only then its trigger's FOR UPDATE waited for the writer. A writer
that then wrote the same row in its own transaction (Cuebot's booking updates its host's idle
cores after the INSERT; cuesched's completion finishes the job; the host memory ledger recounts
the host's idle memory at COMMIT) waited for the mover: a lock cycle, and one of the two was
aborted with a deadlock error.

A unique index that leads with the primary key and holds the moved columns makes them key
columns. It can refuse no row (the primary key alone is unique), and it changes nothing of
anyone's writes but one thing: an UPDATE that sets a moved column locks its row FOR UPDATE
from the start, so it waits for the KEY SHARE holders while holding nothing of the row, and a
writer's later UPDATE of the row (its own KEY SHARE held already) goes ahead of it. The index is
maintained only when a moved column changes, which is rare; every other update of the row stays
as it was (HOT when the page has room).

The show row has none: no writer of procs writes its show row afterwards, and a raw flip keeps
its trigger's bounded wait with the hint that names the stuck session (accounting.keylocks). A
moved host or job row without a session lock_timeout now waits as any row lock does; the
console's and the actions layer's moves set their own.
"""

from __future__ import annotations

# (index name, table, columns): the primary key first, then the columns a move changes.
MOVE_LOCK_INDEXES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("i_host_move_lock", "host", ("pk_host", "pk_alloc")),
    ("i_job_move_lock", "job", ("pk_job", "pk_folder", "pk_dept", "pk_show")),
)


def create_sql() -> list[str]:
    return [
        f"CREATE UNIQUE INDEX IF NOT EXISTS {name} ON {table} ({', '.join(cols)})"
        for name, table, cols in MOVE_LOCK_INDEXES
    ]


def drop_sql() -> list[str]:
    return [f"DROP INDEX IF EXISTS {name}" for name, _, _ in MOVE_LOCK_INDEXES]
