"""`mlxctl drain` of a pipeline's stage node re-plans around it first, between real daemons
on 127.0.0.x: a coordinator (.1) serving a 2-stage plan over three peers, one a spare.

Under a bounded load of streaming completions (``CLIENTS`` `openai` clients for at most
``LOAD_S``), a drain with a generous deadline pushes a plan without the node (a new
epoch, the spare in its place), serves it, stops the drained node's stage, and neither
fails nor refuses a request: make before break, the surviving host's old stage serves on
beside its new one until the router moved to the new plan live and its old engine closed
(``drain.retired``); the clients retry nothing, and a 503 or a refused connection is
counted as refused and must not happen. The counts and the time to the new plan are
printed (``pytest -s``). Undrained, the node is a candidate again and not
pulled into the running plan. ``--force`` on a stage node ends the streams on it with the
drain's error, then re-plans (over the undrained node). The coordinator's restart serves
the last plan, and its drained node stays out. With memory for two stages but not one
(``MLXCELD_TEST_MEMORY_AVAILABLE``), a drain that leaves one host is not re-planned: it
says which memory is missing (event, `mlxctl status` problem) and goes on as a drain
without a plan (new requests refused 503 "draining")."""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.cluster import activate, agent, coordinator, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.load import StreamingLoad
from helpers.memory import two_stages_but_not_one
from helpers.models import PROMPT, expected
from helpers.router import client, complete
from helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(420)

CLIENTS = 4
LOAD_S = 30.0  # the load's bound: it is stopped at the latest then
WARM_S = 2.0  # load before the drain, and on the new plan after it
TOKENS = 24  # per request of the load
WAIT_S = 120.0  # generous waits on a loaded machine; the times are printed
LONG_PROMPT = "Hello"  # greedy on the llama split fixture: no end-of-sequence for 800+ tokens


def events_after(d: DaemonProc, after: int, prefix: str) -> list[dict[str, Any]]:
    return [e for e in d.events(400) if e["id"] > after and e["kind"].startswith(prefix)]


def serves(port: int, model: Path) -> bool:
    try:
        return complete(port, "llama") == expected(model, PROMPT, 8)
    except openai.APIError:  # the router restarting, a stage re-attaching: not yet
        return False


def plan_peers(coord: DaemonProc) -> tuple[int, list[str]]:
    b = coord.status()["bringup"]
    assert b["state"] == "active", b
    return b["epoch"], sorted(r["address"] for r in b["peers"])


def active_after(coord: DaemonProc, epoch: int) -> dict[str, Any] | None:
    b = coord.status()["bringup"]
    return b if b["epoch"] > epoch and b["state"] == "active" else None


