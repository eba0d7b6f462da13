"""The keyed deltas of a proc write and where each goes: `acct_release` messages for a managed
show, the five counter tables (caps checked) for an unmanaged one, the ledger beside Cuebot.
Shared by the proc triggers and the key moves, which book the same way.
"""

from __future__ import annotations

import pgtrigger

from accounting.keylocks import LOCK_DECLARE
from accounting.notify import EMIT_FUNCTION, RELEASE_CHANNEL
from accounting.triggers.common import (
    CURRENT_XID,
    EPOCH_GUARD,
    GENERATION_DECLARE,
    LOCK_DB_SHOWS,
    NEXT_SEQ,
    NOTIFY_ENABLED,
    STORE_ACCOUNTED,
    WRITER_ON,
    WRITER_SETTING,
    _tail,
    bump_generation,
    json_id,
    usage_cores,
    with_generation,
)
from accounting.triggers.definer import DefinerTrigger

# --- keyed deltas ---------------------------------------------------------------------------
# Every source yields (pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g): a signed
# amount in centicores and GPUs against the full key of non-local procs.

PROC_INSERT_KEYED = """
    SELECT n.pk_show, h.pk_alloc, j.pk_folder, n.pk_job, n.pk_layer, j.pk_dept,
           n.int_cores_reserved::bigint, n.int_gpus_reserved::bigint
    FROM new_procs n JOIN host h ON h.pk_host = n.pk_host JOIN job j ON j.pk_job = n.pk_job
    WHERE NOT n.b_local
"""
PROC_DELETE_KEYED = """
    SELECT o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept,
           -o.int_cores_reserved::bigint, -o.int_gpus_reserved::bigint
    FROM old_procs o JOIN host h ON h.pk_host = o.pk_host JOIN job j ON j.pk_job = o.pk_job
    WHERE NOT o.b_local
"""
# A changed proc counts as its old row removed and its new row added: this covers a proc moved
# to another host (allocation), job, layer or show, turned local, or resized in place.
PROC_CHANGED = """
    ROW(o.pk_show, o.pk_host, o.pk_job, o.pk_layer, o.b_local, o.int_cores_reserved, o.int_gpus_reserved)
    IS DISTINCT FROM
    ROW(n.pk_show, n.pk_host, n.pk_job, n.pk_layer, n.b_local, n.int_cores_reserved, n.int_gpus_reserved)
"""
PROC_UPDATE_KEYED = f"""
    SELECT n.pk_show, h.pk_alloc, j.pk_folder, n.pk_job, n.pk_layer, j.pk_dept,
           n.int_cores_reserved::bigint, n.int_gpus_reserved::bigint
    FROM new_procs n JOIN old_procs o ON o.pk_proc = n.pk_proc
    JOIN host h ON h.pk_host = n.pk_host JOIN job j ON j.pk_job = n.pk_job
    WHERE NOT n.b_local AND {PROC_CHANGED}
    UNION ALL
    SELECT o.pk_show, h.pk_alloc, j.pk_folder, o.pk_job, o.pk_layer, j.pk_dept,
           -o.int_cores_reserved::bigint, -o.int_gpus_reserved::bigint
    FROM old_procs o JOIN new_procs n ON n.pk_proc = o.pk_proc
    JOIN host h ON h.pk_host = o.pk_host JOIN job j ON j.pk_job = o.pk_job
    WHERE NOT o.b_local AND {PROC_CHANGED}
"""
# Row-level: the running procs of a host whose allocation changed, off the old one, onto the new.
HOST_MOVE_KEYED = """
    SELECT p.pk_show, OLD.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
           -p.int_cores_reserved::bigint, -p.int_gpus_reserved::bigint
    FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE p.pk_host = OLD.pk_host AND NOT p.b_local
    UNION ALL
    SELECT p.pk_show, NEW.pk_alloc, j.pk_folder, p.pk_job, p.pk_layer, j.pk_dept,
           p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
    FROM proc p JOIN job j ON j.pk_job = p.pk_job WHERE p.pk_host = NEW.pk_host AND NOT p.b_local
"""
# Row-level: the running procs of a job whose folder or department changed.
JOB_MOVE_KEYED = """
    SELECT p.pk_show, h.pk_alloc, OLD.pk_folder, p.pk_job, p.pk_layer, OLD.pk_dept,
           -p.int_cores_reserved::bigint, -p.int_gpus_reserved::bigint
    FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = OLD.pk_job AND NOT p.b_local
    UNION ALL
    SELECT p.pk_show, h.pk_alloc, NEW.pk_folder, p.pk_job, p.pk_layer, NEW.pk_dept,
           p.int_cores_reserved::bigint, p.int_gpus_reserved::bigint
    FROM proc p JOIN host h ON h.pk_host = p.pk_host WHERE p.pk_job = NEW.pk_job AND NOT p.b_local
"""

