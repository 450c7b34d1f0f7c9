"""The router worker's engine on a router node (``--node-role router``):
``ReplicasRouter``, a ``ReplicaEngine`` over one ``RemoteEngine`` per replica (or a
``DisaggEngine`` over prefill and decode nodes), and the tokenizer.

Model-free: of ``RouterOptions.model`` (a local directory, or a Hugging Face repo id
of which only the config, index and tokenizer are fetched: ``models/fetch.py``'s
``local_model``) it reads the config (the context length, the end-of-sequence
tokens), the tokenizer and the model identity (``models/identity.py``), which every
replica must serve too. Each replica (``ReplicasOptions.agents``, in the order
``--replicas`` gives them) is a pool member named ``replica-<i>`` (its index there:
stable across restarts, and no address in what a client sees); before every dial its
serving address is asked of its agent (``discovery/serving.py``'s ``ServingFinder``);
its heartbeat bound is ``[serve] stage_silence_s``.

Replicas found by discovery (``ReplicasOptions.discover``: no ``--replicas``). The
pool starts empty; the daemon sends the worker its discovery's candidates every few
seconds (control op ``replicas``: ``daemon/replica_peers.py``), and ``Discovered`` asks each
new candidate's agent what it serves (``ServingFinder``: a hybrid node serving this
model), at most once per ``ASK_AGAIN_S`` for one that is not (a coordinator, a
``--pp-peer`` without a model, a prefill or decode node, another model, an agent that
does not answer: a debug log line, asked again later). One that is becomes a member
``replica-<its node id>`` (stable, never another node's; its agent in ``mlxctl
status``), a ``RemoteEngine`` as above. A member whose candidate is no longer sent, or
is sent at another agent address, is retired (``ReplicaEngine.retire``: its sequences
in flight finish or fail as a down member's, it gets no new ones); one at a new address
joins again under the same id.

``[serve] max_batch`` on a router node is what it expects each replica to run at once
(set it to the replicas' own): a member's capacity in the routing until its node says
its own at attach, and the router admits that many sequences per replica (the rest
queue, up to ``max_queued``; then 503).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from mlxceld.api.edge.metrics import Continuities
from mlxceld.discovery.serving import ServingFinder, ServingNotFound
from mlxceld.engine import PoolEngine
from mlxceld.roles.options import ReplicasOptions, RouterOptions
from mlxceld.tasks import Background
from mlxceld.types import JSON
from mlxceld.wire.address import canonical_address
from mlxceld.workers.modes import DisaggMode, DiscoveredMode, ReplicasMode
from mlxceld.workers.router_engine import AppHooks, RouterEngine
from mlxceld.workers.runtime import WorkerContext

if TYPE_CHECKING:
    from mlxceld.replicas.remote import RemoteEngine

log = logging.getLogger(__name__)

ASK_AGAIN_S: Final = 30.0  # a candidate found not serving the model is asked again after
MAX_CANDIDATES: Final = 1024  # in one ``replicas`` op

NODE_PREFIX = "replica-"
PREFILL_PREFIX = "prefill-"  # a router's prefill nodes, by their index in --prefill-peers
DECODE_PREFIX = "decode-"


class ReplicasRouter(RouterEngine):
    """A router node's engine: a pool of replicas (listed, or found by discovery:
    ``discovered``), or of prefill and decode nodes. Its stats carry ``replicas`` (and
    ``replicas_discovered``: how many members discovery made)."""

    engine: PoolEngine

    def __init__(self, engine: PoolEngine, tokenizer: Any, path: str,
                 replicas: ReplicasOptions, discovered: Discovered | None = None) -> None:
        super().__init__(engine, tokenizer, path)
        self.replicas = replicas
        self.discovered = discovered

    def hooks(self) -> AppHooks:
        # a replica pool's (``ReplicaEngine.continuity``); a disaggregated one has none
        continuity: Continuities | None = getattr(self.engine, "continuity", None)
        return AppHooks(readiness=self.engine.readiness,
                        router_stats=lambda verbose: self.engine.stats(verbose=verbose),
                        continuity=continuity, elastic=self.discovered is not None)

    def attach(self, ctx: WorkerContext[RouterOptions]) -> None:
        if self.discovered is not None:
            ctx.ops["replicas"] = self.discovered.op
        ctx.rekeyed.append(self.engine.rekey)

    async def keep_linked(self) -> None:
        await self.engine.keep_linked()

    def refresh(self, stats: dict[str, Any], now: float) -> None:
        found = self.discovered
        stats["replicas"] = replica_links(self.engine, self.replicas,
                                          None if found is None else found.agents)
        if found is not None:  # how many members discovery made
            stats["replicas_discovered"] = len(found.agents)

    async def aclose(self) -> None:
        if self.discovered is not None:
            await self.discovered.aclose()
        await self.engine.aclose()


def load_replicas(ctx: WorkerContext[RouterOptions], mode: ReplicasMode | DiscoveredMode
                  | DisaggMode) -> ReplicasRouter:
    """The pool ``mode`` names, and the tokenizer (blocking: a thread)."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.models.context import served_context
    from mlxceld.models.fetch import local_model
    from mlxceld.models.identity import model_identity, read_model_config
    from mlxceld.replicas.pool import ReplicaEngine

    o = ctx.options
    if ctx.keyring is None:
        raise RuntimeError("a router over replicas needs the cluster secret and has none")
    path = local_model(o.model)
    config = read_model_config(path)
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        path, eos_token_ids=config.get("eos_token_id"))
    members = Members(ctx, mode.replicas, model_identity(path))
    context = served_context(config, o.context_length, o.model_name)
    replicas = mode.replicas
    if isinstance(mode, DiscoveredMode):
        found = ReplicaEngine([], model_id=o.model_name, context_length=context)
        return ReplicasRouter(found, tokenizer, o.model, replicas,
                              Discovered(found, members.finder, members.member))
    pool = (ReplicaEngine(members.listed(replicas.agents, NODE_PREFIX, "hybrid"),
                          model_id=o.model_name, context_length=context)
            if replicas.agents else None)
    if isinstance(mode, ReplicasMode):
        assert pool is not None  # ReplicasOptions checked it
        return ReplicasRouter(pool, tokenizer, o.model, replicas)
    from mlxceld.engine.handoff import Mode
    from mlxceld.replicas.disagg import DisaggEngine, DisaggOrReplicas

    quant, _, lz4 = replicas.kv_compression.partition("+")
    disagg = DisaggEngine(members.listed(replicas.prefill_agents, PREFILL_PREFIX, "prefill"),
                          members.listed(replicas.decode_agents, DECODE_PREFIX, "decode"),
                          model_id=o.model_name, context_length=context,
                          mode=Mode(quant, bool(lz4)))  # type: ignore[arg-type]  # config checked it
    return ReplicasRouter(disagg if pool is None else DisaggOrReplicas(disagg, pool),
                          tokenizer, o.model, replicas)


