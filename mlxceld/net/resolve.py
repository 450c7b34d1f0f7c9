"""Host names to addresses, and which addresses are this host's: the DNS half of
``mlxceld.wire.address`` (which never asks DNS).

Bounds: one lookup has ``RESOLVE_S`` (2 s). A ``Resolver`` keeps each answer
``CACHE_S`` (30 s); when a connection's source is not among a name's cached
addresses the name is asked again (a host that moved to another address), at
most once per ``RETRY_S`` (2 s) per name. A name that does not resolve matches
nothing: the connection is refused naming the address, never hung on.

Whether an IP is ours is asked of the kernel: binding it succeeds
(``is_local_ip``). That covers every interface address and, on Linux, all of
127.0.0.0/8, without listing interfaces.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Final

from mlxceld.net.errors import NetError
from mlxceld.wire.address import IP, HostPort, ip_or_none, is_same_node, normalize_ip, parse_address

RESOLVE_S: Final = 2.0
CACHE_S: Final = 30.0
RETRY_S: Final = 2.0


class ResolveError(NetError):
    code = "resolve"


def _ips(infos: list[tuple[object, ...]]) -> frozenset[IP]:
    out = set()
    for info in infos:
        sockaddr = info[4]
        assert isinstance(sockaddr, tuple)
        out.add(normalize_ip(str(sockaddr[0])))
    return frozenset(out)


async def resolve(host: str, *, timeout_s: float = RESOLVE_S) -> frozenset[IP]:
    """The addresses of ``host`` (an IP literal is itself); ``ResolveError`` naming the host
    when it does not resolve within ``timeout_s``."""
    ip = ip_or_none(host)
    if ip is not None:
        return frozenset({ip})
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise ResolveError(f"host name {host!r} did not resolve within {timeout_s:g} s",
                           hint="check the name and this host's DNS / mDNS") from None
    except OSError as exc:
        raise ResolveError(f"host name {host!r} does not resolve: {exc}",
                           hint="check the name, or use the host's IP address") from None
    return _ips(list(infos))


def resolve_blocking(host: str) -> frozenset[IP]:
    """``resolve`` for a worker thread (the system resolver's own timeouts apply; callers
    on the event loop bound the thread with ``asyncio.timeout``)."""
    ip = ip_or_none(host)
    if ip is not None:
        return frozenset({ip})
    try:
        return _ips(list(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)))
    except OSError as exc:
        raise ResolveError(f"host name {host!r} does not resolve: {exc}",
                           hint="check the name, or use the host's IP address") from None


def is_local_ip(ip: IP) -> bool:
    """Whether ``ip`` is this host's (the kernel lets us bind it)."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            return False
    return True


def is_own_host(host: str, *, lookup: Callable[[str], frozenset[IP]] = resolve_blocking
                ) -> bool:
    """Whether ``host`` (an IP or a name) names this host: one of its addresses is ours.
    A wildcard is not a host. Blocking (``lookup``): call it from a thread."""
    ip = ip_or_none(host)
    if ip is not None and ip.is_unspecified:
        return False
    try:
        addresses = lookup(host)
    except ResolveError:
        return False
    return any(is_local_ip(a) for a in addresses)


def matches_blocking(configured: str, bound: HostPort) -> bool:
    """``is_same_node`` with a configured name looked up now (from a thread)."""
    try:
        c = parse_address(configured)
        resolved = resolve_blocking(c.host) if c.is_name else frozenset()
    except (ValueError, ResolveError):
        return False
    return is_same_node(c, bound, resolved)


class Resolver:
    """Cached lookups for matching connections against configured addresses."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cache: dict[str, tuple[float, frozenset[IP]]] = {}

    async def addresses(self, host: str, *, fresh: bool = False) -> frozenset[IP]:
        now = self._clock()
        hit = self._cache.get(host)
        if hit is not None and now - hit[0] < (RETRY_S if fresh else CACHE_S):
            return hit[1]
        try:
            ips = await resolve(host)
        except ResolveError:
            ips = frozenset()
        self._cache[host] = (now, ips)
        return ips

    async def is_node(self, configured: str | HostPort | None, bound: HostPort) -> bool:
        """Whether ``bound`` is the node at ``configured`` (None: no such node)."""
        if configured is None:
            return False
        try:
            c = parse_address(configured) if isinstance(configured, str) else configured
        except ValueError:
            return False
        if not c.is_name:
            return is_same_node(c, bound, frozenset())
        if is_same_node(c, bound, await self.addresses(c.host)):
            return True
        return is_same_node(c, bound, await self.addresses(c.host, fresh=True))