# The keyed deltas are read once per trigger into these arrays (with each show's flag, read in
# the same statement), then shared by both halves.
DELTA_DECLARE = [
    ("v_show", "text[]"),
    ("v_alloc", "text[]"),
    ("v_folder", "text[]"),
    ("v_job", "text[]"),
    ("v_layer", "text[]"),
    ("v_dept", "text[]"),
    ("v_cc", "bigint[]"),
    ("v_g", "bigint[]"),
    ("v_managed", "boolean[]"),
    ("v_xid", "bigint"),
    ("v_seq", "bigint"),
    ("v_constraint", "text"),
    ("v_message", "text"),
    ("v_enabled", "boolean"),
    *GENERATION_DECLARE,
    *LOCK_DECLARE,  # the movers' BEFORE ROW lock shares the declarations of the AFTER ROW trigger
]
DELTAS = (
    "unnest(v_show, v_alloc, v_folder, v_job, v_layer, v_dept, v_cc, v_g, v_managed) "
    "AS d(pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g, managed)"
)


def read_deltas(keyed: str) -> str:
    """Collect the keyed deltas and each show's flag; a fresh statement after the lock."""
    return f"""
    SELECT array_agg(d.pk_show), array_agg(d.pk_alloc), array_agg(d.pk_folder), array_agg(d.pk_job),
           array_agg(d.pk_layer), array_agg(d.pk_dept), array_agg(d.cc), array_agg(d.g),
           array_agg(s.b_scheduler_managed)
    INTO v_show, v_alloc, v_folder, v_job, v_layer, v_dept, v_cc, v_g, v_managed
    FROM ({keyed}) AS d(pk_show, pk_alloc, pk_folder, pk_job, pk_layer, pk_dept, cc, g)
    JOIN show s ON s.pk_show = d.pk_show
    WHERE d.cc <> 0 OR d.g <> 0;"""


# --- managed shows: acct_release -------------------------------------------------------------

RELEASE_PAYLOAD = (
    "'{\"show\":' || "
    + json_id("g.pk_show")
    + " || ',\"alloc\":' || "
    + json_id("g.pk_alloc")
    + " || ',\"folder\":' || "
    + json_id("g.pk_folder")
    + " || ',\"job\":' || "
    + json_id("g.pk_job")
    + " || ',\"layer\":' || "
    + json_id("g.pk_layer")
    + " || ',\"dept\":' || "
    + json_id("g.pk_dept")
    + " || ',\"cores\":' || "
    + usage_cores("g.cc")
    + " || ',\"gpus\":' || g.g || "
    + _tail()
)

# The kill switch silences releases only (what it loses reads high). A positive delta (a proc
# written or grown outside the scheduler, the new side of a move) is always sent: losing one
# would leave the Store LOW.
_MANAGED_GROUPED = f"""
            SELECT d.pk_show, d.pk_alloc, d.pk_folder, d.pk_job, d.pk_layer, d.pk_dept,
                   SUM(d.cc)::bigint AS cc, SUM(d.g)::bigint AS g
            FROM {DELTAS}
            WHERE d.managed
            GROUP BY d.pk_show, d.pk_alloc, d.pk_folder, d.pk_job, d.pk_layer, d.pk_dept"""
