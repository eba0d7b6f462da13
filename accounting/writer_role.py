"""The writer role: PostgreSQL, not a setting any session can make, decides who writes as the scheduler.

The accounting triggers honour a connection's `cuesched.writer=on` claim only when its login
role is a member of `WRITER_ROLE` (accounting.triggers.WRITER_ON). The role is NOLOGIN: nobody
connects as it; the scheduler's login role is granted it. This module creates the role (the
migration `accounting.0009_writer_role` and adoption of a Cuebot database run `ENSURE_SQL`) and
checks, when the scheduler starts, that its own connections carry the mark: a scheduler whose
role is not a member would have every managed booking refused by the triggers, so it says so
at start with what to GRANT instead.
"""

from __future__ import annotations

from typing import Any

import psycopg

from accounting.triggers import WRITER_CLAIM, WRITER_MEMBER, WRITER_ROLE, WRITER_SETTING


# Roles are cluster-wide: the role may exist already (another database of the cluster migrated
# first, or an administrator created it), and two databases migrating at once may race to
# create it. A migrating role that may not create roles gets a clear error and what to run.
def ensure_sql(role: str = WRITER_ROLE) -> str:
    """The idempotent creation of `role` (a parameter for the tests, which cannot drop the real one)."""
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
        BEGIN
            CREATE ROLE {role} NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by another database's migration
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION USING
                    MESSAGE = format('cuesched: the role {role} does not exist and %s may not create it',
                                     current_user),
                    HINT = 'Roles are shared by every database of the cluster. Have a superuser or a role with '
                           'CREATEROLE run CREATE ROLE {role} NOLOGIN once, GRANT {role} TO the '
                           'scheduler''s login role, then migrate again (docs/deployment.md, Roles).',
                    ERRCODE = 'insufficient_privilege';
        END;
    END IF;
END $$;
"""


ENSURE_SQL = ensure_sql()

CHECK_SQL = f"SELECT {WRITER_CLAIM}, {WRITER_MEMBER}, session_user::text, to_regrole('{WRITER_ROLE}') IS NOT NULL"


class WriterRoleError(RuntimeError):
    """The scheduler's connection does not carry the writer mark: its managed bookings would be refused."""


def check(conn: psycopg.Connection[Any]) -> str | None:
    """What keeps this connection from writing as the scheduler, or None when it carries the mark."""
    claim, member, login, exists = conn.execute(CHECK_SQL).fetchone()
    if not member and not exists:
        return (
            f"the role {WRITER_ROLE} does not exist in this cluster (a database restored into another "
            f"cluster: roles are not in its dump): CREATE ROLE {WRITER_ROLE} NOLOGIN; GRANT {WRITER_ROLE} TO {login}"
        )
    if not member:
        return (
            f"the login role {login} is not a member of {WRITER_ROLE}, so the database refuses its bookings of "
            f"scheduler-managed shows: GRANT {WRITER_ROLE} TO {login} (as a role administrator, once)"
        )
    if not claim:
        return (
            f"the connection does not claim the writer mark ({WRITER_SETTING}=on): connect through "
            "accounting.db.connect or Django's settings, which set it"
        )
    return None


def require_writer(conn: psycopg.Connection[Any]) -> None:
    """Raise WriterRoleError, with the GRANT to run, unless `conn` writes as the scheduler."""
    problem = check(conn)
    if problem is not None:
        raise WriterRoleError(f"cuesched: this scheduler cannot book managed shows: {problem}")
