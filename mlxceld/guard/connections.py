"""What an HTTP listener lets a connection hold: how many, how long, how large a head.

A peer can stall us in four ways, and each has its bound (``ConnectionLimits``):

- **too many connections** (``max_connections``): past it, the connection that has
  waited longest for a request of its own goes (a new one that never sent a byte,
  one sending its head a byte a second, a keep-alive one idle between requests);
  a connection whose request is in the app is never closed for it. When every
  connection is busy, the newcomer is answered 503 and closed. The cap is kept
  below the process's file limit (``connection_cap``), so ``accept()`` never fails
  for want of a descriptor and the process keeps the ones it needs for itself. Over
  the cap, a connection is closed once accepted: asyncio accepts ``ACCEPT_BATCH`` in
  a turn of its loop, so for a moment a listener holds that many more, which the
  cap leaves room for. Between two batches the loop reads what the connections
  already accepted have sent, so a burst of newcomers does not push out one whose
  request has arrived but was not read yet; the rest of a burst waits in the
  kernel's queue (the listener's backlog);
- **a slow head** (``header_timeout_s``): a request's head must be whole this long
  after the connection opened, or after the previous response on it; the deadline
  does not move as bytes trickle in. A partial head is answered 408; nothing at all
  is closed quietly, as an idle keep-alive connection is;
- **a slow body** (``body_timeout_s``): the body must be whole this long after the
  head; else 408 (or a plain close once the response has begun);
- **a large head** (``MAX_HEAD_BYTES``, ``MAX_HEADER_LINE_BYTES``, ``MAX_HEADERS``):
  431; ``Content-Length`` with ``Transfer-Encoding`` (a smuggling vector, RFC 9112
  section 6.3): 400;
- **a reader that takes nothing** (``write_stall_s``; off unless a listener sets it,
  as the control socket and the OpenAI port, ``[serve] write_timeout_s``, do): a
  response the peer takes nothing of for this long, the transport's buffers full (its
  reader stopped: a suspended ``mlxctl events -f``), has its connection aborted and
  logged once per burst. Its request is in the app,
  so the cap would never close it: without this bound, stopped followers would hold
  the listener's connections for ever. A reader that is slow but reads resumes the
  writes now and then, and is never closed for it.
  The app learns of it: the request's ASGI scope gains the extension ``WRITE_STALLED``
  before the app's ``receive`` says the client is gone. Where the kernel's send buffer
  grows on its own (Linux's reaches 4 MB on loopback), a reader that stopped would be
  noticed only MBs later: ``send_buffer_bytes`` bounds it, and the transport's
  (``SEND_BUFFER_BYTES`` on the OpenAI port, whose streams are small and steady).

Refusals are written by the protocol (``guarded.py``) in the server's own error
shape (``Refusal`` rendered by the server's ``render``), and logged once per burst
(``bursts.py``).
"""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Protocol

import h11

from mlxceld.guard.bursts import Burst

log = logging.getLogger(__name__)

MAX_HEAD_BYTES: Final = 64 * 1024  # the request line and every header
MAX_HEADER_LINE_BYTES: Final = 16 * 1024  # one header, name and value
MAX_HEADERS: Final = 100
RESERVED_FDS: Final = 128  # descriptors a process keeps for itself beyond its connections
ACCEPT_BATCH: Final = 128  # connections asyncio accepts in one turn, before the cap sees any
MIN_CONNECTIONS: Final = 8
OPEN_MAX: Final = 10240  # macOS: the most a soft limit may be when the hard one is unlimited
# The OpenAI port's send_buffer_bytes: a stream's tokens need little (16 KiB is 330 KB/s at a
# 50 ms round trip), and a client that stops reading is noticed after ~50 KB, not MBs.
SEND_BUFFER_BYTES: Final = 16 * 1024
# An ASGI scope extension: the guard closed the request's connection at the write deadline.
WRITE_STALLED: Final = "mlxceld.write_stalled"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_stall_s: float | None = None  # None: a reader may take nothing for ever
    # The bytes a reader may leave unread in the kernel's send buffer (SO_SNDBUF) and as
    # many in the transport's before our writes pause; None: the OS's and asyncio's.
    send_buffer_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.max_connections < 1 or self.header_timeout_s <= 0 or self.body_timeout_s <= 0
                or (self.write_stall_s is not None and self.write_stall_s <= 0)
                or (self.send_buffer_bytes is not None and self.send_buffer_bytes < 1)):
            raise ValueError(f"connection limits must be positive, not {self}")


@dataclass(frozen=True)
class Refusal:
    """An HTTP answer given before (or instead of) the app's: status, code, what, what next."""

    status: int
    code: str
    message: str
    hint: str = ""
    retry_after_s: int | None = None


class Render(Protocol):
    def __call__(self, refusal: Refusal) -> bytes:
        """The JSON body of ``refusal`` in the server's error shape."""
        ...


