"""The inventory exchange on MXCL channel 3 (agent): what a peer offers a plan.

Messages (the envelope of PROTOCOL.md section 4, header only, no tensors):

========= ================ ====================================================
type      direction        fields
========= ================ ====================================================
inventory asker → agent    none besides ``t``: ``{"t": "inventory"}``
inventory agent → asker    ``node``, ``version``, ``platform``,
                           ``memory_total``, ``memory_available``, ``model``,
                           ``ports``, ``agent``, ``key_id``, and
                           ``compute_units`` when known (below); no
                           other keys
error     agent → asker    ``reason`` (a message type this agent does not serve
                           on this channel, or a malformed envelope)
========= ================ ====================================================

The messages are ``InventoryRequest`` and ``Inventory`` (``wire/agent_messages.py``).
The answer's fields and bounds (``Inventory.from_wire`` checks every one; the
asker treats a violation as a bad answer, never as a partial inventory):

- ``node``: the agent's node id, 1-128 characters without control characters.
- ``version``: its package version, 1-64 characters.
- ``platform``: ``{"system": sys.platform, "machine": platform.machine()}``,
  each a string of at most 64 characters.
- ``memory_total``, ``memory_available``: bytes (psutil), integers in
  ``[0, 2**63)``, available not above total.
- ``model``: ``null`` when no model is configured ([serve] model / --model),
  else ``{"path", "identity", "error"}``: the configured path (1-4096
  characters), the model identity of ``mlxceld.models.identity`` (64 lowercase
  hex digits) or ``null`` with ``error`` (at most 1024 characters) saying why
  it could not be computed.
- ``ports``: 0 to ``MAX_PORTS`` distinct TCP ports in 1-65535 that were free on
  the agent's host when it answered, proposed for stage listeners (found by
  binding port 0 and closing; another process may take one before it is used).
  With ``stage_ports`` set (``stage_ports.py``) they are the lowest free ports of
  that range, found by binding each in turn; none when every one is taken.
- ``agent``: the agent's listener address ``host:port`` as it listens (an
  unspecified host such as ``0.0.0.0`` when it listens on every interface).
- ``key_id``: the key id (16 lowercase hex digits) of the agent's primary cluster
  secret, the one it dials with (``null`` only without one): a node left on an old
  key after a rotation is told apart by this before its traffic fails (the stream's
  own key id is the asker's primary, which the agent may merely still accept).
- ``compute_units`` (optional): the agent's compute units (``discovery/speed.py``,
  the unit of ``models/speed.py``), a number in (0, 10**6]; left out while the agent
  knows none (measuring, or the measurement failed). An answer without it parses; a
  planner then splits by memory (``cluster/plan/solver.py``).

The asker's budget (``mlxceld.discovery.poller``): 5 s to connect and
authenticate, then 5 s for the answer.
"""

from __future__ import annotations

import asyncio
import platform
import random
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import psutil

from mlxceld import __version__, failpoints
from mlxceld.config.stage_ports import StagePorts
from mlxceld.errors import MlxceldError
from mlxceld.models.fetch import local_model
from mlxceld.models.identity import model_identity
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService
from mlxceld.wire import Envelope, MessageSpec, SecretStore, encode_envelope
from mlxceld.wire.agent_messages import Inventory
from mlxceld.wire.messages import MessageError

AGENT_CHANNEL: Final = 3
INVENTORY: Final = Inventory.T
ANSWER_SPECS: Final = {INVENTORY: MessageSpec(), "error": MessageSpec()}  # what the asker does
FREE_PORTS: Final = 3  # proposed per answer


class InventoryError(MlxceldError):
    """An inventory answer that breaks the bounds above; ``message`` names the field."""

    code = "bad_inventory"


