"""The ``serving`` exchange on MXCL channel 3 (agent): where a node serves requests.

A router over replicas (``--node-role router``) names each replica by its agent
address; before every dial of a replica it asks that agent where its serving
listener is (``replicas/service.py``'s, run by the replica's router worker), and
dials the agent's host at that port.

Messages (the envelope of PROTOCOL.md section 4, header only, no tensors;
``ServingRequest`` and ``Serving`` in ``wire/agent_messages.py``):

======= ================ =====================================================
type    direction        fields
======= ================ =====================================================
serving asker → agent    none besides ``t``: ``{"t": "serving"}``
serving agent → asker    ``role``, ``port``, ``model``; exactly these keys
error   agent → asker    ``reason`` (an agent that does not serve the type)
======= ================ =====================================================

- ``role``: the node role of the agent's daemon (``config/replicas.py``):
  ``"hybrid"``, ``"router"``, ``"prefill"`` or ``"decode"``.
- ``port``: the TCP port of its serving listener, from its router worker's stats
  (``serving``), an integer in 1-65535; ``null`` while none listens (no model,
  the worker loading or restarting, or a router).
- ``model``: the model identity (``models/identity.py``, 64 lowercase hex digits)
  of what its router serves, ``null`` when it serves nothing or the identity
  cannot be computed.

The asker's budget (``ask_serving``): ``CONNECT_BUDGET_S`` (5 s) to connect and
authenticate, then ``ANSWER_TIMEOUT_S`` (5 s) for the answer. ``ServingFinder``
turns the answer into the address to dial, or a ``ServingNotFound`` that says why
there is none (the member's ``last_error``; it is asked again at the next dial). Its
message names no address (a member's error reaches clients' 503s and the redacted
``/router/stats``): the member's node id and ``mlxctl status`` say which agent it is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from mlxceld.discovery.inventory import AGENT_CHANNEL
from mlxceld.errors import MlxceldError
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.net.resolve import ResolveError, resolve
from mlxceld.types import HYBRID
from mlxceld.wire import Envelope, MessageSpec, SecretStore, encode_envelope
from mlxceld.wire.address import canonical_address, format_address, parse_address
from mlxceld.wire.agent_messages import Serving, ServingRequest
from mlxceld.wire.messages import MessageError

SERVING: Final = Serving.T
ANSWER_SPECS: Final = {SERVING: MessageSpec(), "error": MessageSpec()}
CONNECT_BUDGET_S: Final = 5.0
ANSWER_TIMEOUT_S: Final = 5.0


class ServingNotFound(MlxceldError):
    """No serving listener to dial at a replica: unreachable agent, a bad answer, no
    listener yet, another role or another model. ``message`` says which."""

    code = "serving_not_found"


def parse_serving(header: Mapping[str, Any]) -> Serving:
    """The checked answer (``Serving.from_wire``); ``ServingNotFound`` names the first field
    out of bounds."""
    try:
        return Serving.from_wire(header)
    except MessageError as exc:
        raise ServingNotFound(f"its agent answered {exc.reason}") from None


def port_of(stats: Mapping[str, Any] | None) -> int | None:
    """The serving listener's port in a router worker's ``stats`` (its ``serving``: the
    port, or ``{"port": ...}``, or ``host:port``); None while there is none."""
    value = (stats or {}).get("serving")
    if isinstance(value, Mapping):
        value = value.get("port")
    if isinstance(value, str):
        try:
            value = parse_address(value).port
        except ValueError:
            return None
    if type(value) is int and 1 <= value <= 65535:
        return value
    return None


def serve_serving(agent: AgentService, answer: Callable[[], Awaitable[Serving]]) -> None:
    """Answer ``serving`` on the agent channel with what ``answer`` says now."""

    async def handle(stream: MxclStream, message: Envelope) -> None:
        await stream.send(encode_envelope((await answer()).to_wire()))

    agent.add_handler(AGENT_CHANNEL, SERVING, handle)


async def ask_serving(origin: str, agent: str, *, keyring: SecretStore) -> Serving:
    """Ask the agent at ``agent`` (``host:port``) as the node whose agent is ``origin``;
    the checked answer, or ``ServingNotFound`` saying why there is none. At most
    ``CONNECT_BUDGET_S + ANSWER_TIMEOUT_S``."""
    try:
        answer = await ask(origin, agent, ServingRequest(), keyring=keyring, channel=AGENT_CHANNEL,
                           answers=ANSWER_SPECS, connect_s=CONNECT_BUDGET_S,
                           answer_s=ANSWER_TIMEOUT_S)
    except AskFailed as exc:
        raise ServingNotFound(_why(exc)) from None
    return parse_serving(answer.header)


def _why(exc: AskFailed) -> str:
    """Why an agent's ``serving`` could not be had, naming no address."""
    if exc.kind in ("connect", "address"):
        return (f"its agent cannot be reached ({exc.detail or exc.kind}): is its daemon up, "
                "with the same cluster secret?")
    if exc.kind == "error":
        return "its agent does not answer 'serving' (an older mlxceld?)"
    if exc.kind == "timeout":
        return f"its agent did not answer 'serving' within {ANSWER_TIMEOUT_S:g} s"
    if exc.kind == "closed":
        return f"its agent closed the stream ({exc.detail})"
    return f"its agent answered out of bounds: {exc.message}"


