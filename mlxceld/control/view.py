"""``DaemonView``: the parts of the daemon the control API uses, as one record.

The seam of this room. As uvicorn hands its protocols a ``ServerState`` and the config,
never its ``Server``, the daemon hands its endpoints this record, never itself: each field
is one part, typed here by what the endpoints (and ``observe/``'s scrape) call of it. The
daemon room fills it with its parts (the supervisor, the cluster member, its key, serving
drain and link-test windows); tests put small fakes under the real app. Their methods return typed
answers (``answers.py``: frozen dataclasses, each written once by its ``to_json``), or
raise ``MlxceldError``s naming what is wrong; the app answers them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from mlxceld.control.answers import (
    ClusterNodes,
    DrainView,
    KeyChange,
    Reloaded,
    ServedModel,
    Undrained,
    Unserved,
    Written,
)
from mlxceld.net.link import LinkReport
from mlxceld.state import DrainRow, EventLog, KeyInfo, RotationRow
from mlxceld.supervisor.views import WorkerView
from mlxceld.types import DEFAULT_MESH, JSON, MeshMode


@dataclass(frozen=True)
class Lifetime:
    """The daemon's own: whether it stops, its status, a stop and a reload asked."""

    stopping: Callable[[], bool]
    status: Callable[[], JSON]
    request_stop: Callable[[], None]
    reload: Callable[[], Awaitable[Reloaded]]


class Workers(Protocol):
    """The supervisor: its workers, their stats (each bounded), logs and restarts."""

    def snapshot(self) -> list[WorkerView]: ...
    async def stats(self) -> dict[str, JSON]: ...
    def log_path(self, name: str) -> str | None: ...
    def restart(self, name: str) -> None: ...


class Cluster(Protocol):
    """The cluster member: its nodes, plans, and the cluster secret's rotation."""

    def nodes(self) -> ClusterNodes: ...
    async def plan(self, model: str, stages: int, replicas: int = 1,
                   mesh: MeshMode = DEFAULT_MESH) -> Written: ...
    async def activate(self, model: str, stages: int, replicas: int = 1,
                       mesh: MeshMode = DEFAULT_MESH) -> JSON: ...
    async def deactivate(self) -> JSON: ...
    async def rotate(self, secret: bytes | None) -> RotationRow: ...
    def rotation(self) -> RotationRow | None: ...


class Secrets(Protocol):
    """This node's keyring, each change pushed to its workers."""

    def list(self) -> list[KeyInfo]: ...
    async def install_secret(self, secret: bytes, primary: bool, source: str) -> KeyChange: ...
    async def use_secret(self, kid: str) -> KeyChange: ...
    async def remove_secret(self, kid: str) -> KeyChange: ...


class ServeCommands(Protocol):
    """What the router serves: `mlxctl serve|unserve`."""

    async def serve_model(self, model: str, name: str | None) -> ServedModel | None: ...
    async def unserve(self) -> Unserved: ...


class Drains(Protocol):
    """`mlxctl drains|drain|undrain`."""

    def list(self) -> list[DrainView]: ...
    def drain(self, node: str | None, deadline_s: float | None, force: bool) -> DrainRow: ...
    def undrain(self, node: str | None) -> Undrained: ...


class Links(Protocol):
    """`mlxctl cluster link-test`: round trips and bandwidth with a peer's agent."""

    async def link_test(self, peer: str, pings: int, size: int) -> LinkReport: ...


@dataclass(frozen=True)
class DaemonView:
    events: EventLog
    daemon: Lifetime
    workers: Workers
    cluster: Cluster
    secrets: Secrets
    serving: ServeCommands
    drains: Drains
    links: Links
