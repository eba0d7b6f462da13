"""A threaded TCP proxy the fault tests put between the scheduler and PostgreSQL.

The network faults of issue 16 are all properties of the path, not of either end: a path
that goes silent while both sockets stay open (`freeze`), connections that all drop at once
(`cut`), a path that leads to another server after a failover (`retarget` then `cut`), and
a COMMIT that reached the server whose reply never came back (`lose_reply`). A proxy on
127.0.0.1 makes each one exact and repeatable, where iptables or a real failover would need
privileges and timing luck.

Bounded and self-stopping: at most `max_connections` live connection pairs (more are refused
by closing them), every socket operation has a timeout so each pump thread notices `close()`
within a fraction of a second, and the proxy closes itself after `lifetime` seconds even if a
test forgets to (all its threads are daemons too).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field

_POLL = 0.05  # seconds a pump waits before re-checking close / freeze
_CHUNK = 65536
_TAIL = 4096  # bytes of each client stream kept to match a marker split across reads


@dataclass(eq=False)
class _Pair:
    """One client connection and its upstream connection."""

    client: socket.socket
    upstream: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)
    # lose_reply state: the client sent the armed marker; swallow the reply and hang up.
    losing: threading.Event = field(default_factory=threading.Event)
    seen_after: bool = False
    tail: bytes = b""

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass


class NetProxy:
    """Forward 127.0.0.1:<ephemeral> to `target`; freeze, thaw, cut, retarget, close on demand.

    The target is (host, port), or (socket directory, port) when host starts with "/".
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 64,
        lifetime: float = 300.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self._target = (host, port)
        self._target_lock = threading.Lock()
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self._deadline = time.monotonic() + lifetime
        self._pairs: set[_Pair] = set()
        self._pairs_lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        # lose_reply: (marker, after) armed for the next client stream that sends them.
        self._armed: tuple[bytes, bytes | None] | None = None
        self._armed_lock = threading.Lock()
        self.replies_lost = 0
        self.accepted = 0
        self.refused = 0
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(32)
        self._server.settimeout(_POLL)
        self.host, self.port = self._server.getsockname()[:2]
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"netproxy-{self.port}", daemon=True)
        self._acceptor.start()

    # -- controls -----------------------------------------------------------------------
    @property
    def target(self) -> tuple[str, int]:
        with self._target_lock:
            return self._target

    @property
    def frozen(self) -> bool:
        return not self._flowing.is_set()

    def freeze(self) -> None:
        """Stop forwarding bytes either way; every socket stays open (a silent, half-dead path).

        Nothing is dropped: bytes already read are held and the rest waits in the kernel's
        buffers, so `thaw()` delivers everything, late. New connections are accepted but
        stay silent too.
        """
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def cut(self) -> int:
        """Close every current connection (both sides); returns how many were cut."""
        with self._pairs_lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()
        return len(pairs)

    def retarget(self, host: str, port: int) -> None:
        """New connections go to (host, port); existing ones are left alone (cut() them)."""
        with self._target_lock:
            self._target = (host, port)

    def lose_reply(self, marker: bytes, after: bytes | None = None) -> None:
        """Once: forward the client bytes containing `marker`, swallow the server's reply, hang up.

        With `after`, only a connection that sent `after` earlier (or in the same bytes)
        triggers. For the ambiguous COMMIT: the server commits, the client sees its connection
        drop while it waits for the answer.
        """
        with self._armed_lock:
            self._armed = (marker, after)

    def connections(self) -> int:
        with self._pairs_lock:
            return len(self._pairs)

    def close(self) -> None:
        """Stop accepting, cut everything, and wait (bounded) for the threads."""
        self._closed.set()
        self._flowing.set()  # release pumps parked by a freeze
        self.cut()
        try:
            self._server.close()
        except OSError:
            pass
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(2)
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(2)

    def __enter__(self) -> NetProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------
    def _stopping(self) -> bool:
        if not self._closed.is_set() and time.monotonic() > self._deadline:
            self._closed.set()
            self._flowing.set()
        return self._closed.is_set()

    def _accept_loop(self) -> None:
        while not self._stopping():
            try:
                client, _addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if self.connections() >= self.max_connections:
                self.refused += 1
                client.close()
                continue
            try:
                upstream = self._open_upstream()
            except OSError:
                self.refused += 1
                client.close()
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for sock in (client, upstream):
                sock.settimeout(5.0)
            pair = _Pair(client, upstream)
            with self._pairs_lock:
                self._pairs.add(pair)
            self.accepted += 1
            self._threads = [t for t in self._threads if t.is_alive()]
            for name, src, dst, upward in (("up", client, upstream, True), ("down", upstream, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(pair, src, dst, upward), name=f"netproxy-{self.port}-{name}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        self.cut()

    def _open_upstream(self) -> socket.socket:
        host, port = self.target
        if host.startswith("/"):
            # A Unix-socket directory, libpq style (the embedded server listens only there).
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(f"{host}/.s.PGSQL.{port}")
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection((host, port), timeout=self.connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _check_armed(self, pair: _Pair, data: bytes) -> None:
        with self._armed_lock:
            armed = self._armed
            if armed is None:
                return
            marker, after = armed
            window = pair.tail + data
            pair.tail = window[-_TAIL:]
            if after is not None and not pair.seen_after:
                at = window.find(after)
                if at < 0:
                    return
                pair.seen_after = True
                window = window[at + len(after) :]
            if marker in window:
                self._armed = None
                pair.losing.set()

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while not pair.closed.is_set() and not self._stopping():
                if not self._flowing.wait(_POLL):
                    continue  # frozen: read nothing, so the kernel buffers fill and hold the rest
                readable, _, _ = select.select([src], [], [], _POLL)
                if not readable:
                    continue
                data = src.recv(_CHUNK)
                if not data:
                    break
                if upward:
                    self._check_armed(pair, data)
                elif pair.losing.is_set():
                    # The server answered what the client will never see: hang up on both.
                    self.replies_lost += 1
                    break
                while not self._flowing.wait(_POLL):  # frozen while this chunk was in hand
                    if pair.closed.is_set() or self._stopping():
                        return
                dst.sendall(data)
        except (OSError, ValueError):
            # The other direction's pump closed the pair between our check and select(): a closed
            # socket's fd is -1, which select() refuses with ValueError, not OSError.
            pass
        finally:
            pair.close()
            with self._pairs_lock:
                self._pairs.discard(pair)
