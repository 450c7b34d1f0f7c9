"""The router worker of a prefill or decode node (``--node-role prefill|decode``).

It loads the model as a hybrid's router worker does, binds no OpenAI port, and serves
the engine on its serving listener only (``replicas/handoffs.py``: ``HandoffService``,
at ``RouterOptions.serving``'s address; the cluster secret arrives on the bootstrap
pipe). Its stats carry ``serving`` (the bound address), ``node_role``, ``handoffs`` and
its engine's ``prompt_cache`` (a prefill node prefills on from the longest prefix it holds:
``LocalEngine.prefill``) for ``mlxctl status``.

- A prefill node reads ``MLXCEL_DECODE_ALLOWLIST`` once at start
  (``handoffs.decode_allowlist``): the decode targets it may send caches to. When the
  keyring's primary changes (a secret rotation's ``use``) its links to decode nodes are
  handed over to the new key (``replicas/targets.py``); the routers move their own
  sequences (``adopt``).
- A decode node takes handoffs from its ``--prefill-peers`` only
  (``HandoffOptions.prefill_agents``): their serving addresses are asked of their agents
  (``discovery/serving.py``'s ``ask_serving``) at start and every ``PEERS_EVERY_S``, and
  at once for a handoff from an address an ``expect`` names that is not among them (a
  prefill node restarted on a new port: ``replicas/held.py``); a peer that is not a
  prefill node serving our model is left out, with a warning naming it, until it is.

Its control channel's ``drain`` op (``handoff_drain_op``: the router worker's request and
answer) is how the daemon's drain of this node reaches it: the serving listener refuses
new ``prefill`` / ``expect`` with ``draining`` (the router tries the other node of that
pool), the held ones run (a prefill hands its cache off, a decode node's expected
sequence takes its handoff and decodes), the deadline ends the rest; ``[]`` undrains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from mlxceld import failpoints
from mlxceld.api.edge.draining import NodeDrain, first_deadline, parse_drains
from mlxceld.discovery.serving import ServingNotFound, ask_serving
from mlxceld.net.resolve import ResolveError, resolve
from mlxceld.roles.options import HandoffOptions, RouterOptions
from mlxceld.types import JSON, PREFILL_ROLE, PromptCacheStats
from mlxceld.wire import SecretStore
from mlxceld.wire.address import canonical_address, format_address, parse_address
from mlxceld.workers.runtime import WorkerContext

log = logging.getLogger(__name__)

PEERS_EVERY_S: Final = 5.0  # how often a decode node asks its prefill peers' agents


class PrefillPeers:
    """A decode node's prefill peers' serving addresses, as their agents last said."""

    def __init__(self, agents: tuple[str, ...], *, origin: str, keyring: SecretStore,
                 model_identity: str) -> None:
        self._agents = agents
        self._origin = origin
        self._keyring = keyring
        self._identity = model_identity
        self._known: dict[str, frozenset[str]] = {}  # agent -> its serving identities
        self._said: dict[str, str] = {}  # agent -> the last problem warned about

    def __call__(self) -> frozenset[str]:
        """The identities a handoff may come from: each peer's serving port at each IP its
        agent's host resolves to (a name may have several)."""
        return frozenset().union(*self._known.values())

    async def keep(self) -> None:
        """Ask every peer's agent now and every ``PEERS_EVERY_S``, until cancelled."""
        while True:
            await self.ask_now()
            await asyncio.sleep(failpoints.PEERS_EVERY_S or PEERS_EVERY_S)

    async def ask_now(self) -> None:
        """Ask every peer's agent now (also for a handoff from an address not known yet:
        ``replicas/held.py``)."""
        await asyncio.gather(*(self._ask(agent) for agent in self._agents))

    async def _ask(self, agent: str) -> None:
        problem = None
        try:
            answer = await ask_serving(self._origin, agent, keyring=self._keyring)
        except ServingNotFound as exc:
            problem = exc.message
        else:
            if answer.role != PREFILL_ROLE:
                problem = (f"it is a {answer.role} node: list only prefill nodes in "
                           "--prefill-peers")
            elif answer.model != self._identity:
                problem = "it serves another model (or none yet)"
            elif answer.port is None:
                problem = "it has no serving listener yet"
            else:
                host = parse_address(agent).host
                try:  # handshakes bind IPs: a name stands for each of its addresses
                    ips = await resolve(host)
                except ResolveError as exc:
                    problem = exc.message
                else:
                    ids = frozenset(canonical_address(format_address(str(ip), answer.port))
                                    for ip in ips)
                    self._known[agent] = ids
                    self._said.pop(agent, None)
                    return
        self._known.pop(agent, None)
        if self._said.get(agent) != problem:
            log.warning("prefill peer %s: %s; its handoffs are not taken until it is one",
                        agent, problem)
            self._said[agent] = problem


async def bind_serving(service: Any, address: str) -> None:
    """Bind a node's serving listener (``ServingService.start``) at ``address``; a port in
    use is a ``RuntimeError`` naming it and the setting that picks another."""
    try:
        await service.start()
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {address} for the serving listener: "
                           f"{exc.strerror}; pick another port with --serving-port or [serve] "
                           "serving_port") from None


