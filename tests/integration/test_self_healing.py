"""Self-healing between real daemons on 127.0.0.x: a coordinator (.1) serving a 2-stage plan
pushed by `mlxctl cluster activate`; a stage host's daemon and stage worker SIGSTOPped (a
host asleep). With a short detector and ``heal_after_s = 2``, the coordinator plans again
over the hosts alive (the spare), pushes it with a new epoch and serves mlx-lm's greedy
text from it; the host that comes back (SIGCONT) is told its plan is over and is not
pulled in. Without a spare, and with memory for two stages but not one
(``MLXCELD_TEST_MEMORY_AVAILABLE``), the heal is refused naming the memory missing and
waits; the host's return ends the wait, and meanwhile `mlxctl status` shows the cluster
view (plan, stages attached with their round trips, peers alive, tokens/s) and the dead
peer as a problem naming its node and the next command, at once. Times are printed
(``pytest -s``)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers.cluster import POLL_WAIT_S, activate, agent, settled, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.keys import secret_file
from helpers.memory import two_stages_but_not_one
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for

PING_S, SUSPECT_S, DEAD_S, HEAL_S = 0.25, 1.0, 2.0, 2.0
COORDINATOR = f"""
[daemon]
peer_ping_interval_s = {PING_S}
peer_suspect_after_s = {SUSPECT_S}
peer_dead_after_s = {DEAD_S}
heal_after_s = {HEAL_S}
"""
HEAL_WAIT_S = 90.0  # generous on a loaded machine: the times are printed and bounded below
HEALED_WITHIN_S = 45.0  # dead (2 s) + grace (2 s) + a poll, a push, a stage loaded again


def peers_and_coordinator(daemons: Daemons, model: Path, ips: list[str],
                          env: dict[str, str] | None = None
                          ) -> tuple[list[DaemonProc], DaemonProc, int]:
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}",
                   env=env) for ip in ips]
    port = free_port("127.0.0.1")
    coord = daemons.make(COORDINATOR, name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", "127.0.0.1:0", "--port", str(port),
                "--cluster-peers", ",".join(agent(p) for p in peers))
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
    return peers, coord, port


@contextmanager
def asleep(host: DaemonProc) -> Iterator[float]:
    """``host``'s daemon and stage worker SIGSTOPped (the time given); SIGCONT in any case."""
    pids = [host.pid, host.worker("stage")["pid"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def kinds(d: DaemonProc, after: int, prefix: str = "heal.") -> list[str]:
    return [e["kind"] for e in d.events(300) if e["id"] > after and e["kind"].startswith(prefix)]


def event(d: DaemonProc, kind: str, after: int) -> dict[str, Any] | None:
    return next((e for e in d.events(300) if e["id"] > after and e["kind"] == kind), None)


def serves(port: int, model: Path) -> bool:
    try:
        return complete(port, "llama") == expected(model, PROMPT, 8)
    except Exception:  # the router restarting, a stage re-attaching: not yet
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_stage_host_is_healed_onto_the_spare_and_not_pulled_back(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    peers, coord, port = peers_and_coordinator(daemons, model,
                                               ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    activate(coord, model, 2)
    first = coord.status()["bringup"]
    daemons.pids.add(coord.worker("router")["pid"])
    by_agent = {agent(p): p for p in peers}
    staged = [r["address"] for r in first["peers"]]
    for a in staged:
        daemons.pids.add(by_agent[a].wait_worker("stage", timeout=READY_S,
                                                 state="running")["pid"])
    (spare,) = set(by_agent) - set(staged)
    assert complete(port, "llama") == expected(model, PROMPT, 8)

    victim_agent, survivor = staged[1], staged[0]
    victim = by_agent[victim_agent]
    stale_stage = victim.worker("stage")["pid"]
    kept_stage = by_agent[survivor].worker("stage")["pid"]  # serves on until plan 2 does
    before = max(e["id"] for e in coord.events(1))
    with asleep(victim) as stopped:
        healed = wait_for(lambda: (b := coord.status()["bringup"])["epoch"] > first["epoch"]
                          and b["state"] == "active" and b, HEAL_WAIT_S, "the heal",
                          every=0.1)
        healed_s = time.monotonic() - stopped
        wait_for(lambda: serves(port, model), HEAL_WAIT_S, "greedy text from the new plan",
                 every=0.2)
        serving_s = time.monotonic() - stopped
        print(f"\nhealed (plan {healed['epoch']} active) {healed_s:.2f} s after SIGSTOP, "
              f"serving again {serving_s:.2f} s after (dead {DEAD_S:g} s + grace {HEAL_S:g} s)")
        assert sorted(r["address"] for r in healed["peers"]) == sorted([survivor, spare])
        assert healed_s < HEALED_WITHIN_S
        daemons.pids.add(coord.worker("router")["pid"])
        for a in (survivor, spare):
            daemons.pids.add(by_agent[a].worker("stage")["pid"])
            assert by_agent[a].status()["assignment"]["epoch"] == healed["epoch"]
        steps = kinds(coord, before)
        assert steps[:4] == ["heal.waiting", "heal.started", "heal.planned", "heal.active"], \
            steps
        assert steps[4:] in ([], ["heal.retired"]), steps
        active = event(coord, "heal.active", before)
        assert active is not None and active["data"]["fenced_later"] == [victim_agent]
        assert coord.status()["healing"]["state"] == "healed"

    # Make before break: the survivor's stage of plan 1 served on beside its new one until
    # the router's plan-1 engine closed; then the survivor was told plan 1 is over.
    retired = wait_for(lambda: event(coord, "heal.retired", before), HEAL_WAIT_S,
                       "the old plan retired", every=0.2)
    assert retired["data"]["told"] == [survivor], retired
    wait_for(lambda: not alive(kept_stage), 30, "the survivor's kept stage to stop")

    # Back: told its plan is over (its stale stage stops), a candidate, not pulled in.
    fenced = wait_for(lambda: event(coord, "heal.fenced", before), HEAL_WAIT_S,
                      "the returning host fenced", every=0.2)
    assert fenced["data"]["peer"] == victim_agent and fenced["data"]["outcome"] == "deactivated"
    assert victim.status()["assignment"]["state"] == "deactivated"
    wait_for(lambda: not alive(stale_stage), 30, "the stale stage worker to stop")
    assert (b := coord.status()["bringup"])["epoch"] == healed["epoch"], b
    assert sorted(r["address"] for r in b["peers"]) == sorted([survivor, spare])
    assert kinds(coord, before, "bringup.pushing").count("bringup.pushing") == 1
    assert serves(port, model)
    assert not [p for p in coord.status()["problems"] if p["subject"] == "healing"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_heal_that_does_not_fit_names_the_memory_missing_and_waits(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    memory = two_stages_but_not_one(model)
    peers, coord, port = peers_and_coordinator(
        daemons, model, ["127.0.0.2", "127.0.0.3"],
        env={"MLXCELD_TEST_MEMORY_AVAILABLE": str(memory)})
    activate(coord, model, 2)
    first = coord.status()["bringup"]
    daemons.pids.add(coord.worker("router")["pid"])
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    victim, survivor = peers[1], peers[0]
    victim_agent = agent(victim)
    victim_node = next(r["node_id"] for r in first["peers"] if r["address"] == victim_agent)
    cluster_view_serving(coord, port, model, first)
    before = max(e["id"] for e in coord.events(1))
    with asleep(victim):
        refused = wait_for(lambda: event(coord, "heal.refused", before), HEAL_WAIT_S,
                           "the heal refused", every=0.1)
        cluster_view_with_a_dead_peer(coord, victim_agent, victim_node)
        message = refused["message"]
        print(f"\nrefused: {message}")
        assert "plan refused: no split of 4 layers over 1 stages fits" in message, message
        assert f"({agent(survivor)})" in message and " short" in message, message
        (short,) = refused["data"]["shortfalls"]
        assert short["address"] == agent(survivor) and short["short_bytes"] > 0
        problems = [p for p in coord.status()["problems"] if p["subject"] == "healing"]
        assert len(problems) == 1 and "short" in problems[0]["message"], (
            problems, coord.status()["healing"], kinds(coord, before, ""))
        assert "--pp-peer" in problems[0]["next"]
        shown = coord.ctl("status").stdout
        assert "self-healing: refused: plan" in shown, shown
        time.sleep(3 * PING_S + HEAL_S)  # held: not planned again while nothing changes
        assert kinds(coord, before).count("heal.started") == 1
        assert coord.status()["bringup"]["epoch"] == first["epoch"]  # nothing pushed
        assert survivor.status()["assignment"]["epoch"] == first["epoch"]

    # The host answers again: the wait ends, the plan serves as it was.
    wait_for(lambda: event(coord, "heal.cancelled", before), HEAL_WAIT_S, "the wait to end",
             every=0.1)
    assert not [p for p in coord.status()["problems"] if p["subject"] == "healing"]
    wait_for(lambda: serves(port, model), HEAL_WAIT_S, "the old plan serving again", every=0.2)
    assert coord.status()["bringup"]["epoch"] == first["epoch"]


STATUS_KEYS = {"schema", "version", "daemon", "serving", "cluster", "assignment", "bringup",
               "healing", "agent", "workers", "problems", "pipeline", "drains", "front",
               "standby", "stood_down", "tensor"}


def status_json(coord: DaemonProc) -> tuple[dict[str, Any], float]:
    """`mlxctl status --json` (its schema pinned), and how long it took."""
    started = time.monotonic()
    out = coord.ctl("status", "--json")
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    body: dict[str, Any] = json.loads(out.stdout)
    assert body["schema"] == "mlxctl.status/1" and set(body) == STATUS_KEYS, sorted(body)
    return body, took


def cluster_view_serving(coord: DaemonProc, port: int, model: Path,
                         plan: dict[str, Any]) -> None:
    """The cluster view of a healthy 2-stage pipeline: the plan, each stage attached with
    its node and a heartbeat round trip, the peers alive, the router's tokens/s."""
    assert complete(port, "llama") == expected(model, PROMPT, 8)

    def measured() -> bool:
        view = coord.status()["pipeline"]  # in-process: cheaper than mlxctl to poll
        rate = (view["router"] or {}).get("tokens_per_s") if view else None
        if not rate:  # a loaded machine: the completion left the 10 s window already
            complete(port, "llama")
        return bool(rate) and all((s["link"] or {}).get("rtt_ms") for s in view["stages"])
    wait_for(measured, 30, "the view with tokens/s and both round trips", every=0.2)
    view = status_json(coord)[0]["pipeline"]
    assert (view["epoch"], view["state"]) == (plan["epoch"], "active")
    assert view["router"]["url"] == f"http://127.0.0.1:{port}/v1"
    assert [(s["stage"], s["node_id"], s["address"], s["layers"]) for s in view["stages"]] \
        == [(r["stage"], r["node_id"], r["address"], r["layers"]) for r in plan["peers"]]
    assert [s["link"]["state"] for s in view["stages"]] == ["attached", "attached"]
    assert [s["peer"]["state"] for s in view["stages"]] == ["alive", "alive"]
    assert all(s["peer"]["key_id"] == view["key_id"] and not s["peer"]["key_stale"]
               for s in view["stages"])
    text = coord.ctl("status").stdout
    assert f"cluster: plan {plan['epoch']} (active)" in text, text
    assert "tokens/s (the pipeline's, last 10 s)" in text and "health: ok" in text, text


def cluster_view_with_a_dead_peer(coord: DaemonProc, victim: str, node: str) -> None:
    """A plan's peer the detector holds dead: `mlxctl status` names its node, why, and the
    next command, at once (no peer is asked: the silent host slows nothing down)."""
    def of_victim(body: dict[str, Any]) -> dict[str, Any]:
        return next(s for s in body["pipeline"]["stages"] if s["address"] == victim)

    wait_for(lambda: of_victim(coord.status())["peer"]["state"] == "dead", 30,
             "the view with the dead peer", every=0.2)
    body, took = status_json(coord)
    print(f"mlxctl status --json with a silent peer: {took:.2f} s")
    assert took < 10, took  # the CLI's start included; nothing waits on the silent host
    stage = of_victim(body)
    assert stage["node_id"] == node
    assert stage["peer"]["reason"].startswith("no answer to pings for"), stage
    assert stage["link"]["state"] != "attached", stage
    [dead] = [p for p in body["problems"] if p["subject"] == node]
    assert dead["message"].startswith(f"node {node} ({victim}) of the active plan is dead "
                                      "since "), dead
    assert dead["next"].startswith(f"check the host of {victim}: awake"), dead
    links = [p for p in body["problems"] if p["subject"] == stage["stage"]]  # its link's
    assert links and all(p["message"].endswith(f"runs on node {node}, agent {victim})")
                         for p in links), body["problems"]
    text = coord.ctl("status").stdout
    assert f"x node {node} ({victim}) of the active plan is dead since " in text, text
    assert f"next: check the host of {victim}: awake" in text, text
    assert f"{stage['stage']} ({node}): dead: no answer to pings for" in text, text
