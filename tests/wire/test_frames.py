"""The frame codec's buffers: sealing makes one buffer per call."""

from __future__ import annotations

import pytest

from mlxceld.wire import FrameLimits, FrameReceiver, FrameSender, Kind, Suite
from mlxceld.wire.crypto import TAG_LEN, UnprotectedAead
from mlxceld.wire.frames import HEADER_LEN

SECRET = bytes(range(32))
SUITES = [Suite.AES_256_GCM, Suite.CHACHA20_POLY1305, Suite.UNPROTECTED]


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
    with pytest.raises(ValueError, match="21 bytes"):
        UnprotectedAead().seal_into(bytes(12), b"hello", b"", memoryview(bytearray(22)))
