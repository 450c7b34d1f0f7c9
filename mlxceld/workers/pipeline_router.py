"""The router worker's engine over pipeline stages: ``PipelineRouter`` (one pipeline,
behind a ``PipelineSwitch``: the ``pipeline`` op moves it to another plan's stages) and
``GroupsRouter`` (replica groups, ``replicas/groups.py``: each group's stages behind a
switch of their own, the groups one pool; its ``pipeline`` op moves every group to a new
plan's stages at once, dropping or adding groups, without a restart). Only the tokenizer
is loaded here; the cluster secret arrives on the bootstrap pipe. Their stats carry the
stages' state (``stages``), ``tokens`` generated and ``tokens_per_s`` over the last
``pipeline/throughput.py`` ``WINDOW_S``, and the stages' ``prompt_cache``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxceld.errors import ConfigError
from mlxceld.pipeline.throughput import Throughput
from mlxceld.roles.options import PipelineOptions, RouterOptions
from mlxceld.types import JSON
from mlxceld.wire.address import parse_address
from mlxceld.workers.router_engine import AppHooks, RouterEngine
from mlxceld.workers.runtime import WorkerContext

if TYPE_CHECKING:
    from mlxceld.pipeline import PipelineEngine
    from mlxceld.pipeline.switch import PipelineSwitch
    from mlxceld.replicas.groups import GroupedPipelines


class _Staged(RouterEngine):
    """What a pipeline and replica groups share: the stages' stats, the refused or
    accepted ``pipeline`` op."""

    engine: PipelineSwitch | GroupedPipelines

    def __init__(self, engine: PipelineSwitch | GroupedPipelines, tokenizer: Any,
                 path: str, pipeline: PipelineOptions) -> None:
        super().__init__(engine, tokenizer, path)
        self.pipeline = pipeline
        self._throughput = Throughput()

    def attach(self, ctx: WorkerContext[RouterOptions]) -> None:
        ctx.ops["pipeline"] = lambda request: self.pipeline_op(ctx, request)
        ctx.rekeyed.append(self.engine.rekey)

    async def keep_linked(self) -> None:
        await self.engine.keep_linked()

    def refresh(self, stats: dict[str, Any], now: float) -> None:
        stats["prompt_cache"] = self.engine.prompt_cache_stats()
        stats["stages"] = self.engine.stages()
        self._throughput.sample(self.engine.tokens, now)
        rate = self._throughput.rate()
        stats.update(tokens=self.engine.tokens,
                     tokens_per_s=None if rate is None else round(rate, 2))

    async def serving_identity(self) -> str:
        return self.pipeline.model_identity

    def pipeline_op(self, ctx: WorkerContext[RouterOptions], request: JSON) -> JSON:
        """The control channel's ``pipeline``: ``{"options": ROUTER-OPTIONS}``, this
        router's options with another plan's ``pipeline`` (and ``replica_pipelines``, and its
        ``replay_hold_s``: a plan of groups shrunk to one is healed with replays). Where
        only those differ, new sequences go to the new stages at once and those running
        end on the old ones (``move``); else ``ok`` is false and the daemon restarts the
        router."""
        from mlxceld.roles import ROUTER
        from mlxceld.roles.options import parse_options

        try:
            new = parse_options(ROUTER, request.get("options"), "options")
        except ConfigError as exc:
            return {"ok": False, "error": exc.message}
        assert isinstance(new, RouterOptions)
        old = ctx.options
        if new.pipeline is None or replace(new, pipeline=old.pipeline,
                                           replica_pipelines=old.replica_pipelines,
                                           replay_hold_s=old.replay_hold_s) != old:
            return {"ok": False, "error": "more than the pipeline's stages changed: restart"}
        groups = (new.pipeline, *new.replica_pipelines)
        refused = self.move(ctx, groups, new.replay_hold_s)
        if refused is not None:
            return {"ok": False, "error": refused}
        ctx.options = new
        return {"ok": True, "stages": sum(len(g.stages) for g in groups),
                "groups": len(groups)}

    def move(self, ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...],
             hold_s: float) -> str | None:
        """New sequences go to ``groups``' stages from now on, a lost stage's held for
        ``hold_s`` (``PipelineSwitch``); why not, if it cannot."""
        raise NotImplementedError


class PipelineRouter(_Staged):
    engine: PipelineSwitch

    def hooks(self) -> AppHooks:
        return AppHooks(readiness=self.engine.readiness, stage_links=self.engine.stages,
                        prompt_caches=lambda: [({}, self.engine.prompt_cache_stats())],
                        continuity=lambda: self.engine.continuity)

    def attach(self, ctx: WorkerContext[RouterOptions]) -> None:
        super().attach(ctx)
        ctx.ops["retiring"] = lambda request: {"ok": True, "retiring": self.engine.retiring()}

    def move(self, ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...],
             hold_s: float) -> str | None:
        if len(groups) > 1:
            return "a router over one pipeline moves to replica groups by a restart"
        eos = set(self.tokenizer.eos_token_ids)
        self.engine.switch(stages_engine(ctx, groups[0], self.engine.context_length, eos))
        self.engine.hold_s = hold_s
        self.pipeline = groups[0]
        return None


class GroupsRouter(_Staged):
    engine: GroupedPipelines

    def hooks(self) -> AppHooks:
        return AppHooks(readiness=self.engine.readiness,
                        router_stats=lambda verbose: self.engine.stats(verbose=verbose),
                        stage_links=self.engine.stages,
                        prompt_caches=lambda: [({}, self.engine.prompt_cache_stats())],
                        continuity=self.engine.continuity)

    def attach(self, ctx: WorkerContext[RouterOptions]) -> None:
        super().attach(ctx)
        ctx.ops["retiring"] = lambda request: {"ok": True, "retiring": self.engine.retiring()}

    def move(self, ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...],
             hold_s: float) -> str | None:
        """Each group's switch to its new stages; groups dropped retire from the pool,
        groups added join it (``GroupedPipelines.move``)."""
        eos = set(self.tokenizer.eos_token_ids)
        self.engine.move([(stages_engine(ctx, pipe, self.engine.context_length, eos),
                           parse_address(pipe.stages[0].address).canonical())
                          for pipe in groups], hold_s=hold_s)
        self.pipeline = groups[0]
        return None


def load_pipeline(ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...]
                  ) -> _Staged:
    """The engine over the stages of ``groups`` (one: a pipeline; more: replica groups)
    and the tokenizer, the model's config checked (blocking: a thread)."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.models.context import served_context
    from mlxceld.models.identity import layer_count, read_model_config
    from mlxceld.models.kvquant import check_kv_quant
    from mlxceld.pipeline.switch import PipelineSwitch

    o = ctx.options
    path = Path(o.model)
    config = read_model_config(path)
    layer_count(config)
    # The stages make each sequence's caches as prepare says: refused here, for them all.
    check_kv_quant(config, o.kv_quant, source=str(path / "config.json"))
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        path, eos_token_ids=config.get("eos_token_id"))
    context = served_context(config, o.context_length, o.model_name)
    eos = set(tokenizer.eos_token_ids)
    if len(groups) > 1:
        return GroupsRouter(grouped_engine(ctx, groups, context, eos), tokenizer, o.model,
                            groups[0])
    return PipelineRouter(PipelineSwitch(stages_engine(ctx, groups[0], context, eos),
                                         hold_s=o.replay_hold_s),
                          tokenizer, o.model, groups[0])


