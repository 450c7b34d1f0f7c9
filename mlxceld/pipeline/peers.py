"""Who is on the other end: canonical ``host:port`` identities and their comparison.

The handshake binds the dialer's claimed identity to the TCP source IP (an
unspecified IP such as ``0.0.0.0`` stands for the source). The *bound* identity
is that claim with the unspecified IP replaced by the source and written
canonically; authorization compares it with the addresses of the cluster
config, canonicalized the same way. Only the IP is proven: the port is the
peer's advertised listener port (PROTOCOL.md section 2).
"""

from __future__ import annotations

import ipaddress
import socket


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into its parts; ``ValueError`` naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = int(port)
    if not 0 <= number <= 65535:
        raise ValueError(f"address {address!r}: port out of range")
    return host, number


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_ip(host: str) -> str:
    """An IP literal normalized (IPv4-mapped IPv6 becomes IPv4); a hostname resolved once."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        ip = ipaddress.ip_address(str(infos[0][4][0]))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def canonical_address(address: str) -> str:
    host, port = split_address(address)
    return join_address(canonical_ip(host), port)


def bound_identity(claimed: str | None, source: str) -> str:
    """The identity a handshake bound: ``claimed`` with an unspecified IP replaced by the
    IP of ``source`` (the TCP peer's ``host:port``)."""
    if not claimed:
        return canonical_address(source)
    host, port = split_address(claimed)
    ip = ipaddress.ip_address(canonical_ip(host))
    if ip.is_unspecified:
        host = split_address(source)[0]
    return join_address(canonical_ip(host), port)


def identity_matches(configured: str, bound: str) -> bool:
    """Whether ``bound`` is the configured peer (an unspecified configured IP matches any
    IP on that port)."""
    c_host, c_port = split_address(configured)
    b_host, b_port = split_address(bound)
    if c_port != b_port:
        return False
    c_ip = ipaddress.ip_address(c_host)
    return c_ip.is_unspecified or str(c_ip) == b_host
