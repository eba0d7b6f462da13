"""LOGIN roles for tests that write as someone other than the database superuser.

Roles are cluster-wide and several checkouts test on one server, so each name carries the test
database's name. A role gets the table privileges an outside tool would be granted (DML on every
table, the sequences), never ownership and never superuser; `writer=True` also makes it a member
of the scheduler's writer role, as docs/deployment.md asks of the scheduler's login role.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from django.db import connection

from accounting.notify import conninfo_from_settings
from cuesched_project.dburl import url_from_settings

# The role the accounting triggers check (accounting.writer_role.WRITER_ROLE; a literal here so that
# the tests import on a checkout without it).
WRITER_ROLE = "cuesched_writer"


def _base() -> str:
    """The test database as Django sees it (not CUESCHED_SCHEDULER_DATABASE_URL, which a test may point at a role)."""
    return conninfo_from_settings(connection.settings_dict)


def _admin(url: str | None) -> psycopg.Connection:
    return psycopg.connect(url or _base(), autocommit=True)


@contextmanager
def login_role(tag: str, *, writer: bool, url: str | None = None) -> Iterator[str]:
    """A non-superuser LOGIN role with DML GRANTs on the test database (or `url`'s); yields its name.

    127.0.0.1 uses trust authentication on the test server, so no password is set."""
    with _admin(url) as conn:
        name = f"{conn.info.dbname}_{tag}"[:63]
        if _exists(conn, name):
            conn.execute(f'DROP OWNED BY "{name}"')
        conn.execute(f'DROP ROLE IF EXISTS "{name}"')
        conn.execute(f'CREATE ROLE "{name}" LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB')
        conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{name}"')
        conn.execute(f'GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO "{name}"')
        if writer:
            conn.execute(f'GRANT {WRITER_ROLE} TO "{name}"')
    try:
        yield name
    finally:
        with _admin(url) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            conn.execute(f'DROP OWNED BY "{name}"')
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def _exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is not None


def conninfo_as(role: str, *, claim_writer: bool, url: str | None = None) -> str:
    """The test database's (or `url`'s) conninfo for `role`; with `claim_writer` it carries `cuesched.writer=on`."""
    params = psycopg.conninfo.conninfo_to_dict(psycopg.conninfo.make_conninfo(url or _base()))
    params["user"] = role
    params.pop("password", None)
    params["options"] = "-c cuesched.writer=on" if claim_writer else ""
    return psycopg.conninfo.make_conninfo(**params)


def url_as(role: str) -> str:
    """A DATABASE_URL for `role` on the test database (CUESCHED_SCHEDULER_DATABASE_URL)."""
    params = psycopg.conninfo.conninfo_to_dict(_base())
    # url_from_settings puts a Unix-socket directory (the embedded server) in the query string: a
    # path in the URL's host part was read as no host, and the child connected to the default socket.
    return url_from_settings(
        {"USER": role, "HOST": params.get("host", ""), "PORT": params.get("port", ""), "NAME": params["dbname"]}
    )


def outside_conninfo() -> str:
    """The test database's conninfo as it is, without cuesched's writer claim: a psql session."""
    params = psycopg.conninfo.conninfo_to_dict(_base())
    params["options"] = ""
    return psycopg.conninfo.make_conninfo(**params)
