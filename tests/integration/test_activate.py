"""`mlxctl cluster activate` on a running coordinator: plan, two-phase push, router over the
pipeline; real daemons on 127.0.0.1 (coordinator), .2 and .3 (peers)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxceld.cluster.assignment.peer_round import FRAME_S, PEER_PHASE_S
from mlxceld.errors import ControlError

from helpers.cluster import ACTIVATE_S, POLL_WAIT_S, agent, settled, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for


def reachable(coord: DaemonProc, peers: list[DaemonProc]) -> None:
    """Both peers polled once (so that the plan does not race their first inventory)."""
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)


def no_stage_or_router_runs(d: DaemonProc) -> bool:
    return not [w for w in d.status()["workers"] if w["name"] in ("stage", "router")
                and w["state"] in ("starting", "running")]


@pytest.mark.slow
def test_activate_brings_up_and_serves(daemons: Daemons, split_fixture_dir: Path) -> None:
    """... and prints how far each peer has loaded its stage: each layer takes 1.5 s here
    (MLXCELD_TEST_STAGE_LAYER_S), so that a preparing heartbeat (every 2 s) says so."""
    model = split_fixture_dir / "llama"
    secret = b"4f" * 16
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}", env={"MLXCELD_TEST_STAGE_LAYER_S": "1.5"}) for i in (2, 3)]
    port = free_port("127.0.0.1")
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers",
                  ",".join(agent(p) for p in peers), "--port", str(port), name="c")
    assert coord.status()["serving"] is None  # idle until activated
    reachable(coord, peers)

    cli = subprocess.Popen(
        [sys.executable, "-m", "mlxctl", "--socket", str(coord.socket), "cluster", "activate",
         "--model", str(model), "--stages", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pushing = wait_for(lambda: (b := coord.status().get("bringup") or {}).get("state")
                           == "pushing" and b, 60, "the push to start", every=0.02)
        with pytest.raises(ControlError) as busy:
            coord.api(lambda c: c.activate_cluster(str(model), 2))
        assert busy.value.code == "bringup_in_progress"
        assert busy.value.message == f"a bring-up is in progress (plan {pushing['epoch']})"
        out, err = cli.communicate(timeout=ACTIVATE_S)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, (out, err, coord.stderr()[-3000:])
    for p, stage in zip(peers, ("stage-0", "stage-1"), strict=True):
        lines = [line for line in out.splitlines() if line.split()[:2] == [stage, agent(p)]]
        loads = [line for line in lines if "% of " in line]
        steps = [line.split()[-1] for line in lines if line not in loads]
        assert [s for s in steps if s != "loading"] == ["offered", "prepared", "committed",
                                                        "active"], out
        assert loads and all(re.search(r" loading \d+% of [\d.]+ [KM]iB, \d+ s$", line)
                             for line in loads), out
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
        assert p.status()["assignment"]["state"] == "active"
    assert f"every stage of 2 is active; serving llama at http://127.0.0.1:{port}/v1" in out
    daemons.pids.add(coord.worker("router")["pid"])
    bringup = coord.status()["bringup"]
    assert bringup["state"] == "active" and bringup["epoch"] == pushing["epoch"]
    assert [p["state"] for p in bringup["peers"]] == ["active", "active"], bringup
    assert bringup["peers"][0]["steps"][-2:] == ["committed", "active"], bringup
    shown = coord.ctl("status").stdout
    assert f"bring-up: active: plan {pushing['epoch']}" in shown, shown
    assert all(f"{agent(p):22} layers" in shown for p in peers), shown
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)


def test_activate_names_the_peer_that_failed(daemons: Daemons,
                                            split_fixture_dir: Path) -> None:
    """A peer without --pp-peer refuses its offer; the push aborts everywhere; the CLI exits 1
    naming that peer and its reason; no stage and no router runs anywhere."""
    model = str(split_fixture_dir / "llama")
    secret = b"5e" * 16
    good = start(daemons, "127.0.0.2", secret, "--pp-peer", "--model", model, name="good")
    lazy = start(daemons, "127.0.0.3", secret, "--model", model, "--port",
                 str(free_port("127.0.0.1")), name="lazy")
    daemons.note(lazy)  # it serves the model itself (a router), which is not a stage
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers",
                  f"{agent(good)},{agent(lazy)}", "--port", str(free_port("127.0.0.1")),
                  name="c")

    reachable(coord, [good, lazy])
    missing = coord.ctl("cluster", "activate", "--model", "/nonexistent/model", "--stages", "2")
    assert missing.returncode == 1 and "/nonexistent/model" in missing.stderr, missing.stderr
    usage = coord.ctl("cluster", "activate", "--model", model, "--stages", "0")
    assert usage.returncode == 2 and "--stages" in usage.stderr, usage.stderr
    too_many = coord.ctl("cluster", "activate", "--model", model, "--stages", "3", timeout=60)
    assert too_many.returncode == 1 and "3 stages need 3 peers" in too_many.stderr, too_many
    assert coord.status()["bringup"] is None  # refused at once: nothing was pushed
    on_peer = good.ctl("cluster", "activate", "--model", model, "--stages", "2")
    assert on_peer.returncode == 1 and "--pp-peer" in on_peer.stderr, on_peer.stderr

    done = coord.ctl("cluster", "activate", "--model", model, "--stages", "2",
                     timeout=ACTIVATE_S)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"{agent(lazy)} (stage-1): refused: not_a_peer:" in done.stderr, done.stderr
    assert "bring-up failed: plan" in done.stderr and agent(lazy) in done.stderr
    assert agent(good) not in [line.split()[0] for line in done.stderr.splitlines()[1:]]
    bringup = coord.status()["bringup"]
    assert bringup["state"] == "failed" and agent(lazy) in bringup["summary"], bringup
    # The abort reaches the good peer at once, or (when the refusal came back before its
    # connection was up) never: then it never had the offer, or it asks the coordinator
    # after its own deadline and aborts (PROTOCOL bound: PEER_PHASE_S, then FRAME_S).
    wait_for(lambda: (good.status()["assignment"] or {}).get("state") in (None, "aborted"),
             PEER_PHASE_S + 2 * FRAME_S, "the good peer aborted", every=0.5)
    for d in (good, coord):
        assert no_stage_or_router_runs(d), d.status()["workers"]
    assert "stage" not in [w["name"] for w in lazy.status()["workers"]]

    again = coord.ctl("cluster", "activate", "--model", model, "--stages", "2", "--json",
                      timeout=ACTIVATE_S)
    assert again.returncode == 1, again.stderr
    doc = json.loads(again.stdout)
    assert doc["schema"] == "mlxctl.cluster_activate/1" and doc["ok"] is False
    assert doc["bringup"]["epoch"] > bringup["epoch"]
    assert [(p["address"], p["state"]) for p in doc["bringup"]["peers"]] == [
        (agent(good), "aborted"), (agent(lazy), "failed")], doc


def test_activate_is_refused_while_a_bring_up_is_in_progress(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """`--pp-auto 2` with no reachable peer waits for two (up to 60 s); meanwhile `cluster
    activate` exits 5 saying so, and the daemon still stops at once (the wait is cancelled)."""
    model = str(split_fixture_dir / "llama")
    coord = start(daemons, "127.0.0.1", b"6d" * 16, "--cluster-peers", "127.0.0.5:9",
                  "--pp-auto", "2", "--model", model, "--port", str(free_port("127.0.0.1")),
                  name="c")
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") == "planning", 10,
             "the bring-up waiting for peers")
    busy = coord.ctl("cluster", "activate", "--model", model, "--stages", "2")
    assert busy.returncode == 5, (busy.stdout, busy.stderr)
    assert "a bring-up is in progress (planning)" in busy.stderr, busy.stderr
    as_json = coord.ctl("cluster", "activate", "--model", model, "--stages", "2", "--json")
    assert as_json.returncode == 5
    assert json.loads(as_json.stdout)["error"]["code"] == "bringup_in_progress"
    assert coord.ctl("stop").returncode == 0
    assert coord.proc is not None and coord.proc.wait(20) == 0
