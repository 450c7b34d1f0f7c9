"""A standby coordinator adopts the plan it followed (``daemon/standby.py`` decides when).

A router in front of a pipeline with ``--standby`` learns the plan from its coordinator's
``plan`` answer (``cluster/front.py``): the stages' node ids, listeners, ranks and layers,
the plan's epoch, cluster and model identity. To heal that plan and re-plan it around a
drain, this daemon's ``Coordinator`` needs it as its served plan (``Served``: the epoch,
the model directory, the stage hosts' agent addresses) and a row in its plans table (a
heal records the plan it replaces as deactivated, superseded; the next epoch is above it).

A pipeline's stage hosts' agent addresses are not in the ``plan`` answer: they are this
daemon's candidates (``--cluster-peers`` or mDNS, as for any coordinator): the one on the
host of the stage's listener (``host_of``; one daemon per host, as a plan has). A 2D mesh's
stages carry their groups (``tp_group``: each rank's agent address): every rank's host is
a stage host here, found among the candidates as that address (or the one candidate on
its host), and the plan is adopted as a mesh (``Served.tp_size``), so that a heal or a
drain's re-plan plans a mesh of the hosts alive (``--mesh auto``), as its coordinator's
would, rather than a pipeline of the stages' rank-0 hosts.
``adopt`` refuses, saying why, while a stage host is not a candidate, or the failure
detector does not say it is alive: the takeover rule's "the plan's stage hosts still
answer"; then while a stage host still hears the coordinator (its lease runs,
``cluster/lease.py``'s ``still_heard``: ``StillHeard``), or holds a newer plan than the one
followed. The row is recorded ``active`` with no cluster file (``toml`` empty): it is the
old coordinator's plan, never pushed from here; the first heal or drain's re-plan pushes
one of this daemon's own, with a newer epoch that the peers take (``peer_round``'s
``on_other_offer``). Until then, this daemon's restart does not resume it (nothing to
place: ``fencing.Fence``); its router serves on with the plan the follower kept
(``daemon/following.py``), and the standby takes over again by the same rule. A standby
restarted after it pushed a plan resumes that one as any coordinator does, and its next
takeover adopts nothing (``take_over``: it coordinates already).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence

from mlxceld.cluster.coordinator import Coordinator, Served
from mlxceld.cluster.lease import StillHeard
from mlxceld.state.plans import Plans
from mlxceld.wire.address import parse_address
from mlxceld.wire.agent_messages import Plan


def host_of(stage: str, candidates: Collection[str]) -> str | None:
    """The agent address, among ``candidates``, of the host whose stage listens on
    ``stage`` (``host:port``): the one candidate on that host (None if none, or several:
    a host's stage ports are not told once in use). A 2D mesh's rank's agent address
    (``tp_group``) that is a candidate is itself."""
    if stage in candidates:
        return stage
    host = parse_address(stage).host
    on_host = [a for a in candidates if parse_address(a).host == host]
    return on_host[0] if len(on_host) == 1 else None


def stage_hosts(plan: Plan, address_of: Callable[[str], str | None],
                alive: Collection[str]) -> tuple[str, ...] | str:
    """The plan's stage hosts' agent addresses in rank order (of a 2D mesh, every rank's,
    stage by stage, as its coordinator's plans table has them), or why there are none:
    ``address_of`` maps a stage's listener, or a rank's agent address, to its host's agent
    address among the candidates (``host_of``); ``alive``: the addresses the failure
    detector says are alive."""
    peers: list[str] = []
    for stage in plan.stages:
        hosts = [(f"{stage.node_id}" + (f" rank {r}" if r else ""), a)
                 for r, a in enumerate(stage.tp_group)] or [(stage.node_id, stage.address)]
        for who, said in hosts:
            address = address_of(said)
            if address is None:
                return (f"the host of {who} ({said}) is not one candidate of this daemon "
                        "(list each stage host's agent in --cluster-peers)")
            if address not in alive:
                return f"the host of {who} ({address}) does not answer"
            peers.append(address)
    return tuple(peers)


def adopt(plan: Plan, peers: tuple[str, ...], model: str, *, coordinator: Coordinator,
          plans: Plans, origin: str) -> Served:
    """Make ``plan`` (its stage hosts ``peers``, of ``model``, a local directory) the one
    ``coordinator`` serves; ``origin``: the coordinator it came from."""
    assert plan.epoch is not None and plan.cluster is not None and plan.model is not None
    if plans.get(plan.epoch) is None:
        plans.create(plan.epoch, plan.cluster, plan.model, peers, toml="")
    plans.decide(plan.epoch, "active", f"adopted from coordinator {origin} by this standby")
    served = Served(plan.epoch, model, peers, tp_size=plan.tp_size)
    coordinator.serving = served
    return served


async def take_over(plan: Plan, origin: str, model: str | None, coordinator: Coordinator, *,
                    plans: Plans, candidates: Sequence[str], alive: Collection[str],
                    still_heard: Callable[[tuple[str, ...]], Awaitable[StillHeard | str | None]]
                    ) -> StillHeard | str | None:
    """``adopt`` ``plan`` when its stage hosts are among ``candidates`` and ``alive`` and
    none of them holds it back (``still_heard`` asked of them: ``lease.still_heard``);
    None once ``coordinator`` serves a plan (this one, or one it resumed after pushing
    it), else why not."""
    if model is None:
        return "no --model: nothing to coordinate with"
    if coordinator.serving is not None:  # it resumed a plan it pushed before
        return None
    peers = stage_hosts(plan, lambda s: host_of(s, candidates), alive)
    if isinstance(peers, str):
        return peers
    if (held := await still_heard(peers)) is not None:
        return held
    if coordinator.serving is not None:  # resumed meanwhile
        return None
    adopt(plan, peers, model, coordinator=coordinator, plans=plans, origin=origin)
    return None
