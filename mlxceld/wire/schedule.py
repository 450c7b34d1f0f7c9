"""The MXCL v1 key schedule (PROTOCOL.md sections 2.4 to 2.7 and the rekey of section 3).

Pure functions of bytes, so that every intermediate value of the test vectors can
be checked on its own. The handshake state machine in ``handshake.py`` calls them.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

from mlxceld.wire.crypto import HASH_LEN, IV_LEN, KEY_LEN, hkdf_expand, hkdf_extract, hmac_sha256
from mlxceld.wire.crypto import sha256 as H


class Channel(IntEnum):
    """Key spaces: each channel derives its own traffic secrets."""

    TRANSPORT = 1
    ASSIGNMENT = 2
    AGENT = 3


CHANNEL_NAMES: Final = {
    Channel.TRANSPORT: "transport",
    Channel.ASSIGNMENT: "assignment",
    Channel.AGENT: "agent",
}

_AUTH_SERVER: Final = b"mlxcel v1 auth server"
_AUTH_CLIENT: Final = b"mlxcel v1 auth client"
_KEY: Final = b"mlxcel v1 key"
_IV: Final = b"mlxcel v1 iv"
_UPDATE: Final = b"mlxcel v1 update"


def prk(client_nonce: bytes, server_nonce: bytes, secret: bytes, dh: bytes) -> bytes:
    """``HKDF-Extract(salt = client_nonce || server_nonce, IKM = S || dh)``."""
    return hkdf_extract(client_nonce + server_nonce, secret + dh)


def auth_keys(prk_: bytes) -> tuple[bytes, bytes]:
    """``(Ks, Kc)``: the server's and the client's authentication keys."""
    return (hkdf_expand(prk_, _AUTH_SERVER, HASH_LEN), hkdf_expand(prk_, _AUTH_CLIENT, HASH_LEN))


def server_auth(ks: bytes, client_hello: bytes, server_hello_head: bytes) -> bytes:
    """``HMAC(Ks, H(ClientHello || status || version || server_nonce || server_share))``."""
    return hmac_sha256(ks, H(client_hello + server_hello_head))


def client_auth(kc: bytes, client_hello: bytes, server_hello: bytes) -> bytes:
    """``HMAC(Kc, H(ClientHello || ServerHello))``, ServerHello including server_auth."""
    return hmac_sha256(kc, H(client_hello + server_hello))


def verdict_tag(ks: bytes, client_hello: bytes, server_hello: bytes, client_auth_: bytes,
                verdict: int) -> bytes:
    """``HMAC(Ks, H(ClientHello || ServerHello || client_auth) || verdict)``."""
    return hmac_sha256(ks, H(client_hello + server_hello + client_auth_) + bytes([verdict]))


def transcript_hash(client_hello: bytes, server_hello: bytes, client_auth_: bytes,
                    verdict_message: bytes) -> bytes:
    """``th = H(ClientHello || ServerHello || client_auth || verdict byte || verdict tag)``."""
    return H(client_hello + server_hello + client_auth_ + verdict_message)


def traffic_secrets(prk_: bytes, channel: Channel, th: bytes) -> tuple[bytes, bytes]:
    """``(ts_c2s, ts_s2c)`` for ``channel``."""
    name = CHANNEL_NAMES[channel].encode("ascii")
    c2s = hkdf_expand(prk_, b"mlxcel v1 traffic " + name + b" c2s" + th, HASH_LEN)
    s2c = hkdf_expand(prk_, b"mlxcel v1 traffic " + name + b" s2c" + th, HASH_LEN)
    return c2s, s2c


def traffic_key_iv(ts: bytes) -> tuple[bytes, bytes]:
    """A direction's AEAD key and IV from its traffic secret."""
    return hkdf_expand(ts, _KEY, KEY_LEN), hkdf_expand(ts, _IV, IV_LEN)


def next_traffic_secret(ts: bytes) -> bytes:
    """``ts' = HKDF-Expand(ts, "mlxcel v1 update", 32)``, after a key update."""
    return hkdf_expand(ts, _UPDATE, HASH_LEN)
