"""MXCL channel 3 (agent): the messages of the daemon-to-daemon control exchanges.

Each exchange is one question and one answer (``mlxceld.net.agent.ask``); the
exchanges, their deadlines and what the fields mean are described where they are
served: ``discovery/inventory.py`` (``inventory``), ``discovery/serving.py``
(``serving``), ``cluster/rotation.py`` (``key_*``), ``cluster/front.py``
(``plan``), ``cluster/fencing.py`` (``assignment``). A question and its answer may
share a type (``inventory``, ``serving``): ``ASKED`` and ``ANSWERED`` are the two
vocabularies, by direction. ``error`` (``messages.Error``) may answer any of them.
A question that is its type alone (``inventory``, ``serving``, ``key_report``, ``plan``,
``assignment``) is a ``BareQuestion``.

``from_wire`` checks every field (``Inventory`` and ``Serving`` against the bounds
their exchanges document) and raises ``MessageError`` naming the first one out of
bounds; ``to_wire`` gives the header as it has always gone out, key for key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.wire.assignment_messages import MAX_AGENT, MAX_GROUP
from mlxceld.wire.messages import Error, MessageError, exact_keys, vocabulary
from mlxceld.wire.names import name_problem

MAX_PORTS: Final = 8
MAX_MEMORY: Final = 2**63
MAX_SECRET_HEX: Final = 2048  # 1 KiB of secret, far above any sane one
INVENTORY_KEYS: Final = frozenset({"t", "node", "version", "platform", "memory_total",
                                   "memory_available", "model", "ports", "agent", "key_id"})
SERVING_KEYS: Final = frozenset({"t", "role", "port", "model"})
PLAN_KEYS: Final = frozenset({"t", "epoch", "cluster", "model", "stages"})
MAX_PLAN_STAGES: Final = 64
# A node role (NODE_ROLES of mlxceld/types.py; the wire imports nothing of ours, and
# tests/config/test_node_role.py holds the two the same)
NODE_ROLES: Final = frozenset({"hybrid", "router", "prefill", "decode",
                               "tensor_parallel_rank"})
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class BareQuestion:
    """A question that is its type alone: ``{"t": T}`` on the wire. ``from_wire`` reads
    nothing else from the header."""

    T: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True)
class InventoryRequest(BareQuestion):
    """What a peer offers a plan (``discovery/inventory.py``)."""

    T: ClassVar[str] = "inventory"


@dataclass(frozen=True)
class Inventory:
    """The answer: the agent's node, memory, model, free ports, listener and key id, and
    its compute units when it knows them (an optional key: answers without it parse)."""

    T: ClassVar[str] = "inventory"
    MAX_UNITS: ClassVar[float] = 1e6  # compute units: a number in (0, MAX_UNITS]
    node: str
    version: str
    platform: dict[str, str]  # {"system", "machine"}
    memory_total: int
    memory_available: int
    model: dict[str, Any] | None  # {"path", "identity", "error"}
    ports: tuple[int, ...]
    agent: str
    key_id: str | None
    compute_units: float | None = None  # None: not known (not sent)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.T, "node": self.node, "version": self.version,
                               "platform": self.platform, "memory_total": self.memory_total,
                               "memory_available": self.memory_available, "model": self.model,
                               "ports": list(self.ports), "agent": self.agent,
                               "key_id": self.key_id}
        if self.compute_units is not None:
            out["compute_units"] = self.compute_units
        return out

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        units: Any = header.get("compute_units")
        exact_keys(header, INVENTORY_KEYS | ({"compute_units"} if "compute_units" in header
                                             else set()), "inventory")
        if "compute_units" in header and (
                type(units) not in (int, float) or not 0 < units <= cls.MAX_UNITS):
            raise MessageError("compute_units", "inventory 'compute_units' must be a number "
                               f"in (0, {cls.MAX_UNITS:g}]")
        problem = name_problem(header["node"])
        if problem:
            raise MessageError("node", f"inventory 'node' {problem}")
        _string(header, "version", 1, 64)
        plat = header["platform"]
        if not isinstance(plat, dict) or set(plat) != {"system", "machine"}:
            raise MessageError("platform", "inventory 'platform' must be {system, machine}")
        for key in ("system", "machine"):
            _string(plat, key, 0, 64)
        for key in ("memory_total", "memory_available"):
            value = header[key]
            if type(value) is not int or not 0 <= value < MAX_MEMORY:
                raise MessageError(key, f"inventory {key!r} must be an integer in [0, 2**63)")
        if header["memory_available"] > header["memory_total"]:
            raise MessageError("memory_available",
                               "inventory 'memory_available' is above 'memory_total'")
        _model(header["model"])
        ports = header["ports"]
        if (not isinstance(ports, list) or len(ports) > MAX_PORTS
                or len(set(ports)) != len(ports)
                or not all(type(p) is int and 1 <= p <= 65535 for p in ports)):
            raise MessageError("ports",
                               f"inventory 'ports' must be at most {MAX_PORTS} distinct ports")
        _string(header, "agent", 3, 255)
        kid = header["key_id"]
        if kid is not None and (not isinstance(kid, str) or not _HEX16.fullmatch(kid)):
            raise MessageError("key_id",
                               "inventory 'key_id' must be 16 lowercase hex digits or null")
        return cls(header["node"], header["version"], dict(plat), header["memory_total"],
                   header["memory_available"], header["model"], tuple(ports), header["agent"],
                   kid, None if units is None else float(units))


def _model(model: Any) -> None:
    if model is None:
        return
    if not isinstance(model, dict) or set(model) != {"path", "identity", "error"}:
        raise MessageError("model", "inventory 'model' must be null or {path, identity, error}")
    _string(model, "path", 1, 4096)
    identity, error = model["identity"], model["error"]
    if identity is not None and not (isinstance(identity, str) and _HEX64.fullmatch(identity)):
        raise MessageError("model.identity",
                           "inventory 'model.identity' must be 64 lowercase hex digits")
    if error is not None:
        _string(model, "error", 0, 1024)
    if (identity is None) == (error is None):
        raise MessageError("model", "inventory 'model' needs exactly one of identity and error")


def _string(table: Mapping[str, Any], key: str, low: int, high: int) -> None:
    value = table[key]
    if not isinstance(value, str) or not low <= len(value) <= high:
        raise MessageError(key, f"inventory {key!r} must be a string of {low}-{high} "
                                "characters")


@dataclass(frozen=True)
class ServingRequest(BareQuestion):
    """Where a node serves requests (``discovery/serving.py``)."""

    T: ClassVar[str] = "serving"


@dataclass(frozen=True)
class Serving:
    """The answer: the node's role, its serving listener's port and its model identity.
    ``from_wire``'s reasons read after "answered" (``'serving' with ...``)."""

    T: ClassVar[str] = "serving"
    role: str
    port: int | None
    model: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "role": self.role, "port": self.port, "model": self.model}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        if set(header) != SERVING_KEYS:
            raise MessageError("t", f"'serving' with keys {sorted(header)}, expected "
                                    f"{sorted(SERVING_KEYS)}")
        if header["role"] not in NODE_ROLES:
            raise MessageError("role", f"'serving' with role {str(header['role'])[:40]!r}")
        port = header["port"]
        if port is not None and (type(port) is not int or not 1 <= port <= 65535):
            raise MessageError("port", "'serving' with a port outside 1-65535")
        model = header["model"]
        if model is not None and not (isinstance(model, str) and _HEX64.fullmatch(model)):
            raise MessageError("model", "'serving' with a model that is not an identity "
                                        "(64 lowercase hex digits)")
        return cls(header["role"], port, model)


