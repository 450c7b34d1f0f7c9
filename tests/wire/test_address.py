"""``mlxceld.wire.address``: the one host:port parser, each form tested once here."""

from __future__ import annotations

import ipaddress

import pytest

from mlxceld.wire.address import (
    HostPort,
    bound_identity,
    canonical_address,
    format_address,
    ip_or_none,
    is_same_node,
    normalize_ip,
    parse_address,
)


@pytest.mark.parametrize(("text", "host", "port", "kind", "canonical"), [
    ("192.168.1.11:19000", "192.168.1.11", 19000, "ip", "192.168.1.11:19000"),
    ("[FD00::0012]:19000", "FD00::0012", 19000, "ip", "[fd00::12]:19000"),
    ("[fe80::1%en0]:19000", "fe80::1%en0", 19000, "ip", "[fe80::1]:19000"),
    ("[::ffff:10.0.0.1]:7", "::ffff:10.0.0.1", 7, "ip", "10.0.0.1:7"),
    ("Studio.Local.:19000", "Studio.Local.", 19000, "name", "studio.local:19000"),
    ("localhost:1", "localhost", 1, "name", "localhost:1"),
    ("0.0.0.0:19000", "0.0.0.0", 19000, "wildcard", "0.0.0.0:19000"),
    ("[::]:65535", "::", 65535, "wildcard", "[::]:65535"),
])
def test_forms(text: str, host: str, port: int, kind: str, canonical: str) -> None:
    hp = parse_address(text)
    assert (hp.host, hp.port) == (host, port)
    assert hp.is_name == (kind == "name") and hp.is_wildcard == (kind == "wildcard")
    assert hp.canonical() == canonical == canonical_address(text)
    assert parse_address(str(hp)) == hp  # what we write, we read back


@pytest.mark.parametrize(("text", "words"), [
    ("10.0.0.1", "has no ':port'"),
    ("10.0.0.1:0", "outside 1-65535"),
    ("10.0.0.1:65536", "outside 1-65535"),
    ("10.0.0.1:019000", "leading zero"),
    ("10.0.0.1:x", "not a number"),
    ("fd00::1:19000", "IPv6 address in brackets"),
    ("[nope]:1", "not an IPv6 address"),
    ("[10.0.0.1]:1", "not an IPv6 address"),
    (":1", "has no host"),
    ("10.0.0.256:1", "not an IPv4 address"),
    ("under_score:1", "neither an IP address nor a hostname"),
    ("a." * 130 + "a:1", "longer than 255 bytes"),
])
def test_refusals_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_address(text)


def test_port_zero_only_where_a_listener_allows_it() -> None:
    assert parse_address("127.0.0.1:0", port_zero=True).port == 0


def test_loose_names_are_the_wires_reading() -> None:
    # A name the RFC would refuse is still host:port on the wire: refused as not owned.
    assert parse_address("under_score:1", loose_names=True).is_name
    assert parse_address("10.0.0.256:1", loose_names=True).is_name


def test_ips_compare_as_the_address_they_carry() -> None:
    assert normalize_ip("::ffff:10.0.0.1") == ipaddress.IPv4Address("10.0.0.1")
    assert normalize_ip("fe80::1%en0") == ipaddress.IPv6Address("fe80::1")
    assert ip_or_none("studio.local") is None
    assert format_address("fd00::1", 5) == "[fd00::1]:5"


@pytest.mark.parametrize(("listener", "claim", "local_addr"), [
    ("10.0.0.2:19000", "10.0.0.2:19000", ("10.0.0.2", 0)),
    ("[::ffff:10.0.0.2]:19000", "10.0.0.2:19000", ("::ffff:10.0.0.2", 0)),
    ("0.0.0.0:19000", "0.0.0.0:19000", None),
    ("[::]:19000", "[::]:19000", None),
    ("studio.local:19000", "0.0.0.0:19000", None),
])
def test_what_a_dialer_claims(listener: str, claim: str,
                              local_addr: tuple[str, int] | None) -> None:
    hp = parse_address(listener)
    assert hp.claim() == claim
    assert hp.local_addr() == local_addr


@pytest.mark.parametrize(("claimed", "source", "bound"), [
    ("0.0.0.0:19000", "10.0.0.2:50000", "10.0.0.2:19000"),
    ("[::]:19000", "[::ffff:10.0.0.2]:50000", "10.0.0.2:19000"),
    ("10.0.0.2:19000", "10.0.0.2:50000", "10.0.0.2:19000"),
    (None, "[fd00::2]:50000", "[fd00::2]:50000"),
])
def test_the_identity_a_handshake_bound(claimed: str | None, source: str, bound: str) -> None:
    assert str(bound_identity(claimed, source)) == bound


def test_same_node() -> None:
    bound = bound_identity("0.0.0.0:19000", "10.0.0.2:1234")
    ip = ipaddress.IPv4Address("10.0.0.2")
    assert is_same_node(parse_address("10.0.0.2:19000"), bound, frozenset())
    assert is_same_node(parse_address("[::ffff:10.0.0.2]:19000"), bound, frozenset())
    assert is_same_node(parse_address("0.0.0.0:19000"), bound, frozenset())
    assert is_same_node(parse_address("studio.local:19000"), bound, frozenset({ip}))
    assert not is_same_node(parse_address("studio.local:19000"), bound, frozenset())
    assert not is_same_node(parse_address("10.0.0.2:19001"), bound, frozenset())
    assert not is_same_node(parse_address("10.0.0.3:19000"), bound, frozenset())
    assert not is_same_node(parse_address("10.0.0.2:19000"),
                            HostPort("x", 19000, None), frozenset({ip}))
