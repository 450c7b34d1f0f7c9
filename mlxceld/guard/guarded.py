"""uvicorn's h11 protocol under a ``Guard`` (``connections.py``): the cap, the deadlines,
the head's size.

uvicorn bounds none of it on h11: a connection that never sends a byte, or sends its
head a byte a second, or a body shorter than its Content-Length, is held for ever, and
a large head is taken whenever it arrives in one read. Two additions close that:

- ``_CheckedConnection``, an ``h11.Connection`` that checks every request head it
  parses (``head_refusal``) and turns h11's own ``RemoteProtocolError`` into a
  ``Refusal`` too. The protocol answers a refusal in the server's error shape, and
  ``next_event`` then returns ``h11.PAUSED``, on which uvicorn stops asking for events
  (else it would answer a plain-text 400 and log a warning for every bad request);
- a write deadline (``write_stall_s``, when set): armed when the transport pauses our
  writes (its buffers are full) and disarmed when it resumes them; at the deadline the
  connection is aborted;
- one deadline per connection, set from h11's state of the client after every turn:
  ``IDLE`` (a head is awaited) arms the header deadline, ``SEND_BODY`` the body
  deadline, and anything else (the app has the request) none. The deadline is armed
  when the state changes, never pushed back by bytes that trickle in.

A connection whose head is refused lingers: the answer and our FIN go out, and what
the peer still sends (the rest of a head too large) is read and dropped until it
closes, or for ``LINGER_S`` at most; closing at once would have the kernel reset the
connection, and the peer lose the answer it had not read yet. A lingering connection
still counts against the cap, and is the first to go over it. Connections closed for
the cap or at a deadline do not linger: they hold descriptors the cap is there to
bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any, Literal

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState

from mlxceld.guard.connections import (
    MAX_HEAD_BYTES,
    WRITE_STALLED,
    Guard,
    Refusal,
    head_refusal,
    too_large_head,
)

log = logging.getLogger(__name__)

Waiting = Literal["head", "body"]
LINGER_S = 2.0


class _CheckedConnection(h11.Connection):
    """h11's server connection; a head it refuses goes to ``refused`` instead of uvicorn."""

    def __init__(self, protocol: GuardedH11Protocol) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._protocol = protocol
        self.refusal: Refusal | None = None

    def next_event(self) -> Any:
        if self.refusal is not None:
            return h11.PAUSED
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            refusal = too_large_head() if exc.error_status_hint == 431 else Refusal(
                exc.error_status_hint, "bad_request", f"invalid HTTP/1.1 request: {exc}",
                "send a well-formed HTTP/1.1 request")
        else:
            if not isinstance(event, h11.Request):
                return event
            found = head_refusal(event)
            if found is None:
                return event
            refusal = found
        self.refusal = refusal
        self._protocol.refuse_head(refusal)
        return h11.PAUSED


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small writes at once on a TCP connection (``TCP_NODELAY``). asyncio sets it
    only where the socket was made with ``IPPROTO_TCP``, and ``socket.create_server`` (the
    router's listener) makes it with 0: Nagle then held a streamed response's first chunk
    behind its head until the client's delayed ACK, 40 ms, on every request but a new
    connection's first (bench/families.py: 8 tokens of a 2-stage pipeline in one burst
    ~40 ms after the head)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer already gone: nothing to send
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def bound_sends(transport: asyncio.Transport, size: int | None) -> None:
    """At most ``size`` bytes unread in the kernel's send buffer (Linux doubles it) and
    ``size`` in the transport's before it pauses our writes (None: as they are)."""
    if size is None:
        return
    transport.set_write_buffer_limits(high=size)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # the peer already gone
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


