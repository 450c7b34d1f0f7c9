"""The router worker's engine on a router node (``--node-role router``): a
``ReplicaEngine`` over one ``RemoteEngine`` per replica, and the tokenizer.

Model-free: of ``RouterOptions.model`` (a local directory, or a Hugging Face repo id
of which only the config, index and tokenizer are fetched: ``models/fetch.py``'s
``local_model``) it reads the config (the context length, the end-of-sequence
tokens), the tokenizer and the model identity (``models/identity.py``), which every
replica must serve too. Each replica (``ReplicasOptions.agents``, in the order
``--replicas`` gives them) is a pool member named ``replica-<i>`` (its index there:
stable across restarts, and no address in what a client sees); before every dial its
serving address is asked of its agent (``discovery/serving.py``'s ``ServingFinder``);
its heartbeat bound is ``[serve] stage_silence_s``.

``[serve] max_batch`` on a router node is what it expects each replica to run at once
(set it to the replicas' own): a member's capacity in the routing until its node says
its own at attach, and the router admits that many sequences per replica (the rest
queue, up to ``max_queued``; then 503).
"""

from __future__ import annotations

from typing import Any

from mlxceld.discovery.serving import ServingFinder
from mlxceld.roles.options import ReplicasOptions, RouterOptions
from mlxceld.workers.runtime import WorkerContext

NODE_PREFIX = "replica-"
PREFILL_PREFIX = "prefill-"  # a router's prefill nodes, by their index in --prefill-peers
DECODE_PREFIX = "decode-"


def replica_engine(ctx: WorkerContext[RouterOptions], replicas: ReplicasOptions
                   ) -> tuple[Any, Any]:
    """The ``ReplicaEngine`` over ``replicas``, and the tokenizer (blocking: a thread)."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.models.fetch import local_model
    from mlxceld.models.identity import model_identity, read_model_config
    from mlxceld.replicas.pool import ReplicaEngine
    from mlxceld.replicas.remote import RemoteEngine

    o = ctx.options
    if ctx.keyring is None:
        raise RuntimeError("a router over replicas needs the cluster secret and has none")
    path = local_model(o.model)
    config = read_model_config(path)
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        path, eos_token_ids=config.get("eos_token_id"))
    identity = model_identity(path)
    keyring = ctx.keyring

    def members(agents: tuple[str, ...], prefix: str, role: str) -> list[RemoteEngine]:
        found = []
        for i, agent in enumerate(agents):
            find = ServingFinder(agent, origin=replicas.origin, keyring=keyring,
                                 model_identity=identity, role=role)
            member = RemoteEngine(  # the keyring is changed in place (supervisor/keys.py)
                f"{prefix}{i}", find, keyring=keyring, origin=replicas.origin,
                model_identity=identity, cluster=replicas.cluster,
                silence_s=o.stage_silence_s, role=role)
            member.max_batch = member.max_batch or o.max_batch  # its own once attached
            found.append(member)
        return found

    context = int(config.get("max_position_embeddings") or 4096)
    pool = (ReplicaEngine(members(replicas.agents, NODE_PREFIX, "hybrid"),
                          model_id=o.model_name, context_length=context)
            if replicas.agents else None)
    if not replicas.prefill_agents:
        return pool, tokenizer
    from mlxceld.engine.handoff import Mode
    from mlxceld.replicas.disagg import DisaggEngine, DisaggOrReplicas

    quant, _, lz4 = replicas.kv_compression.partition("+")
    disagg = DisaggEngine(members(replicas.prefill_agents, PREFILL_PREFIX, "prefill"),
                          members(replicas.decode_agents, DECODE_PREFIX, "decode"),
                          model_id=o.model_name, context_length=context,
                          mode=Mode(quant, bool(lz4)))  # type: ignore[arg-type]  # config checked it
    return (disagg if pool is None else DisaggOrReplicas(disagg, pool)), tokenizer


def replica_links(engine: Any, replicas: ReplicasOptions) -> list[dict[str, Any]]:
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
    return [{"replica": n["id"], "agent": agents.get(n["id"], ""), "state": n["state"],
             "connected": n["state"] == "up", "error": n.get("last_error"),
             "dispatched": n.get("dispatched", 0)} for n in nodes]
