"""``host:port``: the one parser, formatter and comparison of addresses.

Every address the project reads or writes goes through here: the identity in a
ClientHello (PROTOCOL.md section 2), ``--agent-addr``, ``--cluster-peers``,
node addresses in a cluster TOML, mDNS records, stage and router addresses.
No DNS is asked here (names are resolved by the network shell,
``mlxceld.net.resolve``), so this module is pure.

Forms: ``192.168.1.10:19000``, ``studio.local:19000`` (a host name: RFC 1123
letters, digits and hyphens in dot-separated labels), ``[fd00::12]:19000``
(an IPv6 address always in brackets, a scope id ``%en0`` allowed), and the
wildcards ``0.0.0.0:19000`` / ``[::]:19000`` (listen on every interface). The
port is decimal without leading zeros, 1-65535 (0, "let the system choose",
only where a listener allows it).

Two addresses are the same when their ``key`` is: an IP in canonical form
(``::ffff:a.b.c.d`` is the IPv4 address it carries, a scope id is ignored),
a name in lowercase without a trailing dot. Whether a name and an IP are the
same host needs DNS: ``mlxceld.net.resolve``.

What a node claims as its identity when it dials (``HostPort.claim``): its
listener's address when that is one IP, which it then dials from
(``HostPort.local_addr``); when it listens on a wildcard or a name, the
wildcard of the family, which the server replaces by the TCP source address
(PROTOCOL.md: "an unspecified IP ... is replaced by the source IP"). So a
name never travels as an identity: the server could not prove it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_ADDRESS: Final = 255  # bytes of UTF-8: the wire's identity bound
_LABEL: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DOTTED_NUMBERS: Final = re.compile(r"[0-9.]+")


def normalize_ip(ip: IP | str) -> IP:
    """``ip`` as compared: an IPv4-mapped IPv6 address is the IPv4 address it carries and
    a scope id is dropped. ``ValueError`` if ``ip`` is text that is not an IP."""
    if isinstance(ip, str):
        ip = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.scope_id is not None:
            return ipaddress.IPv6Address(int(ip))
    return ip


def ip_or_none(host: str) -> IP | None:
    """The normalized IP of ``host`` if it is an IP literal, else None (a name)."""
    try:
        return normalize_ip(host)
    except ValueError:
        return None


def format_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class HostPort:
    """A parsed address. ``host`` is as written (no brackets; what to dial or bind),
    ``ip`` its IP if it is one (None for a name)."""

    host: str
    port: int
    ip: IP | None

    def __str__(self) -> str:
        return format_address(self.host, self.port)

    @property
    def is_name(self) -> bool:
        return self.ip is None

    @property
    def is_wildcard(self) -> bool:
        """0.0.0.0 or :: (listen on every interface; never dialed)."""
        return self.ip is not None and self.ip.is_unspecified

    def key(self) -> tuple[str, int]:
        """The form equal addresses share (see the module docstring)."""
        if self.ip is None:
            return self.host.lower().rstrip("."), self.port
        return str(normalize_ip(self.ip)), self.port

    def canonical(self) -> str:
        """``host:port`` of ``key``: how addresses are stored and ranked."""
        return format_address(*self.key())

    def with_port(self, port: int) -> HostPort:
        return HostPort(self.host, port, self.ip)

    def claim(self) -> str:
        """The identity to send when dialing from this listener (module docstring)."""
        if self.ip is not None and not self.ip.is_unspecified:
            return self.canonical()
        wildcard = "::" if self.ip is not None and self.ip.version == 6 else "0.0.0.0"
        return format_address(wildcard, self.port)

    def local_addr(self) -> tuple[str, int] | None:
        """Where to dial from so that ``claim`` is owned: this IP and any port (None: let
        the system choose the source, which the server then binds)."""
        if self.ip is None or self.ip.is_unspecified:
            return None
        return self.host, 0


def parse_address(text: str, *, port_zero: bool = False, loose_names: bool = False) -> HostPort:
    """The address in ``text``; ``ValueError`` says what is wrong with it, phrased to follow
    the address (``f"peer {text!r} {exc}"``).

    ``port_zero``: allow port 0 (a listener's "any free port"). ``loose_names``: any
    other host text is a name, without the RFC 1123 check (the wire's reading: such an
    identity is refused as not owned, not as malformed).
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_ADDRESS:
        raise ValueError(f"is longer than {MAX_ADDRESS} bytes")
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError("has no ':port'")
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"has port {port!r}, not a number")
    if str(int(port)) != port:
        raise ValueError(f"has port {port!r} with a leading zero")
    number = int(port)
    if not (0 if port_zero else 1) <= number <= 65535:
        raise ValueError(f"has port {number}, outside {0 if port_zero else 1}-65535")
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        try:
            return HostPort(inner, number, ipaddress.IPv6Address(inner))
        except ValueError:
            raise ValueError(f"has {host!r} in brackets, which is not an IPv6 address"
                             ) from None
    if ":" in host or "[" in host or "]" in host:
        raise ValueError("is not host:port (write an IPv6 address in brackets: [addr]:port)")
    if not host:
        raise ValueError("has no host")
    if _DOTTED_NUMBERS.fullmatch(host):
        try:
            return HostPort(host, number, ipaddress.IPv4Address(host))
        except ValueError:
            if not loose_names:
                raise ValueError(f"has host {host!r}, which is not an IPv4 address") from None
            return HostPort(host, number, None)
    name = host[:-1] if host.endswith(".") else host
    if not loose_names and (len(name) > 253
                            or not all(_LABEL.fullmatch(label) for label in name.split("."))):
        raise ValueError(f"has host {host!r}, which is neither an IP address nor a hostname "
                         "(letters, digits and '-' in dot-separated labels)")
    return HostPort(host, number, None)


def canonical_address(text: str) -> str:
    """``parse_address(text).canonical()``; ``ValueError`` says what is wrong with ``text``."""
    return parse_address(text).canonical()


def bound_identity(claimed: str | None, source: str) -> HostPort:
    """The identity a handshake bound (PROTOCOL.md section 2): ``claimed`` (the
    ClientHello's, already checked by the server) with an unspecified IP replaced by the
    IP of ``source``, the TCP peer's ``host:port``. No claim: the source itself."""
    src = parse_address(source, port_zero=True)
    if not claimed:
        return HostPort(str(normalize_ip(src.host)), src.port, normalize_ip(src.host))
    hp = parse_address(claimed, loose_names=True)
    ip = src.ip if hp.ip is None or hp.ip.is_unspecified else hp.ip
    if ip is None:
        raise ValueError(f"source {source!r} is not an IP address")
    ip = normalize_ip(ip)
    return HostPort(str(ip), hp.port, ip)


def is_same_node(configured: HostPort, bound: HostPort, resolved: frozenset[IP]) -> bool:
    """Whether the handshake's ``bound`` identity is the node ``configured`` names.

    The ports must be equal; a configured wildcard matches any IP, a configured IP
    that IP, a configured name any IP in ``resolved`` (its addresses, looked up by the
    caller: ``mlxceld.net.resolve``)."""
    if configured.port != bound.port or bound.ip is None:
        return False
    if configured.ip is None:
        return normalize_ip(bound.ip) in resolved
    return configured.ip.is_unspecified or normalize_ip(configured.ip) == normalize_ip(bound.ip)