@dataclass(frozen=True)
class KeyInstall:
    """Install a secret, not as the primary (``cluster/rotation.py``)."""

    T: ClassVar[str] = "key_install"
    secret_hex: str

    def __repr__(self) -> str:  # never the secret, not even in a traceback
        return "KeyInstall(secret_hex=<hidden>)"

    def secret(self) -> bytes:
        return bytes.fromhex(self.secret_hex)

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "secret_hex": self.secret_hex}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        text = header.get("secret_hex")
        if not isinstance(text, str) or len(text) > MAX_SECRET_HEX:
            raise MessageError("secret_hex", "key_install needs 'secret_hex', the secret as hex")
        try:
            bytes.fromhex(text)
        except ValueError:
            raise MessageError("secret_hex", "key_install's 'secret_hex' is not hex") from None
        return cls(text)


@dataclass(frozen=True)
class KeyUse:
    """Make the key ``kid`` the primary."""

    T: ClassVar[str] = "key_use"
    kid: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "kid": self.kid}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_kid(header, cls.T))


@dataclass(frozen=True)
class KeyRemove:
    """Remove the key ``kid`` (one already gone is no error)."""

    T: ClassVar[str] = "key_remove"
    kid: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "kid": self.kid}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(_kid(header, cls.T))


def _kid(header: Mapping[str, Any], what: str) -> str:
    kid = header.get("kid")
    if not isinstance(kid, str):
        raise MessageError("kid", f"{what} needs 'kid', a key id")
    return kid


