"""Node addresses in the cluster TOML: ``host:port``, IPv6 as ``[addr]:port``.

An address is also the node's MXCL identity (PROTOCOL.md: the ClientHello's
``host:port``), so it is parsed as strictly as the wire parses identities and
no DNS is ever asked: the host is an IP literal or a hostname (RFC 1123
letters, digits and hyphens). Two addresses are the same node when their
normalized forms are equal: IPs in canonical form (``::ffff:a.b.c.d`` is the
IPv4 address), hostnames in lowercase without a trailing dot.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from mlxceld.wire.hello import MAX_IDENTITY

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")


@dataclass(frozen=True)
class Address:
    host: str  # as written, without brackets
    port: int
    ip: IPAddress | None  # None for a hostname

    def key(self) -> tuple[str, int]:
        """The normalized form that equal addresses share."""
        if self.ip is None:
            return self.host.lower().rstrip("."), self.port
        ip = self.ip
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return str(ip), self.port


def parse_address(text: str) -> Address:
    """The address in ``text``; ``ValueError`` says what is wrong with it."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_IDENTITY:
        raise ValueError(f"is longer than {MAX_IDENTITY} bytes")
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError("has no ':port'")
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"has port {port!r}, not a number")
    if str(int(port)) != port:
        raise ValueError(f"has port {port!r} with a leading zero")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"has port {port}, outside 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            return Address(host[1:-1], int(port), ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"has {host!r} in brackets, which is not an IPv6 address") from None
    if ":" in host or "[" in host or "]" in host:
        raise ValueError("is not host:port (write an IPv6 address in brackets: [addr]:port)")
    if not host:
        raise ValueError("has no host")
    if _DOTTED_NUMBERS.fullmatch(host):
        try:
            return Address(host, int(port), ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"has host {host!r}, which is not an IPv4 address") from None
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"has host {host!r}, which is neither an IP address nor a hostname "
                         "(letters, digits and '-' in dot-separated labels)")
    return Address(host, int(port), None)
