"""The host memory ledger: `host.int_mem_idle` is `int_mem - SUM(proc.int_mem_reserved)`, whoever writes.

Before, only the scheduler's own SQL kept a host's idle memory (its booking takes a frame's
memory from the host in the statement that inserts the proc, its completion gives it back).
Anybody else's proc write left the host untouched: a psql INSERT of a proc reserving 10 GB left
the host's idle memory where it was (HIGH: the scheduler then booked the same 10 GB again), and
an INSERT or UPDATE reserving more than the host has was accepted. The placement's check
`int_mem_idle >= need` is only as good as that column.

The rule, enforced in every writer's transaction:

* every proc statement that changes a reservation or moves a proc (INSERT, DELETE, an UPDATE of
  `int_mem_reserved` or `pk_host`), and every host statement that writes `int_mem` or
  `int_mem_idle`, records the hosts it touched in `cuesched_host_ledger` (one row per
  transaction);
* at COMMIT a deferred trigger locks those hosts `FOR NO KEY UPDATE` in key order (not `FOR
  UPDATE`: every proc writer holds its hosts `FOR KEY SHARE` from its first write, see
  accounting.keylocks, and two of them recounting one host would each wait for the other's), then, in a fresh
  statement (READ COMMITTED: after whatever it waited for), RECOUNTS `SUM(int_mem_reserved)` of
  each host from `proc` and writes `int_mem_idle = int_mem - SUM`. It is never a running sum
  that could drift: a writer that kept the column itself (the scheduler, Cuebot's Java and its
  `upgrade_proc_memory_usage` trigger) finds it already right and nothing is written; one that
  did not (psql, a script) has it written for it; a direct write of the column is put back;
* a host where this transaction's proc writes grew the reservations (net, per statement) and the
  recount is above the host's memory fails the commit with `check_violation`, constraint
  `acct_host_memory`: no reservation ever grows past what the host has. Two writers that each fit
  alone serialise on the host's row lock, and the second recounts with the first's procs;
* a host whose memory shrank under its running frames (an agent or RQD reporting less) is
  accepted: the machine is what it reports. Its idle memory reads 0, never negative, and nothing
  more is booked or grown there until its frames release enough;
* at REPEATABLE READ or SERIALIZABLE, a host row changed after the writer's snapshot fails the
  lock with a serialization failure, so a stale snapshot never recounts low; a
  transaction whose writes leave the sum unchanged writes no host row, and needs none.

TRUNCATE proc gives every host its whole memory back. The ledger table is written by these
triggers only (a client write is refused, as for the outside ledger) and is UNLOGGED: a row
never outlives its transaction. Cuebot keeps the same rule (`HostDaoJdbc.RECONCILE_IDLE_RESOURCES`
recounts a host's idle memory from `SUM(proc.int_mem_reserved)`); here it is kept at every commit
instead of on a repair path. Cores and GPUs keep the scheduler's own in-statement arithmetic.
"""

from __future__ import annotations

import pgtrigger

from accounting.triggers import CURRENT_XID
from accounting.triggers.definer import DefinerTrigger, written_by_triggers

HOST_LEDGER_TABLE = "cuesched_host_ledger"
HOST_MEMORY_CONSTRAINT = "acct_host_memory"
HOST_LEDGER_WRITTEN_BY_TRIGGERS = "acct_host_ledger_written_by_triggers"
# The recount's constraint trigger as installed (pgtrigger's name for HostLedger's
# acct_host_mem_recount; a test holds the two together): `SET CONSTRAINTS` names it.
HOST_LEDGER_RECOUNT_CONSTRAINT = "pgtrigger_acct_host_mem_recount_81613"

_DECLARE = [("v_hosts", "text[]"), ("v_grown", "text[]"), ("v_message", "text")]


