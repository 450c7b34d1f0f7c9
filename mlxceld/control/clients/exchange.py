"""One request and its answer on the control socket, without IO: h11 for the bytes, our
errors for the failures, and how an answer becomes JSON or a ControlError.

Two shells drive it: ``transport`` on asyncio streams (``ControlClient``, for every
command and the tests) and ``blocking`` on a plain socket (``BlockingClient``, for
mlxctl's read-only commands, which would otherwise spend a third of their time importing
asyncio). Each connection carries one request.

Failures, translated once, naming the socket: nothing there or nothing listening is
``DaemonNotRunning``; a refused ``connect()`` is ``PermissionDenied`` (with
``access.denied_hint``: which group to join, when one would do); an answer cut
short is a ``ControlError``; an error answer is the daemon's code, message and hint (a
403 ``permission_denied`` a ``PermissionDenied``).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import h11

from mlxceld import __version__
from mlxceld.control.access import denied_hint
from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied
from mlxceld.paths import socket_candidates
from mlxceld.types import JSON

READ_SIZE = 65536
REQUEST_TIMEOUT_S = 10.0
PLAN_TIMEOUT_S = 30.0  # the daemon's candidate poll (10 s at most) and the planning
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a heartbeat line every 15 s
START_HINT = ("start it with `mlxceld` (or `brew services start mlxceld`, "
              "`systemctl start mlxceld`), or point --socket / MLXCELD_SOCKET at a running one")
_ABSENT = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
_DENIED = (errno.EACCES, errno.EPERM)

Event = h11.Response | h11.Data | h11.EndOfMessage


class Exchange:
    """The bytes of one exchange: ``request()`` to send, ``receive()`` what was read
    (``b""`` at the end), ``next_event()`` until it is not None (None: read more)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn = h11.Connection(h11.CLIENT)

    def request(self, method: str, target: str, body: bytes | None = None) -> bytes:
        headers = [("Host", "mlxceld"), ("User-Agent", f"mlxctl/{__version__}"),
                   ("Accept", "application/json")]
        if body is not None:
            headers += [("Content-Type", "application/json"),
                        ("Content-Length", str(len(body)))]
        out = [self._conn.send(h11.Request(method=method, target=target, headers=headers))]
        if body:
            out.append(self._conn.send(h11.Data(data=body)))
        out.append(self._conn.send(h11.EndOfMessage()))
        return b"".join(part or b"" for part in out)

    def receive(self, data: bytes) -> None:
        self._conn.receive_data(data)

    def next_event(self) -> Event | None:
        """The answer's head, a piece of its body, or its end; None when more bytes are
        needed. A 1xx head is skipped; a connection that ends first raises."""
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise lost(self.path, exc) from exc
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Response | h11.Data | h11.EndOfMessage):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise lost(self.path, None)  # ConnectionClosed, or PAUSED: no answer to come



def lost(path: Path, exc: BaseException | None) -> ControlError:
    """The connection ended (or broke) before the answer did."""
    why = f" ({exc})" if exc is not None and str(exc) else ""
    return ControlError(f"the daemon at {path} closed the connection{why}",
                        hint="it may be stopping; check `mlxctl status` again")


def timed_out(path: Path) -> ControlError:
    return ControlError(f"the daemon at {path} did not answer in time",
                        hint="it may be overloaded or stuck; see its log")


def connect_error(path: Path, exc: OSError) -> ControlError:
    """What a failed ``connect()`` to the control socket means."""
    if exc.errno in _ABSENT:
        looked = socket_candidates()
        where = (f"; with no --socket, mlxctl looked at {', '.join(map(str, looked))}"
                 if path in looked else "")
        return DaemonNotRunning(f"mlxceld is not running (nothing listens on {path})",
                                hint=START_HINT + where)
    if exc.errno in _DENIED:
        return PermissionDenied(f"permission denied on the control socket {path}",
                                hint=denied_hint(path))
    return ControlError(f"cannot talk to the daemon at {path}: {exc.strerror or exc}")


def target(path: str, params: dict[str, Any] | None = None) -> str:
    return f"{path}?{urlencode(params)}" if params else path


def segment(text: str) -> str:
    """``text`` as one path segment (a worker name, a key id)."""
    return quote(text, safe="")


def decode(path: Path, target: str, status: int, content: bytes) -> JSON:
    """A whole answer as JSON, or the error it carries."""
    if status >= 400:
        raise answer_error(status, content)
    try:
        answer: JSON = json.loads(content)
    except ValueError as exc:
        raise ControlError(f"the daemon at {path} answered {target} with something that "
                           "is not JSON") from exc
    return answer


def answer_error(status: int, content: bytes) -> ControlError:
    try:
        err = json.loads(content)["error"]
        code, message, hint = str(err["code"]), str(err["message"]), str(err.get("hint", ""))
    except (ValueError, KeyError, TypeError):
        code, message, hint = "http_error", f"the daemon answered HTTP {status}", ""
    if status == 403 and code == "permission_denied":
        return PermissionDenied(message, hint=hint, code=code, status=status)
    return ControlError(message, hint=hint, code=code, status=status)


class Lines:
    """Newline-delimited JSON from body pieces; empty lines (heartbeats) are skipped."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[JSON]:
        """The items completed by ``data``; ``b""`` at the end of the body."""
        if not data:
            rest, self._pending = self._pending, b""
            return [_item(rest)] if rest.strip() else []
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [_item(line) for line in lines if line.strip()]


def _item(line: bytes) -> JSON:
    item: JSON = json.loads(line)
    return item
