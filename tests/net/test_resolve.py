"""``mlxceld.net.resolve``: host names to addresses, and which addresses are ours."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from mlxceld.net.resolve import (
    ResolveError,
    Resolver,
    is_local_ip,
    is_own_host,
    matches_blocking,
    resolve,
)
from mlxceld.wire.address import bound_identity

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
NOT_OURS = "192.0.2.1"  # TEST-NET-1: never an address of this machine


def test_localhost_resolves_to_loopback() -> None:
    assert LOOPBACK in asyncio.run(resolve("localhost"))
    assert asyncio.run(resolve("::ffff:127.0.0.2")) == {ipaddress.IPv4Address("127.0.0.2")}


def test_a_name_that_does_not_resolve_is_named() -> None:
    with pytest.raises(ResolveError, match=r"'no-such-host\.invalid'"):
        asyncio.run(resolve("no-such-host.invalid"))


def test_which_addresses_are_ours() -> None:
    assert is_local_ip(LOOPBACK)
    assert is_local_ip(ipaddress.IPv4Address("127.0.0.7"))  # all of 127/8 on Linux
    assert not is_local_ip(ipaddress.IPv4Address(NOT_OURS))
    assert is_own_host("localhost") and is_own_host("127.0.0.3")
    assert not is_own_host(NOT_OURS) and not is_own_host("no-such-host.invalid")
    assert not is_own_host("0.0.0.0")  # a wildcard is not a host


def test_a_configured_name_matches_the_addresses_it_resolves_to() -> None:
    from_lo = bound_identity("0.0.0.0:19000", "127.0.0.1:5000")
    from_two = bound_identity("0.0.0.0:19000", "127.0.0.2:5000")
    assert matches_blocking("localhost:19000", from_lo)
    assert not matches_blocking("localhost:19001", from_lo)
    assert not matches_blocking("localhost:19000", from_two)
    assert not matches_blocking("no-such-host.invalid:19000", from_lo)

    async def go() -> list[bool]:
        r = Resolver()
        return [await r.is_node("localhost:19000", from_lo),
                await r.is_node("localhost:19000", from_two),
                await r.is_node("127.0.0.2:19000", from_two),
                await r.is_node(None, from_two),
                await r.is_node("not an address", from_two)]

    assert asyncio.run(go()) == [True, False, True, False, False]


def test_a_miss_asks_again_after_the_cache_but_not_at_once() -> None:
    now = [0.0]
    r = Resolver(clock=lambda: now[0])

    async def go() -> None:
        assert await r.addresses("localhost")
        r._cache["localhost"] = (now[0], frozenset())  # as if it resolved to nothing then
        assert not await r.addresses("localhost", fresh=True)  # within RETRY_S: cached
        now[0] += 5.0
        assert LOOPBACK in await r.addresses("localhost", fresh=True)

    asyncio.run(go())
