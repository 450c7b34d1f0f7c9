"""Prefill and decode nodes: a serving node's side of disaggregation (``protocol.py``).

``HandoffService`` is a ``ServingService`` whose engine can hand a KV cache off
(``HandoffEngine``: the local engine's ``prefill``, ``generate_from`` and
``cache_layout``), in one of two roles:

- ``prefill``: takes ``prefill`` from routers. Before any work it checks the
  ``decode_target`` against the allowlist (``decode_allowlist``: refused with
  ``forbidden``, nothing prefilled, nothing sent) and the compression; the engine's
  ``prefill`` then refuses a model whose cache cannot travel (``unsupported``, per
  request: the node serves on). The cache is encoded off the event loop, sent to the
  decode target over a link this node dials as its own serving address (``targets.py``:
  one per target, kept while it works, handed over to a new key), in ``handoff``
  frames of whole layers, each under ``HANDOFF_FRAME_BYTES``; then ``prefilled``
  {bytes, encode_ms, send_ms} to the router.
- ``decode``: takes ``expect`` from routers and ``handoff`` from prefill nodes. An
  ``expect`` holds a sequence (it counts against the router's bound as a ``generate``)
  for at most ``handoff_timeout_s``; its ``handoff`` must come from an identity in
  ``prefill_peers()`` (the handshake's, never a field) that is the expect's
  ``prefill``, else it is dropped (a rate-limited ``router_drop`` warning) and
  changes nothing. Two cases are held for a moment instead (``held.py``, bounded in
  time, count and bytes): a peer's handoff that came before its ``expect`` waits for
  it, and a handoff from the address an ``expect`` names that is not a peer yet (a
  prefill node restarted on a new port) waits while ``recheck_peers`` asks the peers'
  agents again; if it is still no peer, the sequence ends with ``bad_handoff`` at once.
  A handoff let go so (past ``held.HOLD_S``, or past the bounds) is dropped with the
  same warning, saying why. Bounds: the frames' blobs may not add up to more than the cache of
  the expected prompt would be uncompressed (``handoff_bytes``), nor come in more
  parts than the model has layers; the whole is checked (``decode_cache``) before
  decoding. A cache that does not fit, or none in time, ends the sequence with
  ``bad_handoff`` to the router.

The allowlist (``MLXCEL_DECODE_ALLOWLIST``): comma-separated numeric ``ip:port``
serving addresses a prefill node may send caches to; an entry that is a host name or
malformed is skipped with a warning; unset or empty, or every entry skipped: any target
(one warning at start, naming the skipped entries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from mlxceld import failpoints
from mlxceld.engine.base import Engine, EngineError, GenerationRequest, TokenOutput
from mlxceld.engine.constraints import ConstraintError
from mlxceld.engine.handoff import (
    QUANTS,
    CacheLayout,
    HandoffError,
    HandoffUnsupported,
    Mode,
    decode_cache,
    encode_cache,
    handoff_specs,
)
from mlxceld.net import ConnectionClosed
from mlxceld.net.securitylog import SecurityLog
from mlxceld.replicas import protocol as p
from mlxceld.replicas.held import EarlyHandoffs, HeldHandoffs
from mlxceld.replicas.messages import Expect, Handoff, Prefill, Prefilled
from mlxceld.replicas.service import ServingService, _forget, _Link, _Sequence
from mlxceld.replicas.targets import DecodeTargets
from mlxceld.tasks import Background
from mlxceld.types import HANDOFF_SIDES
from mlxceld.wire import Envelope, MessageSpec, TensorSpec, encode_envelope
from mlxceld.wire.address import parse_address
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import CodedError

log = logging.getLogger(__name__)

ALLOWLIST_ENV: Final = "MLXCEL_DECODE_ALLOWLIST"


class HandoffEngine(Engine, Protocol):
    """An engine that can prefill for a handoff and decode from one (``LocalEngine``)."""

    vocab_size: int

    async def prefill(self, request: GenerationRequest) -> tuple[TokenOutput, list[Any]]: ...

    def generate_from(self, request: GenerationRequest, first: TokenOutput,
                      cache: Sequence[Any]) -> AsyncGenerator[TokenOutput, None]: ...

    def cache_layout(self) -> CacheLayout: ...


def decode_allowlist(text: str | None) -> frozenset[str] | None:
    """The decode targets ``text`` (the variable's value) allows; None: any (it is unset
    or empty: warned once). A host name or malformed entry is skipped with a warning; when
    every entry is skipped, any target is allowed, as unset, with one warning naming them
    all (never a list that refuses every target)."""
    if text is None or not text.strip():
        log.warning("%s is not set: this prefill node sends KV caches to any decode target "
                    "a router names; set it to the decode nodes' serving ip:port list",
                    ALLOWLIST_ENV)
        return None
    allowed, skipped = set(), []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            where = parse_address(entry)
        except ValueError as exc:
            skipped.append((entry, str(exc)))
            continue
        if where.ip is None:
            skipped.append((entry, "give a numeric ip:port (a name may resolve elsewhere)"))
            continue
        allowed.add(where.canonical())
    if not allowed:
        log.warning("%s holds no usable entry (%s): this prefill node sends KV caches to any "
                    "decode target a router names, as if it were unset; give the decode "
                    "nodes' serving addresses as numeric ip:port", ALLOWLIST_ENV,
                    "; ".join(f"skipped {entry!r}: {why}" for entry, why in skipped)
                    or "only commas")
        return None
    for entry, why in skipped:
        log.warning("%s: skipped %r: %s", ALLOWLIST_ENV, entry, why)
    return frozenset(allowed)


def handoff_bytes(layout: CacheLayout, tokens: int) -> int:
    """The most a cache of ``tokens`` tokens may take on the wire, in any mode."""
    return max(sum(t.dims[0][1] for t in handoff_specs(layout, tokens, Mode(q, True))
                   .tensors.values()) for q in QUANTS)


def _union_spec(layout: CacheLayout, max_tokens: int) -> MessageSpec:
    """Any subset of any mode's blobs, each within its largest bound: one ``handoff``."""
    bounds: dict[str, int] = {}
    for quant in QUANTS:
        for name, tspec in handoff_specs(layout, max_tokens, Mode(quant, True)).tensors.items():
            bounds[name] = max(bounds.get(name, 0), tspec.dims[0][1])
    return MessageSpec({name: TensorSpec(frozenset({"u8"}), ((0, bound),), required=False)
                        for name, bound in bounds.items()})