def _enqueue(hosts: str, grown: str | None = None) -> str:
    """Record the hosts a statement touched (`hosts` yields pk_host), and those it grew."""
    grown_sql = (
        f"SELECT COALESCE(array_agg(DISTINCT y.pk_host), '{{}}') INTO v_grown FROM ({grown}) AS y(pk_host)"
        " WHERE y.pk_host IS NOT NULL;"
        if grown
        else "v_grown := '{}';"
    )
    return f"""
    SELECT array_agg(DISTINCT x.pk_host) INTO v_hosts FROM ({hosts}) AS x(pk_host) WHERE x.pk_host IS NOT NULL;
    IF v_hosts IS NULL THEN
        RETURN NULL;
    END IF;
    {grown_sql}
    INSERT INTO {HOST_LEDGER_TABLE} AS t (xid, hosts, grown) VALUES ({CURRENT_XID}, v_hosts, v_grown)
    ON CONFLICT (xid) DO UPDATE SET hosts = t.hosts || EXCLUDED.hosts, grown = t.grown || EXCLUDED.grown;
    RETURN NULL;
"""


_CHANGED = """
    SELECT o.pk_host AS old_host, o.int_mem_reserved AS old_mem, n.pk_host AS new_host, n.int_mem_reserved AS new_mem
    FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc
    WHERE o.int_mem_reserved IS DISTINCT FROM n.int_mem_reserved OR o.pk_host IS DISTINCT FROM n.pk_host
"""
PROC_INSERT_FUNC = _enqueue(
    "SELECT pk_host FROM new_procs WHERE int_mem_reserved <> 0",
    "SELECT pk_host FROM new_procs GROUP BY pk_host HAVING SUM(int_mem_reserved) > 0",
)
PROC_DELETE_FUNC = _enqueue("SELECT pk_host FROM old_procs WHERE int_mem_reserved <> 0")
PROC_UPDATE_FUNC = _enqueue(
    f"SELECT c.old_host FROM ({_CHANGED}) c UNION ALL SELECT c.new_host FROM ({_CHANGED}) c",
    f"""SELECT d.h FROM (
        SELECT c.new_host AS h, c.new_mem AS m FROM ({_CHANGED}) c
        UNION ALL SELECT c.old_host, -c.old_mem FROM ({_CHANGED}) c) d
      GROUP BY d.h HAVING SUM(d.m) > 0""",
)
# Nothing is reserved anywhere any more: every host's memory is idle (the host trigger records
# the hosts this changes, so the commit's recount confirms it against procs written after).
PROC_TRUNCATE_FUNC = """
    UPDATE host SET int_mem_idle = int_mem WHERE int_mem_idle IS DISTINCT FROM int_mem;
    RETURN NULL;
"""
HOST_INSERT_FUNC = _enqueue("SELECT pk_host FROM new_rows")
HOST_UPDATE_FUNC = _enqueue(
    """SELECT n.pk_host FROM new_rows n JOIN old_rows o ON o.pk_host = n.pk_host
       WHERE o.int_mem IS DISTINCT FROM n.int_mem OR o.int_mem_idle IS DISTINCT FROM n.int_mem_idle"""
)

# The recount: SUM(proc) of the moment, under every writer's lock of the host row.
_RESERVED = "COALESCE((SELECT SUM(p.int_mem_reserved) FROM proc p WHERE p.pk_host = h.pk_host), 0)::bigint"
RECOUNT_FUNC = f"""
    DELETE FROM {HOST_LEDGER_TABLE} WHERE xid = NEW.xid RETURNING hosts, grown INTO v_hosts, v_grown;
    IF v_hosts IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM host h WHERE h.pk_host = ANY(v_hosts) ORDER BY h.pk_host FOR NO KEY UPDATE OF h;
    -- A fresh statement: at READ COMMITTED it sees every writer of these hosts that committed
    -- while this waited for their rows.
    SELECT format('cuesched: host %s would have %s KB of memory reserved, more than its %s KB',
                  h.str_name, r.m, h.int_mem)
    INTO v_message
    FROM host h CROSS JOIN LATERAL (SELECT {_RESERVED} AS m) r
    WHERE h.pk_host = ANY(v_grown) AND r.m > h.int_mem
    ORDER BY h.pk_host LIMIT 1;
    IF v_message IS NOT NULL THEN
        RAISE EXCEPTION USING
            MESSAGE = v_message,
            HINT = 'Nothing was written. A reservation may grow only into the host''s idle memory '
                   '(host.int_mem - SUM(proc.int_mem_reserved)).',
            ERRCODE = 'check_violation', CONSTRAINT = '{HOST_MEMORY_CONSTRAINT}';
    END IF;
    UPDATE host h SET int_mem_idle = GREATEST(0, h.int_mem - r.m)
    FROM (SELECT h2.pk_host, {_RESERVED.replace("h.pk_host", "h2.pk_host")} AS m
          FROM host h2 WHERE h2.pk_host = ANY(v_hosts)) r
    WHERE h.pk_host = r.pk_host AND h.int_mem_idle IS DISTINCT FROM GREATEST(0, h.int_mem - r.m);
    RETURN NULL;
"""


