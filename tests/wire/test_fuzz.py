"""Parsers under hypothesis, and the properties that hold for any input:

- a refusal is a ``RemoteProtocolError`` (an ``EnvelopeError`` for a payload) with a kind
  from ``KINDS`` and a reason, and it leaves the connection broken: closed, no deadline,
  refusing more input and any send, holding only the protocol's answer (a reject, or a
  close frame carrying that reason);
- an input that is not refused has not authenticated anyone and delivered nothing;
- the outcome is the same however the bytes are split (whole, or cut at any boundaries);
- an altered frame never delivers a message (no plaintext out of a forgery);
- what we encode parses back to the same thing.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxceld.wire import (
    Channel,
    Connection,
    ConnectionRole,
    EnvelopeError,
    Event,
    FrameReceiver,
    LocalProtocolError,
    MessageReceived,
    MessageSpec,
    PeerClosed,
    RemoteProtocolError,
    Suite,
    TensorSpec,
    encode_envelope,
    key_id,
    parse_envelope,
)
from mlxceld.wire.errors import KINDS
from mlxceld.wire.frames import Frame
from mlxceld.wire.handshake import PRE_AUTH_MAX
from mlxceld.wire.hello import ClientHello

from helpers.keys import keyring
from helpers.wire import FUZZ, IDENTITY, SECRET, connected, drain

GOOD_HELLO = ClientHello(1, 1, 1, key_id(SECRET), bytes(32), bytes(range(1, 33)),
                         IDENTITY).encode()
# What a server may answer before it is sure of its peer: nothing (noise), or a reject.
REJECTS = (b"", b"\x01\x01", b"\x02\x01", b"\x03\x01", b"\x04\x01")
# How a frame that is not the one sent can be refused (or, cut short, end at EOF).
FRAME_REFUSALS = {"frame_auth_failed", "oversized_frame", "malformed_frame", "abort"}


def _server() -> Connection:
    return Connection(ConnectionRole.SERVER, keyring=keyring(SECRET),
                      random=random.Random(1).randbytes,
                      now=0, peer_ip="127.0.0.2")


def _client() -> Connection:
    """A client whose hello has gone out."""
    client = Connection(ConnectionRole.CLIENT, keyring=keyring(SECRET),
                        random=random.Random(2).randbytes, now=0, channel=Channel.TRANSPORT,
                        identity=IDENTITY)
    assert client.data_to_send().startswith(b"MXCL")
    return client


@dataclass(frozen=True)
class Outcome:
    """Everything a connection shows after some input: comparable across splits."""

    events: list[Event]
    refused: tuple[str, str] | None  # (kind, reason)
    answer: bytes
    established: bool
    closed: bool
    deadline: float | None


def feed(make: Callable[[], Connection], data: bytes, cuts: list[int]) -> tuple[Connection,
                                                                                Outcome]:
    """A new connection fed ``data`` in pieces ending at ``cuts`` (and at its end)."""
    conn = make()
    refused = None
    bounds = sorted({c for c in cuts if 0 < c < len(data)} | {len(data)})
    start = 0
    try:
        for end in bounds if data else []:
            conn.receive_data(data[start:end], 0)
            start = end
    except RemoteProtocolError as exc:
        refused = exc.kind, exc.reason
    return conn, Outcome(drain(conn), refused, conn.data_to_send(), conn.established,
                         conn.closed, conn.next_deadline())


def assert_refusal_is_final(conn: Connection, outcome: Outcome) -> None:
    assert outcome.refused is not None
    kind, reason = outcome.refused
    assert kind in KINDS and reason
    assert outcome.closed and not outcome.established and outcome.deadline is None
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"more", 0)
    with pytest.raises(LocalProtocolError):
        conn.send_message(b"anything")
    assert conn.data_to_send() == b"" and conn.next_event() is None


def _mutated(base: bytes) -> st.SearchStrategy[bytes]:
    return st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)),
                    max_size=4).map(lambda edits: _apply(base, edits))


def _apply(base: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(base)
    for i, b in edits:
        out[i] = b
    return bytes(out)


CUTS = st.lists(st.integers(1, 500), max_size=12)


@FUZZ
@given(st.one_of(st.binary(max_size=400), _mutated(GOOD_HELLO),
                 st.binary(max_size=300).map(lambda b: GOOD_HELLO[:82] + b)), CUTS)
def test_hello_parser(data: bytes, cuts: list[int]) -> None:
    conn, outcome = feed(_server, data, cuts)
    whole = feed(_server, data, [])[1]
    if len(data) <= PRE_AUTH_MAX:
        assert outcome == whole  # the same, whole or in pieces
    else:  # more at once than a hello and its ClientAuth: noise, before any parsing
        assert whole.refused is not None and whole.refused[0] == "noise"
        assert whole.answer == b""
    assert outcome.events == []  # a hello alone never authenticates a client
    if outcome.refused is None:
        assert not outcome.closed and outcome.deadline is not None
        return
    assert_refusal_is_final(conn, outcome)
    assert outcome.answer in REJECTS


@FUZZ
@given(st.binary(max_size=200), CUTS)
def test_client_side_server_hello_parser(data: bytes, cuts: list[int]) -> None:
    conn, outcome = feed(_client, data, cuts)
    assert outcome == feed(_client, data, [])[1]
    assert outcome.events == [] and not outcome.established  # nobody forges the server
    assert outcome.answer == b""  # no server's hello passes, so no ClientAuth
    if outcome.refused is None:
        assert not outcome.closed and outcome.deadline is not None
        return
    assert_refusal_is_final(conn, outcome)


SECRET_TS = bytes(range(32))


def frames_of(suite: Suite, data: bytes, cuts: list[int]) -> tuple[list[Frame], str | None]:
    """The frames a fresh receiver opens from ``data`` fed in pieces, and its refusal."""
    receiver = FrameReceiver(suite, SECRET_TS)
    frames: list[Frame] = []
    bounds = sorted({c for c in cuts if 0 < c < len(data)} | {len(data)})
    start = 0
    try:
        for end in bounds:
            receiver.feed(data[start:end])
            start = end
            while (frame := receiver.next_frame()) is not None:
                frames.append(frame)
    except RemoteProtocolError as exc:
        assert exc.kind in KINDS and exc.reason
        return frames, exc.kind
    return frames, None


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([Suite.AES_256_GCM, Suite.CHACHA20_POLY1305,
                                                 Suite.UNPROTECTED]), CUTS)
def test_frame_parser(data: bytes, suite: Suite, cuts: list[int]) -> None:
    frames, refused = frames_of(suite, data, cuts)
    assert (frames, refused) == frames_of(suite, data, [])
    if suite is not Suite.UNPROTECTED:
        assert frames == []  # random bytes never authenticate
    else:  # the body in clear before a zero tag: nothing else comes out
        for frame in frames:
            assert frame.payload in data
    assert refused in (None, "frame_auth_failed", "oversized_frame", "malformed_frame",
                       "unknown_frame_kind")


@FUZZ
@given(st.data())
def test_frame_parser_on_altered_frames(data: st.DataObject) -> None:
    client, server = connected()
    payload = data.draw(st.binary(max_size=64))
    client.send_message(payload)
    sent = client.data_to_send()
    frame = data.draw(_mutated(sent))
    conn, outcome = feed(lambda: server, frame, data.draw(CUTS))
    if frame == sent:
        assert outcome.events == [MessageReceived(payload)] and outcome.refused is None
        return
    if outcome.refused is None:  # a longer length: the frame waits for bytes that never come
        assert outcome.events == []
        with pytest.raises(RemoteProtocolError) as eof:
            conn.receive_data(b"", 0)
        outcome = Outcome(drain(conn), (eof.value.kind, eof.value.reason),
                          conn.data_to_send(), conn.established, conn.closed,
                          conn.next_deadline())
    assert not any(isinstance(e, MessageReceived) for e in outcome.events)
    assert outcome.refused is not None and outcome.refused[0] in FRAME_REFUSALS
    assert_refusal_is_final(conn, outcome)
    # The answer is a close frame with the reason, which the peer opens.
    client.receive_data(outcome.answer, 0)
    assert drain(client) == [PeerClosed(outcome.refused[1])]
    if len(payload) >= 8:
        assert payload not in outcome.answer and payload not in outcome.refused[1].encode()


@FUZZ
@given(st.lists(st.binary(max_size=3000), max_size=6), st.lists(st.booleans(), max_size=6),
       CUTS, st.text(max_size=20))
def test_messages_survive_any_split(payloads: list[bytes], updates: list[bool],
                                    cuts: list[int], reason: str) -> None:
    """A stream of messages (key updates between some), then a close, cut anywhere."""
    client, server = connected()
    for i, payload in enumerate(payloads):
        client.send_message(payload)
        if i < len(updates) and updates[i]:
            client.key_update()
    client.close(reason)
    conn, outcome = feed(lambda: server, client.data_to_send(), [c * 7 for c in cuts])
    assert outcome.refused is None
    messages = [e.payload for e in outcome.events if isinstance(e, MessageReceived)]
    assert messages == payloads
    assert outcome.events[-1] == PeerClosed(reason) and conn.their_closed


SPECS = {"ping": MessageSpec(),
         "act": MessageSpec({"h": TensorSpec(frozenset({"f16", "u8"}), ((0, 4), (0, 4)))})}
HEADERS = st.one_of(
    st.binary(max_size=80),
    st.sampled_from([b'{"t":"ping"}', b'{"t":"act","tensors":[{"name":"h","dtype":"u8",'
                     b'"shape":[2,3]}]}', b'{"t":"act","tensors":[]}', b"[1,2]", b"null"]),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                     max_size=3),
                 max_leaves=8).map(lambda j: json.dumps(j).encode()),
)


def reencoded(env: Any) -> bytes:
    header = {k: v for k, v in env.header.items() if k != "tensors"}
    return encode_envelope(header, [(t.name, t.dtype, t.shape, t.data)
                                    for t in env.tensors.values()])


@FUZZ
@given(HEADERS, st.binary(max_size=40), st.integers(-3, 3))
def test_envelope_parser(header: bytes, blobs: bytes, skew: int) -> None:
    payload = struct.pack(">I", max(0, len(header) + skew)) + header + blobs
    for candidate in (payload, blobs):
        try:
            env = parse_envelope(candidate, SPECS)
        except EnvelopeError as exc:
            assert exc.kind == "bad_envelope" and exc.reason
            continue
        assert env.type in SPECS and env.header["t"] == env.type
        assert set(env.tensors) <= set(SPECS[env.type].tensors)
        again = parse_envelope(reencoded(env), SPECS)  # what we read, we can write back
        assert (again.type, again.header) == (env.type, env.header)
        assert {n: bytes(t.data) for n, t in again.tensors.items()} == \
            {n: bytes(t.data) for n, t in env.tensors.items()}
        # The blobs are the payload's last bytes, in the header's order.
        tail = b"".join(bytes(t.data) for t in env.tensors.values())
        assert candidate.endswith(tail)


FIELDS = st.dictionaries(st.text(max_size=5).filter(lambda k: k not in ("t", "tensors")),
                         st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                         max_size=3)


@FUZZ
@given(FIELDS, st.integers(0, 4), st.integers(0, 4), st.sampled_from(["f16", "u8"]),
       st.data())
def test_envelopes_round_trip(fields: dict[str, Any], rows: int, cols: int, dtype: str,
                              data: st.DataObject) -> None:
    blob = data.draw(st.binary(min_size=rows * cols * (2 if dtype == "f16" else 1),
                               max_size=rows * cols * (2 if dtype == "f16" else 1)))
    payload = encode_envelope({"t": "act", **fields}, [("h", dtype, (rows, cols), blob)])
    env = parse_envelope(payload, SPECS)
    assert env.type == "act" and {k: env.header[k] for k in fields} == fields
    h = env.tensors["h"]
    assert (h.dtype, h.shape, bytes(h.data)) == (dtype, (rows, cols), blob)
    ping = parse_envelope(encode_envelope({"t": "ping", **fields}), SPECS)
    assert ping.tensors == {} and ping.header == {"t": "ping", **fields}

