"""A TCP relay to PostgreSQL that can be frozen: bytes stop moving, nothing is closed.

For the stress suite's `listener_wedge` phase. A frozen relay is the failure the listener's
heartbeat exists for: a path that still accepts and acknowledges at the TCP level (the relay's
own sockets keep their buffers, the kernel keeps answering) but delivers nothing, so neither
keepalives nor `tcp_user_timeout` ever fire and a blocking read waits forever. `freeze()`
stops every pump before its next read or write, for the connections open and the ones accepted
meanwhile; `thaw()` lets the held bytes through in order.

`delay` (seconds, settable at any time) makes the path merely slow instead: every chunk is
held until `delay` after it was read, in order, so a listener behind it keeps receiving its
heartbeats (and stays "fresh") while everything it hears is that much late.

The upstream is read from the scheduler's own conninfo (`accounting.db.conninfo`): a TCP host
and port, or a Unix socket directory, which is what the embedded PostgreSQL uses.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from accounting import db

_CHUNK = 65536


def upstream_address(conninfo: str | None = None) -> tuple[int, Any]:
    """(socket family, address) of the server `conninfo` names (default: the scheduler's)."""
    info = conninfo_to_dict(conninfo if conninfo is not None else db.conninfo())
    host = str(info.get("host") or info.get("hostaddr") or "/var/run/postgresql").split(",")[0]
    port = int(str(info.get("port") or "5432").split(",")[0])
    if host.startswith("/"):
        return socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}")
    return socket.AF_INET, (host, port)


class FreezableProxy:
    """Listens on 127.0.0.1:<port> and relays every connection to the upstream server."""

    def __init__(self, upstream: tuple[int, Any] | None = None) -> None:
        self.family, self.address = upstream or upstream_address()
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port: int = self._server.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self.delay = 0.0

    # -- control -----------------------------------------------------------------------
    def start(self) -> FreezableProxy:
        self._spawn(self._accept_loop, "netfreeze-accept")
        return self

    def __enter__(self) -> FreezableProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    @property
    def frozen(self) -> bool:
        return not self._flowing.is_set()

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(2)

    def connect(self, **extra: Any) -> psycopg.Connection:
        """A psycopg connection to the same database as `db.connect`, through this relay."""
        info = conninfo_to_dict(db.conninfo())
        info.pop("hostaddr", None)
        info.update(host="127.0.0.1", port=str(self.port))
        params: dict[str, Any] = {"autocommit": True, "connect_timeout": 2, "keepalives": 1}
        params.update(extra)
        return psycopg.connect(make_conninfo(**info), **params)

    # -- relaying ----------------------------------------------------------------------
    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        self._server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.socket(self.family, socket.SOCK_STREAM)
                upstream.connect(self.address)
            except OSError:
                client.close()
                continue
            self.accepted += 1
            with self._lock:
                self._sockets.update((client, upstream))
            self._spawn(self._pump, "netfreeze-up", client, upstream)
            self._spawn(self._pump, "netfreeze-down", upstream, client)

    def _wait_flowing(self) -> bool:
        while not self._flowing.wait(0.05):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        held: deque[tuple[float, bytes]] = deque()
        try:
            while self._wait_flowing():
                wait = 0.05
                if held:
                    wait = min(wait, max(0.0, held[0][0] - time.monotonic()))
                readable, _, _ = select.select([src], [], [], wait)
                if readable:
                    if not self._wait_flowing():  # frozen between the select and the read
                        return
                    data = src.recv(_CHUNK)
                    if not data:
                        return
                    held.append((time.monotonic() + self.delay, data))
                while held and held[0][0] <= time.monotonic():
                    if not self._wait_flowing():  # frozen after the read: held until the thaw
                        return
                    dst.sendall(held.popleft()[1])
        except (OSError, ValueError):  # ValueError: select() on a socket the other pump closed
            return
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
