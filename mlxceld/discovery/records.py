"""Our mDNS service, and the checks on each one we browse (PROTOCOL.md section 5).

What a daemon announces, on its agent port:

- instance ``<node-id>._mlxcel._tcp.local.``, SRV target ``<node-id>.local.``
  on the agent port, with an A (or AAAA) record of the advertised IP;
- TXT: the signed record of ``mlxceld.wire.beacon`` (``v ver cluster node addr
  ts nonce kid mac``) with ``addr`` = the advertised IP and the agent port.

What a receiver checks before a service becomes a candidate, in this order
(``check_service``; the first failure raises ``BeaconError`` and the service is
ignored, the reason logged):

1. The TXT strings decode: every key and value is UTF-8 and every key has a
   value (``key=value``).
2. ``verify_record``: exactly the keys above, their formats, a key id we hold,
   the MAC under that secret, ``v`` and ``ver`` equal to ours, ``cluster``
   equal to ours, ``ts`` within 60 s of our clock.
3. ``node`` is the service's instance label (``<node>._mlxcel._tcp.local.``):
   one node cannot announce itself under another's name.
4. ``addr`` is an IP literal and a port (no hostname: nothing is resolved from
   a record), the port is the SRV port, and the IP is one of the addresses the
   service resolved to (its A/AAAA records). The MAC binds ``addr`` to the
   secret; this check binds the DNS records to ``addr``.

Records of our own node are the candidate table's to ignore. Freshness over
time (the newest valid ``ts`` more than 60 s old drops a candidate) is the
candidate table's too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from mlxceld.wire import BeaconError, SecretStore, verify_record
from mlxceld.wire.address import ip_or_none, normalize_ip, parse_address
from mlxceld.wire.beacon import SERVICE_TYPE

__all__ = ["SERVICE_TYPE", "check_service", "decode_txt", "host_name", "instance_name"]

SERVICE_SUFFIX: Final = "." + SERVICE_TYPE


def instance_name(node_id: str) -> str:
    return f"{node_id}{SERVICE_SUFFIX}"


def host_name(node_id: str) -> str:
    return f"{node_id}.local."


def decode_txt(properties: Mapping[bytes, bytes | None]) -> dict[str, str]:
    """The TXT strings as text; ``BeaconError`` for one that is not UTF-8 ``key=value``."""
    out: dict[str, str] = {}
    for key, value in properties.items():
        if value is None:
            raise BeaconError("record has a TXT key without a value")
        try:
            out[key.decode("utf-8")] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise BeaconError("record has a TXT string that is not UTF-8") from None
    return out


def check_service(name: str, addresses: Sequence[str], port: int | None,
                  properties: Mapping[bytes, bytes | None], keyring: SecretStore, *,
                  version: str, package_version: str, cluster: str,
                  now: float) -> tuple[dict[str, str], str]:
    """The verified record of a resolved service and its normalized agent address."""
    record = verify_record(decode_txt(properties), keyring, version=version,
                           package_version=package_version, cluster=cluster, now=now)
    if name != instance_name(record["node"]):
        raise BeaconError("record names a node other than its service instance")
    try:
        addr = parse_address(record["addr"])
    except ValueError:
        raise BeaconError("record field 'addr' is not host:port") from None
    if addr.ip is None:
        raise BeaconError("record field 'addr' is a hostname, not an IP address")
    if addr.port != port:
        raise BeaconError("record 'addr' port is not the service's SRV port")
    resolved = {ip for ip in map(ip_or_none, addresses) if ip is not None}
    if normalize_ip(addr.ip) not in resolved:
        raise BeaconError("record 'addr' IP is not an address the service resolved to")
    return record, addr.canonical()
