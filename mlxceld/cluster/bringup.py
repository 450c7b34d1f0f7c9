"""A bring-up as `mlxctl status` shows it: the coordinator's record of its last one.

``Coordinator`` (``coordinator.py``) keeps its last bring-up here (an operator's, a
resume, a heal or a drain's re-plan, a deactivation): each step into ``state``, each
change of a peer logged once and recorded as a ``bringup.*`` event. ``state`` is what
``mlxctl status`` shows as ``bringup``, and what ``mlxctl cluster activate`` polls::

    {"state": "planning" | "pushing" | "active" | "failed" | "deactivated", "epoch": E,
     "model": DIR, "stages": N, "summary": "...", "config_differs": "..." (a resumed plan),
     "peers": [{"stage": "stage-0", "node_id": ..., "address": AGENT,
                "layers": [first, end], "state": STATE, "reason": "...",
                "steps": [STATE, ...],
                "loading": {"done": B, "total": B, "elapsed_s": S,
                            "step": "downloading" | "loading"} | null}]}

with a peer's STATE one of ``CoordinatorRound.progress``: offered, loading,
prepared, committed, active, failed (its reason), aborted, unreachable (lost
after the decision, and re-dialled: the bring-up stays ``pushing``, and the
peer turns committed or active as soon as it answers); after a deactivation
deactivated, unreachable or refused (``deactivation.Outcome``); ``steps`` holds
every state it went through, in order, so that a poller misses none. ``loading`` is
how far a loading peer's stage has read its weights, as its last ``preparing``
heartbeat said (``CoordinatorRound.loading``); it changes without a step or an event.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlxceld.cluster.assignment import deactivation
from mlxceld.cluster.assignment.coordinator_round import CoordinatorRound
from mlxceld.cluster.clusterfile.load import parse_cluster_text
from mlxceld.cluster.plan.model import Plan
from mlxceld.errors import MlxceldError
from mlxceld.models.fetch import local_model
from mlxceld.models.identity import model_identity
from mlxceld.state import EventLog
from mlxceld.state.plans import PlanRow
from mlxceld.types import JSON

log = logging.getLogger(__name__)


class BringUp:
    """The last bring-up (``state``, None before the first) and its events."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self.state: JSON | None = None

    def pushing(self, epoch: int, plan: Plan) -> None:
        """Plan ``epoch`` is offered to its stages' hosts."""
        self.state = {**(self.state or {}), "state": "pushing", "epoch": epoch, "summary": "",
                      "peers": [{"stage": s.stage_id + (f"-tp-{r}" if r else ""),
                                 "node_id": n.node_id, "address": n.key,
                                 "layers": list(s.layers), "state": "offered", "reason": "",
                                 "steps": ["offered"]}
                                for s in plan.stages for r, n in enumerate(s.ranks)]}
        hosts = [n.key for s in plan.stages for n in s.ranks]  # a stage's group: each rank
        self._events.append(
            "bringup.pushing", "cluster", f"plan {epoch}: offering {len(plan.stages)} "
            f"stage(s) of {self.state.get('model')} to " + ", ".join(hosts), epoch=epoch,
            peers=hosts)

    def watch(self, round_: CoordinatorRound) -> None:
        """Each peer's progress into ``state``; each change logged once."""
        if self.state is None:
            return
        peers: list[dict[str, Any]] = self.state.setdefault("peers", [])
        rows = {p["address"]: p for p in peers}
        loads = round_.loading()
        for address, (state, reason) in round_.progress().items():
            row = rows.get(address)
            if row is None:  # a resumed plan: the plans table knows the peers, not the stages
                row = {"stage": None, "node_id": None, "address": address, "layers": None,
                       "state": "", "reason": "", "steps": []}
                peers.append(row)
            if (row["state"], row["reason"]) != (state, reason):
                row["state"], row["reason"] = state, reason
                row["steps"].append(state)
                log.info("plan %d: peer %s%s is %s%s", round_.epoch, address,
                         f" ({row['stage']})" if row["stage"] else "", state,
                         f": {reason}" if reason else "")
                self._events.append(
                    "bringup.peer", "cluster",
                    f"plan {round_.epoch}: peer {address}"
                    + (f" ({row['stage']})" if row["stage"] else "") + f" is {state}"
                    + (f": {reason}" if reason else ""),
                    epoch=round_.epoch, peer=address, stage=row["stage"], state=state,
                    reason=reason)
            load = loads.get(address) if state == "loading" else None
            # How far a loading peer is: kept on its row, neither a step nor an event.
            row["loading"] = (None if load is None else
                              {"done": load.done, "total": load.total,
                               "elapsed_s": load.elapsed_s, "step": load.step})

    def active(self, epoch: int, summary: str) -> None:
        """Plan ``epoch`` is served."""
        self.state = {**(self.state or {}), "state": "active", "epoch": epoch,
                      "summary": summary}
        self._events.append("bringup.active", "cluster", summary, epoch=epoch)
        log.info("pipeline bring-up: %s", summary)

    def failed(self, summary: str) -> None:
        self.state = {**(self.state or {}), "state": "failed", "summary": summary}
        log.error("pipeline bring-up failed: %s; the daemon stays up without serving (fix "
                  "the peers named, then restart it)", summary)
        self._events.append("bringup.failed", "cluster", summary)

    def deactivated(self, plan: PlanRow, outcomes: dict[str, deactivation.Outcome]
                    ) -> list[str]:
        """``plan`` is deactivated, its peers told with ``outcomes``; returns the peers
        not told (``told_late`` records each once it is)."""
        epoch = plan.epoch
        left = [p for p, (state, _) in outcomes.items() if state != "deactivated"]
        summary = (f"plan {epoch} deactivated: " + (
            f"every stage of {len(plan.peers)} is stopped" if not left else
            f"{len(plan.peers) - len(left)} of {len(plan.peers)} stage(s) stopped; not told: "
            + "; ".join(f"{p}: {outcomes[p][0]}: {outcomes[p][1]}" for p in left)))
        self.state = {"state": "deactivated", "epoch": epoch, "stages": len(plan.peers),
                      "summary": summary,
                      "peers": [{"stage": f"stage-{i}", "node_id": None, "address": p,
                                 "layers": None, "state": outcomes[p][0],
                                 "reason": outcomes[p][1], "steps": [outcomes[p][0]]}
                                for i, p in enumerate(plan.peers)]}
        (log.warning if left else log.info)("%s", summary)
        self._events.append("bringup.deactivated", "cluster", summary, epoch=epoch)
        return left

    def told_late(self, peer: str, outcome: deactivation.Outcome) -> None:
        state = self.state or {}
        for row in state.get("peers") or []:
            if row["address"] == peer and row["state"] != outcome[0]:
                row["state"], row["reason"] = outcome
                row["steps"].append(outcome[0])
        message = f"plan {state.get('epoch')}: peer {peer} told of the deactivation late"
        log.info("%s", message)
        self._events.append("bringup.peer_deactivated", "cluster", message, peer=peer)


