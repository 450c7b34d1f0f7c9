"""Frames of PROTOCOL.md section 3: ``kind u8 · len u32 · ciphertext || tag(16)``.

One ``FrameSender`` and one ``FrameReceiver`` per direction, each holding its
traffic secret, AEAD, IV and sequence number. The nonce is the IV XOR
``00 00 00 00 || seq u64`` and the associated data the 5 header bytes.

Readings where the page is loose (the stricter one):

- The byte limits count frame bodies (``len``: ciphertext and tag) under one
  traffic secret, key-update frames included, on both sides.
- A sender rekeys early enough that neither limit is passed *including* the
  key-update frame itself; the receiver counts every frame it opens (key updates
  too) and closes when a count goes past its limit.
- A key-update frame must be empty and a close reason valid UTF-8 of at most
  1 KiB; otherwise the frame is malformed and the connection closes.
- A sender refuses (``LocalProtocolError``) a payload whose frame would exceed its
  own maximum frame length, since a peer with the same default would refuse it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from mlxceld.wire.crypto import TAG_LEN, Buffer, Suite, make_aead
from mlxceld.wire.errors import LocalProtocolError, RemoteProtocolError
from mlxceld.wire.schedule import next_traffic_secret, traffic_key_iv

HEADER: Final = struct.Struct(">BI")
HEADER_LEN: Final = HEADER.size  # 5
MAX_CLOSE_REASON: Final = 1024
_KEY_UPDATE_LEN: Final = HEADER_LEN + TAG_LEN  # an empty payload


class Kind(IntEnum):
    MESSAGE = 0x01
    CLOSE = 0x02
    KEY_UPDATE = 0x0F


_KINDS: Final = frozenset(int(k) for k in Kind)


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Frame and rekey bounds; the defaults are the protocol's, tests lower them."""

    max_frame_len: int = 256 * 2**20  # largest ``len`` a receiver accepts
    send_frames: int = 2**24  # a sender rekeys before passing these under one secret
    send_bytes: int = 2**36
    recv_frames: int = 2**26  # a receiver closes a peer that passes these
    recv_bytes: int = 2**38


DEFAULT_LIMITS: Final = FrameLimits()


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    payload: bytes


class _Direction:
    """One direction's traffic secret, AEAD, IV, sequence number and byte count."""

    __slots__ = ("_iv", "_secret", "_suite", "aead", "bytes", "seq")

    def __init__(self, suite: Suite, secret: bytes) -> None:
        self._suite = suite
        self._install(secret)

    def _install(self, secret: bytes) -> None:
        key, iv = traffic_key_iv(secret)
        self._secret = secret
        self.aead = make_aead(self._suite, key)
        self._iv = int.from_bytes(iv, "big")
        self.seq = 0
        self.bytes = 0

    def update(self) -> None:
        self._install(next_traffic_secret(self._secret))

    def nonce(self) -> bytes:
        return (self._iv ^ self.seq).to_bytes(12, "big")


