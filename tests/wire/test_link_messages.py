"""The link test's messages (wire/link_messages.py): each header and back, a blob within
the envelope's bounds, and every field out of bounds refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.types import MAX_LINK_MIB
from mlxceld.wire import EnvelopeError, encode_envelope, parse_envelope
from mlxceld.wire.link_messages import (
    BLOB,
    CHUNK,
    DATA_SPEC,
    LINK_ANSWERED,
    LINK_ASKED,
    MAX_PULL,
    PUSH_SPEC,
    LinkAck,
    LinkData,
    LinkPull,
    LinkPush,
)
from mlxceld.wire.messages import MessageError, decode


@pytest.mark.parametrize(("message", "header"), [
    (LinkPush(0), {"t": "link_push", "seq": 0}),
    (LinkAck(3, CHUNK), {"t": "link_ack", "seq": 3, "bytes": CHUNK}),
    (LinkPull(MAX_PULL), {"t": "link_pull", "bytes": MAX_PULL, "chunk": CHUNK}),
    (LinkPull(5, 2), {"t": "link_pull", "bytes": 5, "chunk": 2}),
    (LinkData(7), {"t": "link_data", "seq": 7}),
])
def test_each_message_goes_out_as_its_header_and_comes_back(message: Any,
                                                            header: dict[str, Any]) -> None:
    assert message.to_wire() == header
    assert type(message).from_wire(header) == message
    assert decode(header, LINK_ASKED | LINK_ANSWERED) == message


@pytest.mark.parametrize(("kind", "header", "field"), [
    (LinkPull, {"t": "link_pull", "bytes": MAX_PULL + 1, "chunk": CHUNK}, "bytes"),
    (LinkPull, {"t": "link_pull", "bytes": 0, "chunk": CHUNK}, "bytes"),
    (LinkPull, {"t": "link_pull", "bytes": True, "chunk": CHUNK}, "bytes"),
    (LinkPull, {"t": "link_pull", "bytes": 10, "chunk": CHUNK + 1}, "chunk"),
    (LinkPull, {"t": "link_pull", "bytes": 10}, "chunk"),
    (LinkPush, {"t": "link_push", "seq": -1}, "seq"),
    (LinkAck, {"t": "link_ack", "seq": 1, "bytes": CHUNK + 1}, "bytes"),
    (LinkData, {"t": "link_data", "seq": "1"}, "seq"),
])
def test_a_field_out_of_bounds_is_refused_by_name(kind: Any, header: dict[str, Any],
                                                  field: str) -> None:
    with pytest.raises(MessageError) as err:
        kind.from_wire(header)
    assert err.value.field == field and repr(field) in str(err.value)


def test_a_blob_is_one_to_chunk_bytes() -> None:
    for spec, message in ((PUSH_SPEC, LinkPush(0)), (DATA_SPEC, LinkData(0))):
        for size in (1, CHUNK):
            payload = encode_envelope(message.to_wire(), [(BLOB, "u8", (size,), bytes(size))])
            got = parse_envelope(payload, {message.T: spec})
            assert len(got.tensors[BLOB].data) == size
        for size in (0, CHUNK + 1):
            payload = encode_envelope(message.to_wire(), [(BLOB, "u8", (size,), bytes(size))])
            with pytest.raises(EnvelopeError, match=f"dim 0 is {size}"):
                parse_envelope(payload, {message.T: spec})


def test_the_most_mlxctl_asks_is_the_most_a_peer_sends() -> None:
    assert MAX_LINK_MIB << 20 == MAX_PULL