async def numeric_address(host: str, port: int) -> str:
    """``host:port`` with a host name replaced by its first IP (IPv4 first, then in order);
    ``ServingNotFound`` when it does not resolve (``net/resolve.py``'s bound)."""
    try:
        ips = await resolve(host)
    except ResolveError as exc:
        raise ServingNotFound(exc.message) from None
    ip = min(ips, key=lambda a: (a.version, str(a)))
    return canonical_address(format_address(str(ip), port))


class ServingFinder:
    """The ``resolve`` of a ``RemoteEngine``: the serving address of the replica whose
    agent is at ``agent``, asked anew at every call (a restarted replica may listen on
    another port). The replica must be a hybrid serving ``model_identity``; otherwise
    ``ServingNotFound`` says what it is instead."""

    def __init__(self, agent: str, *, origin: str, keyring: SecretStore,
                 model_identity: str, role: str = "hybrid") -> None:
        """``role``: what the node must be (a router's pool: hybrid for ``--replicas``,
        prefill or decode for ``--prefill-peers`` / ``--decode-peers``)."""
        self.agent = agent
        self.role = role
        self._host = parse_address(agent).host
        self._origin = origin
        self._keyring = keyring
        self._identity = model_identity

    async def __call__(self) -> str:
        answer = await ask_serving(self._origin, self.agent, keyring=self._keyring)
        if answer.role != self.role:
            where = {"hybrid": "--replicas", "prefill": "--prefill-peers",
                     "decode": "--decode-peers"}.get(self.role, self.role)
            raise ServingNotFound(f"it is a {answer.role}, not a {self.role} node serving "
                                  f"the model: list only {self.role} nodes in {where}")
        if answer.model is None:
            raise ServingNotFound("it serves no model (yet)")
        if answer.model != self._identity:
            raise ServingNotFound(
                f"it serves another model (identity "
                f"{answer.model[:12]}…, ours {self._identity[:12]}…): give every replica "
                "the same model files as the router")
        if answer.port is None:
            raise ServingNotFound("it has no serving listener (yet): its router is starting, "
                                  "or it runs without the cluster secret")
        if self.role == HYBRID:  # dialed only: a name stays a name, resolved at the dial
            return format_address(self._host, answer.port)
        # A prefill or decode node's address is also an identity (the prefill node a decode
        # node expects a handoff from, the decode target a prefill node checks against
        # MLXCEL_DECODE_ALLOWLIST), which handshakes bind to IPs: a name is resolved here.
        return await numeric_address(self._host, answer.port)
