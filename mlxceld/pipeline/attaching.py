"""Dialing a stage and attaching it: one authenticated MXCL stream to a stage, its
``attach`` answered, or why not in words a client may read (the stage's node id, never
its address; the log gets both).

Bounded by ``DIAL_BUDGET_S`` (the TCP connect and handshake, retried within it while
refused) plus ``ATTACH_TIMEOUT_S`` (the stage's answer to ``attach``). A stage that
answers ``attached`` for other layers than the cluster config says is refused too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Final

from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, NetError, connect
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.connectivity import Failure
from mlxceld.pipeline.messages import Attached
from mlxceld.wire import EnvelopeError, Keyring, encode_envelope, parse_envelope
from mlxceld.wire.address import HostPort
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import Attach, error_in

log = logging.getLogger(__name__)

DIAL_BUDGET_S: Final = 5.0  # a stage that does not answer within this is unavailable
ATTACH_TIMEOUT_S: Final = 5.0
# Handshake failures that say nothing about the stage refusing us: retried, then unreachable.
UNREACHABLE_KINDS: Final = frozenset({"unreachable", "at_capacity", "abort", "handshake_timeout"})
# What a failed dial says about the stage, in words that name no address.
DIAL_WORDS: Final = {
    "unreachable": "nothing accepts connections on its port",
    "handshake_timeout": "it accepted the connection but did not answer the handshake",
    "at_capacity": "it holds its maximum of connections",
    "abort": "it dropped the connection during the handshake",
}

# Why a stage refused ``attach``, in words that name no address (the stage's own name
# its coordinator's and ours: they go to the log).
ATTACH_WORDS: Final = {
    p.ERR_NOT_COORDINATOR: "it takes commands only from routers, and this router dials "
    "with the identity of one of its neighbour stages: give the router its own address",
    p.ERR_BAD_MESSAGE: "it did not understand the attach (another version of mlxceld?)",
}


@dataclass(frozen=True)
class StageAddress:
    node_id: str
    host: str
    port: int
    rank: int
    layers: tuple[int, int]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def name(self) -> str:
        """The stage as clients read it: its node id, never its address."""
        return f"stage {self.node_id}"

    def where(self) -> str:
        """The stage as the operator's log reads it: node id and address."""
        return f"stage {self.node_id} ({self.address})"


async def open_stream(stage: StageAddress, *, keyring: Keyring, origin: HostPort,
                      dial_budget_s: float, attach: Attach
                      ) -> tuple[MxclStream, int | None]:
    """A new stream to ``stage`` from ``origin`` (the identity it claims), ``attach`` sent
    and answered ``attached``; with the prompt cache bound the stage said (None: none
    said). ``OpenFailed`` saying why not."""
    try:
        stream = await connect(
            stage.host, stage.port, keyring=keyring, identity=origin.claim(),
            channel=1, budget_s=dial_budget_s, local_addr=origin.local_addr())
    except HandshakeFailed as exc:
        if exc.kind in UNREACHABLE_KINDS:
            raise OpenFailed("unreachable", f"{stage.name()} is unreachable: "
                              f"{DIAL_WORDS[exc.kind]} (tried for "
                              f"{dial_budget_s:g} s)") from exc
        raise OpenFailed("refused", f"{stage.name()} refused the handshake "
                          f"({exc.kind.replace('_', ' ')})"
                          + (f": {exc.hint}" if exc.hint else "")) from exc
    try:
        async with asyncio.timeout(ATTACH_TIMEOUT_S):
            await stream.send(encode_envelope(attach.to_wire()))
            env = parse_envelope(await stream.recv(), p.ENGINE_SPECS)
    except (TimeoutError, NetError, EnvelopeError) as exc:
        await stream.abort()
        why = (f"no answer within {ATTACH_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError)
               else why_ended(exc) if isinstance(exc, ConnectionClosed) else str(exc))
        raise OpenFailed("unreachable", f"{stage.name()} did not attach: {why}") from exc
    if env.type != "attached":
        await stream.close()
        error = error_in(env)
        message, code = error.message, error.code or None
        if code == p.ERR_STANDBY:
            raise OpenFailed("standby", f"{stage.name()} is in standby: {message}")
        if code == p.ERR_STAGE_FAILED:  # its host's stand-in: the stage, node, reason
            said = str(message)[:1000]
            raise OpenFailed("failed", said if said.startswith(f"{stage.name()} ")
                              else f"{stage.name()} failed on its host: {said}")
        if code == p.ERR_MODEL_MISMATCH:  # its words name the two models, no address
            raise OpenFailed("model_mismatch",
                              f"{stage.name()} refused to attach: {message}")
        # Other refusals name addresses (its coordinator's, ours): the log has them.
        log.warning("%s refused to attach: %s (%s)", stage.where(), message, code)
        raise OpenFailed("refused", f"{stage.name()} refused to attach ({code}): "
                          + ATTACH_WORDS.get(str(code), "see the router's log"))
    try:
        attached = Attached.from_wire(env.header)
    except MessageError as exc:
        await stream.close()
        raise OpenFailed("refused", f"{stage.name()} answered with a bad 'attached': "
                          f"{exc.reason}") from None
    if attached.layers != stage.layers:
        await stream.close()
        raise OpenFailed("layers_mismatch",
                          f"{stage.name()} serves layers {list(attached.layers)}, the "
                          f"cluster config says {list(stage.layers)}: restart it with the "
                          "same config")
    return stream, attached.cache_bytes



class OpenFailed(Exception):
    """A stream could not be opened and attached: the ``Failure`` and the client's words."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


def why_ended(exc: ConnectionClosed) -> str:
    """Why a stream ended, in words that name no address (a failed write's do)."""
    if exc.kind == "abort":
        return "the connection was reset"
    if exc.kind == "closed":
        return f"it closed the connection ({exc.reason})" if exc.reason \
            else "it closed the connection"
    return exc.reason or exc.kind.replace("_", " ")
