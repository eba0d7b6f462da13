"""Issue 27 row 6: a negative reserved amount is refused, on a plain and on an adopted Cuebot database.

A proc with `int_gpus_reserved = -4` was accepted and, summed with the others, cancelled their
GPUs: 8 real GPUs ran under a folder max of 4. Every reserved and used amount of proc, and the
subscription size, now carry a CHECK constraint (dispatch/nonnegative.py); a migration or an
adoption over rows that break one names them instead of failing bare.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pg_errors

from tests.integration import cuebot_support as cb
from tests.integration.runtime_support import MiniFarm, autocommit_conn, make_farm, uid


@pytest.fixture
def conn() -> Iterator[psycopg.Connection]:
    c = autocommit_conn()
    yield c
    c.close()


def _insert_proc(conn: psycopg.Connection, farm: MiniFarm, tag: str, **amounts: int) -> None:
    job, layer = farm.jobs[0], farm.layers[0]
    frame = farm.frames[job].pop()
    values = {"int_cores_reserved": 100, "int_mem_reserved": 1048576, "int_gpus_reserved": 0, **amounts}
    columns = ", ".join(values)
    conn.execute(
        f"INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, {columns})"
        f" VALUES (%s, %s, %s, %s, %s, %s{', %s' * len(values)})",
        (uid(tag), farm.hosts[0], farm.show, layer, job, frame, *values.values()),
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("managed", [False, True], ids=["unmanaged", "managed"])
@pytest.mark.parametrize(
    "column",
    [
        "int_gpus_reserved",
        "int_cores_reserved",
        "int_mem_reserved",
        "int_gpu_mem_reserved",
        "int_mem_used",
        "int_gpu_mem_used",
    ],
)
def test_a_proc_with_a_negative_amount_is_refused_naming_the_constraint(
    conn: psycopg.Connection, column: str, managed: bool
) -> None:
    tag = f"neg{column[4:14]}{int(managed)}"
    farm = make_farm(conn, tag, managed=managed)
    with pytest.raises(pg_errors.CheckViolation) as raised:
        _insert_proc(conn, farm, tag, **{column: -4})
    name = "c_proc_cores_positive" if column == "int_cores_reserved" else f"c_proc_{column[4:]}_nonneg"
    assert raised.value.diag.constraint_name == name
    assert conn.execute("SELECT count(*) FROM proc WHERE pk_show = %s", (farm.show,)).fetchone() == (0,)


@pytest.mark.django_db(transaction=True)
def test_a_proc_resized_to_negative_gpus_is_refused_and_the_gpu_total_stays_true(conn: psycopg.Connection) -> None:
    """The issue's case: two procs of 4 GPUs each, then a third of -4 would read 4 under a max of 4."""
    farm = make_farm(conn, "neg-gpus-update", managed=False)
    _insert_proc(conn, farm, "neg-gpus-update-a", int_gpus_reserved=4)
    _insert_proc(conn, farm, "neg-gpus-update-b", int_gpus_reserved=4)
    with pytest.raises(pg_errors.CheckViolation, match="c_proc_gpus_reserved_nonneg"):
        conn.execute("UPDATE proc SET int_gpus_reserved = -4 WHERE pk_proc = %s", (uid("neg-gpus-update-b"),))
    with pytest.raises(pg_errors.CheckViolation, match="c_proc_gpus_reserved_nonneg"):
        _insert_proc(conn, farm, "neg-gpus-update-c", int_gpus_reserved=-4)
    assert conn.execute("SELECT SUM(int_gpus_reserved) FROM proc WHERE pk_show = %s", (farm.show,)).fetchone() == (8,)
    assert conn.execute("SELECT int_gpus FROM folder_resource WHERE pk_folder = %s", (farm.folder,)).fetchone() == (8,)


@pytest.mark.django_db(transaction=True)
def test_a_negative_subscription_size_is_refused_and_the_unlimited_caps_still_take_minus_one(
    conn: psycopg.Connection,
) -> None:
    farm = make_farm(conn, "neg-size", managed=False)
    with pytest.raises(pg_errors.CheckViolation, match="c_subscription_size_nonneg"):
        conn.execute("UPDATE subscription SET int_size = -100 WHERE pk_show = %s", (farm.show,))
    # -1 means unlimited for folder and job caps; a negative burst books nothing: both kept.
    conn.execute(
        "UPDATE folder_resource SET int_max_cores = -1, int_max_gpus = -1 WHERE pk_folder = %s", (farm.folder,)
    )
    conn.execute("UPDATE job_resource SET int_max_cores = -1, int_max_gpus = -1 WHERE pk_job = %s", (farm.jobs[0],))
    conn.execute("UPDATE subscription SET int_burst = -100 WHERE pk_show = %s", (farm.show,))


