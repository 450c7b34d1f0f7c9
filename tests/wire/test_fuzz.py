"""Parsers under hypothesis: any input gives a clean result or one of our wire exceptions."""

from __future__ import annotations

import contextlib
import json
import os
import struct

from hypothesis import given
from hypothesis import strategies as st

from mlxceld.wire import (
    Channel,
    Connection,
    FrameReceiver,
    MessageSpec,
    RemoteProtocolError,
    Role,
    Suite,
    TensorSpec,
    key_id,
    parse_envelope,
)
from mlxceld.wire.hello import ClientHello

from helpers.keys import keyring
from helpers.wire import FUZZ, IDENTITY, SECRET, connected

GOOD_HELLO = ClientHello(1, 1, 1, key_id(SECRET), bytes(32), bytes(range(1, 33)),
                         IDENTITY).encode()


def _server() -> Connection:
    return Connection(Role.SERVER, keyring=keyring(SECRET), random=os.urandom, now=0,
                      peer_ip="127.0.0.2")


def _mutated(base: bytes) -> st.SearchStrategy[bytes]:
    return st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)),
                    max_size=4).map(lambda edits: _apply(base, edits))


def _apply(base: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(base)
    for i, b in edits:
        out[i] = b
    return bytes(out)


@FUZZ
@given(st.one_of(st.binary(max_size=400), _mutated(GOOD_HELLO),
                 st.binary(max_size=300).map(lambda b: GOOD_HELLO[:82] + b)),
       st.integers(1, 50))
def test_hello_parser(data: bytes, chunk: int) -> None:
    server = _server()
    try:
        for i in range(0, len(data), chunk):
            server.receive_data(data[i:i + chunk], 0)
    except RemoteProtocolError as exc:
        assert exc.kind and exc.reason
        assert server.data_to_send() in (b"", b"\x01\x01", b"\x02\x01", b"\x03\x01", b"\x04\x01")


@FUZZ
@given(st.binary(max_size=200))
def test_client_side_server_hello_parser(data: bytes) -> None:
    client = Connection(Role.CLIENT, keyring=keyring(SECRET), random=os.urandom, now=0,
                        channel=Channel.TRANSPORT, identity=IDENTITY)
    with contextlib.suppress(RemoteProtocolError):
        client.receive_data(data, 0)


SECRET_TS = bytes(range(32))


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([Suite.AES_256_GCM, Suite.CHACHA20_POLY1305,
                                                 Suite.UNPROTECTED]))
def test_frame_parser(data: bytes, suite: Suite) -> None:
    receiver = FrameReceiver(suite, SECRET_TS)
    try:
        receiver.feed(data)
        while receiver.next_frame() is not None:
            pass
    except RemoteProtocolError:
        pass


@FUZZ
@given(st.data())
def test_frame_parser_on_altered_frames(data: st.DataObject) -> None:
    client, server = connected()
    client.send_message(data.draw(st.binary(max_size=64)))
    frame = data.draw(_mutated(client.data_to_send()))
    with contextlib.suppress(RemoteProtocolError):
        server.receive_data(frame, 0)


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


@FUZZ
@given(HEADERS, st.binary(max_size=40), st.integers(-3, 3))
def test_envelope_parser(header: bytes, blobs: bytes, skew: int) -> None:
    payload = struct.pack(">I", max(0, len(header) + skew)) + header + blobs
    for candidate in (payload, blobs):
        try:
            env = parse_envelope(candidate, SPECS)
        except RemoteProtocolError:
            continue
        assert env.type in SPECS
