"""MXCL channel 3 (agent): a tensor-parallel group across hosts (``--tp-peers``).

Rank 0's daemon (the router's host) forms the group by asking each rank host's agent,
in two questions, one answer each (``mlxceld.net.agent.ask``); the exchange, its
deadlines and what a rank host does are described where they are served and asked,
``cluster/tensor_rank.py`` and ``daemon/tensor_peers.py``.

=============== ================= =====================================================
type            direction         header fields
=============== ================= =====================================================
tensor_reserve  rank 0 → rank     ``model``: the model's identity (64 hex digits);
                                  ``rank``: 1 .. ``size`` - 1; ``size``: 2 .. MAX_SIZE
tensor_reserved rank → rank 0     ``ring``: the ``host:port`` this rank's ring endpoint
                                  binds (its agent's IP, a port kept free for it);
                                  ``host`` (optional): what the host says of its RDMA,
                                  ``{system, macos, jaccl, devices}``
                                  (``engine/transport.py``: ``report_json``)
tensor_join     rank 0 → rank     ``model``, ``rank``; ``hosts``: the ring, one
                                  ``host:port`` per rank, rank 0 first; ``max_batch``;
                                  ``layers`` (optional): ``[start, end)``, the group
                                  is a pipeline stage's (its rank 0 the ``stage``
                                  worker), with ``node_id``: that stage's node
tensor_joined   rank → rank 0     ``rank``: the rank whose worker now starts
=============== ================= =====================================================

``error`` (``messages.Error``) may answer either question (another model, a daemon
that is not a rank host, a rank out of the group). ``from_wire`` checks every field and
raises ``MessageError`` naming the first one out of bounds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.wire.messages import Error, MessageError, vocabulary

MAX_SIZE: Final = 16  # the most ranks of a group (models/tensor.py's MAX_TP_SIZE)
MAX_BATCH: Final = 4096
MAX_ADDRESS: Final = 300  # a host:port's characters
MAX_LAYER: Final = 100_000  # past any model's layer count
MAX_NODE_ID: Final = 200
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _int(header: Mapping[str, Any], name: str, low: int, high: int, what: str) -> int:
    value = header.get(name)
    if type(value) is not int or not low <= value <= high:  # a bool is no count
        raise MessageError(name, f"{what} field {name!r} must be an integer from {low} to "
                                 f"{high}")
    return value


def _model(header: Mapping[str, Any], what: str) -> str:
    value = header.get("model")
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise MessageError("model", f"{what} field 'model' must be a model identity (64 "
                                    "lowercase hex digits)")
    return value


def _address(value: object, name: str, what: str) -> str:
    if not isinstance(value, str) or not 3 <= len(value) <= MAX_ADDRESS or ":" not in value:
        raise MessageError(name, f"{what} field {name!r} must be host:port")
    return value


@dataclass(frozen=True)
class TensorReserve:
    """Keep a ring port for ``rank`` of a ``size``-rank group over ``model``."""

    T: ClassVar[str] = "tensor_reserve"
    model: str
    rank: int
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "model": self.model, "rank": self.rank, "size": self.size}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        size = _int(header, "size", 2, MAX_SIZE, cls.T)
        return cls(_model(header, cls.T), _int(header, "rank", 1, size - 1, cls.T), size)


@dataclass(frozen=True)
class TensorReserved:
    """The answer: where this rank's ring endpoint binds, and the host's RDMA report
    (checked by its reader, ``engine.transport.report_from_json``; None: not sent)."""

    T: ClassVar[str] = "tensor_reserved"
    ring: str
    host: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "ring": self.ring,
                **({"host": self.host} if self.host is not None else {})}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        host = header.get("host")
        if host is not None and not isinstance(host, dict):
            raise MessageError("host", f"{cls.T} field 'host' must be an object")
        return cls(_address(header.get("ring"), "ring", cls.T), host)


@dataclass(frozen=True)
class TensorJoin:
    """Start rank ``rank``'s worker in the ring at ``hosts`` (rank 0 first); with
    ``layers``, of the pipeline stage ``node_id`` holding those layers [start, end)."""

    T: ClassVar[str] = "tensor_join"
    model: str
    rank: int
    hosts: tuple[str, ...]
    max_batch: int
    layers: tuple[int, int] | None = None
    node_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        stage = ({"layers": list(self.layers), "node_id": self.node_id}
                 if self.layers is not None else {})
        return {"t": self.T, "model": self.model, "rank": self.rank,
                "hosts": list(self.hosts), "max_batch": self.max_batch, **stage}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        hosts = header.get("hosts")
        if not isinstance(hosts, list) or not 2 <= len(hosts) <= MAX_SIZE:
            raise MessageError("hosts", f"{cls.T} field 'hosts' must list 2 to {MAX_SIZE} "
                                        "host:port")
        ring = tuple(_address(h, "hosts", cls.T) for h in hosts)
        if len(set(ring)) != len(ring):
            raise MessageError("hosts", f"{cls.T} field 'hosts' names a host:port twice")
        return cls(_model(header, cls.T), _int(header, "rank", 1, len(ring) - 1, cls.T),
                   ring, _int(header, "max_batch", 1, MAX_BATCH, cls.T),
                   *_stage(header, cls.T))


def _stage(header: Mapping[str, Any], what: str) -> tuple[tuple[int, int] | None, str | None]:
    """A stage's group: its ``layers`` [start, end) and ``node_id``; (None, None) when
    ``layers`` is not said (a whole model's group)."""
    layers = header.get("layers")
    if layers is None:
        return None, None
    if (not isinstance(layers, list) or len(layers) != 2
            or not all(type(n) is int for n in layers)
            or not 0 <= layers[0] < layers[1] <= MAX_LAYER):
        raise MessageError("layers", f"{what} field 'layers' must be [start, end) with 0 <= "
                                     f"start < end <= {MAX_LAYER}")
    node = header.get("node_id")
    if not isinstance(node, str) or not 1 <= len(node) <= MAX_NODE_ID:
        raise MessageError("node_id", f"{what} field 'node_id' must name the stage's node "
                                      f"(1 to {MAX_NODE_ID} characters) beside 'layers'")
    return (layers[0], layers[1]), node


@dataclass(frozen=True)
class TensorJoined:
    """The answer: rank ``rank``'s worker starts (it joins the ring within the ring's
    deadline)."""

    T: ClassVar[str] = "tensor_joined"
    rank: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "rank": self.rank}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_int(header, "rank", 1, MAX_SIZE - 1, cls.T))


# The exchange's vocabularies by direction (``error`` answers too).
TENSOR_ASKED: Final = vocabulary(TensorReserve, TensorJoin)
TENSOR_ANSWERED: Final = vocabulary(TensorReserved, TensorJoined, Error)