_RELEASE_ORDER = ["pk_show", "pk_alloc", "pk_folder", "pk_job", "pk_layer", "pk_dept"]
_RELEASE_ROWS = (
    f"SELECT {RELEASE_PAYLOAD} AS payload, g.pk_show AS gen_show, "
    + ", ".join("g." + c for c in _RELEASE_ORDER)
    + f" FROM ({_MANAGED_GROUPED}) g WHERE (g.cc <> 0 OR g.g <> 0) AND (v_enabled OR g.cc > 0 OR g.g > 0)"
)
_BUMP_OUTSIDE = bump_generation(f"SELECT g.pk_show FROM ({_MANAGED_GROUPED}) g WHERE g.cc > 0 OR g.g > 0", "outside")
_RELEASE_MESSAGES = with_generation(_RELEASE_ROWS, _RELEASE_ORDER, add_show=False)
_RELEASE_MESSAGES_PLAIN = _RELEASE_ROWS + " ORDER BY " + ", ".join("g." + c for c in _RELEASE_ORDER)
# Only a statement with a positive managed delta can bump: the releases of the completion path
# (all negative) skip the bump and send their messages as before.
_ANY_POSITIVE = (
    "EXISTS (SELECT 1 FROM unnest(v_cc, v_g, v_managed) AS p(cc, g, managed) WHERE p.managed AND (p.cc > 0 OR p.g > 0))"
)
NOTIFY_MANAGED = f"""
    IF true = ANY(v_managed) AND NOT {STORE_ACCOUNTED} THEN
        v_enabled := {NOTIFY_ENABLED};
        v_xid := {CURRENT_XID};
        v_seq := {NEXT_SEQ};
        IF {_ANY_POSITIVE} THEN
            -- A positive delta on any key (a proc written or grown outside the scheduler, the new
            -- side of a move) is one the Store has not checked: its show's generation moves.
            {_BUMP_OUTSIDE}
            PERFORM {EMIT_FUNCTION}('{RELEASE_CHANNEL}', m.payload) FROM ({_RELEASE_MESSAGES}
            ) m;
        ELSE
            PERFORM {EMIT_FUNCTION}('{RELEASE_CHANNEL}', m.payload) FROM ({_RELEASE_MESSAGES_PLAIN}
            ) m;
        END IF;
    END IF;"""

# --- unmanaged shows: the five tables, caps enforced -------------------------------------------

# Constraint names carried by the errors (psycopg: exc.diag.constraint_name), so a caller can
# tell a cap rejection from any other failure without parsing the message.
CAP_SUBSCRIPTION_MISSING = "acct_subscription_missing"
CAP_SUBSCRIPTION_BURST = "acct_subscription_burst"
CAP_FOLDER_MISSING = "acct_folder_missing"
CAP_FOLDER_MAX_CORES = "acct_folder_max_cores"
CAP_JOB_MISSING = "acct_job_missing"
CAP_JOB_MAX_CORES = "acct_job_max_cores"
CAP_FOLDER_MAX_GPUS = "acct_folder_max_gpus"
CAP_JOB_MAX_GPUS = "acct_job_max_gpus"
CAP_LAYER_MISSING = "acct_layer_missing"  # beside Cuebot only: the outside top-up
CAP_CONSTRAINTS = frozenset(
    {
        CAP_SUBSCRIPTION_MISSING,
        CAP_SUBSCRIPTION_BURST,
        CAP_FOLDER_MISSING,
        CAP_FOLDER_MAX_CORES,
        CAP_JOB_MISSING,
        CAP_JOB_MAX_CORES,
        CAP_FOLDER_MAX_GPUS,
        CAP_JOB_MAX_GPUS,
        CAP_LAYER_MISSING,
    }
)

