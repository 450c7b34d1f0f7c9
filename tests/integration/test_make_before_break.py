"""Make before break, between real daemons on 127.0.0.x shaped as `make run`'s cluster: a
coordinator (.1) and two peers (.2, .3) serving a 2-stage plan, under ``CLIENTS``
streaming `openai` clients with retries off (``helpers/load.py``: every refusal and
every broken stream is counted).

- A re-activate whose push fails (the new stage of one peer killed as it loads) leaves
  the old plan serving: each peer's stage of it went on as ``stage-retiring`` while the
  new one loaded and is ``stage`` again (the same process), and no request failed or
  was refused.
- A drain of a stage host re-plans onto the other peer alone (the whole model beside
  its old stage, which serves on until the router moved): no request failed or was
  refused, and the drained host's stage stops.

The counts are printed (``pytest -s``)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.cluster import activate, agent, coordinator, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.load import StreamingLoad
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLIENTS = 4
WARM_S = 2.0  # load before the operation, and after it
LAYER_S = "0.5"  # each layer a stage loads takes this long (a slow disk): a push to catch
WAIT_S = 120.0  # generous waits on a loaded machine


def cluster(daemons: Daemons, model: Path
            ) -> tuple[list[DaemonProc], DaemonProc, int, tuple[str, ...]]:
    """Two peers and a coordinator (`make run`'s shape), a 2-stage plan served; the
    coordinator's flags last (a restart starts it with them)."""
    secret = secrets.token_hex(16).encode()
    slow = {"MLXCELD_TEST_STAGE_LAYER_S": LAYER_S}
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}",
                   env=slow) for ip in ("127.0.0.2", "127.0.0.3")]
    coord, port, flags = coordinator(daemons, secret, peers)
    activate(coord, model, 2)
    daemons.pids.add(coord.worker("router")["pid"])
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    return peers, coord, port, flags


def served(coord: DaemonProc) -> dict[str, Any]:
    """The coordinator's bring-up ({} while a restarted one has not begun its resume)."""
    b: dict[str, Any] = coord.status()["bringup"] or {}
    return b


def kinds(d: DaemonProc, after: int, prefix: str) -> list[str]:
    return [e["kind"] for e in d.events(400) if e["id"] > after and e["kind"].startswith(prefix)]


def test_a_reactivate_whose_push_fails_leaves_the_old_plan_serving(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    peers, coord, port, _ = cluster(daemons, model)
    first = served(coord)
    old = {p.root: p.worker("stage")["pid"] for p in peers}
    marks = {p.root: max(e["id"] for e in p.events(1)) for p in peers}
    victim = peers[1]
    router = coord.worker("router")["pid"]
    said: list[subprocess.CompletedProcess[str]] = []
    again = threading.Thread(target=lambda: said.append(coord.ctl(
        "cluster", "activate", "--model", str(model), "--stages", "2", timeout=WAIT_S)))
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS) as load:
        time.sleep(WARM_S)
        again.start()

        def loading_anew() -> int | None:
            w = next((w for w in victim.status()["workers"] if w["name"] == "stage"), None)
            return w["pid"] if w and w["pid"] and w["pid"] != old[victim.root] else None

        pid = wait_for(loading_anew, WAIT_S, "the new stage loading on a peer", every=0.05)
        os.kill(pid, signal.SIGKILL)  # as it loads: this peer cannot prepare the new plan
        wait_for(lambda: served(coord)["state"] == "failed", WAIT_S, "the push to fail",
                 every=0.2)
        for p in peers:  # each peer's old stage is its stage again, the same process
            wait_for(lambda p=p: p.wait_worker("stage", timeout=WAIT_S, state="running")
                     ["pid"] == old[p.root], WAIT_S, f"{p.root.name}'s old stage back", every=0.2)
        again.join(WAIT_S)
        time.sleep(WARM_S)
    counts = load.counts()
    print(f"\nre-activate whose push failed, under load ({CLIENTS} streaming clients): "
          f"{counts}; refused: {load.refused[:3]}; failed: {load.failed[:3]}")
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    assert said and said[0].returncode != 0, said  # `mlxctl cluster activate` says it failed
    assert served(coord)["epoch"] > first["epoch"]  # the push that failed
    assert coord.worker("router")["pid"] == router  # never restarted: the old plan serves
    for p in peers:
        assert alive(old[p.root])
        assert "stage-retiring" not in {w["name"] for w in p.status()["workers"]}
        steps = kinds(p, marks[p.root], "stage.")
        assert "stage.retiring" in steps and "stage.kept" in steps, steps


def test_a_drain_of_a_stage_host_moves_to_the_other_peer_and_fails_nothing(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    peers, coord, port, _ = cluster(daemons, model)
    first = served(coord)
    node_of = {p.root: p.status()["daemon"]["node_id"] for p in peers}
    victim, survivor = peers
    stale = victim.worker("stage")["pid"]
    before = max(e["id"] for e in coord.events(1))
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS) as load:
        time.sleep(WARM_S)
        began = time.monotonic()
        drained = coord.ctl("drain", node_of[victim.root], "--deadline", "120s", "--json",
                            timeout=WAIT_S + 60)
        took = time.monotonic() - began
        assert drained.returncode == 0, drained.stdout + drained.stderr
        time.sleep(WARM_S)  # serving goes on, on the new plan
    counts = load.counts()
    print(f"\ndrain of stage node {node_of[victim.root]} (no spare: the other peer takes "
          f"the whole model) under load ({CLIENTS} streaming clients): {counts}; `mlxctl "
          f"drain` returned after {took:.1f} s")
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    row = json.loads(drained.stdout)["drain"]
    assert row["state"] == "drained" and row["reason"].startswith("re-planned around"), row
    now = served(coord)
    assert now["epoch"] > first["epoch"] and [r["address"] for r in now["peers"]] == \
        [agent(survivor)], now
    steps = kinds(coord, before, "drain.")
    assert steps[:5] == ["drain.started", "drain.replanning", "drain.replan_pushing",
                         "drain.replanned", "drain.retired"], steps
    wait_for(lambda: not alive(stale), 60, "the drained host's stage to stop")
    daemons.pids.add(survivor.wait_worker("stage", timeout=READY_S, state="running")["pid"])


def test_a_coordinator_killed_and_restarted_adopts_its_router(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """kill -9 of the coordinator's daemon (a crash, an OS update's reboot of the daemon
    alone): its router worker serves on; the restarted daemon resumes the plan and adopts
    that very router (before: it stopped and started it again, refusing connections for
    a second), so the clients see nothing."""
    model = split_fixture_dir / "llama"
    _, coord, port, flags = cluster(daemons, model)
    first = served(coord)
    router = coord.worker("router")["pid"]
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS) as load:
        time.sleep(WARM_S)
        assert coord.proc is not None
        coord.proc.kill()
        coord.proc.wait(10)
        coord.start(*flags)
        wait_for(lambda: (b := served(coord)).get("state") == "active"
                 and b["epoch"] == first["epoch"], WAIT_S, "the plan resumed", every=0.2)
        time.sleep(WARM_S)
    counts = load.counts()
    print(f"\ncoordinator killed and restarted under load ({CLIENTS} streaming clients): "
          f"{counts}; refused: {load.refused[:3]}")
    assert coord.worker("router")["pid"] == router
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    adopted = [e for e in coord.events(300) if e["kind"] == "worker.adopted"]
    assert [e["subject"] for e in adopted] == ["router"], adopted
