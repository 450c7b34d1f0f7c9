"""``DisaggEngine``: a router's ``Engine`` over prefill and decode nodes (``handoffs.py``).

Each request goes to a pair: the prefill node with the least outstanding prefill tokens
and the decode node with the least outstanding work (``routing.py``'s accounts, one per
pool, without prefix affinity: a decode node holds no prompt cache the router could
use). The router first sends ``expect`` to the decode node over its own link to it (the
result-frame rule: the tokens come back on that link only), then ``prefill`` to the
prefill node, naming the decode node's serving address from the router's own registry
(``RemoteEngine.address``, as it last resolved it) and the deployment's compression
(``mode``). The prefill node's ``prefilled`` (bytes, encode and send time) goes into
the stats; its refusal ends the request (the decode node's sequence is cancelled).

Nodes are ``RemoteEngine``s of role ``prefill`` / ``decode``: up, connecting or down as
replicas are (send errors, silence). Only up nodes are chosen; with no prefill node or
no decode node up the request is refused with ``EngineUnavailable`` (HTTP 503 with
Retry-After) naming which pool has none. A node that refuses a request as ``draining``
(`mlxctl drain` of it, or it stops) before its first token has the request tried on
another pair without it, each draining node at most once, and is passed over until
its ``RemoteEngine.draining_until`` (a last resort meanwhile). Bounds: a prefill is
answered within ``PREFILL_TIMEOUT_S`` (the prompt's prefill and the handoff's send),
else the request fails with 503; the decode node's first token must follow the prefill
node's ``prefilled`` within ``FIRST_TOKEN_S`` (a handoff the decode node dropped, e.g.
from a prefill node missing from its ``--prefill-peers``, would otherwise hold the
request for the decode node's own bound, ``protocol.HANDOFF_TIMEOUT_S``), else 503.
A handoff the decode node cannot take (its sender not among its ``--prefill-peers``,
even asked again; bounds) ends the sequence at once with ``bad_handoff``: 503 with
Retry-After 1, not a wait; a handoff that came before its ``expect`` is held for it
(``held.py``).

Errors: a model whose cache cannot travel (``HandoffUnsupported`` from the prefill
node) is HTTP 500 naming the family: the deployment is wrong (serve it on hybrid
nodes), retrying cannot help; a decode target the prefill node's allowlist refuses is
500 too (the router's log says which); a request the prefill node refuses as the
client's (a prompt over its context, a bad token id) is 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.engine.base import EngineError, EngineUnavailable, GenerationRequest, TokenOutput
from mlxceld.engine.handoff import HandoffUnsupported, Mode
from mlxceld.replicas.messages import Prefilled
from mlxceld.replicas.redaction import scrub
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.replicas.routing import Choice, Outcome, Routing

log = logging.getLogger(__name__)

PREFILL_TIMEOUT_S: Final = 300.0  # a prefill and its handoff, answered within this
FIRST_TOKEN_S: Final = 30.0  # the decode node's first token, once the handoff was sent


@dataclass
class HandoffAccount:
    """Handoffs through one prefill node: how many, their bytes and times."""

    handoffs: int = 0
    bytes: int = 0
    encode_ms: float = 0.0
    send_ms: float = 0.0

    def add(self, prefilled: Prefilled) -> None:
        self.handoffs += 1
        self.bytes += prefilled.bytes
        self.encode_ms += prefilled.encode_ms
        self.send_ms += prefilled.send_ms

    def view(self) -> dict[str, Any]:
        return {"handoffs": self.handoffs, "bytes": self.bytes,
                "encode_ms": round(self.encode_ms, 3), "send_ms": round(self.send_ms, 3)}


class DisaggEngine:
    """Implements ``Engine`` over a prefill pool and a decode pool of ``RemoteEngine``s."""

    def __init__(self, prefill: Sequence[RemoteEngine], decode: Sequence[RemoteEngine], *,
                 model_id: str, context_length: int, mode: Mode | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("disaggregation needs at least one prefill and one decode node")
        self.model_id = model_id
        self.context_length = context_length
        self.mode = mode or Mode()
        self._prefill = {n.node_id: n for n in prefill}
        self._decode = {n.node_id: n for n in decode}
        self._prefill_routing = Routing({n: 1 for n in self._prefill})
        self._decode_routing = Routing({n: 1 for n in self._decode})
        self._handoffs = {n: HandoffAccount() for n in self._prefill}
        self._next = 0

    @property
    def max_batch(self) -> int:
        return sum(n.max_batch for n in self._decode.values()) or 1

    def active_sequences(self) -> int:
        return self._decode_routing.in_flight()

    def readiness(self) -> dict[str, Any] | None:
        """None when a pair can take a request; else which pool has no node up."""
        missing = [pool for pool, nodes in (("prefill", self._prefill),
                                            ("decode", self._decode))
                   if not any(n.state() == "up" for n in nodes.values())]
        if not missing:
            return None
        return {"reason": f"no {' and no '.join(missing)} node is up",
                "nodes": {n.node_id: n.last_error() for n in self._members()
                          if n.state() != "up"}}

    def _members(self) -> list[RemoteEngine]:
        return [*self._prefill.values(), *self._decode.values()]

    def _choose(self, pool: dict[str, RemoteEngine], routing: Routing,
                prompt: Sequence[int], what: str, avoid: Collection[str] = ()) -> Choice:
        for account, node in ((routing.nodes[i], n) for i, n in pool.items()):
            account.capacity = max(node.max_batch, 1)
        up = [i for i, n in pool.items() if n.state() == "up" and i not in avoid]
        now = asyncio.get_running_loop().time()  # a draining one: the last resort
        ready = [i for i in up if pool[i].draining_until <= now]
        choice = routing.choose(prompt, ready or up, hashes=())  # no affinity: see above
        if choice is None:
            errors = "; ".join(e for e in (n.last_error() for n in pool.values()) if e)
            retry = max((n.retry_after_s for n in pool.values()), default=1)
            raise EngineUnavailable(f"no {what} node is up" + (f": {errors}" if errors
                                                                  else ""),
                                    retry_after_s=retry)
        return choice

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        prompt = list(request.prompt_tokens)
        avoid: set[str] = set()  # nodes that refused it as draining
        refusal: EngineUnavailable | None = None  # the latest such refusal
        while True:
            try:
                p_choice = self._choose(self._prefill, self._prefill_routing, prompt,
                                        "prefill", avoid)
                d_choice = self._choose(self._decode, self._decode_routing, [], "decode",
                                        avoid)
            except EngineUnavailable:
                if refusal is None:
                    raise
                raise refusal from None
            source = self._pair(request, p_choice, d_choice)
            try:
                first = await anext(source)
            except EngineUnavailable as exc:
                await source.aclose()
                now = asyncio.get_running_loop().time()
                draining = {n for n, pool in ((p_choice.node_id, self._prefill),
                                              (d_choice.node_id, self._decode))
                            if pool[n].draining_until > now} - avoid
                if not draining:
                    raise
                log.info("node %s refused a request as draining before its first token; "
                         "it goes to another pair", ", ".join(sorted(draining)))
                avoid |= draining
                refusal = exc
                continue
            async with contextlib.aclosing(source):
                yield first
                async for out in source:
                    yield out
            return

    async def _pair(self, request: GenerationRequest, p_choice: Choice, d_choice: Choice
                    ) -> AsyncGenerator[TokenOutput, None]:
        """``request`` on one pair: its tokens, as ``generate``'s."""
        prompt = list(request.prompt_tokens)
        prefill, decode = self._prefill[p_choice.node_id], self._decode[d_choice.node_id]
        seq = uuid.uuid4().hex
        self._next += 1
        key = self._next
        self._prefill_routing.dispatch(key, p_choice, prompt, 0)
        self._decode_routing.dispatch(key, d_choice, (), request.params.max_tokens)
        prefill_outcome: Outcome = "cancelled"
        finished, error = False, None
        try:
            tokens = await decode.expect(seq, request, prefill.address)
            async with contextlib.aclosing(tokens):
                prefilled = await prefill.prefill(
                    seq, request, decode_target=decode.address,
                    compression=str(self.mode), within_s=PREFILL_TIMEOUT_S)
                prefill_outcome = "completed"
                self._prefill_routing.end(key, "completed")
                self._handoffs[prefill.node_id].add(prefilled)
                try:
                    async with asyncio.timeout(FIRST_TOKEN_S):
                        first = await anext(tokens)
                except TimeoutError:
                    raise EngineUnavailable(
                        f"node {decode.node_id} sent no token within {FIRST_TOKEN_S:g} s of "
                        f"node {prefill.node_id}'s handoff (its log names a handoff it "
                        "dropped: mlxctl logs router, on that node)", retry_after_s=1) from None
                except StopAsyncIteration:
                    raise EngineError(f"node {decode.node_id} ended the sequence without a "
                                      "token") from None
                self._decode_routing.token(key, first.token)
                finished = first.finish_reason is not None
                yield first
                async for out in tokens:
                    self._decode_routing.token(key, out.token)
                    finished = out.finish_reason is not None
                    yield out
        except EngineError as exc:
            error = scrub(str(exc))
            raise
        finally:
            decode.forget(seq)  # an expect whose tokens were never read
            if prefill_outcome != "completed":
                self._prefill_routing.end(key, "failed" if error else "cancelled", error)
            outcome: Outcome = ("completed" if finished else "failed" if error is not None
                                else "cancelled")
            self._decode_routing.end(key, outcome, error)

    def stats(self, *, verbose: bool) -> dict[str, Any]:
        """The router's view for ``GET /router/stats``: each node's state, work and (for
        prefill nodes) handoffs, and the totals; addresses only when ``verbose``."""
        total = HandoffAccount()
        nodes = []
        for pool, members, routing in (("prefill", self._prefill, self._prefill_routing),
                                       ("decode", self._decode, self._decode_routing)):
            for node_id, node in members.items():
                account = routing.nodes[node_id]
                entry: dict[str, Any] = {
                    "id": node_id, "role": pool, "state": node.state(),
                    "in_flight": account.in_flight, "dispatched": account.dispatched,
                    "completed": account.completed, "failed": account.failed,
                    "last_error": _shown(node.last_error(), verbose)}
                if pool == "prefill":
                    handoffs = self._handoffs[node_id]
                    entry["handoff"] = handoffs.view()
                    for name in ("handoffs", "bytes"):
                        setattr(total, name, getattr(total, name) + getattr(handoffs, name))
                    total.encode_ms += handoffs.encode_ms
                    total.send_ms += handoffs.send_ms
                if verbose:
                    entry["address"] = node.address
                nodes.append(entry)
        return {"addresses_redacted": not verbose, "model": self.model_id,
                "mode": "disaggregated", "kv_compression": str(self.mode),
                "up": sum(n["state"] == "up" for n in nodes),
                "in_flight": self.active_sequences(), "nodes": nodes,
                "handoff": total.view()}

    async def keep_linked(self) -> None:
        """Keep every node's link, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            for node in self._members():
                tg.create_task(node.keep_linked())

    def rekey(self) -> None:
        for node in self._members():
            node.rekey()

    async def aclose(self) -> None:
        for node in self._members():
            await node.aclose()


def _shown(error: str | None, verbose: bool) -> str | None:
    return error if verbose or error is None else scrub(error)


class DisaggOrReplicas:
    """A router with both pools and replicas (``--prefill-peers``, ``--decode-peers`` and
    ``--replicas``): a request is disaggregated while a prefill node and a decode node are
    up (``disagg.readiness()`` is None), else it goes to the replicas; and to the
    replicas too when the pair refuses it before its first token (the model's family
    cannot hand off, ``HandoffUnsupported``; a node busy or down, ``EngineUnavailable``).
    Implements ``Engine``; ``replicas`` is a ``ReplicaEngine``."""

    def __init__(self, disagg: DisaggEngine, replicas: Any) -> None:
        self.disagg = disagg
        self.replicas = replicas
        self.model_id = disagg.model_id
        self.context_length = disagg.context_length

    @property
    def max_batch(self) -> int:
        return int(self.disagg.max_batch + self.replicas.max_batch)

    def active_sequences(self) -> int:
        return int(self.disagg.active_sequences() + self.replicas.active_sequences())

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        source: AsyncGenerator[TokenOutput, None] = self.replicas.generate(request)
        if self.disagg.readiness() is None:
            source = self.disagg.generate(request)
            try:
                first = await anext(source)
            except (HandoffUnsupported, EngineUnavailable) as exc:
                log.info("disaggregation refused a request (%s); it goes to a replica",
                         type(exc).__name__)
                await source.aclose()
                source = self.replicas.generate(request)
            else:
                async with contextlib.aclosing(source):
                    yield first
                    async for out in source:
                        yield out
                return
        async with contextlib.aclosing(source):
            async for out in source:
                yield out

    def readiness(self) -> dict[str, Any] | None:
        disagg, replicas = self.disagg.readiness(), self.replicas.readiness()
        if disagg is None or replicas is None:
            return None
        return {"reason": "no prefill/decode pair and no replica is up",
                "disaggregation": disagg, "replicas": replicas}

    def stats(self, *, verbose: bool) -> dict[str, Any]:
        return {**self.disagg.stats(verbose=verbose),
                "replicas": self.replicas.stats(verbose=verbose)}

    async def keep_linked(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.disagg.keep_linked())
            tg.create_task(self.replicas.keep_linked())

    def rekey(self) -> None:
        self.disagg.rekey()
        self.replicas.rekey()

    async def aclose(self) -> None:
        await self.disagg.aclose()
        await self.replicas.aclose()


__all__ = ["FIRST_TOKEN_S", "PREFILL_TIMEOUT_S", "DisaggEngine", "DisaggOrReplicas",
           "HandoffAccount"]
