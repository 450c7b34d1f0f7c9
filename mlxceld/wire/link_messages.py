"""MXCL channel 3 (agent): the link test's messages (`mlxctl cluster link-test`).

The exchange and its deadlines are described where it is served and asked,
``net/link.py``. Unlike the other channel-3 exchanges (``agent_messages``: one
question, one answer) it is one stream carrying many messages: the round trips are
the ``ping``/``pong`` every stream answers (``messages.py``), then these four:

========= ============== ======================================================
type      direction      header fields (and blob)
========= ============== ======================================================
link_push asker → peer   ``seq``: its index in the upload; blob ``data``: 1 to
                         ``CHUNK`` bytes (``u8``)
link_ack  peer → asker   ``seq``: the push it answers; ``bytes``: its blob's size
link_pull asker → peer   ``bytes``: how many to send back, 1 to ``MAX_PULL``;
                         ``chunk``: the most in one ``link_data``, 1 to ``CHUNK``
link_data peer → asker   ``seq``: its index in the download; blob ``data``
========= ============== ======================================================

``from_wire`` checks every field and raises ``MessageError`` naming the first one out
of bounds (a peer answers a refused ``link_pull`` with ``error``, the field named in
its reason); the blobs' bounds are the envelope's (``PUSH_SPEC``, ``DATA_SPEC``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.wire.envelope import MessageSpec, TensorSpec
from mlxceld.wire.messages import Error, MessageError, Pong, vocabulary

CHUNK: Final = 1 << 20  # the largest blob of one link_push or link_data: 1 MiB
MAX_PULL: Final = 64 << 20  # the most bytes one link_pull asks a peer to send: 64 MiB
MAX_SEQ: Final = 2**31  # a seq is an integer in [0, MAX_SEQ)
BLOB: Final = "data"  # the blob's name in link_push and link_data
_BLOB_SPEC: Final = TensorSpec(frozenset({"u8"}), ((1, CHUNK),))
PUSH_SPEC: Final = MessageSpec({BLOB: _BLOB_SPEC})
DATA_SPEC: Final = MessageSpec({BLOB: _BLOB_SPEC})


def _count(header: Mapping[str, Any], name: str, low: int, high: int, what: str) -> int:
    value = header.get(name)
    if type(value) is not int or not low <= value <= high:  # a bool is no count
        raise MessageError(name, f"{what} field {name!r} must be an integer from {low} to "
                                 f"{high}")
    return value


@dataclass(frozen=True)
class LinkPush:
    """Chunk ``seq`` of the bytes sent to the peer (its blob travels beside the header)."""

    T: ClassVar[str] = "link_push"
    seq: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_count(header, "seq", 0, MAX_SEQ - 1, cls.T))


@dataclass(frozen=True)
class LinkAck:
    """The peer took push ``seq``, ``bytes`` long."""

    T: ClassVar[str] = "link_ack"
    seq: int
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq, "bytes": self.bytes}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_count(header, "seq", 0, MAX_SEQ - 1, cls.T),
                   _count(header, "bytes", 1, CHUNK, cls.T))


@dataclass(frozen=True)
class LinkPull:
    """Send ``bytes`` back, at most ``chunk`` in one ``link_data``."""

    T: ClassVar[str] = "link_pull"
    bytes: int
    chunk: int = CHUNK

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "bytes": self.bytes, "chunk": self.chunk}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_count(header, "bytes", 1, MAX_PULL, cls.T),
                   _count(header, "chunk", 1, CHUNK, cls.T))


@dataclass(frozen=True)
class LinkData:
    """Chunk ``seq`` of the bytes a ``link_pull`` asked for (its blob beside the header)."""

    T: ClassVar[str] = "link_data"
    seq: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_count(header, "seq", 0, MAX_SEQ - 1, cls.T))


# The link test's vocabularies by direction (``pong`` and ``error`` answer too).
LINK_ASKED: Final = vocabulary(LinkPush, LinkPull)
LINK_ANSWERED: Final = vocabulary(LinkAck, LinkData, Pong, Error)
