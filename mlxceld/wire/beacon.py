"""Discovery records of PROTOCOL.md section 5: the TXT keys of ``_mlxcel._tcp`` and their MAC.

Readings where the page is loose (the stricter one): a record must carry exactly
the keys ``v ver cluster node addr ts nonce kid mac``; ``ts`` is decimal unix
seconds, ``nonce`` 32 lowercase hex digits, ``kid`` 16 and ``mac`` 64; the MAC
is checked with the secret whose key id the record names, which must be in the
receiver's keyring; a record exactly 60 s away is still fresh.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from typing import Final

from mlxceld.wire.crypto import hkdf_expand, hkdf_extract, hmac_sha256
from mlxceld.wire.errors import BeaconError
from mlxceld.wire.handshake import SecretStore
from mlxceld.wire.secret import key_id

SERVICE_TYPE: Final = "_mlxcel._tcp.local."
FIELDS: Final = ("v", "ver", "cluster", "node", "addr", "ts", "nonce", "kid")
FRESHNESS_S: Final = 60
REFRESH_S: Final = 20
_HEX = {"nonce": re.compile(r"[0-9a-f]{32}"), "kid": re.compile(r"[0-9a-f]{16}"),
        "mac": re.compile(r"[0-9a-f]{64}"), "ts": re.compile(r"0|[1-9][0-9]{0,15}")}


def beacon_key(secret: bytes) -> bytes:
    """``K_b = HKDF-Expand(HKDF-Extract(salt = "", IKM = S), "mlxcel v1 beacon", 32)``."""
    return hkdf_expand(hkdf_extract(b"", secret), b"mlxcel v1 beacon", 32)


def canonical(fields: Mapping[str, str]) -> bytes:
    """Every key but ``mac`` as ``key=value`` lines, sorted by key, joined with ``\\n``."""
    return "\n".join(f"{k}={fields[k]}" for k in sorted(fields) if k != "mac").encode("utf-8")


def beacon_mac(secret: bytes, fields: Mapping[str, str]) -> str:
    return hmac_sha256(beacon_key(secret), canonical(fields)).hex()


def build_record(secret: bytes, *, version: str, package_version: str, cluster: str,
                 node: str, addr: str, ts: int, nonce: bytes) -> dict[str, str]:
    """A TXT record (``nonce``: 16 fresh random bytes from the caller)."""
    if len(nonce) != 16:
        raise ValueError("a beacon nonce is 16 bytes")
    fields = {"v": version, "ver": package_version, "cluster": cluster, "node": node,
              "addr": addr, "ts": str(int(ts)), "nonce": nonce.hex(),
              "kid": key_id(secret).hex()}
    return fields | {"mac": beacon_mac(secret, fields)}


def verify_record(record: Mapping[str, str], keyring: SecretStore, *, version: str,
                  package_version: str, cluster: str, now: float) -> dict[str, str]:
    """The record if a receiver may use it; ``BeaconError`` says why to ignore it."""
    if set(record) != {*FIELDS, "mac"}:
        raise BeaconError("record does not have exactly the MXCL v1 keys")
    for key, pattern in _HEX.items():
        if not pattern.fullmatch(record[key]):
            raise BeaconError(f"record field {key!r} is malformed")
    secret = keyring.get(bytes.fromhex(record["kid"]))
    if secret is None:
        raise BeaconError("record names a key id this node does not hold")
    if not hmac.compare_digest(beacon_mac(secret, record), record["mac"]):
        raise BeaconError("record MAC does not verify")
    if record["v"] != version or record["ver"] != package_version:
        raise BeaconError("record is from another protocol or package version")
    if record["cluster"] != cluster:
        raise BeaconError("record is from another cluster")
    if abs(now - int(record["ts"])) > FRESHNESS_S:
        raise BeaconError("record is stale (more than 60 s from our clock)")
    return dict(record)
