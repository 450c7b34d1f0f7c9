"""Keep the control socket file where mlxctl looks for it.

A socket file deleted while the daemon runs (a careless ``rm``, a temp-file
cleaner, a package script) leaves the daemon listening on an inode nobody can
reach: mlxctl says it is not running and cannot stop it. The keeper compares the
file at the socket's path with the one it bound (device and inode) every
``SOCKET_CHECK_S`` seconds, and at once when asked (the daemon's SIGHUP), and
binds the path again when it is gone or is another file, with the modes and group
of the start (``bind_control_socket``); the new socket takes over from the old
one, and requests under way finish. A path held by something it must not replace
(another daemon's live socket, a file that is no socket) is left alone; each such
problem is logged once. Each re-creation and each problem is reported to
``on_event`` (the daemon's event log) with what noticed it.

``holder_hint`` is the other side: what to tell a second daemon that finds the
state dir's lock held, depending on whether the holder's socket answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from mlxceld.control.access import OperatorGroup
from mlxceld.control.server import SocketServer, bind_control_socket, is_listening
from mlxceld.errors import SocketError

log = logging.getLogger(__name__)

SOCKET_CHECK_S: Final = 2.0
"""How often the socket file is checked: a deleted one answers again within this (plus
the bind, milliseconds)."""

OnEvent = Callable[[str, str, str], None]  # (kind: "restored" | "lost", message, trigger)


class SocketKeeper:
    def __init__(self, server: SocketServer, path: Path, group: OperatorGroup | None,
                 on_event: OnEvent) -> None:
        self._server = server
        self._path = path
        self._group = group
        self._on_event = on_event
        self._bound = _identity(path)  # the file we bound (the daemon binds before us)
        self._problem = ""  # the last problem reported, so that it is reported once
        self._closed = asyncio.Event()

    async def run(self) -> None:
        """Check every ``SOCKET_CHECK_S`` until ``close``."""
        while True:
            try:
                async with asyncio.timeout(SOCKET_CHECK_S):
                    await self._closed.wait()
                return
            except TimeoutError:
                await self.restore("periodic check")

    def close(self) -> None:
        self._closed.set()

    async def restore(self, trigger: str) -> bool:
        """Bind the socket's path again if the file there is not the one we bound; True if
        it was. Never raises: a failure is logged and reported once."""
        found = _identity(self._path)
        if found is not None and found == self._bound:
            self._problem = ""
            return False
        what = "deleted" if found is None else "replaced by another file"
        try:
            sock = bind_control_socket(self._path, self._group)
        except SocketError as exc:
            problem = (f"the control socket {self._path} was {what} and cannot be bound "
                       f"again: {exc.message}")
            if problem != self._problem:
                self._problem = problem
                log.error("%s (%s)", problem, trigger)
                self._on_event("lost", problem, trigger)
            return False
        try:
            await self._server.listen_on(sock)
        except BaseException:
            sock.close()
            raise
        self._bound, self._problem = _identity(self._path), ""
        message = f"the control socket {self._path} was {what}; bound again"
        log.warning("%s (%s)", message, trigger)
        self._on_event("restored", message, trigger)
        return True


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def holder_hint(pid: int | None, socket: Path | None) -> str:
    """What to do about a daemon that holds the lock: its pid, and ``mlxctl stop`` when its
    control socket answers."""
    who = str(pid) if pid is not None else "PID"  # a lock file of an older mlxceld: no pid
    other = "or give this daemon another --state-dir"
    if socket is None:
        return f"stop it first: mlxctl stop, or kill -TERM {who}; {other}"
    try:
        answers = is_listening(socket)
    except SocketError:
        answers = False
    if answers:
        return f"stop it first: mlxctl --socket {socket} stop, or kill -TERM {who}; {other}"
    return (f"its control socket {socket} does not answer (a deleted socket file is bound "
            f"again within {SOCKET_CHECK_S:g} s, or at once by kill -HUP {who}); stop it with "
            f"kill -TERM {who}, {other}")