class FrameSender:
    def __init__(self, suite: Suite, secret: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> None:
        self._dir = _Direction(suite, secret)
        self._limits = limits

    @property
    def seq(self) -> int:
        return self._dir.seq

    def seal(self, kind: Kind, payload: Buffer) -> bytearray:
        """The frame for ``payload``, preceded by a key update when the limits call for one.

        Both lie in one new buffer, sealed in place: the cipher's output is the only
        copy of the payload.
        """
        if isinstance(payload, memoryview) and (payload.format != "B" or payload.ndim != 1):
            payload = payload.cast("B")  # the ciphers take bytes, not items
        size = len(payload)
        body_len = size + TAG_LEN
        if body_len > self._limits.max_frame_len:
            raise LocalProtocolError(
                f"a {size}-byte payload exceeds the maximum frame length "
                f"{self._limits.max_frame_len}")
        d, lim = self._dir, self._limits
        lead = 0
        if kind is not Kind.KEY_UPDATE and d.seq > 0 and (
                d.seq + 2 > lim.send_frames or d.bytes + body_len + TAG_LEN > lim.send_bytes):
            lead = _KEY_UPDATE_LEN
        out = bytearray(lead + HEADER_LEN + body_len)
        if lead:
            self._seal_into(out, 0, Kind.KEY_UPDATE, b"", TAG_LEN)
            d.update()
        self._seal_into(out, lead, kind, payload, body_len)
        return out

    def key_update(self) -> bytearray:
        """A key-update frame; the traffic secret moves on right after it."""
        out = bytearray(_KEY_UPDATE_LEN)
        self._seal_into(out, 0, Kind.KEY_UPDATE, b"", TAG_LEN)
        self._dir.update()
        return out

    def _seal_into(self, out: bytearray, at: int, kind: Kind, payload: Buffer,
                   body_len: int) -> None:
        """Header, then ciphertext and tag, into ``out`` from offset ``at``."""
        d = self._dir
        HEADER.pack_into(out, at, kind, body_len)
        view, body_at = memoryview(out), at + HEADER_LEN
        d.aead.seal_into(d.nonce(), payload, view[at:body_at], view[body_at:body_at + body_len])
        d.seq += 1
        d.bytes += body_len


class FrameReceiver:
    """Buffers bytes, checks each header before its body arrives, opens frames in order.

    A frame that lies whole within fed ``bytes`` is opened where it lies; the bytes of
    a frame still incomplete are copied into a buffer of our own and the chunk is let
    go at once. (Holding chunks until a large frame completes, to join them once, cost
    more here than that copy: the allocator stopped reusing memory and page faults
    tripled.) Other buffer types are copied on ``feed``, since their owner may reuse them.
    """

    def __init__(self, suite: Suite, secret: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> None:
        self._dir = _Direction(suite, secret)
        self._limits = limits
        self._buf = bytearray()
        self._view: memoryview | None = None  # fed bytes not yet opened; only if ``_buf`` is empty
        self._head: tuple[bytes, int] | None = None  # the next frame's header and ``len``

    @property
    def buffered(self) -> int:
        return len(self._buf) if self._view is None else len(self._view)

    def feed(self, data: Buffer) -> None:
        if not data:
            return
        if self._view is not None:
            self._keep_rest()
        if not self._buf and isinstance(data, bytes):
            self._view = memoryview(data)
        else:
            self._buf += data
        self._parse_header()  # refuse a bad header before anything else is read

    def _keep_rest(self) -> None:
        """Copy what is left of the fed chunk (part of a frame) into our buffer."""
        assert self._view is not None
        self._buf += self._view
        self._view = None

    def _parse_header(self) -> None:
        src = self._buf if self._view is None else self._view
        if self._head is not None or len(src) < HEADER_LEN:
            return
        header = bytes(src[:HEADER_LEN])
        _kind, body_len = HEADER.unpack(header)
        if body_len > self._limits.max_frame_len:
            raise RemoteProtocolError(
                f"frame length {body_len} exceeds the maximum {self._limits.max_frame_len}",
                kind="oversized_frame")
        if body_len < TAG_LEN:
            raise RemoteProtocolError(f"frame length {body_len} is shorter than its tag",
                                      kind="malformed_frame")
        self._head = header, int(body_len)

    def next_frame(self) -> Frame | None:
        """The next whole frame, opened and checked, or ``None`` until more bytes arrive."""
        self._parse_header()
        head = self._head
        if head is None or self.buffered < HEADER_LEN + head[1]:
            if self._view is not None:
                self._keep_rest()  # the frame completes in our buffer; let the chunk go
            return None
        header, body_len = head
        end = HEADER_LEN + body_len
        d = self._dir
        with memoryview(self._buf if self._view is None else self._view) as src, \
                src[HEADER_LEN:end] as body:
            plain = d.aead.open(d.nonce(), body, header)
        if plain is None:
            raise RemoteProtocolError("frame does not authenticate (altered, replayed, "
                                      "reordered, dropped or foreign)", kind="frame_auth_failed")
        if self._view is None:
            del self._buf[:end]  # cheap at the front of a bytearray
        else:
            self._view = self._view[end:] if len(self._view) > end else None
        self._head = None
        d.seq += 1
        d.bytes += body_len
        if d.seq > self._limits.recv_frames or d.bytes > self._limits.recv_bytes:
            raise RemoteProtocolError("peer passed the frame or byte limit without a key update",
                                      kind="key_limit_exceeded")
        kind = header[0]
        if kind not in _KINDS:
            raise RemoteProtocolError(f"unknown frame kind 0x{kind:02x}",
                                      kind="unknown_frame_kind")
        if kind == Kind.KEY_UPDATE:
            if plain:
                raise RemoteProtocolError("key-update frame is not empty", kind="malformed_frame")
            d.update()
        elif kind == Kind.CLOSE:
            _check_close_reason(plain)
        return Frame(Kind(kind), plain)


def _check_close_reason(reason: bytes) -> None:
    if len(reason) > MAX_CLOSE_REASON:
        raise RemoteProtocolError("close reason longer than 1 KiB", kind="malformed_frame")
    try:
        reason.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("close reason is not UTF-8", kind="malformed_frame") from None