def head_refusal(request: h11.Request) -> Refusal | None:
    """What is wrong with a request's head, if anything (h11 has parsed it whole)."""
    size = len(request.method) + len(request.target) + 12
    with_length = with_encoding = False
    for count, (name, value) in enumerate(request.headers.raw_items(), start=1):
        line = len(name) + len(value) + 4
        size += line
        if count > MAX_HEADERS:
            return _too_large(f"the request has more than {MAX_HEADERS} headers")
        if line > MAX_HEADER_LINE_BYTES:
            return _too_large(f"the request header {_shown(name)} is {line} bytes long; "
                              f"the limit is {MAX_HEADER_LINE_BYTES} bytes a header")
        lowered = name.lower()
        with_length = with_length or lowered == b"content-length"
        with_encoding = with_encoding or lowered == b"transfer-encoding"
    if size > MAX_HEAD_BYTES:
        return too_large_head()
    if with_length and with_encoding:
        return Refusal(400, "bad_request", "the request has both Content-Length and "
                       "Transfer-Encoding, which RFC 9112 forbids",
                       "send one of them: Content-Length, or Transfer-Encoding: chunked")
    return None


def too_large_head() -> Refusal:
    return _too_large(f"the request's head (request line and headers) is larger than "
                      f"{MAX_HEAD_BYTES} bytes")


def _too_large(message: str) -> Refusal:
    return Refusal(431, "request_header_too_large", message,
                   f"send at most {MAX_HEADERS} headers of at most {MAX_HEADER_LINE_BYTES} "
                   f"bytes each, {MAX_HEAD_BYTES} bytes in all")


def _shown(name: bytes) -> str:
    return repr(name[:64].decode("latin-1"))


class Connection(Protocol):
    """What ``Guard`` needs of a connection: a way to close it, telling it why."""

    def evict(self, *, newcomer: bool) -> None: ...


class Guard:
    """One listener's connections: its limits, and who goes first when there are too many.

    The connections waiting for a request (``idle``) are kept in the order they began
    to wait; ``busy`` takes one out (its request is in), ``closed`` forgets it.
    """

    def __init__(self, limits: ConnectionLimits, render: Render, what: str) -> None:
        self.limits = limits
        self.render = render
        self.what = what  # "the OpenAI port", "the control socket": named in the log
        self._open: set[Connection] = set()
        self._idle: OrderedDict[Connection, None] = OrderedDict()  # longest waiting first
        self.evictions = Burst(log, logging.WARNING, "connections closed over the cap")
        self.late = Burst(log, logging.WARNING, "connections closed at a deadline")
        self.refusals = Burst(log, logging.INFO, "requests refused before the app")

    @property
    def open(self) -> int:
        return len(self._open)

    def opened(self, conn: Connection) -> None:
        """A new connection, waiting for its first request; close the longest waiting
        ones (``conn`` itself last) while there are more than ``max_connections``."""
        self._open.add(conn)
        self._idle[conn] = None
        while len(self._open) > self.limits.max_connections:
            oldest = next(iter(self._idle))
            self.forget(oldest)
            self.evictions.note("%s has %d connections open, its cap: closing the one that "
                                "waited longest for a request", self.what, len(self._open) + 1)
            oldest.evict(newcomer=oldest is conn)

    def idle(self, conn: Connection) -> None:
        if conn in self._open:
            self._idle.pop(conn, None)
            self._idle[conn] = None

    def doomed(self, conn: Connection) -> None:
        """``conn`` is closing (refused, lingering for its answer to be read): first to go."""
        if conn in self._open:
            self._idle[conn] = None
            self._idle.move_to_end(conn, last=False)

    def busy(self, conn: Connection) -> None:
        self._idle.pop(conn, None)

    def forget(self, conn: Connection) -> None:
        self._open.discard(conn)
        self._idle.pop(conn, None)


def raise_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit where the OS allows
    (to ``OPEN_MAX`` when the hard one is unlimited, as macOS wants); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_MAX if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.info("file limit stays %d: cannot raise it to %d (%s)", soft, target, exc)
        return soft
    log.info("file limit raised from %d to %d", soft, target)
    return target


def connection_cap(wanted: int, what: str, burst: int = 0) -> int:
    """``wanted``, lowered to keep ``RESERVED_FDS`` of the soft file limit free, and
    ``burst`` more (and logged when it is): the connections accepted in one turn, before
    the cap can close any of them."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    cap = min(wanted, max(MIN_CONNECTIONS, soft - RESERVED_FDS - burst))
    if cap < wanted:
        log.warning("%s takes %d connections, not %d: the file limit is %d, and %d are kept "
                    "for the process itself and %d for a burst of accepts; raise the limit "
                    "(ulimit -n) to take more", what, cap, wanted, soft, RESERVED_FDS, burst)
    return cap