@dataclass(frozen=True)
class KeyReport(BareQuestion):
    """Say the key state, change nothing."""

    T: ClassVar[str] = "key_report"


KeyOp = KeyInstall | KeyUse | KeyRemove | KeyReport


@dataclass(frozen=True)
class KeyState:
    """The answer to every key op: the primary key id (or None) and every installed one."""

    T: ClassVar[str] = "key_state"
    primary: str | None
    ids: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "primary": self.primary, "ids": list(self.ids)}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        primary, ids = header.get("primary"), header.get("ids")
        if not (primary is None or isinstance(primary, str)) or not isinstance(ids, list):
            raise MessageError("ids", "key_state needs 'primary' and 'ids'")
        return cls(primary, tuple(str(i) for i in ids))


@dataclass(frozen=True)
class PlanRequest(BareQuestion):
    """The pipeline plan a coordinator's router serves (``cluster/front.py``)."""

    T: ClassVar[str] = "plan"


@dataclass(frozen=True)
class PlanStage:
    """One stage of a ``Plan``: its node id, listener address, rank and layers; a stage
    that is a tensor group across hosts (a 2D mesh) its ``tp_group``, its ranks' agent
    addresses in rank order (rank 0 the stage's own host), as its offers carried it."""

    node_id: str
    address: str
    rank: int
    layers: tuple[int, int]
    tp_group: tuple[str, ...] = ()  # () : no group (a pipeline's stage)

    def to_wire(self) -> dict[str, Any]:
        stage = {"node": self.node_id, "address": self.address, "rank": self.rank,
                 "layers": list(self.layers)}
        return stage | {"tp_group": list(self.tp_group)} if self.tp_group else stage


@dataclass(frozen=True)
class Plan:
    """The answer: the plan's ``epoch``, ``cluster`` name, ``model`` identity and its
    ``stages`` in rank order; ``stages`` empty (and the rest null) when the agent's router
    serves no pipeline plan. A 2D mesh's stages each carry their ``tp_group``, all of one
    size; a pipeline's none (the key left out: the answer as it has always gone out).
    ``from_wire``'s reasons read after "answered"."""

    T: ClassVar[str] = "plan"
    epoch: int | None
    cluster: str | None
    model: str | None
    stages: tuple[PlanStage, ...]

    @property
    def tp_size(self) -> int:
        """The ranks of each stage's group: 1 for a pipeline."""
        return len(self.stages[0].tp_group) if self.stages and self.stages[0].tp_group else 1

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch, "cluster": self.cluster, "model": self.model,
                "stages": [s.to_wire() for s in self.stages]}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        exact_keys(header, PLAN_KEYS, "'plan'")
        epoch, cluster, model, stages = (header["epoch"], header["cluster"], header["model"],
                                         header["stages"])
        if epoch is not None and (type(epoch) is not int or not 0 <= epoch < 2**63):
            raise MessageError("epoch", "'plan' with an epoch that is not a count")
        if cluster is not None and not (isinstance(cluster, str) and 0 < len(cluster) <= 64):
            raise MessageError("cluster", "'plan' with a cluster that is not a name")
        if model is not None and not (isinstance(model, str) and _HEX64.fullmatch(model)):
            raise MessageError("model", "'plan' with a model that is not an identity")
        if not isinstance(stages, list) or len(stages) > MAX_PLAN_STAGES:
            raise MessageError("stages", f"'plan' with stages that are not a list of at most "
                               f"{MAX_PLAN_STAGES}")
        parsed = tuple(_plan_stage(s) for s in stages)
        if [s.rank for s in parsed] != list(range(len(parsed))):
            raise MessageError("stages", "'plan' with stages out of rank order")
        if parsed and (model is None or cluster is None):
            raise MessageError("model", "'plan' with stages but no model or cluster")
        if len({len(s.tp_group) for s in parsed}) > 1:
            raise MessageError("tp_group", "'plan' with stages whose tp_group sizes differ")
        return cls(epoch, cluster, model, parsed)


