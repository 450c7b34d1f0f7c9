"""Dial an MXCL v1 peer: TCP connect, handshake, retry what is worth retrying.

Retried with exponential backoff and jitter, within ``budget_s``: a refused or
failed TCP connect, an at-capacity verdict, and a handshake that ended early
(the server's pending pool was full) or ran out of its 5 s. Never retried: the
handshake refusals (wrong secret, unknown key id, version or suite mismatch,
identity not owned), which raise ``HandshakeFailed`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random as _random
from collections.abc import Callable
from typing import Final

from mlxceld.net.errors import HandshakeFailed
from mlxceld.net.liveness import keep_alive_socket
from mlxceld.net.stream import MxclStream, close_writer, handshake
from mlxceld.wire import (
    Channel,
    Connection,
    ConnectionRole,
    FrameLimits,
    HandshakeComplete,
    RemoteProtocolError,
    SecretStore,
    Suite,
)
from mlxceld.wire.address import parse_address
from mlxceld.wire.frames import DEFAULT_LIMITS

log = logging.getLogger(__name__)

RETRYABLE_KINDS: Final = frozenset({"at_capacity", "abort", "handshake_timeout"})
_jitter = _random.Random()


def _peer_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _attempt(host: str, port: int, *, keyring: SecretStore, identity: str,
                   channel: Channel, suite: Suite, random: Callable[[int], bytes],
                   local_addr: tuple[str, int] | None, limits: FrameLimits) -> MxclStream:
    reader, writer = await asyncio.open_connection(host, port, local_addr=local_addr)
    keep_alive_socket(writer.get_extra_info("socket"))
    try:
        conn = Connection(ConnectionRole.CLIENT, keyring=keyring, random=random,
                          now=asyncio.get_running_loop().time(), channel=channel,
                          identity=identity, suite=suite, limits=limits)
        done = await handshake(conn, reader, writer)
        if not isinstance(done, HandshakeComplete):  # only a server sees HandshakeRefused
            raise RemoteProtocolError("the server is at capacity", kind="at_capacity")
    except BaseException:
        await close_writer(writer)
        raise
    return MxclStream(conn, reader, writer, done, peer=_peer_name(host, port))


async def connect(host: str, port: int, *, keyring: SecretStore, identity: str, channel: int,
                  suite: int = 1, random: Callable[[int], bytes] = os.urandom,
                  budget_s: float = 10.0, initial_backoff_s: float = 0.05,
                  max_backoff_s: float = 1.0, local_addr: tuple[str, int] | None = None,
                  limits: FrameLimits = DEFAULT_LIMITS) -> MxclStream:
    """An authenticated stream to ``host:port`` on ``channel``, or ``HandshakeFailed``.

    ``identity`` is our advertised listener ``host:port``; its IP must be the
    address we connect from (``local_addr`` picks it).
    """
    peer = _peer_name(host, port)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + budget_s
    backoff = initial_backoff_s
    attempts = 0
    last_kind, last_reason = "unreachable", "no attempt finished"
    try:
        async with asyncio.timeout_at(give_up):
            while True:
                attempts += 1
                try:
                    return await _attempt(host, port, keyring=keyring, identity=identity,
                                          channel=Channel(channel), suite=Suite(suite),
                                          random=random, local_addr=local_addr, limits=limits)
                except RemoteProtocolError as exc:
                    if exc.kind not in RETRYABLE_KINDS:
                        raise HandshakeFailed(
                            exc.kind, f"handshake with {peer} refused: {exc.reason}",
                            peer=peer) from exc
                    last_kind, last_reason = exc.kind, exc.reason
                except OSError as exc:
                    last_kind, last_reason = "unreachable", f"connect failed: {exc}"
                delay = backoff * (0.5 + _jitter.random() / 2)
                log.debug("dialing %s: %s (%s); retry %d in %.3f s", peer, last_reason,
                          last_kind, attempts, delay)
                if loop.time() + delay >= give_up:
                    break
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, max_backoff_s)
    except TimeoutError:
        pass
    raise HandshakeFailed(last_kind, f"could not connect to {peer} within {budget_s:g} s "
                          f"({attempts} attempts); last: {last_reason}", peer=peer)


async def connect_as(origin: str, address: str, *, keyring: SecretStore, channel: int,
                     budget_s: float = 10.0) -> MxclStream:
    """``connect`` to ``address`` (``host:port``, a host name resolved when dialed) as the
    node whose listener is at ``origin``: with the identity it claims and from the IP it
    dials from (``mlxceld.wire.address.HostPort.claim``). ``ValueError`` if either is not
    ``host:port``."""
    me, where = parse_address(origin, port_zero=True), parse_address(address)
    return await connect(where.host, where.port, keyring=keyring, identity=me.claim(),
                         channel=channel, budget_s=budget_s, local_addr=me.local_addr())
