"""LOGIN roles for tests that write as someone other than the database superuser.

Roles are cluster-wide and several checkouts test on one server, so each name carries the test
database's name. A role gets the privileges docs/deployment.md grants, never ownership and never
superuser: an outside tool (`writer=False`) DML on the OpenCue tables and their sequences and
SELECT only on cuesched's own (`cuesched_*`: the accounting triggers write those as their owner,
SECURITY DEFINER, so no outside writer needs more; without UPDATE it cannot lock their rows
either); `writer=True` makes it a member of the scheduler's writer role with DML on every table,
as the scheduler's login role. `cuesched_dml=True` gives an outside tool DML on cuesched's tables
too, for the tests of the triggers that guard those rows against a role granted too much.
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
def login_role(tag: str, *, writer: bool, url: str | None = None, cuesched_dml: bool = False) -> Iterator[str]:
    """A non-superuser LOGIN role with docs/deployment.md's GRANTs on the test database (or `url`'s): its name.

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
        elif not cuesched_dml:
            for kind, relkinds, privileges in (
                ("TABLE", "rp", "INSERT, UPDATE, DELETE"),
                ("SEQUENCE", "S", "USAGE, UPDATE"),
            ):
                for (rel,) in conn.execute(
                    "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'public' AND c.relkind::text = ANY(%s) AND c.relname LIKE 'cuesched\\_%%'",
                    (list(relkinds),),
                ):
                    conn.execute(f'REVOKE {privileges} ON {kind} public."{rel}" FROM "{name}"')
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