@dataclass
class _Expected:
    """A decode node's pending ``expect``: what its ``handoff`` must match."""

    request: GenerationRequest
    prefill: str  # the identity the handoff must come from
    parts: int = 0  # 0 until part 0 came
    got: int = 0
    first: TokenOutput | None = None  # part 0's
    cache: dict[str, Any] = field(default_factory=dict)  # part 0's: encode_cache's header
    blobs: dict[str, bytes] = field(default_factory=dict)
    size: int = 0
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                       .create_future())


@dataclass
class HandoffStats:
    """What a prefill node sent (or a decode node took)."""

    handoffs: int = 0
    bytes: int = 0
    refused: int = 0
    dropped: int = 0
    held: int = 0  # (decode) handoffs held for their expect or a peers' ask (``held.py``)
    # Time in the handoffs: a prefill node's encoding and sending, a decode node's decoding.
    seconds: float = 0.0


class HandoffService(ServingService):
    def __init__(self, engine: HandoffEngine, *, role: str,
                 prefill_peers: Callable[[], Collection[str]] = frozenset,
                 recheck_peers: Callable[[], Awaitable[None]] | None = None,
                 allowlist: frozenset[str] | None = None,
                 handoff_timeout_s: float = p.HANDOFF_TIMEOUT_S,
                 early: HeldHandoffs | None = None, **options: Any) -> None:
        """``role``: "prefill" or "decode"; ``prefill_peers``: (decode) the serving
        addresses a handoff may come from, asked at each one; ``recheck_peers``: (decode)
        asks the peers' agents again now, for a handoff from an address not among them
        (None: none is asked, such a handoff is dropped once held); ``allowlist``:
        (prefill) the decode targets allowed (``decode_allowlist``; None: any);
        ``early``: (decode) where early handoffs are held (default ``held.py``'s bounds).
        The rest is ``ServingService``'s."""
        if role not in HANDOFF_SIDES:
            raise ValueError(f"role must be one of {', '.join(HANDOFF_SIDES)}, not {role!r}")
        super().__init__(engine, role=role, **options)
        self.handoff_engine = engine
        self._layout = engine.cache_layout()
        self._prefill_peers = prefill_peers
        self._allowlist = allowlist
        self._handoff_timeout_s = handoff_timeout_s
        self._expected: dict[str, _Expected] = {}
        self._targets = DecodeTargets(self.node_id, origin=lambda: self.origin,
                                      keyring=self._keyring)
        # The early handoffs' rechecks: they outlive the handoff that started them, and
        # the node has no scope for them beside its connections'; aclose ends them.
        self._readers = Background(f"node {self.node_id}'s held handoffs")
        self._early = EarlyHandoffs(
            early if early is not None else HeldHandoffs(),
            known=lambda peer: peer in self._prefill_peers(),
            expects=self._expected.__contains__, deliver=self._deliver,
            fail=self._fail_expected, dropped=self._drop, recheck=recheck_peers,
            spawn=self._readers.spawn)
        self._security = SecurityLog(logger=log)
        self.stats = HandoffStats()
        if role == "prefill":
            self._specs.pop("generate")
            self._specs.pop("expect")
        else:
            self._specs.pop("generate")
            self._specs.pop("prefill")
            self._specs["handoff"] = _union_spec(self._layout, engine.context_length)
            self._unattached = frozenset({"handoff"})

    @property
    def origin(self) -> str:
        """This node's serving address as it dials: its identity to decode nodes."""
        return f"{self.host}:{self.port}"

    async def aclose(self) -> None:
        self._early.close()
        await self._targets.aclose()
        await self._readers.aclose()
        self._security.flush(f"node {self.node_id}: ")
        await super().aclose()

    async def _other(self, link: _Link, env: Envelope) -> None:
        if env.type == "prefill" and self.role == "prefill":
            self._prefill(link, env)
        elif env.type == "expect" and self.role == "decode":
            if failpoints.EXPECT_DELAY_S:  # tests only: the handoff comes first
                await asyncio.sleep(failpoints.EXPECT_DELAY_S)
            self._expect(link, env)
        elif env.type == "handoff" and self.role == "decode":
            self._handoff(link, env)
        else:
            await super()._other(link, env)

    async def _failed(self, link: _Link, seq: str, exc: Exception) -> None:
        code = (p.ERR_UNSUPPORTED if isinstance(exc, HandoffUnsupported)
                else p.ERR_BAD_HANDOFF if isinstance(exc, HandoffError) else None)
        if code is None:
            await super()._failed(link, seq, exc)
            return
        log.warning("node %s: sequence %s of router %s: %s", self.node_id, seq,
                    link.stream.peer, exc)
        with contextlib.suppress(ConnectionClosed):
            await link.stream.send(encode_envelope(CodedError(code, str(exc), seq).to_wire()))

    # -- prefill ------------------------------------------------------------------------

    def _prefill(self, link: _Link, env: Envelope) -> None:
        prefill = Prefill.from_wire(env.header)
        target = prefill.decode_target
        if self._allowlist is not None \
                and parse_address(target).canonical() not in self._allowlist:
            self.stats.refused += 1
            raise p.ProtocolViolation(p.ERR_FORBIDDEN, f"decode target {target} is not in "
                                      f"node {self.node_id}'s {ALLOWLIST_ENV}: add it there "
                                      "if it is one of the cluster's decode nodes")
        seq, request = self._admit(link, prefill, env)
        self._spawn(link, seq, lambda sequence: self._run_prefill(
            sequence, seq, request, target, prefill.compression))

    async def _run_prefill(self, sequence: _Sequence, seq: str, request: GenerationRequest,
                           target: str, mode: Mode) -> None:
        self._held += 1
        try:
            first, cache = await self.handoff_engine.prefill(request)
            started = time.perf_counter()
            header, blobs = await asyncio.to_thread(encode_cache, cache, mode)
            del cache
            encoded = time.perf_counter()
            size = await self._send_handoff(target, seq, first, header, blobs)
            sent = time.perf_counter()
            self.stats.handoffs += 1
            self.stats.bytes += size
            self.stats.seconds += sent - started
            await sequence.link.stream.send(encode_envelope(Prefilled(
                seq, size, round((encoded - started) * 1000, 3),
                round((sent - encoded) * 1000, 3)).to_wire()))
        except ConnectionClosed:
            pass  # the router is gone: the connection's end cancels the rest
        except (ConstraintError, EngineError) as exc:
            await self._failed(sequence.link, seq, exc)
        except ValueError as exc:  # the prompt or parameters, as handoff.prefill says
            with contextlib.suppress(ConnectionClosed):
                await sequence.link.stream.send(encode_envelope(
                    CodedError(p.ERR_BAD_REQUEST, str(exc), seq).to_wire()))
        finally:
            self._held -= 1
            self._ended.set()
            _forget(sequence, seq)

    async def _send_handoff(self, target: str, seq: str, first: TokenOutput,
                            header: dict[str, Any], blobs: dict[str, bytes]) -> int:
        """Send the cache to ``target`` in frames of whole layers; its byte count."""
        groups: list[list[tuple[str, bytes]]] = [[]]
        room = p.HANDOFF_FRAME_BYTES
        for i in range(header["layers"]):
            layer = [(name, blobs[name]) for name in (f"k{i}", f"k{i}.s", f"v{i}", f"v{i}.s")
                     if name in blobs]
            need = sum(len(b) for _, b in layer)
            if groups[-1] and need > room:
                groups.append([])
                room = p.HANDOFF_FRAME_BYTES
            groups[-1].extend(layer)
            room -= need
        frames = (encode_envelope(
            Handoff(seq, part, len(groups),
                    *((first, header) if part == 0 else (None, None))).to_wire(),
            [(name, "u8", (len(data),), data) for name, data in group])
            for part, group in enumerate(groups))
        await self._targets.send(target, frames)
        return sum(len(b) for b in blobs.values())

    def rekey(self) -> None:
        """The keyring's primary changed: (prefill) the links to decode targets are
        handed over (``targets.py``); routers hand their own links over (``adopt``)."""
        self._targets.rekey()

    # -- decode -------------------------------------------------------------------------

    def _expect(self, link: _Link, env: Envelope) -> None:
        expect = Expect.from_wire(env.header)
        prefill = expect.prefill
        seq, request = self._admit(link, expect, env)
        if seq in self._expected:
            raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"sequence {seq} is already "
                                      "expected on this node")
        expected = _Expected(request, prefill)
        self._expected[seq] = expected
        self._spawn(link, seq, lambda sequence: self._run(
            sequence, seq, request, lambda: self._decode(seq, expected)))
        self._early.expected(seq)

    async def _decode(self, seq: str, expected: _Expected
                      ) -> AsyncGenerator[TokenOutput, None]:
        """The expected sequence's tokens, once its handoff came whole (see above)."""
        try:
            try:
                async with asyncio.timeout(self._handoff_timeout_s):
                    await expected.done
            except TimeoutError:
                raise HandoffError(f"no KV cache came from the prefill node within "
                                   f"{self._handoff_timeout_s:g} s") from None
        finally:
            self._expected.pop(seq, None)
            if not expected.done.done():  # its frames still to come are dropped at once
                self._early.rule.drop(seq, "its sequence ended before its KV cache came")
        assert expected.first is not None  # part 0 came, with its first token
        first = checked_first(expected.first, self.handoff_engine.vocab_size)
        started = time.perf_counter()
        cache = await asyncio.to_thread(decode_cache, expected.cache,
                                        expected.blobs, expect=self._layout,
                                        max_tokens=len(expected.request.prompt_tokens))
        expected.blobs.clear()
        self.stats.handoffs += 1
        self.stats.bytes += expected.size
        self.stats.seconds += time.perf_counter() - started
        try:
            source = self.handoff_engine.generate_from(expected.request, first, cache)
        except ValueError as exc:
            raise HandoffError(str(exc)) from None
        async with contextlib.aclosing(source) as tokens:
            async for out in tokens:
                yield out

    def _handoff(self, link: _Link, env: Envelope) -> None:
        peer = link.stream.peer_identity
        seq = env.header.get("seq")
        if peer is None or not isinstance(seq, str):
            self._drop(str(link.stream.peer), "no router expects that sequence here")
            return
        expected = self._expected.get(seq)
        known = peer in self._prefill_peers()
        if seq in self._early:
            self._early.hold(seq, peer, env)  # behind its sequence's frames held before
        elif expected is None or (not known and expected.prefill == peer):
            # Early (its expect may be on its way), or from a prefill node that restarted
            # on a new port, maybe (its agent is asked again).
            self.stats.held += 1
            self._early.hold(seq, peer, env)
        else:
            self._deliver(seq, peer, env, known)

    def _deliver(self, seq: str, peer: str, env: Envelope, known: bool) -> None:
        """Take ``env`` into its expected sequence, or drop it saying why (see above)."""
        expected = self._expected.get(seq)
        why = None
        if not known:
            why = "it is not one of this node's prefill peers"
            if expected is not None and expected.prefill == peer and not expected.done.done():
                # The router sent the cache here from that node: end the wait at once.
                expected.done.set_exception(HandoffError(
                    f"the KV cache came from {peer}, which is not one of decode node "
                    f"{self.node_id}'s prefill peers, as their agents answered when asked "
                    "again (see its log and its --prefill-peers)"))
        elif expected is None:
            why = self._early.rule.gone(seq) or "no router expects that sequence here"
        elif expected.prefill != peer:
            why = "the router expects it from another prefill node"
        elif expected.done.done():
            why = "that sequence's handoff is already complete"
        if why is not None:
            self._drop(peer, why)
            return
        assert expected is not None
        try:
            self._take_part(expected, env)
        except HandoffError as exc:
            expected.blobs.clear()
            expected.done.set_exception(exc)

    def _drop(self, peer: str, why: str) -> None:
        self.stats.dropped += 1
        self._security.warn("router_drop", "node %s dropped a handoff from %s: %s",
                            self.node_id, peer, why, kind="handoff dropped")

    def _fail_expected(self, seq: str, why: str) -> None:
        expected = self._expected.get(seq)
        if expected is not None and not expected.done.done():
            expected.done.set_exception(HandoffError(f"its KV cache was dropped: {why}"))

    def _take_part(self, expected: _Expected, env: Envelope) -> None:
        layers = self._layout.layers
        try:
            handoff = Handoff.from_wire(env.header)
        except MessageError as exc:
            raise HandoffError(f"'part' and 'parts' must be 0 <= part < parts <= {layers}"
                               if exc.field == "part" else exc.reason) from None
        part, parts = handoff.part, handoff.parts
        if parts > layers:
            raise HandoffError(f"'part' and 'parts' must be 0 <= part < parts <= {layers}")
        if part != expected.got or (expected.parts and parts != expected.parts):
            raise HandoffError(f"handoff part {part} of {parts} came out of order")
        if part == 0:
            expected.first, expected.cache = handoff.first, dict(handoff.cache or {})
            expected.parts = parts
        limit = handoff_bytes(self._layout, len(expected.request.prompt_tokens))
        for name, tensor in env.tensors.items():
            if name in expected.blobs:
                raise HandoffError(f"blob {name!r} came twice")
            expected.size += len(tensor.data)
            if expected.size > limit:
                raise HandoffError(f"the handoff exceeds {limit} bytes, the most a cache of "
                                   f"{len(expected.request.prompt_tokens)} tokens takes")
            expected.blobs[name] = bytes(tensor.data)
        expected.got += 1
        if expected.got == expected.parts:
            expected.done.set_result(None)


def checked_first(first: TokenOutput, vocab_size: int) -> TokenOutput:
    """``first``, whose token must be in this node's vocabulary."""
    if not first.token < vocab_size:
        raise HandoffError(f"'first.token' must be a token id below {vocab_size}")
    return first


__all__ = ["ALLOWLIST_ENV", "HandoffEngine", "HandoffService", "HandoffStats",
           "checked_first", "decode_allowlist", "handoff_bytes"]
