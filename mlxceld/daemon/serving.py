"""The daemon's serving window: what its router serves, and the commands that change it.

``ServingWindow`` sets the roster's ``[serve]``, which it draws the router from
(``serve``: the flags and the config file, else what `mlxctl serve` chose last time, kept
in the settings table; a cluster coordinator serves its cluster's model) and whether the
router is held back (``hold_router``: ``pp_auto`` waiting for its plan, a plan to
resume at start, or after `mlxctl cluster deactivate`, until `mlxctl serve`).

`mlxctl serve` (``serve_model``) validates the model (with ``--tp-size`` above 1: that
it splits over the ranks, ``config/tensor.py``), remembers it and (re)starts the
router on it; `mlxctl unserve` (``unserve``) stops the single-host router and forgets
that choice, refused (changing nothing) where a restart would serve again anyway or
where the router is a cluster's. ``describe`` is what `mlxctl status` shows as
``serving``.

Over a pipeline this daemon coordinates, the router serves the pushed plan's model
(``serve_pipeline``): a running router is restarted on it, or, ``live`` (a drain's
re-plan), moved to the new plan's stages by its ``pipeline`` op (``workers/router.py``,
``pipeline/switch.py``) and restarted only if it refuses or does not answer. Once the
plan is deactivated, the router is held back (``stop_pipeline``).

It lives in the daemon room beside ``root.py`` (the composition root, its only user),
which hands it ``ServingParts``: the parts it uses, never the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.cluster.front import Fronts
from mlxceld.config.clients import parse_model_names
from mlxceld.config.daemon import Config, Overrides
from mlxceld.config.kvquant import check_kv_model
from mlxceld.config.serve import ROUTER, ServeConfig, resolve_model
from mlxceld.config.tensor import check_tp_model, check_tp_reload
from mlxceld.config.tensor_modes import check_tp_modes_model, setting_names
from mlxceld.control.answers import ServedModel, Unserved
from mlxceld.daemon.roster import Roster
from mlxceld.errors import ConfigError, ModelRefused, UnserveRefused
from mlxceld.models.drafts import check_draft
from mlxceld.models.families import require_splittable
from mlxceld.models.fetch import local_model, names_a_repo
from mlxceld.roles.options import options_json
from mlxceld.state import EventLog, Settings
from mlxceld.supervisor.ops import Pipeline, Retiring
from mlxceld.supervisor.service import Supervisor

log = logging.getLogger(__name__)

RETIRED_POLL_S = 0.2  # between two asks whether the router's old engines closed


@dataclass(frozen=True)
class ServingParts:
    """What the serving window uses, never the daemon: the roster (whose ``serve`` and
    ``hold_router`` it sets, and whose one reconcile it calls), the supervisor (the
    router's restart and its ``pipeline`` op), the settings (what `mlxctl serve` chose
    last), the event log, and the flags (where a configured model came from)."""

    roster: Roster
    supervisor: Supervisor
    settings: Settings
    events: EventLog
    flags: Overrides
    fronts: Fronts = field(default_factory=Fronts)  # routers in front (cluster/front.py)


class ServingWindow:
    def __init__(self, parts: ServingParts, configured: ServeConfig) -> None:
        self._parts = parts
        self._roster = parts.roster
        self._switched_at = 0.0  # time.monotonic() of the last live move (old_plan_retired)
        self._roster.serve = self.effective(configured)

    @property
    def fronts(self) -> Fronts:
        """The routers in front of our pipeline (the cluster member tells it who asked)."""
        return self._parts.fronts

    @property
    def serve(self) -> ServeConfig:
        """What the router serves now (the roster's input)."""
        return self._roster.serve

    def effective(self, configured: ServeConfig) -> ServeConfig:
        """Flags and the config file win; else what `mlxctl serve` chose last time.
        A cluster coordinator serves its cluster's model."""
        placement = self._roster.placement
        if placement is not None:
            return configured.with_model(str(placement.model), configured.model_name)
        saved = self._parts.settings.get("serve")
        if configured.model is None and saved is not None:
            return configured.with_model(saved["model"], saved.get("model_name"))
        return configured

    async def serve_model(self, model: str, name: str | None) -> ServedModel | None:
        """`mlxctl serve`: validate, remember, and (re)start the router on the new model."""
        parts, roster = self._parts, self._roster
        if roster.config.pp_peer:
            raise ModelRefused("this daemon is a --pp-peer: it takes a pipeline stage from a "
                               "coordinator and runs no router",
                               hint="serve on the coordinator (mlxctl cluster activate), or "
                               "run this daemon without --pp-peer ([daemon] pp_peer)")
        if roster.placement is not None:
            raise ModelRefused(
                f"this daemon is node {roster.placement.node.id!r} of cluster config "
                f"{roster.placement.cluster.path}; it serves that cluster's model",
                hint="change [cluster] model in that file on every node, then restart them")
        try:
            resolved = resolve_model(model, Path("/"), "mlxctl serve")
            name = parse_model_names(name, "mlxctl serve's model name")  # a,b: aliases
            local = resolved
            if names_a_repo(resolved):  # its config, index, tokenizer (models/fetch.py)
                local = str(await asyncio.to_thread(local_model, resolved))
            check_tp_model(local, self.serve.tp_size, f"mlxctl serve {model} (with tp_size "
                           f"{self.serve.tp_size})")
            check_tp_modes_model(local, self.serve.tp_modes, setting_names(),
                                 f"mlxctl serve {model}")
            check_kv_model(local, self.serve.kv_quant, "serve.kv_bits")
            draft = self.serve.draft_model  # a repo id's is checked where it is loaded
            if draft is not None and Path(draft).is_dir() and Path(local).is_dir():
                check_draft(Path(local), Path(draft), "serve.draft_model")
        except ConfigError as exc:
            raise ModelRefused(exc.message, hint=exc.hint) from exc
        roster.serve = self.serve.with_model(resolved, name)
        roster.hold_router = False  # told to serve: also after a deactivate
        parts.settings.put("serve", {"model": resolved, "model_name": name})
        existed = ROUTER in parts.supervisor.names()
        await roster.reconcile()
        if existed:
            parts.supervisor.restart(ROUTER)
        parts.events.append("serve.changed", ROUTER,
                           f"now serving {self.serve.served_name} from {resolved}")
        return self.describe()

    def check_start(self, config: Config) -> None:
        """At start, before anything runs, the model to serve (refused with exit 2 where
        the flags or the config file name it): fetched first if it is a repo id, split over
        ``tp_size`` ranks (``check_split``), and with --pp-auto of a family that splits,
        refused here rather than after the wait for peers (a model that is neither a local
        directory nor a repo id is the coordinator's to refuse)."""
        planned = self.serve.model
        if planned is not None and names_a_repo(planned):
            self._fetch_metadata(planned, config.serve.model)
        self.check_split(config.serve.model)
        check_planned(config, planned)

    @staticmethod
    def _fetch_metadata(model: str, configured: str | None) -> None:
        """A model named by its Hugging Face repo id: its config, index and tokenizer, once,
        before anything asks for its identity (``models/fetch.py``). Refused at start-up
        (exit 2) when it is ``configured`` (the flags or the config file); a model `mlxctl
        serve` chose before is only warned of (its router and inventory say what is
        wrong)."""
        try:
            local_model(model)
        except ConfigError as exc:
            if configured == model:
                raise
            log.warning("model %s cannot be fetched: %s (%s)", model, exc.message, exc.hint)

    def check_split(self, configured: str | None) -> None:
        """At start: the model to serve splits over ``tp_size`` ranks (``config/tensor.py``;
        a repo id judged by its fetched config). Refused (``ConfigError``, exit 2) when it
        is ``configured`` (the flags, the config file, a cluster TOML); one `mlxctl serve`
        chose before is only warned of (its router fails as it loads)."""
        try:
            split_check(self.serve)
        except ConfigError as exc:
            if self.serve.model == configured:
                raise
            log.warning("the model mlxctl serve chose, %s: %s (%s)", self.serve.model,
                        exc.message, exc.hint)
            self._parts.events.append("serve.unsplittable", ROUTER,
                                     f"{exc.message} ({exc.hint})")

    async def unserve(self) -> Unserved:
        """`mlxctl unserve`: stop the single-host router and forget what `mlxctl serve`
        chose, so that a restart does not serve it again. Refused, changing nothing, where
        a restart would serve again anyway (a model from the flags or the config file) or
        where the router is a cluster's."""
        parts, roster = self._parts, self._roster
        p = roster.placement
        if p is not None and p.is_coordinator:
            raise UnserveRefused("this daemon's router serves a pipeline",
                                 hint="mlxctl cluster deactivate ends the plan and stops its "
                                 "router" if roster.config.distributed_config is None else
                                 f"it runs the cluster config {p.cluster.path}; stop the daemon")
        if p is not None:
            raise UnserveRefused(f"this daemon runs {p.node.id} of a cluster and no router",
                                 hint="on the coordinator: mlxctl cluster deactivate")
        config = roster.config
        configured = config.serve.model
        if configured is not None:
            origin = ("--model" if parts.flags.model else
                      f"the cluster TOML {config.distributed_config} (or [serve] "
                      "model)"
                      if config.distributed_config is not None else
                      f"[serve] model in {config.config_file}")
            raise UnserveRefused(f"the model {configured} comes from {origin}: a restart would "
                                 "serve it again, so it is not unserved",
                                 hint="remove it there, then reload (systemctl reload mlxceld, "
                                 "or SIGHUP) or restart; then mlxctl unserve forgets what "
                                 "mlxctl serve chose, if anything")
        was = self.describe()
        parts.settings.delete("serve")
        roster.serve = replace(self.serve, model=None, model_name=None)
        await roster.reconcile()
        if was is not None:
            parts.events.append("serve.stopped", ROUTER,
                               f"no longer serving {was.model_name} ({was.model})")
            log.info("no longer serving %s (mlxctl unserve)", was.model)
        return Unserved(was)

    def resume_placement(self, placement: Placement) -> None:
        """The roster over ``placement``, on its model, not yet reconciled: at start, the
        plan to resume, so that its router, left running by the daemon before, is
        re-adopted (``Supervisor.reconcile``) and not started again; ``serve_pipeline``'s
        first step."""
        self._roster.placement = placement
        if self.serve.model != str(placement.model):
            self._roster.serve = self.serve.with_model(str(placement.model))

    async def serve_pipeline(self, placement: Placement, *, live: bool = False) -> None:
        """Run the router over the pushed plan ``placement`` (the roster's now): on its model,
        restarted if it was serving another (as it was: left as it is, a resume's);
        ``live``: a running router is moved to the plan's stages by its ``pipeline`` op,
        and restarted only if it refuses or does not answer."""
        parts, roster = self._parts, self._roster
        before = roster.spec(ROUTER)
        self.resume_placement(placement)
        existed = ROUTER in parts.supervisor.names()
        self._switched_at = time.monotonic()  # the plan answered from now on is the new one
        await roster.reconcile()
        spec = roster.spec(ROUTER)
        if not existed or spec == before:
            return
        if live and spec is not None:
            reply = await parts.supervisor.call_running(
                ROUTER, Pipeline(options_json(spec.options)))
            if reply is not None and reply.get("ok"):
                log.info("router moved to the new plan's stages without a restart")
                return
            log.info("router not moved live (%s): restarting it",
                     "no answer" if reply is None else reply.get("error"))
        parts.supervisor.restart(ROUTER)

    async def old_plan_retired(self, within_s: float) -> bool:
        """Whether the router, moved live, closed the engines of the plans before (their
        sequences ended on the old stages: ``pipeline/switch.py``, ``RETIRE_S`` at most)
        within ``within_s``; a router that does not answer has none (it restarted). The
        routers in front of the pipeline (``cluster/front.py``'s ``Fronts``) are waited for
        too: each that asked lately has asked for the new plan since the move."""
        loop = asyncio.get_running_loop()
        until = loop.time() + within_s
        while loop.time() < until:
            reply = await self._parts.supervisor.call_running(ROUTER, Retiring())
            fronts = self._parts.fronts.behind(self._switched_at, time.monotonic())
            if (reply is None or not reply.get("retiring")) and not fronts:
                return True
            await asyncio.sleep(RETIRED_POLL_S)
        return False

    async def stop_pipeline(self) -> None:
        """The plan is deactivated: no placement, and no router (not even a single-host one
        on the configured model) until `mlxctl serve`, an activate, or a restart."""
        self._roster.placement = None
        self._roster.hold_router = True
        await self._roster.reconcile()

    def check_reload(self, configured: ServeConfig) -> None:
        """On a reload: the model the new ``[serve]`` serves (what `mlxctl serve` chose
        included) splits over its ``tp_size``, and a group across hosts keeps its peers and
        role (``config/tensor.py``); else ``ConfigError``, and the reload keeps the running
        config."""
        split_check(self.effective(configured))
        check_tp_reload(self.serve.tp_peers, self.serve.node_role, configured.tp_peers,
                        configured.node_role)

    def describe(self) -> ServedModel | None:
        """What the router serves, and where; None where the roster runs no router (no
        model, a router held back, a --pp-peer or a stage node: nothing listens there)."""
        s = self.serve
        if s.model is None or self._roster.spec(ROUTER) is None:
            return None
        return ServedModel(s.model, s.served_name, f"http://{s.host}:{s.port}/v1",
                           s.api_key_file is not None,
                           str(s.api_key_file) if s.api_key_file else None)


def check_planned(config: Config, planned: str | None) -> None:
    """With --pp-auto: a model to plan (``planned``), of a family that splits into stages;
    else ``ConfigError`` (a model that is neither a local directory nor a repo id is the
    coordinator's to refuse)."""
    if config.pp_auto is None:
        return
    if planned is None:
        raise ConfigError("--pp-auto needs the model to plan: pass --model DIR",
                          hint="the same checkpoint must be on every host")
    if Path(planned).is_dir():
        require_splittable(Path(planned), "--pp-auto --model")
    elif names_a_repo(planned):
        require_splittable(local_model(planned), "--pp-auto --model")


def split_check(serve: ServeConfig) -> None:
    """``serve``'s model splits over its ``tp_size`` ranks (a repo id judged by its fetched
    config.json); else ``ConfigError`` naming why (``config/tensor.py``)."""
    model, tp_size = serve.model, serve.tp_size
    if model is None or tp_size == 1:
        return
    local = str(local_model(model)) if names_a_repo(model) else model
    check_tp_model(local, tp_size, f"the model {model} (with tp_size {tp_size})")
    check_tp_modes_model(local, serve.tp_modes, setting_names(), f"the model {model}")
