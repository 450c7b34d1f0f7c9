"""A prefill node's links to the decode nodes it hands KV caches to (``handoffs.py``).

One link per decode target, dialed when a handoff first needs it as this node's serving
address (``connect_as``: the identity the decode node checks against its prefill peers),
within ``DIAL_BUDGET_S``, and kept while it works: a handoff's frames all go over one
link, in order (``send``). The decode node sends nothing on it but pongs, which a reader
drains.

Handover (``rekey``: the keyring's primary changed, a secret rotation's ``use``): the
next handoff to a target dials a new link under the new primary; a link under another
key is finished (our close frame: the decode node reads every frame sent before it) at
once when no handoff is being sent over it, else as its last one ends. So the old key
is soon unused and its removal cuts no handoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Final

from mlxceld.engine.handoff import HandoffError
from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, connect_as
from mlxceld.tasks import Background
from mlxceld.wire import SecretStore
from mlxceld.wire.crypto import Buffer

log = logging.getLogger(__name__)

DIAL_BUDGET_S: Final = 5.0  # a prefill node dialing a decode target
_HANDED_OVER: Final = "handed over to a link under the new primary key"


class DecodeTargets:
    """The links of prefill node ``node_id`` (dialing as ``origin()``) to its targets."""

    def __init__(self, node_id: str, *, origin: Callable[[], str],
                 keyring: SecretStore) -> None:
        self._node_id = node_id
        self._origin = origin
        self._keyring = keyring
        self._links: dict[str, MxclStream] = {}  # target -> the link new handoffs take
        self._sending: dict[MxclStream, int] = {}  # link -> handoffs being sent over it
        self._dialing = asyncio.Lock()  # one dial at a time
        self._readers = Background(f"node {node_id}'s links to decode nodes")

    async def send(self, target: str, payloads: Iterable[Buffer]) -> None:
        """Send a handoff's frames (``payloads``, each made as it is sent) to ``target``
        over one link; ``HandoffError`` if it cannot be dialed or ends meanwhile."""
        stream = await self._link(target)
        self._sending[stream] = self._sending.get(stream, 0) + 1
        try:
            for payload in payloads:
                await stream.send(payload)
        except ConnectionClosed:
            if self._links.get(target) is stream:
                del self._links[target]
            raise HandoffError("sending the KV cache to the decode node failed: the "
                               "connection ended") from None
        finally:
            self._sending[stream] -= 1
            if not self._sending[stream]:
                del self._sending[stream]
                if self._stale(stream):
                    self._finish(target, stream)

    def rekey(self) -> None:
        """The keyring's primary changed: finish each idle link under another key (see the
        module doc)."""
        for target, stream in list(self._links.items()):
            if self._stale(stream) and stream not in self._sending:
                self._finish(target, stream)

    async def aclose(self) -> None:
        for stream in list(self._links.values()):
            await stream.close("prefill node stopping")
        self._links.clear()
        await self._readers.aclose()

    def _stale(self, stream: MxclStream) -> bool:
        return stream.key_id != self._keyring.primary_id

    def _finish(self, target: str, stream: MxclStream) -> None:
        if self._links.get(target) is stream:
            del self._links[target]
        log.info("node %s: the link to decode target %s under key %s is finished (%s)",
                 self._node_id, target, stream.key_id.hex(), _HANDED_OVER)
        stream.finish(_HANDED_OVER)

    async def _link(self, target: str) -> MxclStream:
        """The link to ``target`` under the primary, dialed if need be."""
        async with self._dialing:
            return await self._dialed(target)

    async def _dialed(self, target: str) -> MxclStream:
        stream = self._links.get(target)
        if stream is not None and not stream.closed and not self._stale(stream):
            return stream
        try:
            new = await connect_as(self._origin(), target, keyring=self._keyring,
                                   channel=1, budget_s=DIAL_BUDGET_S)
        except (HandshakeFailed, ValueError) as exc:
            log.info("node %s: dialing decode target %s failed: %s", self._node_id, target,
                     exc)
            raise HandoffError("the decode node is unreachable from the prefill node "
                               f"{self._node_id} (tried for {DIAL_BUDGET_S:g} s)") from None
        old = self._links.get(target)
        if old is not None and old is not new and not old.closed \
                and old not in self._sending:
            self._finish(target, old)  # a stale one no handoff uses
        self._links[target] = new
        self._readers.spawn(_read_to_end(new))
        return new


async def _read_to_end(stream: MxclStream) -> None:
    """The decode node never sends on this link but pongs; read them so they drain."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await stream.recv()


__all__ = ["DIAL_BUDGET_S", "DecodeTargets"]
