"""What a node's answers to a router's sequence mean (``remote.py``, the router's side).

A ``token`` becomes the engine's ``TokenOutput`` (``token_output``: every field checked,
a bad one an ``EngineError`` naming the node); an ``error`` becomes the exception the
API answers with (``refusal``): ``busy``, ``unavailable`` and ``draining`` as
``EngineUnavailable`` naming the node (the pool tries another), ``bad_request`` as
``RequestRefused`` (a ``ConstraintError``: the API answers 400, as for a pipeline stage's
``bad_constraint``), ``unsupported`` as ``HandoffUnsupported`` (500 naming the family),
``forbidden`` and anything else as ``EngineError``, ``bad_handoff`` as
``EngineUnavailable`` (retry). What the node said goes to the router's log; what a client
may read names the node by its id only.
"""

from __future__ import annotations

import logging
import struct
from typing import Final

from mlxceld.engine.base import EngineError, EngineUnavailable, TokenOutput
from mlxceld.engine.constraints import ConstraintError
from mlxceld.engine.handoff import HandoffUnsupported
from mlxceld.replicas import protocol as p
from mlxceld.wire import Envelope
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import CodedError, Token

log = logging.getLogger(__name__)

DRAINING_RETRY_S: Final = 5  # Retry-After for a draining node: it stops, then restarts


class RequestRefused(ConstraintError):
    """The node refused a request as the client's (``bad_request``): HTTP 400."""


def token_output(node_id: str, env: Envelope, logprobs: int | None) -> TokenOutput:
    """A sequence's ``token`` as its next output (an ``error`` is the caller's:
    ``refusal``)."""
    if env.type != "token":
        raise EngineError(f"node {node_id} sent '{env.type}' for a sequence")
    try:
        said = Token.from_wire(env.header)
        logprob, top = said.logprobs(logprobs)
        if said.cached is not None and said.cached > p.MAX_PROMPT_TOKENS:
            raise MessageError("cached", f"'cached' must be an integer from 0 to "
                                         f"{p.MAX_PROMPT_TOKENS}")
    except MessageError as exc:
        raise EngineError(f"node {node_id} sent a bad token: {exc.reason}") from None
    (token,) = struct.unpack("<i", env.tensors["tokens"].data)
    return TokenOutput(token, said.finish_reason, logprob, top, cached=said.cached)


def refusal(node_id: str, error: CodedError) -> Exception:
    """The exception for the node's ``error`` (see the module doc)."""
    code, message = error.code or None, error.message[:1000]
    name = f"node {node_id}"
    if code == p.ERR_BAD_REQUEST:
        return RequestRefused(f"{name}: {message}")
    if code == p.ERR_UNSUPPORTED:
        return HandoffUnsupported(f"{name}: {message}")
    if code == p.ERR_FORBIDDEN:
        log.warning("%s refused a prefill: %s", name, message)
        return EngineError(f"{name} refused to send the KV cache to the decode node "
                           "chosen (not in its MLXCEL_DECODE_ALLOWLIST); see the "
                           "router's log")
    if code == p.ERR_BAD_HANDOFF:
        log.warning("%s: %s", name, message)
        return EngineUnavailable(f"{name}: the KV cache handoff failed; retry",
                                 retry_after_s=1)
    if code == p.ERR_BUSY:
        return EngineUnavailable(f"{name} is busy: {message}", retry_after_s=1)
    if code == p.ERR_DRAINING:
        return EngineUnavailable(f"{name} is draining: it takes no new request; retry "
                                 "shortly", retry_after_s=DRAINING_RETRY_S)
    if code == p.ERR_UNAVAILABLE:
        after = error.retry_after_s
        return EngineUnavailable(f"{name} is unavailable: {message}",
                                 retry_after_s=after if type(after) is int and 0 < after
                                 <= 3600 else 1)
    log.warning("%s refused a request: %s (%s)", name, message, code)
    return EngineError(f"{name} failed the request ({code}); see the router's log")


__all__ = ["DRAINING_RETRY_S", "RequestRefused", "refusal", "token_output"]