def grouped_engine(ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...],
                   context: int, eos: set[int]) -> GroupedPipelines:
    """Replica groups: each group's stages behind a ``PipelineSwitch``, the groups
    behind one pool."""
    from mlxceld.pipeline.switch import PipelineSwitch
    from mlxceld.replicas.groups import GroupedPipelines, GroupMember

    members = [GroupMember(i, PipelineSwitch(stages_engine(ctx, pipe, context, eos)),
                           parse_address(pipe.stages[0].address).canonical())
               for i, pipe in enumerate(groups)]
    return GroupedPipelines(members, model_id=ctx.options.model_name, context_length=context)


def stages_engine(ctx: WorkerContext[RouterOptions], pipe: PipelineOptions, context: int,
                  eos: set[int]) -> PipelineEngine:
    """A ``PipelineEngine`` over the stages of ``pipe``."""
    from mlxceld.pipeline import PipelineEngine, StageAddress

    o = ctx.options
    if ctx.keyring is None:
        raise RuntimeError("the pipeline engine needs the cluster secret and has none")
    stages = []
    for s in pipe.stages:
        where = parse_address(s.address)
        stages.append(StageAddress(s.node_id, where.host, where.port, s.rank, s.layers))
    return PipelineEngine(  # the keyring is changed in place by the daemon (supervisor/keys.py)
        stages, keyring=ctx.keyring, origin=pipe.coordinator,
        model_identity=pipe.model_identity, cluster=pipe.cluster, model_id=o.model_name,
        context_length=context, eos_token_ids=eos, max_batch=o.max_batch,
        silence_s=o.stage_silence_s, prompt_cache_bytes=o.prompt_cache_bytes,
        kv_quant=o.kv_quant)