# Every host made exact at once, with proc's writers held off (SHARE) until the commit, by when the
# triggers that keep it are installed: the migration that installs them, and adoption beside Cuebot.
REBUILD_SQL = [
    "LOCK TABLE proc IN SHARE MODE",
    f"""UPDATE host h SET int_mem_idle = GREATEST(0, h.int_mem - {_RESERVED})
    WHERE h.int_mem_idle IS DISTINCT FROM GREATEST(0, h.int_mem - {_RESERVED})""",
]


def _statement(name: str, operation: pgtrigger.Operation, func: str, **referencing: str) -> pgtrigger.Trigger:
    # DefinerTrigger, as every accounting trigger: no session setting (pgtrigger.ignore) switches
    # the ledger off, and it writes its table as the owner whoever fired it.
    return DefinerTrigger(
        name=name,
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Statement,
        referencing=pgtrigger.Referencing(**referencing) if referencing else None,
        declare=_DECLARE,
        func=func,
    )


def proc_triggers() -> list[pgtrigger.Trigger]:
    """The proc side: every statement that reserves, releases or moves memory."""
    return [
        _statement("acct_host_mem_insert", pgtrigger.Insert, PROC_INSERT_FUNC, new="new_procs"),
        _statement("acct_host_mem_delete", pgtrigger.Delete, PROC_DELETE_FUNC, old="old_procs"),
        _statement("acct_host_mem_update", pgtrigger.Update, PROC_UPDATE_FUNC, old="old_procs", new="new_procs"),
        _statement("acct_host_mem_truncate", pgtrigger.Truncate, PROC_TRUNCATE_FUNC),
    ]


def host_triggers() -> list[pgtrigger.Trigger]:
    """The host side: a write of its memory or its idle memory is recounted at commit."""
    return [
        _statement("acct_host_mem_host_insert", pgtrigger.Insert, HOST_INSERT_FUNC, new="new_rows"),
        _statement("acct_host_mem_host_update", pgtrigger.Update, HOST_UPDATE_FUNC, old="old_rows", new="new_rows"),
    ]


def ledger_triggers() -> list[pgtrigger.Trigger]:
    return [
        DefinerTrigger(
            name="acct_host_mem_recount",
            when=pgtrigger.After,
            operation=pgtrigger.Insert,
            level=pgtrigger.Row,
            timing=pgtrigger.Deferred,
            declare=_DECLARE,
            func=RECOUNT_FUNC,
        ),
        DefinerTrigger(
            name="acct_host_ledger_guard",
            when=pgtrigger.Before,
            operation=pgtrigger.Insert | pgtrigger.Update | pgtrigger.Delete,
            level=pgtrigger.Row,
            # Only the ledger's own trigger functions write it (a session's TEMP trigger, at depth
            # 1 too, is refused): the same owner test as the other "written by triggers" guards.
            condition=pgtrigger.Condition(f"NOT {written_by_triggers(HOST_LEDGER_TABLE)}"),
            func=f"""
    RAISE EXCEPTION USING
        MESSAGE = 'cuesched: {HOST_LEDGER_TABLE} is written by the host memory triggers only',
        HINT = 'It holds the hosts this transaction touched, recounted at its commit; write procs and hosts.',
        ERRCODE = 'check_violation', CONSTRAINT = '{HOST_LEDGER_WRITTEN_BY_TRIGGERS}';
""",
        ),
    ]