@pytest.mark.django_db(transaction=True)
def test_installing_over_bad_rows_names_them_and_adds_nothing(conn: psycopg.Connection) -> None:
    """What the migration (and adoption) does on a database that already holds a negative amount."""
    from dispatch import nonnegative

    farm = make_farm(conn, "neg-install", managed=False)
    conn.execute("ALTER TABLE proc DROP CONSTRAINT c_proc_gpus_reserved_nonneg")
    conn.execute("ALTER TABLE proc DROP CONSTRAINT c_proc_mem_used_nonneg")
    try:
        _insert_proc(conn, farm, "neg-install-a", int_gpus_reserved=-4)
        with pytest.raises(nonnegative.NegativeAmountsError) as raised:
            with conn.transaction(), conn.cursor() as cur:
                nonnegative.install(cur)
        message = str(raised.value)
        assert "proc.int_gpus_reserved: 1 row(s) break c_proc_gpus_reserved_nonneg" in message, message
        assert f"pk_proc {uid('neg-install-a')} (-4)" in message, message
        assert "UPDATE proc SET int_gpus_reserved = 0 WHERE int_gpus_reserved < 0" in message, message
        with conn.cursor() as cur:
            assert ("proc", "c_proc_mem_used_nonneg") not in nonnegative.existing(cur)  # all or nothing
        conn.execute("UPDATE proc SET int_gpus_reserved = 0 WHERE int_gpus_reserved < 0")
    finally:
        with conn.transaction(), conn.cursor() as cur:
            assert nonnegative.install(cur) == ["c_proc_gpus_reserved_nonneg", "c_proc_mem_used_nonneg"]


@pytest.fixture(scope="module")
def cuebot_url() -> Iterator[str]:
    """A Cuebot database, not yet adopted."""
    name = cb.cuebot_db_name("nonneg")
    url = cb.build_cuebot_db(name)
    try:
        yield url
    finally:
        cb.drop_database(name)


def test_adoption_names_bad_rows_refuses_then_adds_the_constraints_and_cuebot_still_books(cuebot_url: str) -> None:
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        show, alloc = conn.execute(
            "SELECT s.pk_show, s.pk_alloc FROM subscription s ORDER BY s.pk_subscription LIMIT 1"
        ).fetchone()
        conn.execute("UPDATE subscription SET int_size = -500 WHERE pk_show = %s AND pk_alloc = %s", (show, alloc))
    check = cb.manage(cuebot_url, "adopt_cuebot_db", "--check").stdout
    assert "add constraint proc.c_proc_gpus_reserved_nonneg" in check, check
    assert "add constraint proc.c_proc_cores_positive" in check, check
    assert "subscription.int_size: 1 row(s) break c_subscription_size_nonneg" in check, check
    assert "--apply refuses until they are fixed" in check, check
    refused = cb.manage(cuebot_url, "adopt_cuebot_db", "--apply", check=False)
    assert refused.returncode != 0 and "c_subscription_size_nonneg" in refused.stderr, refused.stderr
    assert "nothing was written" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        conn.execute("UPDATE subscription SET int_size = 0 WHERE int_size < 0")
    cb.manage(cuebot_url, "adopt_cuebot_db", "--apply")
    assert "nothing to add" in cb.manage(cuebot_url, "adopt_cuebot_db", "--check").stdout
    with psycopg.connect(cuebot_url, autocommit=True) as conn:
        # The CHECK runs before the foreign keys and cuesched's statement triggers: no farm needed.
        with pytest.raises(pg_errors.CheckViolation) as raised:
            conn.execute(
                "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved,"
                " int_mem_reserved, int_gpus_reserved) VALUES ('p', 'h', %s, 'l', 'j', 'f', 100, 0, -4)",
                (show,),
            )
        assert raised.value.diag.constraint_name == "c_proc_gpus_reserved_nonneg"
        with pytest.raises(pg_errors.CheckViolation, match="c_subscription_size_nonneg"):
            conn.execute("UPDATE subscription SET int_size = -1 WHERE pk_show = %s", (show,))
