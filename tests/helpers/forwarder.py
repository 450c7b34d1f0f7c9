"""A TCP forwarder that can go silent: a partition between two hosts on 127.0.0.x.

``Forwarder(listen_host, target, source_host)`` accepts on ``listen_host`` (a port of its
own) and forwards each connection to ``target``, dialling from ``source_host`` (so that the
target's MXCL listener, which checks that a dialer's claimed identity is its source address,
sees the real dialer's host). ``cut()`` makes it silent without closing anything: bytes on
the connections open are no longer read or passed on, and new connections are accepted
(by the kernel) but never dialled through; the peers see a host that stopped answering,
as behind a broken link. ``mend()`` ends the connections held during the cut (their
dialers gave up on them) and forwards new ones again. Threads of the test process; every
socket is closed by ``close()``, each thread ends within ``POLL_S``."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Final

POLL_S: Final = 0.05
DIAL_S: Final = 5.0  # the target's accept, at most


class Forwarder:
    def __init__(self, listen_host: str, target: tuple[str, int], source_host: str) -> None:
        self._target, self._source = target, source_host
        self._server = socket.create_server((listen_host, 0))
        self._server.settimeout(POLL_S)
        self.address = f"{listen_host}:{self._server.getsockname()[1]}"
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._generation = 0  # mend() ends the connections of earlier generations
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut(self) -> None:
        self._cut.set()

    def mend(self) -> None:
        with self._lock:
            self._generation += 1
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(timeout=5)
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        self._server.close()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._keep(client)
            t = threading.Thread(target=self._pipe, args=(client, self._generation),
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _stale(self, generation: int) -> bool:
        return self._stop.is_set() or generation != self._generation

    def _pipe(self, client: socket.socket, generation: int) -> None:
        upstream: socket.socket | None = None
        try:
            while self._cut.is_set() and not self._stale(generation):
                self._stop.wait(POLL_S)  # silent: not dialled through
            if self._stale(generation):
                return
            upstream = socket.create_connection(self._target, timeout=DIAL_S,
                                                source_address=(self._source, 0))
            self._keep(upstream)
            other = {client: upstream, upstream: client}
            while not self._stale(generation):
                if self._cut.is_set():
                    self._stop.wait(POLL_S)  # silent: nothing read, nothing passed on
                    continue
                ready, _, _ = select.select([client, upstream], [], [], POLL_S)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    other[s].sendall(data)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
