"""Handshake messages of PROTOCOL.md section 2: their layout, parsing and the identity check.

Readings where the page is loose (the stricter one, per its own instruction):

- A hello is *malformed* (closed without an answer, like bad magic) when its flags
  are not 0, its channel is not 1, 2 or 3, its identity is empty, longer than
  255 bytes, not UTF-8, or not ``host:port`` with a decimal port 1..65535 without
  leading zeros (an IPv6 host in brackets, an IPv4 host or name without them).
- An identity whose host is a name rather than an IP address cannot be shown to
  be owned by the TCP source: status 4.
- IPv6 scope ids (``%eth0``) are ignored when comparing addresses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from mlxceld.wire.address import MAX_ADDRESS, ip_or_none, parse_address
from mlxceld.wire.crypto import SHARE_LEN
from mlxceld.wire.errors import RemoteProtocolError
from mlxceld.wire.schedule import Channel
from mlxceld.wire.secret import KEY_ID_BYTES

MAGIC: Final = b"MXCL"
VERSION: Final = 1
NONCE_LEN: Final = 32
AUTH_LEN: Final = 32
MAX_IDENTITY: Final = MAX_ADDRESS
# "MXCL" · version · suite · channel · flags · key_id 8 · nonce 32 · share 32 · identity_len u16
_FIXED: Final = struct.Struct(f">4sBBBB{KEY_ID_BYTES}s{NONCE_LEN}s{SHARE_LEN}sH")
HELLO_FIXED_LEN: Final = _FIXED.size  # 82
SERVER_HELLO_LEN: Final = 2 + NONCE_LEN + SHARE_LEN + AUTH_LEN  # 98
VERDICT_LEN: Final = 1 + AUTH_LEN
_CHANNELS: Final = frozenset(int(c) for c in Channel)

# Reject statuses (a 2-byte answer ``status · server_version``) and their log kinds.
STATUS_OK: Final = 0
REJECTS: Final = {
    1: ("version_mismatch", "version mismatch"),
    2: ("suite_mismatch", "suite mismatch"),
    3: ("unknown_key_id", "unknown key id"),
    4: ("identity_not_owned", "identity not owned"),
}
VERDICT_ACCEPTED: Final = 0
VERDICT_AT_CAPACITY: Final = 1


def noise(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"not an MXCL v1 hello: {what}", kind="noise")


@dataclass(frozen=True, slots=True)
class ClientHello:
    version: int
    suite: int
    channel: int
    key_id: bytes
    nonce: bytes
    share: bytes
    identity: str

    def encode(self) -> bytes:
        ident = self.identity.encode("utf-8")
        if not ident or len(ident) > MAX_IDENTITY:
            raise ValueError(f"identity must be 1..{MAX_IDENTITY} bytes of UTF-8")
        return _FIXED.pack(MAGIC, self.version, self.suite, self.channel, 0, self.key_id,
                           self.nonce, self.share, len(ident)) + ident


@dataclass(frozen=True, slots=True)
class HelloHead:
    """The fixed 82 bytes, checked for magic and form; the identity is still to come."""

    version: int
    suite: int
    channel: int
    key_id: bytes
    nonce: bytes
    share: bytes
    identity_len: int


def parse_hello_head(data: bytes) -> HelloHead:
    """Parse the fixed part of a ClientHello; raise ``noise`` for bad magic or form."""
    if len(data) != HELLO_FIXED_LEN:
        raise noise("short hello")
    magic, version, suite, channel, flags, kid, nonce, share, ident_len = _FIXED.unpack(data)
    if magic != MAGIC:
        raise noise("bad magic")
    if flags != 0:
        raise noise("flags are not 0")
    if channel not in _CHANNELS:
        raise noise("unknown channel")
    if not 0 < ident_len <= MAX_IDENTITY:
        raise noise("identity length out of range")
    return HelloHead(version, suite, channel, kid, nonce, share, ident_len)


def parse_identity(data: bytes) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) from identity bytes; raise ``noise`` if malformed."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise noise("identity is not UTF-8") from None
    try:
        hp = parse_address(text, loose_names=True)
    except ValueError as exc:
        raise noise(f"identity {exc}") from None
    return hp.host, hp.port


def identity_owned(identity_host: str, source_ip: str) -> bool:
    """Whether the identity's IP is the TCP source's (unspecified IPs match any source)."""
    source, claimed = ip_or_none(source_ip), ip_or_none(identity_host)
    if source is None or claimed is None:
        return False
    return claimed.is_unspecified or claimed == source


def reject(status: int) -> bytes:
    return bytes([status, VERSION])