# Applies the unmanaged deltas to the five tables and returns the first cap violation, if any.
# Every UPDATE ... RETURNING locks the rows it changes, so concurrent writers of one subscription,
# folder or job queue up and each checks the values it wrote itself. Only keys whose delta is
# positive are checked: a release always succeeds, even above a cap lowered meanwhile; a positive
# delta against a missing row fails closed, as a missing subscription always did. The order is
# the Store's: subscription, folder cores, job cores, folder GPUs, job GPUs.
DB_APPLY = f"""
    WITH delta AS (SELECT * FROM {DELTAS} WHERE NOT d.managed),
    sub_d AS (
        SELECT pk_show, pk_alloc, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_show, pk_alloc HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    sub_u AS (
        UPDATE subscription t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM sub_d d WHERE t.pk_show = d.pk_show AND t.pk_alloc = d.pk_alloc
        RETURNING t.pk_show, t.pk_alloc, t.int_cores, t.int_burst
    ),
    folder_d AS (
        SELECT pk_folder, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_folder HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    folder_u AS (
        UPDATE folder_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM folder_d d WHERE t.pk_folder = d.pk_folder
        RETURNING t.pk_folder, t.int_cores, t.int_gpus, t.int_max_cores, t.int_max_gpus
    ),
    job_d AS (
        SELECT pk_job, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
        FROM delta GROUP BY pk_job HAVING SUM(cc) <> 0 OR SUM(g) <> 0
    ),
    job_u AS (
        UPDATE job_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM job_d d WHERE t.pk_job = d.pk_job
        RETURNING t.pk_job, t.int_cores, t.int_gpus, t.int_max_cores, t.int_max_gpus
    ),
    layer_u AS (
        UPDATE layer_resource t SET int_cores = t.int_cores + d.cc, int_gpus = t.int_gpus + d.g
        FROM (
            SELECT pk_layer, SUM(cc)::bigint AS cc, SUM(g)::bigint AS g
            FROM delta GROUP BY pk_layer HAVING SUM(cc) <> 0 OR SUM(g) <> 0
        ) d
        WHERE t.pk_layer = d.pk_layer
    ),
    point_u AS (
        INSERT INTO point AS t (pk_point, pk_show, pk_dept, int_cores, int_gpus)
        SELECT gen_random_uuid()::text, pk_show, pk_dept, SUM(cc)::int, SUM(g)::int
        FROM delta GROUP BY pk_show, pk_dept HAVING SUM(cc) <> 0 OR SUM(g) <> 0
        ON CONFLICT (pk_show, pk_dept) DO UPDATE
        SET int_cores = t.int_cores + EXCLUDED.int_cores, int_gpus = t.int_gpus + EXCLUDED.int_gpus
    )
    SELECT v.con, v.msg INTO v_constraint, v_message FROM (
        SELECT 1 AS ord, '{CAP_SUBSCRIPTION_MISSING}' AS con, format(
            'no subscription for show=%s alloc=%s: cannot book %s centicores',
            d.pk_show, d.pk_alloc, d.cc) AS msg
        FROM sub_d d
        WHERE d.cc > 0 AND NOT EXISTS (
            SELECT 1 FROM sub_u u WHERE u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc)
        UNION ALL
        SELECT 2, '{CAP_SUBSCRIPTION_BURST}', format(
            'subscription has exceeded burst size: show=%s alloc=%s cores=%s burst=%s (centicores)',
            u.pk_show, u.pk_alloc, u.int_cores, u.int_burst)
        FROM sub_d d JOIN sub_u u ON u.pk_show = d.pk_show AND u.pk_alloc = d.pk_alloc
        WHERE d.cc > 0 AND u.int_cores > u.int_burst
        UNION ALL
        SELECT 3, '{CAP_FOLDER_MISSING}', format(
            'no folder_resource row for folder=%s: cannot book %s centicores', d.pk_folder, d.cc)
        FROM folder_d d
        WHERE (d.cc > 0 OR d.g > 0) AND NOT EXISTS (SELECT 1 FROM folder_u u WHERE u.pk_folder = d.pk_folder)
        UNION ALL
        SELECT 4, '{CAP_FOLDER_MAX_CORES}', format(
            'folder has exceeded max cores: folder=%s cores=%s max_cores=%s (centicores)',
            u.pk_folder, u.int_cores, u.int_max_cores)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.cc > 0 AND u.int_max_cores >= 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 5, '{CAP_JOB_MISSING}', format(
            'no job_resource row for job=%s: cannot book %s centicores', d.pk_job, d.cc)
        FROM job_d d
        WHERE (d.cc > 0 OR d.g > 0) AND NOT EXISTS (SELECT 1 FROM job_u u WHERE u.pk_job = d.pk_job)
        UNION ALL
        SELECT 6, '{CAP_JOB_MAX_CORES}', format(
            'job has exceeded max cores: job=%s cores=%s max_cores=%s (centicores)',
            u.pk_job, u.int_cores, u.int_max_cores)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.cc > 0 AND u.int_max_cores >= 0 AND u.int_cores > u.int_max_cores
        UNION ALL
        SELECT 7, '{CAP_FOLDER_MAX_GPUS}', format(
            'folder has exceeded max GPUs: folder=%s gpus=%s max_gpus=%s',
            u.pk_folder, u.int_gpus, u.int_max_gpus)
        FROM folder_d d JOIN folder_u u ON u.pk_folder = d.pk_folder
        WHERE d.g > 0 AND u.int_max_gpus >= 0 AND u.int_gpus > u.int_max_gpus
        UNION ALL
        SELECT 8, '{CAP_JOB_MAX_GPUS}', format(
            'job has exceeded max GPUs: job=%s gpus=%s max_gpus=%s',
            u.pk_job, u.int_gpus, u.int_max_gpus)
        FROM job_d d JOIN job_u u ON u.pk_job = d.pk_job
        WHERE d.g > 0 AND u.int_max_gpus >= 0 AND u.int_gpus > u.int_max_gpus
    ) v
    ORDER BY v.ord, v.msg
    LIMIT 1;"""

