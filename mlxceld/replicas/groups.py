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

A new plan of the groups (self-healing's heal or drain re-plan, ``cluster/healer.py``; an
operator's re-activate) moves the pool live (``move``, the router's ``pipeline`` op): each
group kept switches to its new stages, its running sequences ending on the old ones; a
group the plan dropped retires from the pool (its sequences end there, then it is
closed); ``retiring`` counts what of the old plan still runs, for the coordinator to tell
the old plan's hosts once it is 0. A group moved is "up" while its new stages are first
dialed (they serve: their plan is active), so the move refuses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Final

from mlxceld.engine import GenerationRequest, TokenOutput
from mlxceld.engine.continuation import Continuity
from mlxceld.pipeline.switch import PipelineSwitch
from mlxceld.replicas.pool import ReplicaEngine
from mlxceld.types import PipelineCacheStats

if TYPE_CHECKING:
    from mlxceld.pipeline import PipelineEngine

log = logging.getLogger(__name__)

ROLE: Final = "pipeline"  # a group's role in /router/stats: a pipeline of stages
FIRST_DIAL: Final = frozenset({"connecting"})  # a stage never attached yet


class GroupMember:
    """Replica group ``index`` (node id ``replica-<index>``) as a pool ``Member``."""

    role = ROLE

    def __init__(self, index: int, engine: PipelineSwitch, address: str, *,
                 moved: bool = False) -> None:
        self.index = index
        self.moved = moved  # it serves a plan the router moved to (``move``)
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
        is being dialed for the first time, else "down". Once moved to a new plan's
        stages (``moved``: they serve, their plan is active), a first dial is "up": a
        request dials them itself (``PipelineEngine.generate``), so that a move of every
        group at once leaves none out of the pool."""
        ready = self.engine.readiness()
        if ready is None:
            return "up"
        states = {s.get("state") for s in ready.get("stages", ())}
        if states <= FIRST_DIAL:
            return "up" if self.moved else "connecting"
        return "down"

    def move(self, engine: PipelineEngine, address: str) -> None:
        """New sequences go to ``engine`` (a new plan's stages of this group); those
        running end on the old one (``PipelineSwitch.switch``)."""
        self.engine.switch(engine)
        self.address = address
        self.moved = True

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
        self._dropped: list[GroupMember] = []  # groups a move left out (for ``tokens``)

    @property
    def tokens(self) -> int:
        """Tokens generated through every group since the router started."""
        return sum(g.engine.tokens for g in (*self.groups, *self._dropped))

    def move(self, engines: Sequence[tuple[PipelineEngine, str]], *,
             hold_s: float = 0.0) -> None:
        """The router moves to a new plan of the groups (a heal, a drain's re-plan, a
        re-activate): group ``i``'s new sequences go to ``engines[i]`` (its engine and its
        stage 0's address), those running end on its old stages; a group past
        ``len(engines)`` retires from the pool (closed once its sequences end: ``retire``);
        one more joins it. ``hold_s``: each group's hold of a sequence whose stage is lost
        (``PipelineSwitch``; the roster gives one to a plan of one group only)."""
        for member, (engine, address) in zip(self.groups, engines, strict=False):
            member.move(engine, address)
            member.engine.hold_s = hold_s
        dropped = self.groups[len(engines):]
        for member in dropped:
            self._dropped.append(member)
            self.retire(member.node_id)
        added = [GroupMember(i, PipelineSwitch(engine, hold_s=hold_s), address, moved=True)
                 for i, (engine, address) in enumerate(engines) if i >= len(self.groups)]
        for member in added:
            self.add(member)
        self.groups = (*self.groups[:len(engines)], *added)
        log.info("replica groups moved to a new plan's stages: %d group(s) serve, %d "
                 "retired from the pool, %d joined", len(self.groups), len(dropped),
                 len(added))

    def continuity(self) -> Continuity:
        """The pool's counts, and every group's held and replayed sequences."""
        return sum((g.engine.continuity for g in (*self.groups, *self._dropped)),
                   super().continuity())

    def retiring(self) -> int:
        """What of the plans before still runs: each group's replaced engines not closed
        yet, and the groups retired from the pool with sequences in flight (the ``retiring``
        op: the coordinator tells the old plan's hosts once it is 0)."""
        return sum(g.engine.retiring() for g in self.groups) + len(self._retiring)

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