_STAGE_KEYS: Final = frozenset({"node", "address", "rank", "layers"})


def _plan_stage(entry: Any) -> PlanStage:
    if not isinstance(entry, dict) or set(entry) - {"tp_group"} != _STAGE_KEYS:
        raise MessageError("stages", "'plan' with a stage that is not {node, address, rank, "
                           "layers} (and tp_group)")
    node, address, rank, layers = entry["node"], entry["address"], entry["rank"], entry["layers"]
    if not (isinstance(node, str) and 0 < len(node) <= 64 and isinstance(address, str)
            and 0 < len(address) <= 300):
        raise MessageError("stages", "'plan' with a stage's node or address out of bounds")
    if type(rank) is not int or not (isinstance(layers, list) and len(layers) == 2
                                     and all(type(n) is int and 0 <= n < 2**20
                                             for n in layers) and layers[0] < layers[1]):
        raise MessageError("stages", "'plan' with a stage's rank or layers out of bounds")
    group = entry.get("tp_group", [])
    if "tp_group" in entry and not (
            isinstance(group, list) and 2 <= len(group) <= MAX_GROUP
            and all(isinstance(a, str) and 0 < len(a) <= MAX_AGENT for a in group)):
        raise MessageError("tp_group", f"'plan' with a stage's tp_group that is not 2 to "
                           f"{MAX_GROUP} agent addresses")
    return PlanStage(node, address, rank, (layers[0], layers[1]), tuple(group))


@dataclass(frozen=True)
class AssignmentRequest(BareQuestion):
    """The stage assignment a peer holds, and whose (``cluster/fencing.py``)."""

    T: ClassVar[str] = "assignment"


@dataclass(frozen=True)
class Assignment:
    """The answer: the newest plan ``epoch`` the peer recorded, the agent address of the
    ``coordinator`` that offered it and its ``state``; all null when it holds none. Its
    lease (``cluster/lease.py``): the ``holder`` (the coordinator of the newest plan it
    holds a stage of) and that plan's epoch (``held``), how long ago it last heard the
    holder (``heard_s``) and how long the lease still runs (``lease_s``, 0 once expired);
    all null when it holds no stage. A peer of an older release sends none of the four
    (read as null: it keeps no lease)."""

    T: ClassVar[str] = "assignment"
    epoch: int | None
    coordinator: str | None
    state: str | None
    holder: str | None = None
    held: int | None = None
    heard_s: float | None = None
    lease_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "epoch": self.epoch, "coordinator": self.coordinator,
                "state": self.state, "holder": self.holder, "held": self.held,
                "heard_s": self.heard_s, "lease_s": self.lease_s}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        lease = header.keys() >= LEASE_KEYS
        exact_keys(header, ASSIGNMENT_KEYS | (LEASE_KEYS if lease else set()),
                   "'assignment'")
        epoch, coordinator, state = header["epoch"], header["coordinator"], header["state"]
        held = header.get("held")
        for name, e in (("epoch", epoch), ("held", held)):
            if e is not None and (type(e) is not int or not 0 <= e < 2**63):
                raise MessageError(name, f"'assignment' with an {name} that is not a count")
        holder = header.get("holder")
        for name, value in (("coordinator", coordinator), ("state", state),
                            ("holder", holder)):
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 300):
                raise MessageError(name, f"'assignment' with a {name} that is not a string")
        if (epoch is None) != (coordinator is None) or (held is None) != (holder is None):
            raise MessageError("coordinator", "'assignment' with an epoch but no coordinator")
        ages = [header.get("heard_s"), header.get("lease_s")]
        if not all(a is None or (type(a) in (int, float) and 0 <= a < 1e9) for a in ages):
            raise MessageError("lease_s", "'assignment' with an age that is not seconds")
        heard_s, lease_s = (None if a is None else float(a) for a in ages)
        return cls(epoch, coordinator, state, holder, held, heard_s, lease_s)


ASSIGNMENT_KEYS: Final = frozenset({"t", "epoch", "coordinator", "state"})
LEASE_KEYS: Final = frozenset({"holder", "held", "heard_s", "lease_s"})
ASKED: Final = vocabulary(InventoryRequest, ServingRequest, KeyInstall, KeyUse, KeyRemove,
                          KeyReport, PlanRequest, AssignmentRequest)
ANSWERED: Final = vocabulary(Inventory, Serving, KeyState, Plan, Assignment, Error)
