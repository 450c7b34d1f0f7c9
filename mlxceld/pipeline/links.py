"""The coordinator's connection to one stage: dial, attach, send, and sort what comes back.

A link reads its stream all the time (so pings are answered and a closed or
killed stage is noticed at once) and hands each message to the waiting
sequence's inbox by ``seq``. When the stream ends, every sequence that waits on
the link gets ``StageUnavailable`` naming the stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.engine.base import EngineUnavailable
from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, NetError, connect
from mlxceld.pipeline import protocol as p
from mlxceld.wire import Envelope, EnvelopeError, Keyring, encode_envelope, parse_envelope

log = logging.getLogger(__name__)

DIAL_BUDGET_S: Final = 5.0  # a stage that does not answer within this is unavailable
ATTACH_TIMEOUT_S: Final = 5.0

Inbox = asyncio.Queue[tuple[int, Envelope] | BaseException]  # (the stage's rank, message)


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
        return f"stage {self.node_id} ({self.address})"


class StageLink:
    def __init__(self, stage: StageAddress, *, keyring: Keyring, identity: str,
                 dial_ip: str | None, inboxes: Callable[[str], Inbox | None]) -> None:
        self.stage = stage
        self._keyring = keyring
        self._identity = identity
        self._dial_ip = dial_ip
        self._inboxes = inboxes  # seq -> its inbox, or None when nobody waits for it
        self._stream: MxclStream | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._waiting: set[str] = set()  # sequences prepared through this link
        self.broken: str | None = None

    @property
    def up(self) -> bool:
        return self._stream is not None and not self._stream.closed

    async def ensure(self, model_identity: str, cluster: str) -> None:
        """Connect and attach unless already attached; ``EngineUnavailable`` otherwise."""
        async with self._lock:
            if self.up:
                return
            stage = self.stage
            try:
                stream = await connect(
                    stage.host, stage.port, keyring=self._keyring, identity=self._identity,
                    channel=1, budget_s=DIAL_BUDGET_S,
                    local_addr=(self._dial_ip, 0) if self._dial_ip else None)
            except HandshakeFailed as exc:
                raise EngineUnavailable(f"{stage.name()} is unavailable: {exc}") from exc
            try:
                async with asyncio.timeout(ATTACH_TIMEOUT_S):
                    await stream.send(encode_envelope(
                        {"t": "attach", "model": model_identity, "cluster": cluster}))
                    env = parse_envelope(await stream.recv(), p.ENGINE_SPECS)
            except (TimeoutError, ConnectionClosed, EnvelopeError) as exc:
                await stream.abort()
                raise EngineUnavailable(f"{stage.name()} did not attach: {exc or 'timeout'}"
                                        ) from exc
            if env.type != "attached":
                await stream.close()
                raise EngineUnavailable(f"{stage.name()} refused to attach: "
                                        f"{env.header.get('message', env.type)}")
            if tuple(env.header.get("layers", ())) != stage.layers:
                await stream.close()
                raise EngineUnavailable(
                    f"{stage.name()} serves layers {env.header.get('layers')}, the cluster "
                    f"config says {list(stage.layers)}: restart it with the same config")
            self._stream = stream
            self.broken = None
            self._reader = asyncio.ensure_future(self._read(stream))
            log.info("attached %s, layers %s", stage.name(), list(stage.layers))

    async def send(self, header: dict[str, Any], tensors: list[Any] | None = None) -> None:
        stream = self._stream
        if stream is None or stream.closed:
            raise EngineUnavailable(f"{self.stage.name()} is not connected"
                                    + (f": {self.broken}" if self.broken else ""))
        try:
            await stream.send(encode_envelope(header, tensors or ()))
        except NetError as exc:
            raise EngineUnavailable(f"{self.stage.name()}: sending failed: {exc}") from exc

    def track(self, seq: str) -> None:
        self._waiting.add(seq)

    def untrack(self, seq: str) -> None:
        self._waiting.discard(seq)

    async def _read(self, stream: MxclStream) -> None:
        reason = "closed"
        try:
            while True:
                payload = await stream.recv()
                try:
                    env = parse_envelope(payload, p.ENGINE_SPECS)
                except EnvelopeError as exc:
                    log.warning("%s sent a bad message: %s", self.stage.name(), exc.reason)
                    continue
                seq = env.header.get("seq")
                inbox = self._inboxes(seq) if isinstance(seq, str) else None
                if inbox is None:
                    if env.type == "error":
                        log.warning("%s: %s (%s)", self.stage.name(),
                                    env.header.get("message"), env.header.get("code"))
                    continue
                inbox.put_nowait((self.stage.rank, env))
        except ConnectionClosed as exc:
            reason = str(exc)
        except asyncio.CancelledError:
            reason = "the engine is closing"
            raise
        finally:
            self.broken = reason
            failure = EngineUnavailable(f"{self.stage.name()} is unavailable: {reason}")
            for seq in list(self._waiting):
                inbox = self._inboxes(seq)
                if inbox is not None:
                    inbox.put_nowait(failure)
            self._waiting.clear()
            log.warning("lost %s: %s", self.stage.name(), reason)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._stream is not None:
            await self._stream.close("coordinator stopping")