def resumed_rows(plan: PlanRow) -> list[dict[str, Any]]:
    """A resumed plan's peers as ``state`` shows them: each stage's id and layers from the
    plan's TOML (its stages in rank order, as the plans table lists the peers); the peer's
    node id is not kept, so it reads None."""
    try:
        cluster = parse_cluster_text(plan.toml, Path(f"cluster-{plan.epoch}.toml"))
    except MlxceldError:
        return []
    stages = sorted((n for n in cluster.nodes if n.rank is not None),
                    key=lambda n: n.rank or 0)
    if len(stages) != len(plan.peers):
        return []
    return [{"stage": n.id, "node_id": None, "address": address,
             "layers": list(n.layers) if n.layers else None, "state": "", "reason": "",
             "steps": []} for address, n in zip(plan.peers, stages, strict=True)]


def config_differences(plan: PlanRow, n: int | None, configured: str | None,
                       configured_identity: str | None, mesh: str | None = None) -> str:
    """How the start-up config differs from the plan resumed (empty: it does not); ``mesh``
    (``--mesh``, ``[daemon] mesh``) is pp_auto's, so compared with it alone, and with a
    plan that recorded its own."""
    parts = []
    if configured is not None and configured_identity != plan.model_identity:
        parts.append(f"the config names model {configured} ({configured_identity}), the plan "
                     f"serves model {plan.model_identity}")
    if n is not None and n != len(plan.peers):
        parts.append(f"pp_auto is {n}, the plan has {len(plan.peers)} stage(s)")
    if n is not None and mesh is not None and plan.mesh is not None and mesh != plan.mesh:
        parts.append(f"the plan was planned with --mesh {plan.mesh}, --mesh ([daemon] mesh) "
                     f"is now {mesh}")
    return "; ".join(parts)


def identity_or_error(model: str) -> str:
    try:
        return model_identity(local_model(model))
    except MlxceldError as exc:
        return f"unreadable: {exc.message}"


def resumed_model(plan: PlanRow, path: Path, configured: str | None) -> tuple[str, str | None]:
    """The model plan ``plan`` (its TOML to be at ``path``) is served on when resumed: the
    configured one when it is the plan's (by identity), else the plan's own; and the
    configured one's identity (None: none configured)."""
    model = parse_cluster_text(plan.toml, path).model_source()
    identity = None if configured is None else identity_or_error(configured)
    if configured is not None and identity == plan.model_identity:
        model = configured
    return str(model), identity
