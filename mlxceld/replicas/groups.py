"""A coordinator's router over replica groups: each group a pipeline, the groups one pool.

A cluster of R replicas of S stages (`mlxctl cluster activate --replicas R`, the
cluster TOML's ``[cluster] replicas``) is R independent pipelines, every one a whole
copy of the model. The router drives each with its own engine (a ``PipelineSwitch``
over a ``PipelineEngine``, as a one-group router does) and puts them behind one
``ReplicaEngine`` (``pool.py``): each group is a pool member (``GroupMember``), node id
``replica-<i>``, address its stage 0's. A group is "up" while every one of its stages is
attached (its engine's ``readiness()`` is None), "connecting" while a stage is still
being dialed for the first time, else "down", its ``last_error`` what ``readiness``
says; only "up" groups get new requests, and a request a group refuses before its first
token is tried on the next group (the pool's rule). A request streaming on a group whose
stage is lost fails, the error naming the group (``replica-<i>``) and the stage.

``GroupedPipelines`` is the router's engine then: the pool, plus what a pipeline
router reports (``stages()``: every group's stages, each with its ``replica``;
``tokens``: generated through every group). With one group the router does not use
it: the plain ``PipelineSwitch``, as before.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final

from mlxceld.engine import GenerationRequest, TokenOutput
from mlxceld.pipeline.switch import PipelineSwitch
from mlxceld.replicas.pool import ReplicaEngine
from mlxceld.types import PipelineCacheStats

ROLE: Final = "pipeline"  # a group's role in /router/stats: a pipeline of stages
FIRST_DIAL: Final = frozenset({"connecting"})  # a stage never attached yet


class GroupMember:
    """Replica group ``index`` (node id ``replica-<index>``) as a pool ``Member``."""

    role = ROLE

    def __init__(self, index: int, engine: PipelineSwitch, address: str) -> None:
        self.index = index
        self.node_id = f"replica-{index}"
        self.address = address  # its stage 0's listener: shown only in verbose stats
        self.engine = engine
        self.model_id = engine.model_id
        self.context_length = engine.context_length
        self.max_batch = engine.max_batch

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        return self.engine.generate(request)

    def active_sequences(self) -> int:
        return self.engine.active_sequences()

    def state(self) -> str:
        """"up" when every stage is attached; "connecting" while each stage not attached
        is being dialed for the first time; else "down"."""
        ready = self.engine.readiness()
        if ready is None:
            return "up"
        states = {s.get("state") for s in ready.get("stages", ())}
        return "connecting" if states <= FIRST_DIAL else "down"

    def last_error(self) -> str | None:
        ready = self.engine.readiness()
        return None if ready is None else f"{self.node_id}: {ready['message']}"

    def stages(self) -> list[dict[str, Any]]:
        """Its stages' stats, each with ``replica``: this group's index."""
        return [{**s, "replica": self.index} for s in self.engine.stages()]

    async def keep_linked(self) -> None:
        await self.engine.keep_linked()

    def rekey(self) -> None:
        self.engine.rekey()

    async def aclose(self) -> None:
        await self.engine.aclose()


class GroupedPipelines(ReplicaEngine):
    """The pool over ``groups`` (replica 0 first) with a pipeline router's stats."""

    def __init__(self, groups: Sequence[GroupMember], *, model_id: str,
                 context_length: int) -> None:
        super().__init__(groups, model_id=model_id, context_length=context_length)
        self.groups = tuple(groups)

    @property
    def tokens(self) -> int:
        """Tokens generated through every group since the router started."""
        return sum(g.engine.tokens for g in self.groups)

    def stages(self) -> list[dict[str, Any]]:
        """Every group's stages, group by group, each with its ``replica``."""
        return [s for g in self.groups for s in g.stages()]

    def prompt_cache_stats(self) -> PipelineCacheStats:
        """Every group's prompt cache, summed (each group keeps its own)."""
        each = [g.engine.prompt_cache_stats() for g in self.groups]
        return {"hits": sum(c["hits"] for c in each),
                "misses": sum(c["misses"] for c in each),
                "tokens_reused": sum(c["tokens_reused"] for c in each),
                "entries": sum(c["entries"] for c in each),
                "bytes": sum(c["bytes"] for c in each), "lost": sum(c["lost"] for c in each),
                "pending": sum(c["pending"] for c in each)}
