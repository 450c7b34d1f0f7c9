"""A coordinator starting with a plan in its database resumes it whatever the config says now;
a config that differs is reported (state, event), not applied. Real SQLite, a real model,
the daemon's side played by a recording ``CoordinatorSlot``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from mlxceld.cluster.bringup import config_differences
from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.cluster.coordinator import Coordinator
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.service import DiscoveryService
from mlxceld.models import model_identity
from mlxceld.state import EventLog, PeersTable, open_db
from mlxceld.state.plans import PlanRow, Plans
from mlxceld.types import MeshMode
from mlxceld.wire import Keyring

from helpers.clusterfile import write_cluster_toml

PEERS = ("127.0.0.2:19000", "127.0.0.3:19000")


class Slot:
    def __init__(self) -> None:
        self.served: list[Placement] = []

    async def serve_pipeline(self, placement: Placement, *, live: bool = False) -> None:
        self.served.append(placement)

    async def stop_pipeline(self) -> None:
        self.served.clear()


def coordinator(tg: asyncio.TaskGroup, tmp_path: Path, model: Path, decision: str,
                mesh: str | None = None) -> tuple[Coordinator, Slot, EventLog]:
    """A coordinator over a database that holds a plan of ``model`` decided ``decision``
    (planned with ``mesh``)."""
    db = open_db(tmp_path / "state.db")
    plans, events, keyring, slot = Plans(db), EventLog(db), Keyring(), Slot()
    toml = write_cluster_toml(tmp_path, model, [(0, 2), (2, 4)]).read_text().replace(
        'id = "coord"', 'id = "coordinator"')  # the planner's name for it
    plans.create(7, "c", model_identity(model) if model.exists() else "ab" * 32, PEERS, toml,
                 mesh)
    plans.decide(7, decision)
    discovery = DiscoveryService(CandidateTable(PeersTable(db), node_id="n"), keyring,
                                 node_id="n", cluster="c", peers=(), mode="static",
                                 agent_address="127.0.0.1:19000")
    c = Coordinator(slot, tg, cluster="c", state_dir=tmp_path, config_out=None, plans=plans,
                    keyring=keyring, discovery=discovery, identity="127.0.0.1:19000",
                    events=events)
    return c, slot, events


async def start(tmp_path: Path, model: Path, decision: str, n: int | None,
                configured: str | None, *, planned: str | None = None, mesh: MeshMode = "pp"
                ) -> tuple[Coordinator, Slot, EventLog]:
    """``Coordinator.start`` with pp_auto ``n`` and the ``configured`` model, over a plan of
    ``model`` decided ``decision``, until what it started has ended."""
    async with asyncio.TaskGroup() as tg:
        c, slot, events = coordinator(tg, tmp_path, model, decision, planned)
        c.start(n, configured, configured_model=configured, mesh=mesh)
    return c, slot, events


def test_an_active_plan_is_served_again_as_it_was(tmp_path: Path,
                                                  split_fixture_dir: Path) -> None:
    llama, qwen = split_fixture_dir / "llama", split_fixture_dir / "qwen3"
    c, slot, events = asyncio.run(start(tmp_path, llama, "active", 3, str(qwen)))
    assert [p.model for p in slot.served] == [llama]  # the plan's model, not the config's
    assert slot.served[0].is_coordinator and len(slot.served[0].cluster.stages) == 2
    state = c.state or {}
    assert state["state"] == "active" and state["summary"] == (
        "plan 7: resumed as decided (active)")
    differs = state["config_differs"]
    assert f"the config names model {qwen} ({model_identity(qwen)})" in differs
    assert f"the plan serves model {model_identity(llama)}" in differs
    assert "pp_auto is 3, the plan has 2 stage(s)" in differs
    kinds = [e.kind for e in events.since(0)]
    assert kinds == ["bringup.config_differs", "bringup.active"]
    assert (tmp_path / "cluster-7.toml").exists()


def test_a_matching_config_resumes_quietly_on_its_own_model_path(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    llama = split_fixture_dir / "llama"
    c, slot, events = asyncio.run(start(tmp_path, llama, "active", 2, str(llama)))
    assert [p.model for p in slot.served] == [llama]
    assert "config_differs" not in (c.state or {})
    assert [e.kind for e in events.since(0)] == ["bringup.active"]


def test_a_changed_mesh_is_said_and_the_plan_resumed_as_it_was(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    """A plan planned with --mesh pp, the daemon started with pp_auto 2 and --mesh tp: the
    plan is served as it was (no re-plan), and the setting named (state, event, log)."""
    llama = split_fixture_dir / "llama"
    c, slot, events = asyncio.run(start(tmp_path, llama, "active", 2, str(llama),
                                        planned="pp", mesh="tp"))
    assert [p.model for p in slot.served] == [llama]
    assert len(slot.served[0].cluster.stages) == 2 and not slot.served[0].cluster.mesh
    said = "the plan was planned with --mesh pp, --mesh ([daemon] mesh) is now tp"
    assert (c.state or {})["config_differs"] == said
    differs = [e for e in events.since(0) if e.kind == "bringup.config_differs"]
    assert len(differs) == 1 and said in differs[0].message


def test_an_aborted_heal_after_an_active_plan_resumes_the_active_plan(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    """A heal's push that aborted is the newest plan, yet it never took over: the active
    plan before it is served again, not nothing."""
    llama = split_fixture_dir / "llama"

    async def go() -> tuple[Coordinator, Slot]:
        async with asyncio.TaskGroup() as tg:
            c, slot, _ = coordinator(tg, tmp_path, llama, "active")
            plans = Plans(open_db(tmp_path / "state.db"))
            plans.create(8, "c", model_identity(llama), PEERS[:1], "")
            plans.decide(8, "abort", "stage-0: refused")
            c.start(None, None, configured_model=None)
        return c, slot

    c, slot = asyncio.run(go())
    assert [p.model for p in slot.served] == [llama]
    state = c.state or {}
    assert (state["state"], state["epoch"]) == ("active", 7), state


def test_a_deactivated_plan_is_not_resumed(tmp_path: Path, split_fixture_dir: Path) -> None:
    c, slot, events = asyncio.run(start(tmp_path, split_fixture_dir / "llama", "deactivated",
                                         None, None))
    assert slot.served == [] and events.since(0) == []
    state = c.state or {}
    assert state["state"] == "deactivated" and "plan 7 was deactivated" in state["summary"]


def test_a_plan_whose_model_is_gone_fails_visibly(tmp_path: Path) -> None:
    c, slot, events = asyncio.run(start(tmp_path, tmp_path / "gone", "active", None, None))
    state = c.state or {}
    assert slot.served == [] and state["state"] == "failed"
    assert state["summary"].startswith("plan 7 cannot be resumed: ")
    assert str(tmp_path / "gone") in state["summary"]
    assert [e.kind for e in events.since(0)] == ["bringup.failed"]


def test_the_differences_named() -> None:
    plan = PlanRow(7, "c", "ab" * 32, PEERS, "", "active", "")
    assert config_differences(plan, None, None, None) == ""
    assert config_differences(plan, 2, "/m", "ab" * 32) == ""
    assert config_differences(plan, 4, None, None) == "pp_auto is 4, the plan has 2 stage(s)"
    assert config_differences(plan, None, "/m", "unreadable: gone") == (
        f"the config names model /m (unreadable: gone), the plan serves model {'ab' * 32}")
    said = "the plan was planned with --mesh pp, --mesh ([daemon] mesh) is now auto"
    planned = replace(plan, mesh="pp")
    assert config_differences(planned, 2, None, None, "auto") == said
    assert config_differences(planned, 2, None, None, "pp") == ""
    assert config_differences(planned, None, None, None, "auto") == ""  # not pp_auto's
    assert config_differences(plan, 2, None, None, "auto") == ""  # a plan of no known mesh


def test_a_peer_asking_about_a_plan_left_decided_activate_pushes_it_on(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    """A push that gave up on a peer (STALLED) leaves its plan decided activate: the peer's
    query when it is back (``peer_asked``) pushes it on, as a restart would; a query about
    another plan or decision, or one while a push runs, does nothing."""

    async def go() -> tuple[object, object]:
        async with asyncio.TaskGroup() as tg:
            c, _, _ = coordinator(tg, tmp_path, split_fixture_dir / "llama", "activate")
            c.peer_asked(7, "active")
            c.peer_asked(6, "activate")
            idle = c.state
            c.peer_asked(7, "activate")
            await asyncio.sleep(0.1)
            pushing = dict(c.state or {})
            c.peer_asked(7, "activate")  # a push runs: ignored (not BringUpInProgress)
            c.close()
        return idle, pushing

    idle, pushing = asyncio.run(go())
    assert idle is None
    assert isinstance(pushing, dict) and (pushing["state"], pushing["epoch"]) == ("pushing", 7)