class Members:
    """How a router node names, finds and links to its replicas (and prefill and decode
    nodes): a ``ServingFinder`` per agent, a ``RemoteEngine`` per member."""

    def __init__(self, ctx: WorkerContext[RouterOptions], replicas: ReplicasOptions,
                 identity: str) -> None:
        assert ctx.keyring is not None
        self._keyring = ctx.keyring
        self._replicas = replicas
        self._identity = identity
        self._silence_s = ctx.options.stage_silence_s
        self._max_batch = ctx.options.max_batch

    def finder(self, agent: str, role: str = "hybrid") -> ServingFinder:
        return ServingFinder(agent, origin=self._replicas.origin, keyring=self._keyring,
                             model_identity=self._identity, role=role)

    def member(self, node_id: str, find: ServingFinder, role: str = "hybrid") -> RemoteEngine:
        from mlxceld.replicas.remote import RemoteEngine

        remote = RemoteEngine(  # the keyring is changed in place (supervisor/keys.py)
            node_id, find, keyring=self._keyring, origin=self._replicas.origin,
            model_identity=self._identity, cluster=self._replicas.cluster,
            silence_s=self._silence_s, role=role)
        remote.max_batch = remote.max_batch or self._max_batch  # its own once attached
        return remote

    def listed(self, agents: tuple[str, ...], prefix: str, role: str) -> list[RemoteEngine]:
        return [self.member(f"{prefix}{i}", self.finder(agent, role), role)
                for i, agent in enumerate(agents)]