def drain_serving(service: Any, drains: Sequence[NodeDrain]) -> JSON:
    """Say ``drains`` (every drain in force of the nodes this worker's requests need; on a
    serving node, this node) to ``service``'s serving listener (``ServingService.drain``:
    new sequences refused with ``draining``, the held ones run, the earliest deadline ends
    the rest; none: ``undrain``); its counts, ``senders`` naming each router with
    sequences held here."""
    if drains:
        service.drain(first_deadline(drains))
    else:
        service.undrain()
    state = service.drain_state()
    senders = [{"sender": f"router {s['router']}", "sequences": s["sequences"]}
               for s in state["senders"]]
    return {"in_flight": state["in_flight"], "finished": state["finished"],
            "ended": state["ended"], "senders": senders}


def handoff_drain_op(service: Any, request: JSON) -> JSON:
    """A prefill or decode node's control channel ``drain``: the router's (same request,
    same answer: ``workers/router.py``'s ``drain_op``), said to its serving listener."""
    try:
        drains = parse_drains(request)
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "nodes": [d.node for d in drains], **drain_serving(service, drains)}


async def handoff_service(ctx: WorkerContext[RouterOptions], engine: Any, identity: str,
                          handoff: HandoffOptions) -> tuple[Any, PrefillPeers | None]:
    """The bound ``HandoffService`` over ``engine``, and a decode node's peers (to keep)."""
    from mlxceld.replicas.handoffs import ALLOWLIST_ENV, HandoffService, decode_allowlist

    o = ctx.options
    if o.serving is None or ctx.keyring is None:
        raise RuntimeError(f"a {handoff.role} node needs the cluster secret and has none")
    peers = None
    extra: dict[str, Any] = {}
    if handoff.role == PREFILL_ROLE:
        extra["allowlist"] = decode_allowlist(os.environ.get(ALLOWLIST_ENV))
    else:
        peers = PrefillPeers(handoff.prefill_agents, origin=handoff.origin,
                             keyring=ctx.keyring, model_identity=identity)
        extra["prefill_peers"] = peers
        extra["recheck_peers"] = peers.ask_now
    service = HandoffService(  # the keyring is changed in place by the daemon
        engine, role=handoff.role, node_id=o.serving.node_id, model_identity=identity,
        cluster=o.serving.cluster, keyring=ctx.keyring, address=o.serving.address,
        silence_s=o.stage_silence_s, vocab_size=engine.vocab_size, **extra)
    await bind_serving(service, o.serving.address)
    return service, peers


async def run_handoff_node(ctx: WorkerContext[RouterOptions], engine: Any, path: str,
                           handoff: HandoffOptions, broken: list[BaseException], *,
                           stats_every_s: float, graceful_s: float) -> int:
    """Serve ``engine`` (loaded from ``path``) as a prefill or decode node until the
    worker stops; the engine is closed at the end."""
    from mlxceld.models.identity import model_identity

    service = None
    try:
        identity = await asyncio.to_thread(model_identity, Path(path))
        service, peers = await handoff_service(ctx, engine, identity, handoff)
        await serve_handoffs(ctx, service, peers, stats_every_s, graceful_s,
                             prompt_cache=engine.prompt_cache_stats)
    finally:
        if service is not None:
            await service.aclose()
        await engine.aclose()
    if broken:  # exit non-zero: the supervisor restarts us with a fresh engine
        raise RuntimeError(f"the engine failed: {broken[0]!r}") from broken[0]
    return 0


async def serve_handoffs(ctx: WorkerContext[RouterOptions], service: Any,
                         peers: PrefillPeers | None, stats_every_s: float,
                         graceful_s: float, *,
                         prompt_cache: Callable[[], PromptCacheStats]) -> None:
    """Serve until the worker stops; then drain for ``graceful_s`` and close.
    ``prompt_cache``: the engine's prompt cache stats, for the worker's stats."""
    async with asyncio.TaskGroup() as tg:
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tg.create_task(service.serve(started))
        keeping = tg.create_task(peers.keep()) if peers is not None else None
        await started
        ctx.stats.update(serving=format_address(service.host, service.port),
                         node_role=service.role)
        ctx.ops["drain"] = lambda request: handoff_drain_op(service, request)
        ctx.rekeyed.append(service.rekey)  # a prefill node's links to decode nodes
        ctx.ready()
        while not ctx.stopping.is_set():
            stats = service.stats
            ctx.stats["handoffs"] = {"handoffs": stats.handoffs, "bytes": stats.bytes,
                                     "refused": stats.refused, "dropped": stats.dropped,
                                     "held": stats.held,
                                     "seconds": round(stats.seconds, 6)}
            ctx.stats["prompt_cache"] = prompt_cache()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ctx.stopping.wait(), stats_every_s)
        if keeping is not None:
            keeping.cancel()
        await service.finish_held(graceful_s)
        await service.aclose()
