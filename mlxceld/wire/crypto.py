"""Primitives for MXCL v1: HKDF (RFC 5869, SHA-256), X25519 and the AEAD suites.

This module is the seam to ``cryptography``: its exceptions stop here. ``Aead.open``
answers ``None`` for a ciphertext that does not authenticate instead of raising
``InvalidTag``, and ``x25519`` answers ``None`` for an all-zero shared secret.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import IntEnum
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

Buffer = bytes | bytearray | memoryview

HASH_LEN: Final = 32
KEY_LEN: Final = 32
IV_LEN: Final = 12
TAG_LEN: Final = 16
SHARE_LEN: Final = 32


class Suite(IntEnum):
    """AEAD suites. ``UNPROTECTED`` is for benchmarks only and is never negotiable."""

    UNPROTECTED = 0
    AES_256_GCM = 1
    CHACHA20_POLY1305 = 2


NEGOTIABLE_SUITES: Final = frozenset({Suite.AES_256_GCM, Suite.CHACHA20_POLY1305})


def sha256(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


def hmac_sha256(key: bytes, data: Buffer) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    """RFC 5869 HKDF-Extract; an empty salt means ``HashLen`` zero bytes."""
    return hmac_sha256(salt or bytes(HASH_LEN), ikm)


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF-Expand with SHA-256."""
    if not 0 < length <= 255 * HASH_LEN:
        raise ValueError(f"HKDF-Expand length {length} out of range")
    out = bytearray()
    block = b""
    counter = 1
    while len(out) < length:
        block = hmac_sha256(prk, block + info + bytes([counter]))
        out += block
        counter += 1
    return bytes(out[:length])


def x25519_public(private: bytes) -> bytes:
    """The public share of a 32-byte X25519 private key (clamped as RFC 7748 says)."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def x25519(private: bytes, peer_share: bytes) -> bytes | None:
    """``X25519(private, peer_share)``, or ``None`` where the result is all zero."""
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(
            X25519PublicKey.from_public_bytes(peer_share))
    except ValueError:  # cryptography refuses an all-zero shared secret itself
        return None
    if not any(shared):
        return None
    return shared


class Aead(Protocol):
    """One direction's AEAD under one key. ``open`` answers ``None`` when it does not verify.

    ``seal_into`` writes ciphertext and tag into ``out``, exactly ``len(plaintext) +
    TAG_LEN`` bytes: a frame is sealed in place, after its header, so the cipher's own
    output is the only copy of the payload.
    """

    def seal_into(self, nonce: bytes, plaintext: Buffer, ad: Buffer, out: memoryview) -> None: ...

    def open(self, nonce: bytes, sealed: Buffer, ad: Buffer) -> bytes | None: ...


class _CryptographyAead:
    __slots__ = ("_impl",)

    def __init__(self, impl: AESGCM | ChaCha20Poly1305) -> None:
        self._impl = impl

    def seal_into(self, nonce: bytes, plaintext: Buffer, ad: Buffer, out: memoryview) -> None:
        self._impl.encrypt_into(nonce, plaintext, ad, out)

    def open(self, nonce: bytes, sealed: Buffer, ad: Buffer) -> bytes | None:
        # ``decrypt`` writes straight into the bytes it returns: one copy, as with
        # ``decrypt_into`` a fresh bytearray (within 10% of it here, either way), and
        # the payload handed upward stays immutable ``bytes``.
        try:
            return self._impl.decrypt(nonce, sealed, ad)
        except InvalidTag:
            return None


_ZERO_TAG: Final = bytes(TAG_LEN)


class UnprotectedAead:
    """Suite 0: the plaintext and a zero tag. Benchmarks only; never on a real wire.

    It copies exactly once each way, into the same buffers as the ciphers, so that a
    benchmark against it measures the cipher and nothing else. (Into a memoryview: a
    ``bytes`` value assigned to a bytearray slice is first copied into a temporary
    bytearray, and a fresh megabyte costs more in page faults here than the cipher.)
    """

    __slots__ = ()

    def seal_into(self, nonce: bytes, plaintext: Buffer, ad: Buffer, out: memoryview) -> None:
        end = len(plaintext)
        if len(out) != end + TAG_LEN:
            raise ValueError(f"buffer must be {end + TAG_LEN} bytes")
        out[:end] = plaintext
        out[end:] = _ZERO_TAG

    def open(self, nonce: bytes, sealed: Buffer, ad: Buffer) -> bytes | None:
        view = memoryview(sealed)
        if len(view) < TAG_LEN or view[len(view) - TAG_LEN:] != _ZERO_TAG:
            return None
        return bytes(view[: len(view) - TAG_LEN])


def make_aead(suite: Suite, key: bytes) -> Aead:
    if suite is Suite.AES_256_GCM:
        return _CryptographyAead(AESGCM(key))
    if suite is Suite.CHACHA20_POLY1305:
        return _CryptographyAead(ChaCha20Poly1305(key))
    if suite is Suite.UNPROTECTED:
        return UnprotectedAead()
    raise ValueError(f"unknown suite {suite!r}")
