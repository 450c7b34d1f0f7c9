"""MXCL channel 2 (assignment): the messages of the two-phase stage assignment.

What each one means, who sends it and when is ``cluster/assignment/push.py``'s table;
how a peer judges an offer is ``cluster/assignment/offers.py``. Every message carries
``epoch``, the plan's. ``to_wire`` gives the header as it has always gone out: ``t``,
``epoch``, then the fields in the order below, an optional one left out when it is
empty. ``from_wire`` checks every field a receiver reads and raises ``MessageError``
naming the first one out of bounds. ``error`` (``messages.Error``) may come instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.wire.messages import Error, MessageError, field, optional, vocabulary

MAX_TOML: Final = 64 * 1024


MAX_GROUP: Final = 16  # the most ranks of a stage's tensor group (models/tensor.py's)
MAX_AGENT: Final = 300  # an agent address's characters in ``tp_group``


@dataclass(frozen=True)
class Offer:
    """Coordinator to peer: run stage ``stage`` (its layers, its listener port, its node
    id) of the plan in ``toml``. A stage that is a tensor group across hosts (a 2D mesh):
    ``tp_group``, its ranks' agent addresses in rank order, and ``tp_rank``, the peer's
    (rank 0 runs the stage; a rank past 0 the stage's rank on its host, no listener:
    ``port`` 0); both left out of the header without a group."""

    T: ClassVar[str] = "offer"
    epoch: int
    assignment_version: int
    package_version: str
    cluster: str
    model_identity: str
    stage: int
    layers: tuple[int, int]
    node_id: str
    port: int
    coordinator: str
    toml: str
    tp_rank: int = 0
    tp_group: tuple[str, ...] = ()  # () : no group

    def to_wire(self) -> dict[str, Any]:
        header = {"t": self.T, "epoch": self.epoch, "av": self.assignment_version,
                  "version": self.package_version, "cluster": self.cluster,
                  "model": self.model_identity, "stage": self.stage,
                  "layers": list(self.layers), "node": self.node_id, "port": self.port,
                  "coordinator": self.coordinator, "toml": self.toml}
        if self.tp_group:
            header |= {"tp_rank": self.tp_rank, "tp_group": list(self.tp_group)}
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        layers = header.get("layers")
        if (not isinstance(layers, list) or len(layers) != 2
                or not all(type(n) is int for n in layers)):
            raise MessageError("layers", "offer field 'layers' must be [start, end]")
        toml = field(header, "toml", str, "offer")
        if len(toml) > MAX_TOML:
            raise MessageError("toml", f"offer field 'toml' is longer than {MAX_TOML} "
                                       "characters")
        return cls(epoch=field(header, "epoch", int, "offer"),
                   assignment_version=field(header, "av", int, "offer"),
                   package_version=field(header, "version", str, "offer"),
                   cluster=field(header, "cluster", str, "offer"),
                   model_identity=field(header, "model", str, "offer"),
                   stage=field(header, "stage", int, "offer"),
                   layers=(layers[0], layers[1]), node_id=field(header, "node", str, "offer"),
                   port=field(header, "port", int, "offer"),
                   coordinator=field(header, "coordinator", str, "offer"), toml=toml,
                   **_group(header))


def _group(header: Mapping[str, Any]) -> dict[str, Any]:
    """An offer's ``tp_rank`` and ``tp_group``, checked; both absent: no group."""
    group = header.get("tp_group")
    rank = optional(header, "tp_rank", int, "offer")
    if group is None and rank is None:
        return {}
    if (not isinstance(group, list) or not 2 <= len(group) <= MAX_GROUP
            or not all(isinstance(a, str) and 0 < len(a) <= MAX_AGENT for a in group)):
        raise MessageError("tp_group", f"offer field 'tp_group' must be 2 to {MAX_GROUP} "
                                       "agent addresses")
    if rank is None or not 0 <= rank < len(group):
        raise MessageError("tp_rank", f"offer field 'tp_rank' must be a rank of its "
                                      f"{len(group)}-rank tp_group")
    return {"tp_rank": rank, "tp_group": tuple(group)}


@dataclass(frozen=True)
class _Plain:
    """A message with nothing but its epoch."""

    T: ClassVar[str]
    epoch: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T))


