"""`mlxceld --pp-auto 2` on a coordinator and `--pp-peer` on two peers: the two-phase stage
assignment on real daemons (127.0.0.1/.2/.3), then a completion through the router."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest

from mlxceld.daemon.roster import MODEL_STOP_TIMEOUT_S

from helpers.cluster import agent, start
from helpers.daemons import READY_S, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for


@pytest.mark.slow
def test_pp_auto_brings_up_a_two_stage_pipeline(daemons: Daemons, split_fixture_dir: Path,
                                                tmp_path: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}") for i in (2, 3)]
    port = free_port("127.0.0.1")
    out = tmp_path / "pushed.toml"
    coord_args = ("--cluster-secret-file", "", "--agent-addr",
                  f"127.0.0.1:{free_port('127.0.0.1')}", "--cluster-peers",
                  ",".join(agent(p) for p in peers), "--pp-auto", "2", "--model", str(model),
                  "--port", str(port), "--cluster-config-out", str(out))
    coord = daemons.make(name="c")
    coord_args = (coord_args[0], str(secret_file(coord.root, secret)), *coord_args[2:])
    coord.start(*coord_args)
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active", "failed"),
             90, "the push to end\n" + coord.stderr()[-3000:])
    assert coord.status()["bringup"]["state"] == "active", (
        coord.status()["bringup"], coord.stderr()[-3000:], peers[0].stderr()[-3000:])
    router = coord.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(router["pid"])
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    assert out.exists()
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)
    shown = peers[0].ctl("status", "--json")
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assignment = body.get("assignment") or body.get("data", {}).get("assignment")
    assert assignment["state"] == "active" and assignment["stage"] == "stage-0", body
    assert body["serving"] is None  # a stage node: no router listens there
    assert coord.status()["bringup"]["state"] == "active"
    human = peers[1].ctl("status")
    assert "stage-1 active" in human.stdout, human.stdout
    # Each step of the bring-up is an event, on the coordinator and on each peer.
    pushed = coord.events()
    kinds = [e["kind"] for e in pushed]
    assert kinds.index("bringup.pushing") < kinds.index("bringup.active"), kinds
    reached = [e["data"] for e in pushed if e["kind"] == "bringup.peer"]
    assert sorted(r["stage"] for r in reached if r["state"] == "active") == [
        "stage-0", "stage-1"], reached
    for p in peers:
        steps = [e["kind"] for e in p.events() if e["kind"].startswith("assignment.")]
        assert steps == ["assignment.preparing", "assignment.accepted",
                         "assignment.committed", "assignment.active"], steps

    # A peer restarted while active brings its stage back active (from the stored TOML).
    p = peers[1]
    assert p.ctl("stop").returncode == 0 and p.proc is not None and p.proc.wait(30) == 0
    p.start("--agent-addr", "127.0.0.3:0", "--pp-peer", "--model", str(model))
    daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    assert p.status()["assignment"]["state"] == "active"
    wait_for(lambda: sum(e["kind"] == "stage.active" for e in p.events()) == 2, 20,
             "stage-1 activated again")
    assert complete(port, "llama") == text

    # A coordinator restarted after its plan went active serves that plan again, unpushed.
    assert coord.ctl("stop").returncode == 0 and coord.proc is not None
    assert coord.proc.wait(30) == 0
    coord.start(*coord_args)
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    # its router is put back at once; the plan is resumed once its peers were asked
    # whether another coordinator superseded it (cluster/fencing.py)
    wait_for(lambda: "resumed" in ((coord.status()["bringup"] or {}).get("summary") or ""),
             30, "the plan resumed")
    assert complete(port, "llama") == text


def test_refusals_are_named_and_no_stage_runs(daemons: Daemons,
                                             split_fixture_dir: Path) -> None:
    """A peer with another model is left out of the plan (and named); a peer with no model
    refuses its offer with code `model` (final); the push aborts (the good peer aborts its
    offer, if it got one before the refusal); nothing runs anywhere."""
    secret = secrets.token_hex(16).encode()
    llama = str(split_fixture_dir / "llama")
    good = start(daemons, "127.0.0.2", secret, "--pp-peer", "--model", llama, name="good")
    bare = start(daemons, "127.0.0.3", secret, "--pp-peer", name="bare")
    other = start(daemons, "127.0.0.4", secret, "--pp-peer", "--model",
                  str(split_fixture_dir / "qwen3"), name="other")
    peers = [good, bare, other]
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers",
                  ",".join(agent(p) for p in peers), "--pp-auto", "2", "--model", llama,
                  "--port", str(free_port("127.0.0.1")), name="c")

    def ended() -> dict[str, str] | None:
        b = coord.status().get("bringup") or {}
        return b if b.get("state") == "failed" else None

    failed = wait_for(ended, 120, "the bring-up to fail")
    summary = failed["summary"]
    assert f"{agent(bare)}: refused: model:" in summary, summary
    assert agent(other) in summary and "left out" in summary, summary
    assert "bring-up failed" in coord.stderr()
    wait_for(lambda: (bare.status()["assignment"] or {}).get("state") == "refused", 10,
             "the bare peer's refusal recorded")
    # The good peer aborts its offer (recorded once its standby stage is stopped: within
    # the stop timeout of a model worker, 20 s, on a loaded machine), or never hears one:
    # its dial was still under way when the bare peer's refusal ended the push, and a dial
    # the push ends sends nothing (cluster/assignment/push.py, _Links).
    def steps() -> list[str]:
        return [e["kind"] for e in good.events() if e["kind"].startswith("assignment.")]

    deadline = time.monotonic() + MODEL_STOP_TIMEOUT_S + 10
    while (seen := steps())[-1:] != ["assignment.aborted"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen in ([], ["assignment.preparing", "assignment.aborted"],
                    ["assignment.preparing", "assignment.accepted", "assignment.aborted"]), seen
    assert (good.status()["assignment"] or {}).get("state") == ("aborted" if seen else None)
    for d in (*peers, coord):
        assert not [w for w in d.status()["workers"] if w["name"] in ("stage", "router")
                    and w["state"] in ("starting", "running")], d.status()["workers"]


def test_pp_auto_over_mdns_discovery(daemons: Daemons, split_fixture_dir: Path) -> None:
    """The same bring-up with no peer list: the coordinator finds both peers by their signed
    mDNS records on lo (see tests/discovery/test_mdns.py for why lo carries them)."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    flags = ("--cluster-discovery", "mdns", "--cluster-name", f"mdns-{secrets.token_hex(4)}")
    peers = [start(daemons, f"127.0.0.{i}", secret, *flags, "--pp-peer", "--model",
                   str(model), name=f"p{i}") for i in (2, 3)]
    port = free_port("127.0.0.1")
    coord = start(daemons, "127.0.0.1", secret, *flags, "--pp-auto", "2", "--model",
                  str(model), "--port", str(port), name="c")
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active", "failed"),
             120, "the push to end\n" + coord.stderr()[-3000:])
    assert coord.status()["bringup"]["state"] == "active", (coord.status()["bringup"],
                                                            coord.stderr()[-3000:])
    nodes = {n["address"]: n for n in coord.api(lambda c: c.cluster_nodes())["nodes"]}
    assert {nodes[agent(p)]["source"] for p in peers} == {"mdns"}
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    for i, p in enumerate(peers):
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
        assert p.status()["assignment"]["stage"] == f"stage-{i}"
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)
