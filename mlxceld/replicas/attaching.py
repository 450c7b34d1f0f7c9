"""A router's attempt to link to one serving node (``remote.py``'s ``keep_linked``): find
its serving address, dial it, attach.

``resolved`` asks the resolver (within ``RESOLVE_S``: a router node's asks the node's
agent, ``discovery/serving.py``); ``dial`` connects as the router's ``origin``
(``connect_as``, channel 1, within the dial budget); ``attach`` sends ``attach`` and reads
the node's ``attached`` (within ``ATTACH_TIMEOUT_S``), which must name the role the
router lists the node under. Each raises ``LinkFailed`` whose message names the node by
its id and says why and what to check, never its address or the secret; the causes'
own words (addresses included) go to the log only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from mlxceld.errors import MlxceldError
from mlxceld.net import HandshakeFailed, MxclStream, NetError, connect_as
from mlxceld.replicas import messages as m
from mlxceld.replicas import protocol as p
from mlxceld.wire import EnvelopeError, SecretStore, encode_envelope, parse_envelope
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import Attach, error_in

log = logging.getLogger(__name__)

# Finding the node's serving address: a router node's resolve asks the node's agent,
# 5 s to connect and 5 s for the answer (discovery/serving.py).
RESOLVE_S: Final = 10.0
DIAL_BUDGET_S: Final = 5.0  # TCP connect and handshake, retried within it
ATTACH_TIMEOUT_S: Final = 5.0  # the node's answer to ``attach``
_DIAL_WORDS: Final = {
    "unreachable": "nothing accepts connections on its serving port",
    "handshake_timeout": "it accepted the connection but did not answer the handshake",
    "at_capacity": "it holds its maximum of connections",
    "abort": "it dropped the connection during the handshake",
}


class LinkFailed(Exception):
    """An attempt failed; the message names the node, never its address."""


async def resolved(name: str, resolve: Callable[[], Awaitable[str]]) -> str:
    """The node's serving address, as ``resolve`` says it now."""
    try:
        async with asyncio.timeout(RESOLVE_S):
            return await resolve()
    except MlxceldError as exc:  # the resolver says why (discovery/serving.py)
        log.info("%s: finding its serving address failed: %s", name, exc.message)
        raise LinkFailed(f"{name}: its serving address is not known: "
                         f"{exc.message}") from exc
    except Exception as exc:  # the resolver's own failure, whatever it is
        log.info("%s: finding its serving address failed: %s", name, exc)
        raise LinkFailed(f"{name}: its serving address is not known "
                         f"({type(exc).__name__}); is its daemon up?") from exc


async def dial(name: str, address: str, *, origin: str, keyring: SecretStore,
               budget_s: float) -> MxclStream:
    """A stream to ``address``, dialed as ``origin`` under the keyring's primary."""
    try:
        return await connect_as(origin, address, keyring=keyring, channel=1,
                                budget_s=budget_s)
    except ValueError as exc:
        raise LinkFailed(f"{name}: its serving address is not host:port") from exc
    except HandshakeFailed as exc:
        log.info("%s (%s): %s", name, address, exc)
        words = _DIAL_WORDS.get(exc.kind)
        if words is not None:
            raise LinkFailed(f"{name} is unreachable: {words} (tried for "
                             f"{budget_s:g} s)") from exc
        raise LinkFailed(f"{name} refused the handshake ({exc.kind.replace('_', ' ')}): "
                         "do both hosts hold the same cluster secret?") from exc


async def attach(stream: MxclStream, name: str, message: Attach, role: str) -> m.Attached:
    """Attach over ``stream``: the node's ``attached``, of ``role``; else the stream is
    closed and ``LinkFailed`` says why."""
    try:
        async with asyncio.timeout(ATTACH_TIMEOUT_S):
            await stream.send(encode_envelope(message.to_wire()))
            env = parse_envelope(await stream.recv(), p.ROUTER_SPECS)
    except (TimeoutError, NetError, EnvelopeError) as exc:
        await stream.abort()
        why = (f"no answer within {ATTACH_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError)
               else "the connection ended" if isinstance(exc, NetError) else str(exc))
        raise LinkFailed(f"{name} did not attach: {why}") from exc
    if env.type != "attached":
        await stream.close()
        error = error_in(env)
        raise LinkFailed(f"{name} refused to attach ({error.code or None}): "
                         f"{error.message[:1000]}")
    try:
        attached = m.Attached.from_wire(env.header)
    except MessageError as exc:
        await stream.close()
        raise LinkFailed(
            f"{name} sent an 'attached' without its context_length and max_batch "
            "(another version of mlxceld?)" if exc.field in ("context_length", "max_batch")
            else f"{name} sent a bad 'attached': {exc.reason}") from None
    if attached.role != role:
        await stream.close()
        raise LinkFailed(f"{name} is a {attached.role[:20]} node, listed here "
                         f"as a {role} node: list it in the right pool")
    return attached


__all__ = ["ATTACH_TIMEOUT_S", "DIAL_BUDGET_S", "RESOLVE_S", "LinkFailed", "attach", "dial",
           "resolved"]
