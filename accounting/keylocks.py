"""The accounting-keys locks: row locks on the keys a proc is accounted by, never one lock for the farm.

A proc's delta is right only if the keys it is read against (its show's flag, its host's
allocation, its job's folder and department, its layer's limits) cannot change between the read
and the commit. Every proc writer therefore locks the rows of those keys FOR KEY SHARE, in a
statement of its own before it reads them: the show, job, layer and host rows of every proc it
writes (old and new). A mover locks the row it moves FOR UPDATE before it reads the procs it
moves: a flip its show's row, `UPDATE host SET pk_alloc` the host's, `UPDATE job SET pk_folder`
the job's, a limit put on an existing layer the layer's. FOR UPDATE conflicts with KEY SHARE,
so a mover waits for the proc writers of exactly the keys it moves, and later writers of those
keys wait for it; at READ COMMITTED the writer's next statement sees the move. A host or job
mover then locks the shows of the procs it moves FOR KEY SHARE, as a proc writer does, since
their flags decide which side books the move: a flip of one of them and the move wait for each
other instead of the flip committing between the move's read of the flag and its commit. A
writer at REPEATABLE READ or SERIALIZABLE whose snapshot predates a move fails on the moved row
(40001), as any lock of a row updated after the snapshot does.

This replaces one transaction-level advisory lock (class 'acct', key 0) shared by every proc
statement and taken exclusively by every mover: any session may take an advisory lock without
any privilege, so one login holding it stopped every booking and every proc write of every show,
and one idle transaction that wrote a proc of show B made a flip of show A fail after 10 s.
Now a stuck or hostile session holds off the moves of its own keys only, and locking a row needs
the UPDATE privilege on its table, which PostgreSQL checks. KEY SHARE is the weakest row lock:
it never waits for, nor holds off, the writes the farm makes all the time to these rows (a
host's idle cores, a job's state), only a delete of the row or a FOR UPDATE of it.

A host row is shared by the shows that run on it, so the scheduler's own transactions, which
update their hosts' idle cores anyway, lock their hosts FOR NO KEY UPDATE (in host order) up
front instead: a move of the host then waits for them and they never wait for it midway, which
would be a lock cycle (they hold the host's KEY SHARE, the mover its NO KEY UPDATE).

A mover's wait is bounded: at most MOVE_LOCK_SECONDS (or the session's lock_timeout when that is
shorter), then `lock_not_available` with a hint that names what to look for.
"""

from __future__ import annotations

# The tables in lock order (any writer that locks more than one takes them in this order, each
# by key), with their key column.
KEY_TABLES = (("show", "pk_show"), ("job", "pk_job"), ("layer", "pk_layer"), ("host", "pk_host"))
MOVE_LOCK_SECONDS = 10


def lock_keys_of(rows: str, *, tables: tuple[str, ...] = ("show", "job", "layer", "host")) -> str:
    """PL/pgSQL: KEY SHARE of the key rows of the procs `rows` yields (a relation with the pk_* columns).

    One PERFORM per table, in KEY_TABLES order, each in key order.
    """
    parts = []
    for table, key in KEY_TABLES:
        if table in tables:
            parts.append(
                f"PERFORM 1 FROM {table} t WHERE t.{key} IN (SELECT r.{key} FROM {rows} r) "
                f"ORDER BY t.{key} FOR KEY SHARE OF t;"
            )
    return "\n    ".join(parts)


def lock_proc_keys(*transition: str) -> str:
    """PL/pgSQL: KEY SHARE of the keys of every row of the named transition tables."""
    rows = " UNION ALL ".join(f"SELECT pk_show, pk_job, pk_layer, pk_host FROM {t}" for t in transition)
    return lock_keys_of(f"({rows})")


def lock_for_move(table: str, keys: str, what: str) -> str:
    """PL/pgSQL: FOR UPDATE of the `table` rows whose keys the subquery `keys` yields, bounded.

    Needs `v_lock_timeout text` declared (LOCK_DECLARE). The wait is the session's lock_timeout
    when that is set and shorter than MOVE_LOCK_SECONDS, else MOVE_LOCK_SECONDS; the session's
    value is put back afterwards. The one subtransaction of the EXCEPTION block is the price of
    a message that says what to do.
    """
    key = dict(KEY_TABLES)[table]
    return f"""
    v_lock_timeout := current_setting('lock_timeout');
    BEGIN
        IF (SELECT s.setting::bigint FROM pg_settings s WHERE s.name = 'lock_timeout')
           NOT BETWEEN 1 AND {MOVE_LOCK_SECONDS * 1000} THEN
            PERFORM set_config('lock_timeout', '{MOVE_LOCK_SECONDS}s', true);
        END IF;
        PERFORM 1 FROM {table} t WHERE t.{key} IN ({keys}) ORDER BY t.{key} FOR UPDATE OF t;
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION USING
            MESSAGE = 'cuesched: {what}: a {table} row it changes stayed locked past the lock wait',
            HINT = 'A transaction that wrote procs of this {table} (or locked its row) is still open: find it in '
                   'pg_stat_activity (state ''idle in transaction''), end it, and retry. Flips and moves of '
                   'other keys are not held up.',
            ERRCODE = 'lock_not_available';
    END;"""


LOCK_DECLARE = [("v_lock_timeout", "text")]

# From a client, one statement: the keys of the procs named by id (a completion, a compensation,
# a kill). Hosts FOR NO KEY UPDATE: the same transaction gives their cores back next.
_CLIENT_LOCK = """(SELECT count(*) FROM (SELECT 1 FROM {table} t WHERE t.{key} IN (SELECT {src}.{key} FROM {src_from})
 ORDER BY t.{key} FOR {mode} OF t) x)"""


def client_lock_sql(src_from: str, src: str = "p") -> str:
    """One SQL statement locking the show, job, layer (KEY SHARE) and host (NO KEY UPDATE) rows of
    the rows `src_from` yields (alias `src`), table by table in KEY_TABLES order."""
    parts = [
        _CLIENT_LOCK.format(
            table=table, key=key, src=src, src_from=src_from, mode="NO KEY UPDATE" if table == "host" else "KEY SHARE"
        )
        for table, key in KEY_TABLES
    ]
    return "SELECT " + " + ".join(parts)


LOCK_KEYS_OF_PROCS_SQL = client_lock_sql("proc p WHERE p.pk_proc = ANY(%(proc)s::text[])")
# The booking's keys, from its arrays (it books procs that do not exist yet).
LOCK_KEYS_OF_BOOKINGS_SQL = client_lock_sql(
    "unnest(%(show)s::text[], %(job)s::text[], %(layer)s::text[], %(host)s::text[])"
    " AS b(pk_show, pk_job, pk_layer, pk_host)",
    src="b",
)
# A flip from a client: its show rows, FOR UPDATE, under the caller's lock_timeout.
LOCK_SHOWS_FOR_FLIP_SQL = "SELECT pk_show FROM show WHERE pk_show = ANY(%s::text[]) ORDER BY pk_show FOR UPDATE"
# Every show: the statements that rebuild or read every show's flag (a TRUNCATE).
LOCK_EVERY_SHOW = "PERFORM 1 FROM show t ORDER BY t.pk_show FOR KEY SHARE OF t;"
