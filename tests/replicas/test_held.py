"""The rule of a decode node's held handoffs (``replicas/held.py``), fed frames and the
time: what is held, for how long, within which bounds, and what is remembered."""

from __future__ import annotations

from mlxceld.replicas.held import REMEMBERED, HeldHandoffs
from mlxceld.wire import Envelope, MessageSpec, TensorSpec, encode_envelope, parse_envelope

PEER = "127.0.0.2:19100"
SPEC = MessageSpec({"k0": TensorSpec(frozenset({"u8"}), ((0, 1 << 20),), required=False)})


def frame(seq: str, size: int, part: int = 0) -> Envelope:
    return parse_envelope(encode_envelope(
        {"t": "handoff", "seq": seq, "part": part, "parts": 2},
        [("k0", "u8", (size,), bytes(size))]), {"handoff": SPEC})


def test_frames_are_held_in_order_until_taken_and_expire_after_hold_s() -> None:
    rule = HeldHandoffs(hold_s=3.0)
    assert rule.hold("s1", PEER, frame("s1", 10), now=100.0) is None
    assert rule.hold("s1", PEER, frame("s1", 20, part=1), now=101.0) is None
    assert rule.hold("s2", PEER, frame("s2", 5), now=102.0) is None
    assert "s1" in rule and len(rule) == 2 and rule.next_deadline() == 103.0
    assert rule.expired(102.9) == [] and rule.expired(103.0) == ["s1"]
    held = rule.take("s1")
    assert held is not None and held.peer == PEER and held.size == 30
    assert [f.header["part"] for f in held.frames] == [0, 1]
    assert rule.take("s1") is None and rule.expired(200.0) == ["s2"]


def test_past_the_count_or_the_bytes_a_frame_is_refused_and_its_sequence_let_go() -> None:
    rule = HeldHandoffs(sequences=2, max_bytes=100)
    assert rule.hold("s1", PEER, frame("s1", 40), now=0.0) is None
    assert rule.hold("s2", PEER, frame("s2", 40), now=0.0) is None
    why = rule.hold("s3", PEER, frame("s3", 1), now=0.0)
    assert why is not None and "2 sequences' handoffs are held already" in why
    why = rule.hold("s1", PEER, frame("s1", 30, part=1), now=0.0)
    assert why is not None and "would pass 100 bytes" in why
    assert "s1" not in rule and rule.gone("s1") == why and rule.gone("s3") is not None
    # s1's later frames are refused at once, for the same reason; s2 is still held, and
    # the bytes s1 held are free again.
    assert rule.hold("s1", PEER, frame("s1", 1, part=1), now=0.0) == why
    assert rule.hold("s4", PEER, frame("s4", 60), now=0.0) is None


def test_a_sequence_held_from_one_sender_refuses_another_senders_frames() -> None:
    rule = HeldHandoffs()
    assert rule.hold("s1", PEER, frame("s1", 1), now=0.0) is None
    assert rule.hold("s1", "127.0.0.9:1", frame("s1", 1, part=1), now=0.0) == \
        "another node sends frames of that sequence"
    held = rule.get("s1")
    assert held is not None and len(held.frames) == 1


def test_the_sequences_let_go_are_remembered_up_to_the_bound() -> None:
    rule = HeldHandoffs()
    for i in range(REMEMBERED + 1):
        rule.drop(f"s{i}", f"why {i}")
    assert rule.gone("s0") is None and rule.gone("s1") == "why 1"
    assert rule.gone(f"s{REMEMBERED}") == f"why {REMEMBERED}"