# A Cuebot database (its `verify_subscription` trigger is on `subscription`): Cuebot's Java code
# (ProcDaoJdbc.procCreated / procDestroyed, its after_job_moved and after_job_dept_update
# triggers) keeps the five tables of the shows it owns, the unmanaged ones, in the writing
# transaction, and its verify_* triggers enforce their caps. Applying the deltas here as well
# would count every Cuebot booking twice, so the unmanaged half does not apply them there for
# any writer but cuesched's own; for the others it records what they owe instead, settled at
# commit (RECORD_OUTSIDE below). cuesched's connections carry the writer mark (the claim
# WRITER_OPTION, set by accounting.db.connect and Django's settings, from a member of
# WRITER_ROLE): a frame the
# scheduler booked while the show was managed and completes after a flip back is deleted by
# our completion path, which Cuebot's Java never sees, so our trigger is the only one to
# count that release. Read per statement, and only when an unmanaged show is in it: the
# managed hot path never pays for it.
CUEBOT_ACCOUNTS = (
    "EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'verify_subscription' AND tgrelid = to_regclass('subscription'))"
)
WRITER_OPTION = f"-c {WRITER_SETTING}=on"
CUEBOT_WRITES = f"(NOT {WRITER_ON} AND {CUEBOT_ACCOUNTS})"

# --- beside Cuebot: writers that count nothing themselves ----------------------------------------
# Standing down for every unmarked writer trusted that writer to be Cuebot, whose Java updates the
# five tables in the same transaction. A psql session or script that writes a proc without those
# UPDATEs was counted by nobody: the counters read LOW and Cuebot booked past the burst. So an
# unmarked transaction in Cuebot mode keeps a ledger of what it owes each counter row: its proc
# deltas (recorded here, by the proc triggers) minus the change anybody else made to that row's
# int_cores / int_gpus in the same transaction (Cuebot's UPDATEs, its own triggers,
# recalculate_subs(); recorded by the counter tables' statement triggers). A deferred constraint
# trigger tops up at commit whatever is still owed (OUTSIDE_TOPUP_FUNC): Cuebot's own SQL owes
# nothing and is counted once; a raw INSERT owes its cores and is counted at commit, caps checked.
# Rows are the transaction's own (keyed by its xid), so a rollback, or a rollback to a savepoint,
# takes them back together with the writes they describe.
OUTSIDE_LEDGER_TABLE = "cuesched_outside_ledger"
# tbl: the counter table, numbered in the order Cuebot's procCreated updates them (and the top-up
# locks them): subscription, layer_resource, job_resource, folder_resource, point.
OUTSIDE_SUB, OUTSIDE_LAYER, OUTSIDE_JOB, OUTSIDE_FOLDER, OUTSIDE_POINT = 1, 2, 3, 4, 5
# cc, g: what the transaction still owes the row; bc, bg: what its proc writes booked on the row's
# key (net), which decides whether the top-up checks the row's cap (a transaction that booked
# nothing there, as Cuebot's recalculate_subs(), cannot breach it and is not refused).
_LEDGER_UPSERT = f"""
    INSERT INTO {OUTSIDE_LEDGER_TABLE} AS t (xid, tbl, k1, k2, cc, g, bc, bg)
    SELECT {CURRENT_XID}, x.tbl, x.k1, x.k2, SUM(x.cc)::bigint, SUM(x.g)::bigint, SUM(x.bc)::bigint, SUM(x.bg)::bigint
    FROM ({{owed}}) AS x(tbl, k1, k2, cc, g, bc, bg)
    GROUP BY x.tbl, x.k1, x.k2 HAVING SUM(x.cc) <> 0 OR SUM(x.g) <> 0 OR SUM(x.bc) <> 0 OR SUM(x.bg) <> 0
    ORDER BY x.tbl, x.k1, x.k2
    ON CONFLICT (xid, tbl, k1, k2) DO UPDATE
    SET cc = t.cc + EXCLUDED.cc, g = t.g + EXCLUDED.g, bc = t.bc + EXCLUDED.bc, bg = t.bg + EXCLUDED.bg;"""