class Discovered:
    """Fills ``pool`` from the daemon's candidates (the module docstring):
    ``finder(agent)`` asks an agent what it serves; ``member(node_id, finder)`` is the
    ``RemoteEngine`` of one that serves the model."""

    def __init__(self, pool: Any, finder: Callable[[str], Any],
                 member: Callable[[str, Any], Any], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._finder = finder
        self._member = member
        self._clock = clock
        self.agents: dict[str, str] = {}  # member id -> its agent address
        self._asked: dict[tuple[str, str], float] = {}  # (node id, agent) -> when, not serving
        self._asking: set[tuple[str, str]] = set()  # (node id, agent) being asked
        self._tasks = Background("replica discovery")  # the askings, until aclose

    def op(self, request: JSON) -> JSON:
        """The control channel's ``replicas``: ``{"candidates": [{"node_id", "agent"},
        ...]}``, every candidate now; answers the members' ids."""
        try:
            candidates = self._parse(request.get("candidates"))
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}
        self.update(candidates)
        return {"ok": True, "members": sorted(self.agents)}

    @staticmethod
    def _parse(raw: object) -> dict[str, str]:
        if not isinstance(raw, list) or len(raw) > MAX_CANDIDATES:
            raise ValueError(f"'candidates' must be a list of at most {MAX_CANDIDATES}")
        found: dict[str, str] = {}
        for item in raw:
            node = item.get("node_id") if isinstance(item, dict) else None
            agent = item.get("agent") if isinstance(item, dict) else None
            if not (isinstance(node, str) and 0 < len(node) <= 128 and node.isprintable()
                    and isinstance(agent, str)):
                raise ValueError("each candidate must be {\"node_id\": str, \"agent\": "
                                 "\"host:port\"}")
            try:
                found[node] = canonical_address(agent)
            except ValueError:
                raise ValueError(f"candidate {node!r}: agent is not host:port") from None
        return found

    def update(self, candidates: Mapping[str, str]) -> None:
        """Retire the members whose candidate is gone or moved; ask the new ones."""
        for node_id, agent in list(self.agents.items()):
            if candidates.get(node_id.removeprefix(NODE_PREFIX)) != agent:
                del self.agents[node_id]
                self._pool.retire(node_id)
        now = self._clock()
        for node, agent in candidates.items():
            key = (node, agent)
            if (f"{NODE_PREFIX}{node}" in self.agents or key in self._asking
                    or now - self._asked.get(key, -ASK_AGAIN_S) < ASK_AGAIN_S):
                continue
            self._asking.add(key)
            self._tasks.spawn(self._ask(node, agent))
        for key in [k for k in self._asked if k not in candidates.items()]:
            del self._asked[key]

    async def _ask(self, node: str, agent: str) -> None:
        try:
            await self._ask_once(node, agent)
        finally:
            self._asking.discard((node, agent))

    async def _ask_once(self, node: str, agent: str) -> None:
        find = self._finder(agent)
        try:
            await find()  # bounded: ask_serving's budget
        except ServingNotFound as exc:
            self._asked[(node, agent)] = self._clock()
            log.debug("candidate %s is not a replica of this model (%s); asked again in "
                      "%g s", node, exc.message, ASK_AGAIN_S)
            return
        except Exception as exc:  # never ends the worker: asked again later
            self._asked[(node, agent)] = self._clock()
            log.warning("candidate %s could not be asked what it serves: %r", node, exc)
            return
        node_id = f"{NODE_PREFIX}{node}"
        if node_id in self.agents:
            return
        self.agents[node_id] = agent
        self._pool.add(self._member(node_id, find))
        log.info("replica %s found by discovery", node_id)

    async def aclose(self) -> None:
        await self._tasks.aclose()


def replica_links(engine: PoolEngine, replicas: ReplicasOptions,
                  discovered: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Each replica's (and prefill and decode node's) state for the worker's stats
    (``mlxctl status``, on the operator's socket: with its agent address): node id,
    agent, state, last error."""
    stats = engine.stats(verbose=True)
    nodes = list(stats["nodes"]) + list(stats.get("replicas", {}).get("nodes", []))
    agents = dict(zip((f"{NODE_PREFIX}{i}" for i in range(len(replicas.agents))),
                      replicas.agents, strict=True))
    for prefix, pool in ((PREFILL_PREFIX, replicas.prefill_agents),
                         (DECODE_PREFIX, replicas.decode_agents)):
        agents.update((f"{prefix}{i}", agent) for i, agent in enumerate(pool))
    agents.update(discovered or {})
    return [{"replica": n["id"], "agent": agents.get(n["id"], ""), "state": n["state"],
             "connected": n["state"] == "up", "error": n.get("last_error"),
             "dispatched": n.get("dispatched", 0)} for n in nodes]
