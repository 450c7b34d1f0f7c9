"""The control clients: the sans-IO exchange byte by byte, then both shells (asyncio's
``ControlClient`` and the ``BlockingClient``) against a real Unix socket whose server
answers with scripted bytes: whole, chunked, cut short, never, or refused."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import pytest

from mlxceld.control.clients import blocking
from mlxceld.control.clients import typed as client
from mlxceld.control.clients.blocking import BlockingClient
from mlxceld.control.clients.exchange import Exchange, Lines
from mlxceld.control.clients.typed import ControlClient
from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied

KINDS = ("blocking", "asyncio")


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")


def whole(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


# -- the sans-IO core ---------------------------------------------------------------------


def test_an_answer_fed_one_byte_at_a_time() -> None:
    ex = Exchange(Path("/x.sock"))
    sent = ex.request("GET", "/v1/workers/a%2Fb/logs?lines=5&follow=0")
    assert sent.startswith(b"GET /v1/workers/a%2Fb/logs?lines=5&follow=0 HTTP/1.1\r\n")
    assert b"host: mlxceld\r\n" in sent.lower()
    events: list[Any] = []
    data = b"HTTP/1.1 100 Continue\r\n\r\n" + chunked(b'{"a": 1}\n', b"\n", b'{"b"', b": 2}")
    for i in range(len(data)):
        assert ex.next_event() is None
        ex.receive(data[i:i + 1])
        while (event := ex.next_event()) is not None:
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                break
    heads = [e for e in events if isinstance(e, h11.Response)]
    assert [h.status_code for h in heads] == [200]  # the 100 is skipped
    body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
    assert body == b'{"a": 1}\n\n{"b": 2}'
    assert isinstance(events[-1], h11.EndOfMessage)


def test_an_answer_cut_short_is_a_lost_connection() -> None:
    ex = Exchange(Path("/x.sock"))
    ex.request("GET", "/v1/status")
    ex.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{\"a\"")
    assert isinstance(ex.next_event(), h11.Response)
    assert isinstance(ex.next_event(), h11.Data)
    ex.receive(b"")
    with pytest.raises(ControlError, match=r"the daemon at /x.sock closed the connection"):
        ex.next_event()


def test_lines_skip_heartbeats_and_keep_a_last_line_without_newline() -> None:
    lines = Lines()
    out = []
    for byte in b'{"n": 1}\n\n  \n{"n": 2}\n{"n": 3}':
        out += lines.feed(bytes([byte]))
    assert out == [{"n": 1}, {"n": 2}]
    assert lines.feed(b"") == [{"n": 3}]


# -- both shells against a scripted server ---------------------------------------------------


class Script:
    """A Unix socket server on a thread: for each connection it reads the request head,
    records it, then sends ``pieces`` (with ``pause`` between them) and closes, unless
    ``hang`` (then it holds the connection open until the test ends)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pieces: list[bytes] = []
        self.pause = 0.0
        self.hang = False
        self.requests: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                    head += chunk
                self.requests.append(head)
                for piece in self.pieces:
                    conn.sendall(piece)
                    time.sleep(self.pause)
                if self.hang:
                    self._done.wait(10)

    def close(self) -> None:
        self._done.set()
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(10)


@pytest.fixture
def script() -> Iterator[Script]:
    root = Path(tempfile.mkdtemp(prefix="mxc", dir="/tmp"))
    s = Script(root / "s.sock")
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(root, ignore_errors=True)


def status(kind: str, path: Path) -> dict[str, Any]:
    if kind == "blocking":
        return BlockingClient(path).status()

    async def go() -> dict[str, Any]:
        async with ControlClient(path) as c:
            return await c.status()

    return asyncio.run(go())


def logs(kind: str, path: Path, worker: str) -> list[dict[str, Any]]:
    if kind == "blocking":
        return list(BlockingClient(path).logs(worker, 5, follow=True))

    async def go() -> list[dict[str, Any]]:
        async with ControlClient(path) as c:
            return [item async for item in c.logs(worker, 5, follow=True)]

    return asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_answer(kind: str, script: Script) -> None:
    script.pieces = [whole(200, b'{"daemon": {"pid": 7}}')]
    assert status(kind, script.path) == {"daemon": {"pid": 7}}
    assert script.requests[0].startswith(b"GET /v1/status HTTP/1.1\r\n")


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_in_pieces_with_heartbeats(kind: str, script: Script) -> None:
    data = chunked(b'{"data": "a\\n"}\n', b"\n", b'{"data"', b': "b"}\n')
    script.pieces = [data[:40], data[40:]]
    script.pause = 0.05
    assert logs(kind, script.path, "al/pha") == [{"data": "a\n"}, {"data": "b"}]
    assert script.requests[0].startswith(
        b"GET /v1/workers/al%2Fpha/logs?lines=5&follow=1 HTTP/1.1\r\n")


@pytest.mark.parametrize("kind", KINDS)
def test_error_answers_carry_the_daemons_words(kind: str, script: Script) -> None:
    script.pieces = [whole(404, b'{"error": {"code": "unknown_worker", "message": "no worker '
                               b'named \'x\'", "hint": "see: mlxctl workers"}}')]
    with pytest.raises(ControlError) as err:
        logs(kind, script.path, "x")
    assert (err.value.code, err.value.message, err.value.hint, err.value.status) == (
        "unknown_worker", "no worker named 'x'", "see: mlxctl workers", 404)
    script.pieces = [whole(403, b'{"error": {"code": "permission_denied", "message": "no", '
                               b'"hint": "h"}}')]
    with pytest.raises(PermissionDenied, match="no"):
        status(kind, script.path)
    script.pieces = [whole(200, b"<html>")]
    with pytest.raises(ControlError, match="answered /v1/status with something that is not "
                                           "JSON"):
        status(kind, script.path)
    script.pieces = [whole(502, b"bad gateway")]
    with pytest.raises(ControlError, match="the daemon answered HTTP 502"):
        status(kind, script.path)


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_cut_short(kind: str, script: Script) -> None:
    script.pieces = [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"]
    with pytest.raises(ControlError, match="closed the connection"):
        status(kind, script.path)
    script.pieces = [b"SSH-2.0-OpenSSH\r\n"]
    with pytest.raises(ControlError, match="closed the connection"):
        status(kind, script.path)


@pytest.mark.parametrize("kind", KINDS)
def test_no_answer_in_time(kind: str, script: Script, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocking, "REQUEST_TIMEOUT_S", 0.3)
    monkeypatch.setattr(client, "REQUEST_TIMEOUT_S", 0.3)
    script.hang = True
    start = time.monotonic()
    with pytest.raises(ControlError, match=f"the daemon at {script.path} did not answer in "
                                           "time"):
        status(kind, script.path)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_listening(kind: str, script: Script) -> None:
    missing = script.path.parent / "missing.sock"
    with pytest.raises(DaemonNotRunning, match=f"nothing listens on {missing}"):
        status(kind, missing)
    stale = script.path.parent / "stale.sock"
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
        s.bind(str(stale))  # a socket file nobody listens on: ECONNREFUSED
    with pytest.raises(DaemonNotRunning):
        status(kind, stale)