@dataclass(frozen=True)
class _Said:
    """A message with its epoch and, optionally, why (left out when empty)."""

    T: ClassVar[str]
    epoch: int
    reason: str = ""

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "epoch": self.epoch}
        if self.reason:
            header["reason"] = self.reason
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T),
                   optional(header, "reason", str, cls.T) or "")


class Commit(_Plain):
    """Coordinator to peer: every peer accepted (the decision is durable)."""

    T = "commit"


class Activate(_Plain):
    """Coordinator to peer: every peer committed; re-sent until active."""

    T = "activate"


class DecisionQuery(_Plain):
    """Either way: what did you decide for this epoch? (``Decision`` answers.)"""

    T = "query"


class Accepted(_Said):
    """Peer to coordinator: the stage is loaded; the vote is durable."""

    T = "accepted"


class Committed(_Said):
    T = "committed"


class Active(_Said):
    """Peer to coordinator: the stage serves."""

    T = "active"


class Aborted(_Said):
    """Peer to coordinator: the standby stage is gone."""

    T = "aborted"


@dataclass(frozen=True)
class Deactivate:
    """Coordinator to peer: the plan ended (`mlxctl cluster deactivate`), and why."""

    T: ClassVar[str] = "deactivate"
    epoch: int
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch, "reason": self.reason}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T), str(header.get("reason", "")))


class Deactivated(_Said):
    """Peer to coordinator: what was done; the stage is stopped."""

    T = "deactivated"


@dataclass(frozen=True)
class Abort:
    """Coordinator to peer: ``summary``, each peer that did not commit and why (none when
    the abort is re-sent over a new connection)."""

    T: ClassVar[str] = "abort"
    epoch: int
    summary: str | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "epoch": self.epoch}
        if self.summary is not None:
            header["summary"] = self.summary
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T),
                   optional(header, "summary", str, cls.T))


@dataclass(frozen=True)
class Preparing:
    """Peer to coordinator, every ``HEARTBEAT_S`` while the stage loads in standby: how far
    (``done`` and ``total`` bytes, ``elapsed_s``, ``step``) once the stage has said."""

    T: ClassVar[str] = "preparing"
    epoch: int
    reason: str = ""
    done: int | None = None
    total: int | None = None
    elapsed_s: float | None = None
    step: str | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "epoch": self.epoch}
        if self.reason:
            header["reason"] = self.reason
        if self.done is not None:
            header.update(done=self.done, total=self.total, elapsed_s=self.elapsed_s,
                          step=self.step)
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        """The load is for the operator's eyes only: one that does not add up is left out
        (``push.peer_load``), never refused."""
        return cls(field(header, "epoch", int, cls.T),
                   optional(header, "reason", str, cls.T) or "", header.get("done"),
                   header.get("total"), header.get("elapsed_s"), header.get("step"))


@dataclass(frozen=True)
class Refused:
    """Peer to coordinator: the offer (or a deactivation) is refused: ``code``, ``reason``,
    ``final`` (True: a retry against the same coordinator cannot succeed)."""

    T: ClassVar[str] = "refused"
    epoch: int
    code: str
    reason: str
    final: bool

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch, "code": self.code, "final": self.final,
                "reason": self.reason}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T), field(header, "code", str, cls.T),
                   field(header, "reason", str, cls.T), header.get("final") is True)


DECISIONS: Final = frozenset({"commit", "activate", "active", "abort", "deactivated",
                              "unknown"})


@dataclass(frozen=True)
class Decision:
    """The answer to ``query``: commit | activate | active | abort | deactivated | unknown
    (never heard of it)."""

    T: ClassVar[str] = "decision"
    epoch: int
    decision: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch, "decision": self.decision}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "epoch", int, cls.T), field(header, "decision", str, cls.T))


FROM_PEER: Final = vocabulary(Preparing, Accepted, Refused, Committed, Active, Aborted,
                              Decision, Deactivated, Error)
FROM_COORDINATOR: Final = vocabulary(Offer, Commit, Activate, Abort, DecisionQuery,
                                     Deactivate)
#: What a peer's round answers, by the round's word (``peer_round.Reply.kind``).
REPLIES: Final = {kind.T: kind for kind in (Accepted, Committed, Active, Aborted,
                                            Deactivated)}