@pytest.mark.slow
def test_a_drain_replans_around_a_stage_node_and_fails_no_request(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    memory = {"MLXCELD_TEST_MEMORY_AVAILABLE": str(two_stages_but_not_one(model))}
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}",
                   env=memory) for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    coord, port, flags = coordinator(daemons, secret, peers)
    activate(coord, model, 2)
    first, staged = plan_peers(coord)
    by_agent = {agent(p): p for p in peers}
    node_of = {a: p.status()["daemon"]["node_id"] for a, p in by_agent.items()}
    (spare,) = set(by_agent) - set(staged)
    survivor, victim = staged
    daemons.pids.add(coord.worker("router")["pid"])
    stale_stage = by_agent[victim].wait_worker("stage", timeout=READY_S,
                                               state="running")["pid"]
    daemons.pids.add(stale_stage)

    # 1. Under load, drain a stage node: the plan moves to the spare; nothing fails.
    before = max(e["id"] for e in coord.events(1))
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS, max_tokens=TOKENS,
                       bound_s=LOAD_S) as load:
        time.sleep(WARM_S)
        began = time.monotonic()
        drained = coord.ctl("drain", node_of[victim], "--deadline", "120s", "--json",
                            timeout=WAIT_S + 60)
        drain_s = time.monotonic() - began
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        new = wait_for(lambda: active_after(coord, first), WAIT_S, "the new plan", every=0.2)
        time.sleep(WARM_S)  # serving goes on, on the new plan
    counts = load.counts()
    replanned = events_after(coord, before, "drain.replanned")
    took = replanned[0]["data"]["took_s"] if replanned else None
    print(f"\ndrain of stage node {node_of[victim]} under load ({CLIENTS} streaming clients, "
          f"{TOKENS} tokens each): {counts}; the new plan served {took} s after the drain "
          f"began; `mlxctl drain` returned after {drain_s:.1f} s")
    assert load.failed == [], load.failed[:3]
    assert load.refused == [], load.refused[:3]
    assert counts["completed"] > 0
    row = json.loads(drained.stdout)["drain"]
    assert row["node_id"] == node_of[victim] and row["state"] == "drained", row
    assert row["reason"].startswith("re-planned around"), row
    assert new["epoch"] > first
    assert sorted(r["address"] for r in new["peers"]) == sorted([survivor, spare])
    kinds = [e["kind"] for e in events_after(coord, before, "drain.")]
    assert kinds[:5] == ["drain.started", "drain.replanning", "drain.replan_pushing",
                         "drain.replanned", "drain.retired"], kinds
    retired = events_after(coord, before, "drain.retired")[0]
    assert retired["data"]["closed"] and retired["data"]["told"] == [survivor], retired
    assert replanned[0]["subject"] == node_of[victim]
    fenced = wait_for(lambda: events_after(coord, before, "drain.fenced"), WAIT_S,
                      "the drained stage fenced", every=0.2)
    assert fenced[0]["data"]["peer"] == victim, fenced
    wait_for(lambda: not alive(stale_stage), 30, "the drained node's stage to stop")
    assert "drain.drained" in kinds + [e["kind"] for e in events_after(coord, before,
                                                                        "drain.drained")]
    for a in (survivor, spare):
        daemons.pids.add(by_agent[a].wait_worker("stage", timeout=READY_S,
                                                 state="running")["pid"])
    daemons.pids.add(coord.worker("router")["pid"])

    # A plan asked for now leaves the drained node out, and says so.
    planned = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", "--json",
                        timeout=60)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    notes = json.loads(planned.stdout)["notes"]
    assert any(f"{node_of[victim]} ({victim}) is drained" in n for n in notes), notes

    # 2. Undrained: a candidate again, not pulled into the running plan.
    assert coord.ctl("undrain", node_of[victim]).returncode == 0
    time.sleep(1.0)
    assert plan_peers(coord) == (new["epoch"], sorted([survivor, spare]))

    # 3. --force on a stage node (the spare, now): its streams end with the drain's error,
    # then the plan moves again, onto the node undrained.
    ended: list[str] = []
    begun = threading.Semaphore(0)

    def long_stream() -> None:
        with client(f"http://127.0.0.1:{port}/v1") as c:
            try:
                for i, _ in enumerate(c.completions.create(
                        model="llama", prompt=LONG_PROMPT, stream=True, max_tokens=600,
                        temperature=0)):
                    if i == 0:
                        begun.release()
                ended.append("completed")
            except openai.APIError as exc:
                ended.append(str(exc))

    streams = [threading.Thread(target=long_stream) for _ in range(2)]
    for t in streams:
        t.start()
    for _ in streams:
        assert begun.acquire(timeout=60), "a stream to begin"
    forced = coord.ctl("drain", node_of[spare], "--force", timeout=WAIT_S)
    for t in streams:
        t.join(60)
    print(f"drain --force of stage node {node_of[spare]}: {ended}; {forced.stdout.strip()}")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert len(ended) == 2 and all("drain" in e and "deadline" in e for e in ended), ended
    third = wait_for(lambda: active_after(coord, new["epoch"]), WAIT_S, "the plan after --force",
                     every=0.2)
    assert sorted(r["address"] for r in third["peers"]) == sorted([survivor, victim])
    wait_for(lambda: serves(port, model), WAIT_S, "serving on the plan after --force",
             every=0.2)

    # 4. The coordinator restarts: it serves the last plan; the drained node stays out,
    # and is told again that the plan it ran is over (the restart may have come first).
    wait_for(lambda: [e for e in events_after(coord, before, "drain.fenced")
                      if e["data"]["peer"] == spare], WAIT_S, "the spare fenced", every=0.2)
    restarted = max(e["id"] for e in coord.events(1))
    assert coord.terminate() == 0
    coord.start(*flags)
    wait_for(lambda: (b := coord.status()["bringup"]) and b["state"] == "active"
             and b["epoch"] == third["epoch"], WAIT_S, "the plan resumed", every=0.2)
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    wait_for(lambda: serves(port, model), WAIT_S, "serving after the restart", every=0.2)
    assert plan_peers(coord) == (third["epoch"], sorted([survivor, victim]))
    assert [(r["node_id"], r["state"]) for r in coord.api(lambda c: c.drains())["drains"]] \
        == [(node_of[spare], "drained")]
    again = wait_for(lambda: events_after(coord, restarted, "drain.fenced"), WAIT_S,
                     "the spare fenced again after the restart", every=0.2)
    assert again[0]["data"]["peer"] == spare and again[0]["data"]["outcome"] == "deactivated"

    # 5. Drain one more: the model does not fit on the one host left. Not re-planned: the
    # memory missing is named, and the drain goes on without a plan.
    before = max(e["id"] for e in coord.events(1))
    alone = coord.ctl("drain", node_of[survivor], "--deadline", "60s", timeout=WAIT_S)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    (no_fit,) = events_after(coord, before, "drain.no_fit")
    print(f"no fit: {no_fit['message']}")
    assert no_fit["subject"] == node_of[survivor]
    assert "short" in no_fit["message"] and "goes on without a new plan" in no_fit["message"]
    assert no_fit["data"]["shortfalls"][0]["short_bytes"] > 0, no_fit
    problems = [p for p in coord.status()["problems"] if p["subject"] == "drain"]
    assert len(problems) == 1 and "short" in problems[0]["message"], problems
    assert plan_peers(coord) == (third["epoch"], sorted([survivor, victim]))
    with client(f"http://127.0.0.1:{port}/v1") as c, pytest.raises(openai.APIStatusError) as exc:
        c.completions.create(model="llama", prompt=PROMPT, max_tokens=2)
    assert exc.value.status_code == 503 and f"node {node_of[survivor]} draining" in str(
        exc.value), exc.value
    assert coord.ctl("undrain", node_of[survivor]).returncode == 0
    wait_for(lambda: serves(port, model), WAIT_S, "serving once undrained", every=0.2)
    wait_for(lambda: not [p for p in coord.status()["problems"] if p["subject"] == "drain"],
             30, "the drain's problem to go once undrained", every=0.2)
