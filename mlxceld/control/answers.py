"""The typed answers of the control API: what the parts in ``view.DaemonView`` return.

As h11's events and our MXCL messages (``wire/messages.py``), each is a frozen dataclass
with one place that writes its JSON: ``to_json``, whose dict is what went on the control
socket before the answers were typed, key for key and in the same order (the published
schemas: ``mlxctl/schemas.py``). The parts above this room build them (``cluster/``,
``drain/``, ``daemon/``); the endpoints (``endpoints.py``) write them. Answers built
below this room live where they are built: a worker (``supervisor/views.py``), a drain's
row (``state/drains.py``), a rotation's (``state/rotations.py``), a key's
(``state/keys.py``: ``KeyInfo``); a plan is typed with the plan, above this room
(``Written``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mlxceld.state import DrainRow, KeyInfo
from mlxceld.types import JSON


class Written(Protocol):
    """An answer typed above this room, which the endpoints only write: a plan
    (``cluster/plan/candidates.py``: ``Proposal``, whose ``to_json`` is ``ProposalJSON``)."""

    def to_json(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Reloaded:
    """`mlxctl reload` (and SIGHUP): the config file read again, every setting it changed
    (``config/changes.py``: ``Change``, its key, old and new value), and those of them
    that take effect only at the next start."""

    config_file: str | None
    changed: list[Mapping[str, Any]]
    at_next_start: list[str]

    def to_json(self) -> JSON:
        return {"config_file": self.config_file, "changed": self.changed,
                "at_next_start": self.at_next_start}


@dataclass(frozen=True)
class Detector:
    """The failure detector's settings (``[liveness]``), and whether it runs."""

    running: bool
    ping_interval_s: float
    suspect_after_s: float
    dead_after_s: float

    def to_json(self) -> JSON:
        return {"running": self.running, "ping_interval_s": self.ping_interval_s,
                "suspect_after_s": self.suspect_after_s, "dead_after_s": self.dead_after_s}


@dataclass(frozen=True)
class ClusterNodes:
    """`mlxctl cluster nodes`: the cluster as this node's discovery and detector know it."""

    cluster: str  # [cluster] name
    node_id: str  # this node's
    key_id: str | None  # its primary key id (hex); None: no cluster secret
    discovery: JSON  # discovery's own description (``discovery/service.py``)
    nodes: list[JSON]  # each candidate's row, with its ``liveness`` and ``key_stale``
    detector: Detector
    liveness: list[JSON]  # each watched peer's liveness row, by address

    def to_json(self) -> JSON:
        return {"cluster": self.cluster, "node_id": self.node_id, "key_id": self.key_id,
                "discovery": self.discovery, "nodes": self.nodes,
                "detector": self.detector.to_json(), "liveness": self.liveness}


@dataclass(frozen=True)
class KeyChange:
    """`mlxctl secret install|use|remove`: the key as the change left it, and what the
    workers holding the cluster secret made of the new keyring (``daemon/keys.py``)."""

    key: KeyInfo
    # the workers that failed to take it, by name, each with why ({}: none failed); None:
    # the keyring is empty now, so nothing was pushed
    failed: dict[str, str] | None

    def to_json(self) -> JSON:
        return {**self.key.to_json(),
                "workers": {} if self.failed is None else {"failed": dict(self.failed)}}


@dataclass(frozen=True)
class ServedModel:
    """What the router serves, and where (`mlxctl serve`, `mlxctl status`'s ``serving``)."""

    model: str  # the model as resolved (a directory, or a Hugging Face repo id)
    model_name: str  # the name clients ask for
    url: str  # the OpenAI API's base URL
    api_key: bool  # whether it asks for an API key
    api_key_file: str | None  # where the key is (never the key): mlxctl chat reads it

    def to_json(self) -> JSON:
        return {"model": self.model, "model_name": self.model_name, "url": self.url,
                "api_key": self.api_key, "api_key_file": self.api_key_file}


@dataclass(frozen=True)
class Unserved:
    """`mlxctl unserve`: what the router served before (None: nothing)."""

    was: ServedModel | None

    def to_json(self) -> JSON:
        return {"unserved": None if self.was is None else self.was.to_json()}


@dataclass(frozen=True)
class DrainView:
    """`mlxctl drains`: a drain's row (while it drains, with the router's last counts of
    ``finished`` and ``ended``), whether it waits for a re-plan around its node, the
    requests in flight that need the node (None: not known, or not said to the router),
    and who still sends them (``senders``: ``{"sender", "sequences"}`` each, the node's
    OpenAI clients and every router with sequences on its serving listener; None: not
    known)."""

    row: DrainRow
    replanning: bool
    in_flight: int | None
    senders: list[JSON] | None = None

    def to_json(self) -> JSON:
        return {**self.row.to_json(), "replanning": self.replanning,
                "in_flight": self.in_flight, "senders": self.senders}


@dataclass(frozen=True)
class Undrained:
    """`mlxctl undrain`: the node, and its drain as it ended (None: it was not drained)."""

    node: str
    was: DrainRow | None

    def to_json(self) -> JSON:
        return {"node": self.node, "was": None if self.was is None else self.was.to_json()}