class GuardedH11Protocol(H11Protocol):
    """One connection; ``guard`` is the listener's (``SocketServer`` binds it)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, guard: Guard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self.conn = _CheckedConnection(self)
        self._waiting: Waiting | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._answered = 0  # responses completed on this connection
        self._lingering = False
        self._stalled: asyncio.TimerHandle | None = None  # the write_stall_s deadline

    # -- uvicorn's protocol, followed --------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        no_delay(transport)
        bound_sends(transport, self.guard.limits.send_buffer_bytes)
        super().connection_made(transport)
        self.guard.opened(self)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        super().data_received(data)
        self._follow()

    def pause_writing(self) -> None:
        """The transport's buffers are full: the reader has ``write_stall_s`` to take some."""
        super().pause_writing()
        stall = self.guard.limits.write_stall_s
        if stall is not None and self._stalled is None:
            self._stalled = self.loop.call_later(stall, self._write_stalled)

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def on_response_complete(self) -> None:
        self._answered += 1
        super().on_response_complete()
        self._follow()

    # -- the guard's side --------------------------------------------------------------------

    def evict(self, *, newcomer: bool) -> None:
        """Closed to make room: said so (503) unless it is a keep-alive connection with
        nothing of a next request, which is closed as an idle one is."""
        limits = self.guard.limits
        if self._lingering:
            self.transport.abort()
            return
        if not newcomer and self._answered and not self._partial_head():
            self._close_quietly()
            return
        self.refuse(Refusal(
            503, "too_many_connections",
            f"{self.guard.what} holds at most {limits.max_connections} connections and "
            "closes the one that waited longest for a request first"
            + (": every other one has a request in progress" if newcomer else ""),
            "retry shortly, and send the request as soon as the connection is open",
            retry_after_s=1))

    def refuse_head(self, refusal: Refusal) -> None:
        self.guard.refusals.note("%s refused a request: %d %s (%s)", self.guard.what,
                                 refusal.status, refusal.message, self._peer())
        self.refuse(refusal, linger=True)

    def refuse(self, refusal: Refusal, *, linger: bool = False) -> None:
        """Answer ``refusal`` instead of the app (a plain close if the app's answer has
        begun) and close. The app's request, if any, sees the client gone."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() says so, its send() is dropped
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.abort()
                return
        body = self.guard.render(refusal)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        if refusal.retry_after_s is not None:
            headers.append((b"retry-after", str(refusal.retry_after_s).encode()))
        try:
            data = self.conn.send(h11.Response(status_code=refusal.status, headers=headers,
                                               reason=STATUS_PHRASES[refusal.status]))
            data += self.conn.send(h11.Data(data=body))
            data += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # our answer to this request has already begun
            self.transport.abort()
            return
        self.transport.write(data)
        self._close(linger=linger)

    # -- deadlines ---------------------------------------------------------------------------

    def _follow(self) -> None:
        """Arm the deadline of what the connection now waits for, if that changed."""
        state = self.conn.their_state
        waiting: Waiting | None = None
        if self._lingering:
            return
        if not self.transport.is_closing():
            waiting = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY \
                else None
        if waiting == self._waiting:
            return
        self._waiting = waiting
        self._disarm()
        limits = self.guard.limits
        if waiting == "head":
            self.guard.idle(self)
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._head_late)
        else:
            self.guard.busy(self)
            if waiting == "body":
                self._deadline = self.loop.call_later(limits.body_timeout_s, self._body_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        timeout = self.guard.limits.header_timeout_s
        if not self._partial_head():
            self._close_quietly()  # nothing sent: an idle connection, closed as uvicorn does
            return
        self.guard.late.note("%s closed a connection whose request head was not whole "
                             "%.0f s after it began to wait (%s)", self.guard.what, timeout,
                             self._peer())
        self.refuse(Refusal(408, "request_timeout", f"the request's head did not arrive "
                            f"within {timeout:g} s", "send the request line and headers at "
                            "once"))

    def _body_late(self) -> None:
        self._deadline = None
        timeout = self.guard.limits.body_timeout_s
        self.guard.late.note("%s closed a connection whose request body was not whole %.0f s "
                             "after its head (%s)", self.guard.what, timeout, self._peer())
        self.refuse(Refusal(408, "request_timeout", f"the request's body did not arrive "
                            f"within {timeout:g} s of its head", "send the whole body at once, "
                            "and no less than its Content-Length"))

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _write_stalled(self) -> None:
        """The reader took nothing for ``write_stall_s``: abort (nothing more can reach it;
        the app's stream sees the client gone and ends, and ``WRITE_STALLED`` in its
        scope says why)."""
        self._stalled = None
        self.guard.late.note("%s closed a connection that took nothing of its response for "
                             "%.0f s: its reader stopped reading (%s)", self.guard.what,
                             self.guard.limits.write_stall_s or 0.0, self._peer())
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.scope.setdefault("extensions", {})[WRITE_STALLED] = {}
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.abort()

    # -- closing -----------------------------------------------------------------------------

    def _partial_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def _close_quietly(self) -> None:
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self._close()

    def _close(self, *, linger: bool = False) -> None:
        # A peer that reads nothing must not hold the connection open through our
        # unsent answer: what the kernel did not take at once is dropped.
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        elif not linger or not self.transport.can_write_eof():
            self.transport.close()
        else:
            self.transport.write_eof()
            self._lingering = True
            self._disarm()
            self.guard.doomed(self)
            self._deadline = self.loop.call_later(LINGER_S, self.transport.close)
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()  # uvicorn paused it when it saw h11.PAUSED

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a local client"


def json_refusal(refusal: Refusal) -> bytes:
    """The control API's shape: ``{"error": {"code", "message", "hint"}}``."""
    return json.dumps({"error": {"code": refusal.code, "message": refusal.message,
                                 "hint": refusal.hint}}).encode()
