"""Upgrading cuesched on an adopted Cuebot database: `adopt_cuebot_db` run again after a cuesched
release brings cuesched's own objects up to date and leaves Cuebot's alone.

`migrate` is refused on a Cuebot database, so re-adoption is the only way a changed trigger body
reaches an adopted farm; before this, a function of an existing name was kept whatever its body,
and an adopted farm ran the old (counter-low, cap-breaching) bodies forever. The database here is
adopted, then made to look like one adopted by an older cuesched, exactly as such a database is:
no adoption marks on any function, an accounting function with an old body (its licence cap
check gone), a trigger under another pgtrigger name, a column of a later migration missing with
that migration unrecorded.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from dataclasses import dataclass

import psycopg
import pytest

from dispatch.adoption import MARK, Catalog, function_mark_sql, read_catalog
from tests.integration import cuebot_support as cb
from tests.integration.cuebot_standin import CuebotStandIn, Proc
from tests.integration.test_cuebot_mode import ALLOC, SHOW, Farm

STALE_HASH = "00000"


def catalog(url: str) -> Catalog:
    with psycopg.connect(url) as conn:
        return read_catalog(conn)


def pgtrigger_name(cat: Catalog, table: str, base: str) -> str:
    """The installed name of cuesched's trigger `base` on `table` (pgtrigger appends a hash)."""
    found = [n for (t, n) in cat.triggers if t == table and re.fullmatch(f"pgtrigger_{base}_[0-9a-f]{{5}}", n)]
    assert len(found) == 1, found
    return found[0]


def cuesched_lines(dump: str) -> Counter[str]:
    """The dump's lines less function comments and the server's per-column version stamp (this
    server dumps `ALTER COLUMN ... SET (pg_attver=...)`, new for a column added again)."""
    lines = cb.dump_lines(dump).items()
    return Counter({k: v for k, v in lines if not k.startswith("COMMENT ON FUNCTION") and "(pg_attver=" not in k})


@dataclass
class Upgraded:
    url: str
    cuebot: str  # the dump before any adoption: Cuebot's own objects
    cuebot_catalog: Catalog
    adopted: str  # the dump right after a first adoption by this cuesched
    adopted_comments: dict[str, str | None]  # its function comments (adoption's marks)
    capped: str  # the licence-counting function whose cap check the old body lacked
    renamed: str  # the trigger found under an old pgtrigger name
    stale_booked: bool  # the old body let a frame over its licence limit through
    check: str
    after_check: str
    apply: str
    after_apply: str
    again: str
    after_again: str
    migrate: str


