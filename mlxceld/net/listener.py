"""The MXCL v1 listener: accept, bound the pending pool, handshake, hand streams over.

Bounds of PROTOCOL.md section 2: sockets that have not finished the handshake come
from a pending pool (64 in flight, 8 per source, a source being an IPv4 address or
an IPv6 /64); a socket beyond either bound is closed at accept. Each handshake has
5 s. Authenticated connections are capped (512); past the cap the core answers
verdict 1. Every accepted socket is served by one task in the listener's task group;
a handler that raises ends its own connection, never the listener.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable

from mlxceld.net.errors import ConnectionClosed
from mlxceld.net.stream import MxclStream, close_writer, handshake
from mlxceld.tasks import cancelling_group
from mlxceld.wire import (
    HANDSHAKE_TIMEOUT_S,
    Connection,
    FrameLimits,
    HandshakeRefused,
    RemoteProtocolError,
    Role,
    SecretStore,
    Suite,
)
from mlxceld.wire.address import normalize_ip
from mlxceld.wire.frames import DEFAULT_LIMITS

# Every refusal, a socket closed at accept counted as ``noise``, goes to this logger
# and to ``on_refused(kind, peer)``, where a security log can count it.
log = logging.getLogger(__name__)

Handler = Callable[[MxclStream], Awaitable[None]]
OnRefused = Callable[[str, str], None]  # (kind, peer "host:port")


def source_bucket(ip: str) -> str:
    """The pending-pool source of ``ip``: the IPv4 address itself, or the IPv6 /64."""
    addr = normalize_ip(ip)
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return str(addr)


def _peer_of(writer: asyncio.StreamWriter) -> tuple[str, str]:
    """(source IP, "host:port") of the socket's peer."""
    name = writer.get_extra_info("peername")
    ip, port = str(name[0]), int(name[1])
    return ip, (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")


class Listener:
    def __init__(self, host: str, port: int, *, keyring: SecretStore, identity_of_server: str,
                 channels: set[int], handler: Handler, max_pending: int = 64,
                 max_pending_per_source: int = 8, max_established: int = 512,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 random: Callable[[int], bytes] = os.urandom,
                 suite: Suite = Suite.AES_256_GCM, limits: FrameLimits = DEFAULT_LIMITS,
                 on_refused: OnRefused | None = None) -> None:
        self.host = host
        self.identity = identity_of_server
        self._port = port
        self._keyring = keyring
        self._channels = frozenset(channels)
        self._handler = handler
        self._max_pending = max_pending
        self._max_per_source = max_pending_per_source
        self._max_established = max_established
        self._handshake_timeout = handshake_timeout
        self._random = random
        self._suite = suite
        self._limits = limits
        self._on_refused = on_refused
        self._pending: Counter[str] = Counter()
        self._pending_total = 0
        self._established = 0
        self._server: asyncio.Server | None = None
        self._tg: asyncio.TaskGroup | None = None  # the connections' (while serving)
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._serving = False
        self._accepting = asyncio.Event()

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def pending(self) -> int:
        return self._pending_total

    @property
    def established(self) -> int:
        return self._established

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
            self._stopped.set()

    async def wait_accepting(self) -> None:
        """Return once ``serve`` accepts connections (its readiness signal)."""
        await self._accepting.wait()

    async def aclose(self) -> None:
        """Stop accepting, cancel every connection (each closes its socket), wait."""
        self._stop.set()
        if self._serving:
            await self._stopped.wait()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _refused(self, kind: str, peer: str, reason: str) -> None:
        log.warning("refused %s: %s (%s)", peer, reason, kind)
        if self._on_refused is not None:
            self._on_refused(kind, peer)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ip, peer = _peer_of(writer)
        bucket = source_bucket(ip)
        if self._tg is None:
            writer.close()
            return
        if self._pending_total >= self._max_pending:
            writer.close()
            self._refused("noise", peer, f"pending pool full ({self._max_pending})")
            return
        if self._pending[bucket] >= self._max_per_source:
            writer.close()
            self._refused("noise", peer, f"pending pool full for source {bucket} "
                                         f"({self._max_per_source})")
            return
        self._pending[bucket] += 1
        self._pending_total += 1
        self._tg.create_task(self._serve_one(reader, writer, ip, peer, bucket))

    def _release_pending(self, bucket: str) -> None:
        self._pending_total -= 1
        self._pending[bucket] -= 1
        if self._pending[bucket] <= 0:
            del self._pending[bucket]

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         ip: str, peer: str, bucket: str) -> None:
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
                conn = Connection(Role.SERVER, keyring=self._keyring, random=self._random,
                                  now=asyncio.get_running_loop().time(), suite=self._suite,
                                  peer_ip=str(normalize_ip(ip)), capacity_ok=capacity_ok,
                                  limits=self._limits, handshake_timeout=self._handshake_timeout)
                done = await handshake(conn, reader, writer)
            except RemoteProtocolError as exc:
                self._refused(exc.kind, peer, exc.reason)
                return
            except OSError as exc:
                self._refused("abort", peer, f"socket error during the handshake: {exc}")
                return
            finally:
                self._release_pending(bucket)
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
