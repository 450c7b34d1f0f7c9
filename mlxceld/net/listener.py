"""The MXCL v1 listener: accept, bound the pending pool, handshake, hand streams over.

Knobs (``Listener`` arguments; the daemon's agent listener and every stage listener
use the defaults):

- ``max_pending`` (64) and ``max_pending_per_source`` (8): the pending pool of
  PROTOCOL.md section 2, sockets accepted and not yet authenticated; a source is an
  IPv4 address or an IPv6 /64 (``source_bucket``). See ``mlxceld.net.pending``.
- ``hello_timeout`` (``HELLO_TIMEOUT_S``, 2 s): a socket's whole ClientHello must
  arrive within it (a client sends it as it connects), else the socket is closed
  (``hello_timeout``).
- ``handshake_timeout`` (5 s): the whole handshake.
- ``max_established`` (512): authenticated connections; past it the core answers
  verdict 1. It is lowered to ``established_cap`` so that established and pending
  sockets together stay within half the process's open-file limit (RLIMIT_NOFILE,
  soft): at the usual 256 of macOS launchd that is 64, at 1024 it is 448. Raise the
  limit (``ulimit -n``, systemd ``LimitNOFILE=``, launchd ``SoftResourceLimits``) for
  more; the cap in force is logged at start when it was lowered.

How PROTOCOL.md section 2 is read here. "A socket beyond either bound is closed at
accept": the pool never holds more than 64 sockets, nor more than 8 from a source;
when a bound is reached one socket is closed to make room and the newcomer takes
its slot. Which one (``mlxceld.net.pending``): of the newcomer's source when that
source is full, else of the source holding the most pending sockets; within it the
oldest *silent* socket (no complete ClientHello yet), else the oldest that sent its
hello and has not finished the handshake; never the newcomer's source's only socket.
Only when nothing is left to close under that rule is the newcomer itself closed.
Either way the socket closed gets nothing more (a silent one nothing at all), which
is all a peer can see of "closed at accept", and both bounds hold at every instant.
"5 s for the whole handshake" is an upper bound; requiring the hello, the first
flight, within 2 s of the 5 s is within it, and so is closing a socket early to make
room.

Pre-authentication is fair between sources, and a key id buys nothing: the key id is
public, so a complete hello that then stalls costs its sender no more than silence,
and the pool does not spare it. A flood fills the pool only by holding several
sockets per source (or, from 64 sources and more, by sockets older than a peer's),
so each socket it opens replaces one of its own, while a keyed peer holds one
socket per dial for one network trip and finishes its handshake under the flood.

Refusals (closed at accept, evicted, timed out, refused by the handshake) are never
logged one by one: each goes to the listener's ``SecurityLog`` (class by kind: see
``CLASS_OF``; at most 5 warnings a minute per class, the rest counted, a summary
with the counts by kind every minute while there are any, and at close) and to
``on_refused(kind, peer)`` if given. Every accepted socket is served by one task in
the listener's task group; a handler that raises ends its own connection, never the
listener.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import resource
from collections.abc import Awaitable, Callable
from typing import Any, Final

from mlxceld.net.errors import ConnectionClosed
from mlxceld.net.liveness import keep_alive_socket
from mlxceld.net.pending import Pending, PendingPool
from mlxceld.net.securitylog import SecurityClass, SecurityLog
from mlxceld.net.stream import MxclStream, close_writer, handshake
from mlxceld.tasks import cancelling_group
from mlxceld.wire import (
    HANDSHAKE_TIMEOUT_S,
    Connection,
    ConnectionRole,
    FrameLimits,
    HandshakeRefused,
    RemoteProtocolError,
    SecretStore,
    Suite,
)
from mlxceld.wire.address import normalize_ip
from mlxceld.wire.frames import DEFAULT_LIMITS

log = logging.getLogger(__name__)

Handler = Callable[[MxclStream], Awaitable[None]]
OnRefused = Callable[[str, str], None]  # (kind, peer "host:port")

HELLO_TIMEOUT_S: Final = 2.0
# A refusal's security-log class by its kind; every other kind is ``diagnostic``.
CLASS_OF: Final[dict[str, SecurityClass]] = {
    "noise": "noise", "abort": "noise", "evicted": "noise", "hello_timeout": "noise",
    "at_capacity": "capacity"}


def open_file_limit() -> int | None:
    """This process's soft RLIMIT_NOFILE, or ``None`` if unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def established_cap(requested: int, max_pending: int, file_limit: int | None) -> int:
    """``requested``, lowered so that pending and established sockets take at most half
    of ``file_limit`` (the other half is the rest of the process's: its database, logs,
    workers' pipes, outgoing connections); at least 1."""
    if file_limit is None:
        return requested
    return max(1, min(requested, file_limit // 2 - max_pending))


def source_bucket(ip: str) -> str:
    """The pending-pool source of ``ip``: the IPv4 address itself, or the IPv6 /64."""
    addr = normalize_ip(ip)
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return str(addr)


def _peer_of(name: tuple[Any, ...]) -> tuple[str, str]:
    """(source IP, "host:port") of a socket's peer address."""
    ip, port = str(name[0]), int(name[1])
    return ip, (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")


class Listener:
    def __init__(self, host: str, port: int, *, keyring: SecretStore, identity_of_server: str,
                 channels: set[int], handler: Handler, max_pending: int = 64,
                 max_pending_per_source: int = 8, max_established: int = 512,
                 hello_timeout: float = HELLO_TIMEOUT_S,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 random: Callable[[int], bytes] = os.urandom,
                 suite: Suite = Suite.AES_256_GCM, limits: FrameLimits = DEFAULT_LIMITS,
                 on_refused: OnRefused | None = None, seclog: SecurityLog | None = None,
                 name: str = "MXCL listener") -> None:
        """``name`` starts its security-log lines ("agent listener")."""
        self.host = host
        self.identity = identity_of_server
        self.name = name
        self._port = port
        self._keyring = keyring
        self._channels = frozenset(channels)
        self._handler = handler
        self._pool = PendingPool(max_pending, max_pending_per_source)
        self._max_established = established_cap(max_established, max_pending,
                                                open_file_limit())
        self._hello_timeout = hello_timeout
        self._handshake_timeout = handshake_timeout
        self._random = random
        self._suite = suite
        self._limits = limits
        self._on_refused = on_refused
        self._seclog = seclog or SecurityLog()
        self._established = 0
        self._server: asyncio.Server | None = None
        self._tg: asyncio.TaskGroup | None = None  # the connections' (while serving)
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._serving = False
        self._accepting = asyncio.Event()
        if self._max_established < max_established:
            log.info("%s: at most %d authenticated connections (not %d): the open-file "
                     "limit is %s; raise it (ulimit -n, LimitNOFILE=) for more", name,
                     self._max_established, max_established, open_file_limit())

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def pending(self) -> int:
        return len(self._pool)

    def pending_from(self, bucket: str) -> int:
        """Pending sockets from one source (``source_bucket``)."""
        return self._pool.count(bucket)

    @property
    def established(self) -> int:
        return self._established

    @property
    def max_established(self) -> int:
        """The established cap in force (``established_cap``)."""
        return self._max_established

    async def start(self) -> None:
        """Bind the socket (``port`` is known after this); accepting starts in ``serve``."""
        self._server = await asyncio.start_server(self._accepted, self.host, self._port,
                                                  start_serving=False)
        log.info("MXCL listener bound on %s:%d", self.host, self.port)

    async def serve(self, started: asyncio.Future[None] | None = None) -> None:
        """Accept and serve until ``aclose``, then cancel every connection's task (each in
        the one task group this owns); ``started`` resolves once it accepts."""
        if self._server is None:
            await self.start()
        assert self._server is not None
        self._serving = True
        try:
            async with cancelling_group() as tg:
                self._tg = tg
                tg.create_task(self._summarize())
                await self._server.start_serving()
                self._accepting.set()
                if started is not None:
                    started.set_result(None)
                await self._stop.wait()
                self._server.close()
                self._tg = None
        finally:
            self._tg = None
            self._server.close()
            self._seclog.flush(f"{self.name}: ")
            self._stopped.set()

    async def wait_accepting(self) -> None:
        """Return once ``serve`` accepts connections (its readiness signal)."""
        await self._accepting.wait()

    def stop_accepting(self) -> None:
        """Close the listening socket now, without waiting (its port is free on return);
        ``serve`` then winds its connections down as after ``aclose``."""
        self._stop.set()
        if self._server is not None:
            self._server.close()  # closes the bound sockets at once

    async def aclose(self) -> None:
        """Stop accepting, cancel every connection (each closes its socket), wait."""
        self._stop.set()
        if self._serving:
            await self._stopped.wait()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _summarize(self) -> None:
        """The security log's pending counts, once a window, for as long as this serves."""
        while True:
            await asyncio.sleep(self._seclog.window_s)
            self._seclog.flush(f"{self.name}: ")

    def _refused(self, kind: str, peer: str, reason: str) -> None:
        self._seclog.warn(CLASS_OF.get(kind, "diagnostic"), "%s: refused %s: %s (%s)",
                          self.name, peer, reason, kind, kind=kind)
        if self._on_refused is not None:
            self._on_refused(kind, peer)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tg is None:
            writer.close()
            return
        name = writer.get_extra_info("peername")
        if not name:  # reset before we got to it
            writer.close()
            self._refused("abort", "an unknown peer", "the socket was gone at accept")
            return
        ip, peer = _peer_of(name)
        keep_alive_socket(writer.get_extra_info("socket"))
        entry = Pending(source_bucket(ip), peer, writer)
        admission = self._pool.admit(entry)
        if not admission.admitted:
            writer.close()
            self._refused("noise", peer, admission.refusal)
            return
        if (victim := admission.evicted) is not None:
            victim.writer.close()
            if victim.task is not None:
                victim.task.cancel()
            state = "silent" if victim.silent else "its handshake unfinished"
            self._refused("evicted", victim.peer, f"{state}, closed to make room in the "
                                                  "pending pool")
        entry.task = self._tg.create_task(self._serve_one(reader, entry, ip))

    async def _serve_one(self, reader: asyncio.StreamReader, entry: Pending, ip: str) -> None:
        writer, peer = entry.writer, entry.peer
        reserved = False

        def capacity_ok() -> bool:
            nonlocal reserved
            if self._established >= self._max_established:
                return False
            self._established += 1
            reserved = True
            return True

        try:
            try:
                conn = Connection(ConnectionRole.SERVER, keyring=self._keyring, random=self._random,
                                  now=asyncio.get_running_loop().time(), suite=self._suite,
                                  peer_ip=str(normalize_ip(ip)), capacity_ok=capacity_ok,
                                  limits=self._limits, handshake_timeout=self._handshake_timeout,
                                  hello_timeout=self._hello_timeout)
                entry.conn = conn
                done = await handshake(conn, reader, writer)
            except RemoteProtocolError as exc:
                self._refused(exc.kind, peer, exc.reason)
                return
            except OSError as exc:
                self._refused("abort", peer, f"socket error during the handshake: {exc}")
                return
            finally:
                self._pool.release(entry)
            if isinstance(done, HandshakeRefused):
                self._refused("at_capacity", peer, done.reason)
                return
            stream = MxclStream(conn, reader, writer, done, peer=peer)
            if done.channel not in self._channels:
                self._refused("channel", peer, f"channel {int(done.channel)} not served here")
                await stream.close(f"channel {int(done.channel)} is not served here")
                return
            # Debug: inventory polls alone would write a line per peer every 20 s.
            log.debug("accepted %s (identity %s) on channel %s", peer, done.peer_identity,
                      done.channel.name.lower())
            await self._run_handler(stream)
        finally:
            if reserved:
                self._established -= 1
            await close_writer(writer)

    async def _run_handler(self, stream: MxclStream) -> None:
        """The handler's error ends its connection only: caught here, it never reaches the
        task group, where it would end the listener and every other connection."""
        try:
            await self._handler(stream)
        except ConnectionClosed as exc:
            log.info("connection with %s ended: %s", stream.peer, exc)
        except Exception:
            log.exception("handler for %s failed", stream.peer)
        finally:
            await stream.close()
