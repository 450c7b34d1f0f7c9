"""The frame codec's buffers: however bytes are cut and whatever buffer type carries
them, the same frames come out, and sealing makes one buffer per call."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxceld.wire import Frame, FrameLimits, FrameReceiver, FrameSender, Kind, Suite
from mlxceld.wire.crypto import TAG_LEN, UnprotectedAead
from mlxceld.wire.frames import HEADER_LEN

from helpers.wire import FUZZ

SECRET = bytes(range(32))
SUITES = [Suite.AES_256_GCM, Suite.CHACHA20_POLY1305, Suite.UNPROTECTED]
PAYLOADS = [b"", b"x", bytes(range(256)) * 20, b"\xab" * 12_295,
            bytes(300_000)]


def stream_of(suite: Suite, payloads: list[bytes]) -> bytes:
    sender = FrameSender(suite, SECRET)
    return b"".join(sender.seal(Kind.MESSAGE, p) for p in payloads)


def received(suite: Suite, pieces: Iterator[bytes | bytearray | memoryview]) -> list[Frame]:
    receiver = FrameReceiver(suite, SECRET)
    frames = []
    for piece in pieces:
        receiver.feed(piece)
        while (frame := receiver.next_frame()) is not None:
            frames.append(frame)
    assert receiver.buffered == 0
    return frames


def cut(data: bytes, sizes: list[int]) -> Iterator[bytes]:
    at, i = 0, 0
    while at < len(data):
        n = sizes[i % len(sizes)]
        yield data[at:at + n]
        at, i = at + n, i + 1


def header_apart(data: bytes) -> Iterator[bytes]:
    """Each header on its own, then its body in one piece."""
    at = 0
    while at < len(data):
        body_len = int.from_bytes(data[at + 1:at + HEADER_LEN], "big")
        yield data[at:at + HEADER_LEN]
        yield data[at + HEADER_LEN:at + HEADER_LEN + body_len]
        at += HEADER_LEN + body_len


CUTS: dict[str, Callable[[bytes], Iterator[bytes | bytearray | memoryview]]] = {
    "whole": lambda d: iter([d]),
    "header apart": header_apart,
    "64 KiB": lambda d: cut(d, [64 << 10]),
    "odd sizes": lambda d: cut(d, [1, 4, 5, 4095, 4096, 4097, 70_001]),
    "bytearrays": lambda d: (bytearray(p) for p in cut(d, [3, 5000])),
    "memoryviews": lambda d: (memoryview(p) for p in cut(d, [4096, 17])),
}


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name.lower())
@pytest.mark.parametrize("how", list(CUTS))
def test_any_cut_gives_the_same_frames(suite: Suite, how: str) -> None:
    frames = received(suite, CUTS[how](stream_of(suite, PAYLOADS)))
    assert [f.payload for f in frames] == PAYLOADS
    assert all(f.kind is Kind.MESSAGE and type(f.payload) is bytes for f in frames)


def test_a_large_body_byte_by_byte() -> None:
    payload = bytes(range(256)) * 64  # 16 KiB: a trickle, every byte its own feed
    frames = received(Suite.AES_256_GCM,
                      cut(stream_of(Suite.AES_256_GCM, [payload, b"next"]), [1]))
    assert [f.payload for f in frames] == [payload, b"next"]


@FUZZ
@given(st.lists(st.binary(max_size=9000), min_size=1, max_size=4),
       st.lists(st.integers(1, 10_000), min_size=1, max_size=8),
       st.sampled_from(["bytes", "bytearray", "memoryview"]))
def test_random_cuts(payloads: list[bytes], sizes: list[int], kind: str) -> None:
    wrap = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}[kind]
    data = stream_of(Suite.AES_256_GCM, payloads)
    frames = received(Suite.AES_256_GCM, (wrap(p) for p in cut(data, sizes)))
    assert [f.payload for f in frames] == payloads


def test_a_fed_buffer_may_be_reused_at_once() -> None:
    data = stream_of(Suite.AES_256_GCM, [b"A" * 9000])
    receiver = FrameReceiver(Suite.AES_256_GCM, SECRET)
    scratch = bytearray(data)
    receiver.feed(scratch)
    scratch[:] = bytes(len(scratch))  # a shell reusing its read buffer
    frame = receiver.next_frame()
    assert frame is not None and frame.payload == b"A" * 9000


def test_a_trickle_costs_no_more_memory_than_its_bytes() -> None:
    """The pieces of an incomplete frame are copied together, not kept one object each."""
    limits = FrameLimits(max_frame_len=1 << 20)
    receiver = FrameReceiver(Suite.AES_256_GCM, SECRET, limits)
    receiver.feed(bytes([1]) + (1 << 20).to_bytes(4, "big"))  # a large body announced
    fed = 200_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(fed // 100):
            receiver.feed(b"x" * 100)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert receiver.next_frame() is None
    assert grown < 2 * fed, grown


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name.lower())
def test_a_rekey_and_its_message_come_in_one_buffer(suite: Suite) -> None:
    limits = FrameLimits(send_frames=3)
    sender = FrameSender(suite, SECRET, limits)
    receiver = FrameReceiver(suite, SECRET, limits)
    out = [sender.seal(Kind.MESSAGE, f"m{i}".encode()) for i in range(4)]
    assert [len(o) for o in out] == [HEADER_LEN + 2 + TAG_LEN] * 2 + [
        2 * HEADER_LEN + 2 + 2 * TAG_LEN, HEADER_LEN + 2 + TAG_LEN]
    kinds = received_kinds(receiver, b"".join(out))
    assert kinds == [Kind.MESSAGE, Kind.MESSAGE, Kind.KEY_UPDATE, Kind.MESSAGE, Kind.MESSAGE]


def received_kinds(receiver: FrameReceiver, data: bytes) -> list[Kind]:
    receiver.feed(data)
    kinds = []
    while (frame := receiver.next_frame()) is not None:
        kinds.append(frame.kind)
    return kinds


def test_seal_takes_any_contiguous_buffer() -> None:
    sender = FrameSender(Suite.AES_256_GCM, SECRET)
    wide = memoryview(bytes(range(8))).cast("I")  # two 4-byte items, 8 bytes
    receiver = FrameReceiver(Suite.AES_256_GCM, SECRET)
    receiver.feed(sender.seal(Kind.MESSAGE, wide))
    frame = receiver.next_frame()
    assert frame is not None and frame.payload == bytes(range(8))


def test_the_null_aead_wants_an_exact_buffer_as_the_ciphers_do() -> None:
    out = bytearray(b"\xff" * (2 + 5 + TAG_LEN))
    UnprotectedAead().seal_into(bytes(12), b"hello", b"", memoryview(out)[2:])
    assert out == b"\xff\xffhello" + bytes(TAG_LEN)
    with pytest.raises(ValueError, match="21 bytes"):
        UnprotectedAead().seal_into(bytes(12), b"hello", b"", memoryview(out)[1:])