def _limit_of_one(url: str) -> tuple[Farm, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE subscription SET int_burst = 100000 WHERE pk_show = %s AND pk_alloc = %s", (SHOW, ALLOC))
        farm = Farm(conn, url=url)
        pk = str(uuid.uuid4())
        conn.execute(
            "INSERT INTO limit_record (pk_limit_record, str_name, int_max_value, b_host_limit)"
            " VALUES (%s, %s, 1, false)",
            (pk, f"arnold-{pk[:8]}"),
        )
        conn.execute(
            "INSERT INTO layer_limit (pk_layer_limit, pk_layer, pk_limit_record) VALUES (%s, %s, %s)",
            (str(uuid.uuid4()), farm.layer, pk),
        )
    return farm, pk


def _book_two(url: str, farm: Farm) -> bool:
    """Cuebot books two frames of a layer whose licence limit is 1: True when both went in."""
    standin = CuebotStandIn(url)
    booked: list[Proc] = []
    try:
        for frame in farm.frames[:2]:
            booked.append(
                standin.book(
                    host=farm.host, alloc=ALLOC, show=SHOW, job=farm.job, layer=farm.layer, frame=frame, cores=100
                )
            )
        return True
    except psycopg.errors.CheckViolation as exc:
        assert exc.diag.constraint_name == "acct_limit_max", exc
        return False
    finally:
        for proc in booked:
            standin.unbook(proc)
        standin.close()


def _make_it_old(url: str, cat: Catalog) -> tuple[str, str]:
    """What an adoption by an older cuesched left: returns (the stale function, the renamed trigger)."""
    capped = pgtrigger_name(cat, "proc", "acct_licence_insert")
    renamed = pgtrigger_name(cat, "proc", "acct_licence_delete")
    old_name = renamed[:-5] + STALE_HASH
    with psycopg.connect(url, autocommit=True) as conn:
        for sig, comment in cat.function_comments.items():
            if comment and comment.startswith(MARK):
                conn.execute(f"COMMENT ON FUNCTION {cat.function_ids[sig]} IS NULL")
        body = cat.functions[f"{capped}()"]
        # The body's licence check, whatever its reading of the max: the count must have grown.
        stale = body.replace("u.int_running > u.old_running", "false")
        assert stale != body
        conn.execute(stale)
        definition, comment = cat.triggers[("proc", renamed)]
        conn.execute(f"DROP TRIGGER {renamed} ON proc")
        conn.execute(cat.functions[f"{renamed}()"].replace(renamed, old_name))
        conn.execute(definition.replace(renamed, old_name))
        conn.execute(f"COMMENT ON TRIGGER {old_name} ON proc IS '{'0' * 40}'")
        conn.execute("ALTER TABLE host DROP COLUMN str_rqd_address")
        conn.execute("DROP INDEX i_frame_updated")  # the console's frame-list index came later
        conn.execute("DELETE FROM django_migrations WHERE app = 'dispatch' AND name = '0010_rqd'")
    return capped, renamed


@pytest.fixture(scope="module")
def upgraded() -> Upgraded:
    name = cb.cuebot_db_name("upgrade")
    url = cb.build_cuebot_db(name)
    try:
        cuebot, cuebot_catalog = cb.schema_dump(url), catalog(url)
        cb.manage(url, "adopt_cuebot_db", "--apply")
        adopted, adopted_catalog = cb.schema_dump(url), catalog(url)
        capped, renamed = _make_it_old(url, adopted_catalog)
        farm, _limit = _limit_of_one(url)
        stale_booked = _book_two(url, farm)
        check = cb.manage(url, "adopt_cuebot_db", "--check").stdout
        after_check = cb.schema_dump(url)
        apply = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        after_apply = cb.schema_dump(url)
        assert not _book_two(url, farm), "the licence cap is still not enforced after the upgrade"
        again = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
        after_again = cb.schema_dump(url)
        migrate = cb.manage(url, "migrate", "--no-input").stdout
        yield Upgraded(
            url,
            cuebot,
            cuebot_catalog,
            adopted,
            adopted_catalog.function_comments,
            capped,
            renamed,
            stale_booked,
            check,
            after_check,
            apply,
            after_apply,
            again,
            after_again,
            migrate,
        )
    finally:
        cb.drop_database(name)


def test_check_lists_each_upgrade_step_and_writes_nothing(upgraded: Upgraded) -> None:
    u = upgraded
    old_name = u.renamed[:-5] + STALE_HASH
    lines = u.check.splitlines()
    assert f"replace function {u.capped}() (body differs; pgtrigger's)" in lines, u.check
    assert f"drop trigger proc.{old_name} (stale, replaced by {u.renamed})" in lines, u.check
    assert f"drop function {old_name}() (stale)" in lines, u.check
    assert f"add trigger proc.{u.renamed} (replaces stale {old_name})" in lines, u.check
    assert "add column host.str_rqd_address" in lines
    assert "add index frame.i_frame_updated" in lines, u.check
    assert "record 1 Django migrations as applied" in lines
    # proc's writers are held off from the first statement to the commit (a trigger is dropped there).
    assert "lock proc in ACCESS EXCLUSIVE mode, its writers held off until the commit" in lines, u.check
    assert "check only: nothing was written" in u.check
    assert u.after_check != u.adopted  # the old state, still there
    assert not [line for line in lines if line.startswith("keep Cuebot's function")], u.check


def test_apply_brings_the_new_behaviour_back_and_changes_nothing_of_cuebots(upgraded: Upgraded) -> None:
    u = upgraded
    assert u.stale_booked, "the simulated old body should have let the second frame over the limit through"
    # (the fixture asserted that, after --apply, the same booking is refused on acct_limit_max)
    assert u.apply.rstrip().endswith("applied"), u.apply
    # Cuebot's own objects: every line of its dump still there, its catalog objects identical.
    lost = cb.dump_lines(u.cuebot) - cb.dump_lines(u.after_apply)
    assert not lost, f"lines of Cuebot's schema changed or gone: {sorted(lost)[:20]}"
    after = catalog(u.url)
    b = u.cuebot_catalog
    for table, cols in b.tables.items():
        assert after.tables[table][: len(cols)] == cols, table
    for kind in ("constraints", "indexes", "triggers", "functions", "sequences", "views"):
        old, new = getattr(b, kind), getattr(after, kind)
        changed = [k for k in old if new.get(k) != old[k]]
        assert not changed, f"{kind} changed or dropped: {changed}"
    # cuesched's objects: exactly what a fresh adoption installs (function comments aside: the
    # replaced ones now carry adoption's mark, the untouched ones of the old adoption do not).
    assert cuesched_lines(u.after_apply) == cuesched_lines(u.adopted)
    assert after.function_comments[f"{u.capped}()"].startswith(MARK)


def test_a_second_apply_is_a_no_op_and_migrate_has_nothing_to_do(upgraded: Upgraded) -> None:
    assert "nothing to add: the database is adopted and cuesched's own objects are current" in upgraded.again
    assert "replace " not in upgraded.again and "drop " not in upgraded.again
    assert upgraded.after_again == upgraded.after_apply
    assert "No migrations to apply." in upgraded.migrate


def test_a_cuebot_function_is_never_replaced(upgraded: Upgraded) -> None:
    """Cuebot's own functions (a site's hot-fix of trigger__verify_subscription here) are not
    cuesched's, whatever their body; and a function adoption marked, rewritten since by someone
    else (as a later Cuebot migration reusing the name would), is reported and left alone."""
    url = upgraded.url
    cat = catalog(url)
    cuebots = "trigger__verify_subscription()"
    hotfix = cat.functions[cuebots].replace("BEGIN", "BEGIN\n    -- site hot-fix: see ticket 123", 1)
    assert hotfix != cat.functions[cuebots]
    helper = "_pgh_attach_context()"
    assert upgraded.adopted_comments[helper].startswith(MARK)  # the first adoption added and marked it
    rewritten = cat.functions[helper].replace("BEGIN", "BEGIN\n    -- another owner's body", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(function_mark_sql(cat.function_ids[helper]))  # as that adoption left it (the fixture wiped it)
        conn.execute(hotfix)
        conn.execute(rewritten)
    hotfixed = catalog(url)
    out = cb.manage(url, "adopt_cuebot_db", "--apply").stdout
    after = catalog(url)
    assert after.functions[cuebots] == hotfixed.functions[cuebots]
    assert after.functions[helper] == hotfixed.functions[helper]
    assert cuebots not in out
    assert (
        f"keep Cuebot's function {helper} (a function of that name differs from cuesched's;"
        " changed after adoption installed it)" in out
    ), out
    assert "replace " not in out and "drop " not in out, out