def local_inventory(node_id: str, agent: str, agent_host: str, model: str | None,
                    stage_ports: StagePorts | None = None, *,
                    key_id: str | None = None, compute_units: float | None = None) -> Inventory:
    """This daemon's answer (psutil, the platform, free ports on ``agent_host``, the key id
    of its primary secret, its compute units when known)."""
    memory = psutil.virtual_memory()
    available = int(memory.available)
    if failpoints.MEMORY_AVAILABLE is not None:  # tests only: a plan that does not fit
        available = min(available, failpoints.MEMORY_AVAILABLE)
    return Inventory(node=node_id, version=__version__,
                     platform={"system": sys.platform, "machine": platform.machine()[:64]},
                     memory_total=int(memory.total), memory_available=available,
                     model=model_entry(model),
                     ports=tuple(free_ports(agent_host, FREE_PORTS, stage_ports)),
                     agent=agent, key_id=key_id, compute_units=compute_units)


def model_entry(model: str | None) -> dict[str, Any] | None:
    if model is None:
        return None
    try:
        return {"path": model, "identity": model_identity(local_model(model)), "error": None}
    except MlxceldError as exc:
        return {"path": model, "identity": None, "error": exc.message[:1024]}


def free_ports(host: str, count: int, within: StagePorts | None = None) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now: ephemeral ones (all bound at
    once, then closed), or the lowest free ones ``within`` a range (fewer, or none, when
    the range has fewer free ports)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if within is not None:
        return _bindable(host, family, count, within)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return sorted(int(s.getsockname()[1]) for s in sockets)
    except OSError:
        return []  # nothing to propose; the planner picks ports some other way
    finally:
        for s in sockets:
            s.close()


RING_LOW: Final = 20000  # ring ports are drawn from here up to the ephemeral range
EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port of the system's ephemeral range (Linux's, read; 49152 elsewhere, as
    macOS and IANA have it)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def ring_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now, for an ``mx.distributed`` ring's
    ends, drawn at random below the ephemeral range: a port that ``free_ports`` picks
    there is closed before mlx binds it, and meanwhile any outgoing connection on the
    host may take it as its own source port (seen as a ring rank aborting at its join).
    Below that range only an explicit bind takes a port. Falls back to ``free_ports``
    when that range is too small or full."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = ephemeral_low()
    if high - RING_LOW < 64:
        return free_ports(host, count)
    drawn = random.sample(range(RING_LOW, high), min(high - RING_LOW, 64 * count))
    found = _bindable(host, family, count, drawn)
    return sorted(found) if len(found) == count else free_ports(host, count)


def _bindable(host: str, family: socket.AddressFamily, count: int,
              candidates: Iterable[int]) -> list[int]:
    """The first ``count`` of ``candidates`` that bind on ``host`` now (each closed again):
    one taken, or not ours to bind, is passed over."""
    found: list[int] = []
    for port in candidates:
        if len(found) == count:
            break
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            found.append(port)
    return found


def parse_inventory(header: Mapping[str, Any]) -> Inventory:
    """The checked answer (``Inventory.from_wire``); ``InventoryError`` names the first field
    out of bounds."""
    try:
        return Inventory.from_wire(header)
    except MessageError as exc:
        raise InventoryError(exc.reason) from None


def serve_inventory(agent: AgentService, node_id: str, model: Callable[[], str | None],
                    stage_ports: StagePorts | None = None, *,
                    keyring: SecretStore | None = None,
                    units: Callable[[], float | None] = lambda: None) -> None:
    """Answer ``inventory`` on the agent channel; ``model`` gives the configured model now,
    ``stage_ports`` the range stage ports are proposed from (None: ephemeral ports),
    ``keyring`` the primary key id at the time of each answer, ``units`` the compute
    units known now (``discovery/speed.py``)."""

    async def answer(stream: MxclStream, message: Envelope) -> None:
        kid = keyring.primary_id if keyring is not None else None
        inventory = await asyncio.to_thread(local_inventory, node_id, agent.address, agent.host,
                                            model(), stage_ports,
                                            key_id=kid.hex() if kid else None,
                                            compute_units=units())
        await stream.send(encode_envelope(inventory.to_wire()))

    agent.add_handler(AGENT_CHANNEL, INVENTORY, answer)