RECORD_OUTSIDE = _LEDGER_UPSERT.format(
    owed="\n        UNION ALL ".join(
        f"SELECT {tbl}, {k1}, {k2}, d.cc, d.g, d.cc, d.g FROM {DELTAS} WHERE NOT d.managed"
        for tbl, k1, k2 in (
            (OUTSIDE_SUB, "d.pk_show", "d.pk_alloc"),
            (OUTSIDE_LAYER, "d.pk_layer", "''"),
            (OUTSIDE_JOB, "d.pk_job", "''"),
            (OUTSIDE_FOLDER, "d.pk_folder", "''"),
            (OUTSIDE_POINT, "d.pk_show", "d.pk_dept"),
        )
    )
)

APPLY_UNMANAGED = f"""
    IF false = ANY(v_managed) THEN
        IF NOT {CUEBOT_WRITES} THEN
            {LOCK_DB_SHOWS.format(rows=f"(SELECT * FROM {DELTAS} WHERE NOT d.managed)")}
            {DB_APPLY}
            IF v_message IS NOT NULL THEN
                RAISE EXCEPTION USING MESSAGE = v_message, ERRCODE = 'check_violation', CONSTRAINT = v_constraint;
            END IF;
        ELSE
            {RECORD_OUTSIDE}
        END IF;
    END IF;"""


def usage_func(
    keyed: str,
    *,
    guard: str = "",
    prologue: str = "",
    rows: str | None = None,
    outside_check: str = "",
    keyed_check: str = "",
    lock: str = "",
) -> str:
    """A trigger body: optional cheap exit, the key locks, the keyed deltas, then both halves.

    `lock` locks the key rows of the procs written (accounting.keylocks.lock_proc_keys); a
    mover locked the row it moves in its BEFORE ROW trigger and passes the shows of the procs it
    moves (their flags decide which side books the move: see accounting.triggers.moves).

    `rows` names the transition table of a proc trigger: a statement of the scheduler's own
    Store-accounted transaction that touches no unmanaged show has nothing to do, which is
    told from the show flags alone (no host or job join) on the booking hot path.
    `outside_check` runs for every other writer only: the scheduler's booking statement checks
    its rows' hosts and jobs itself (and keys them exactly), so it is spared a second join.
    `keyed_check` runs once the deltas and their shows' flags are read, before either half.
    """
    fast = ""
    if rows is not None:
        fast = f"""
    IF {STORE_ACCOUNTED} AND NOT EXISTS (
        SELECT 1 FROM {rows} r JOIN show s ON s.pk_show = r.pk_show AND NOT s.b_scheduler_managed
        WHERE NOT r.b_local
    ) THEN
        RETURN NULL;
    END IF;"""
    return f"""
    {guard}
    {prologue}
    {lock}
    {EPOCH_GUARD}
    {fast}
    {f"IF NOT {STORE_ACCOUNTED} THEN {outside_check} END IF;" if outside_check else ""}
    {read_deltas(keyed)}
    IF v_show IS NULL THEN
        RETURN NULL;
    END IF;{keyed_check}
    {NOTIFY_MANAGED}
    {APPLY_UNMANAGED}
    RETURN NULL;
"""


def _usage_trigger(name: str, operation: pgtrigger.Operation, func: str) -> pgtrigger.Trigger:
    referencing = {
        "INSERT": pgtrigger.Referencing(new="new_procs"),
        "DELETE": pgtrigger.Referencing(old="old_procs"),
        "UPDATE": pgtrigger.Referencing(old="old_procs", new="new_procs"),
    }[str(operation)]
    return DefinerTrigger(
        name=name,
        when=pgtrigger.After,
        operation=operation,
        level=pgtrigger.Statement,
        referencing=referencing,
        declare=DELTA_DECLARE,
        func=func,
    )
