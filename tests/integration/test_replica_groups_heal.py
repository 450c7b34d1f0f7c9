"""Replica groups healed and drained like single pipelines, between real daemons on
127.0.0.x: a coordinator (.1, a short failure detector, ``heal_after_s = 2``) serving 2
groups of 1 stage (`mlxctl cluster activate --replicas 2`) on peers .2 and .3, with .4 a
spare or not, under ``CLIENTS`` streaming `openai` clients with retries off
(``helpers/load.py``: every refusal and every broken stream is counted).

- `mlxctl drain` of a group's host, a spare there: that group is re-planned onto the
  spare, the other keeps its host, the router's pool moves live (never restarted); no
  request failed or was refused, the command exits 0 and the drained host ends with no
  stage worker.
- Its host SIGSTOPped past the grace, a spare there: the group is healed onto the spare
  while the streams on the silent host go on on the other group (``replicas/pool.py``):
  no request failed or was refused, during the heal or after it.
- `mlxctl drain` of a group's host without a spare: the group is dropped, the plan is
  the other group alone (a pipeline of one stage), nothing failed or was refused, and
  the drained host ends with no stage worker.

The counts are printed (``pytest -s``)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.cluster import ACTIVATE_S, POLL_WAIT_S, agent, settled, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.keys import secret_file
from helpers.load import StreamingLoad
from helpers.ports import free_port
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLIENTS = 4
WARM_S = 2.0  # load before the operation, and after it
WAIT_S = 120.0  # generous waits on a loaded machine
COORDINATOR = """
[daemon]
peer_ping_interval_s = 0.25
peer_suspect_after_s = 1.0
peer_dead_after_s = 2.0
heal_after_s = 2.0
"""


class Groups:
    """Two groups of one stage served by a coordinator over ``ips``' peers."""

    def __init__(self, daemons: Daemons, model: Path, ips: list[str]) -> None:
        secret = secrets.token_hex(16).encode()
        self.peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model),
                            name=f"p{ip[-1]}") for ip in ips]
        self.port = free_port("127.0.0.1")
        self.coord = coord = daemons.make(COORDINATOR, name="c")
        coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                    "--agent-addr", "127.0.0.1:0", "--port", str(self.port),
                    "--cluster-peers", ",".join(agent(p) for p in self.peers))
        want = {agent(p): "reachable" for p in self.peers}
        wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
        out = subprocess.run(
            [sys.executable, "-m", "mlxctl", "--socket", str(coord.socket), "cluster",
             "activate", "--model", str(model), "--stages", "1", "--replicas", "2"],
            capture_output=True, text=True, timeout=ACTIVATE_S)
        assert out.returncode == 0, (out.stdout, out.stderr, coord.stderr()[-3000:])
        self.first = coord.status()["bringup"]
        self.by_agent = {agent(p): p for p in self.peers}
        self.staged = [r["address"] for r in self.first["peers"]]
        self.stage_pids = {a: self.by_agent[a].wait_worker("stage", timeout=READY_S,
                                                           state="running")["pid"]
                           for a in self.staged}
        daemons.pids |= set(self.stage_pids.values())
        self.router = coord.worker("router")["pid"]
        daemons.pids.add(self.router)
        wait_for(lambda: self.stats()["up"] == 2, READY_S, "both groups up")

    def stats(self) -> dict[str, Any]:
        answer = httpx.get(f"http://127.0.0.1:{self.port}/router/stats", timeout=10)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    def served(self) -> dict[str, Any]:
        b: dict[str, Any] = self.coord.status()["bringup"] or {}
        return b

    def replaced(self) -> dict[str, Any] | None:
        """The bring-up once a newer plan than the first is active."""
        b = self.served()
        return b if b.get("epoch", 0) > self.first["epoch"] and b["state"] == "active" \
            else None

    def mark(self) -> int:
        return max(e["id"] for e in self.coord.events(1))

    def kinds(self, after: int, prefix: str) -> list[str]:
        return [e["kind"] for e in self.coord.events(400)
                if e["id"] > after and e["kind"].startswith(prefix)]


def no_stage(host: DaemonProc) -> bool:
    return not {"stage", "stage-retiring"} & {w["name"] for w in host.status()["workers"]}


def drain(g: Groups, victim: DaemonProc) -> tuple[subprocess.CompletedProcess[str], float]:
    node = victim.status()["daemon"]["node_id"]
    began = time.monotonic()
    out = g.coord.ctl("drain", node, "--deadline", "120s", "--json", timeout=WAIT_S + 60)
    return out, time.monotonic() - began


def test_a_drain_of_a_group_host_moves_that_group_to_the_spare_and_fails_nothing(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    g = Groups(daemons, split_fixture_dir / "llama", ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    (spare,) = set(g.by_agent) - set(g.staged)
    victim_agent, kept = g.staged
    victim = g.by_agent[victim_agent]
    before = g.mark()
    with StreamingLoad(f"http://127.0.0.1:{g.port}/v1", clients=CLIENTS) as load:
        time.sleep(WARM_S)
        drained, took = drain(g, victim)
        time.sleep(WARM_S)  # serving goes on, on the new plan
    counts = load.counts()
    print(f"\ndrain of replica group 0's host (a spare there) under load ({CLIENTS} "
          f"streaming clients): {counts}; `mlxctl drain` exited {drained.returncode} after "
          f"{took:.1f} s; refused: {load.refused[:3]}; failed: {load.failed[:3]}")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    row = json.loads(drained.stdout)["drain"]
    assert row["state"] == "drained" and row["reason"].startswith("re-planned around"), row
    now = g.served()
    assert now["epoch"] > g.first["epoch"]
    assert [r["address"] for r in now["peers"]] == [spare, kept], now  # group 0 on the spare
    assert g.coord.worker("router")["pid"] == g.router  # moved live, never restarted
    steps = g.kinds(before, "drain.")
    assert steps[:5] == ["drain.started", "drain.replanning", "drain.replan_pushing",
                         "drain.replanned", "drain.retired"], steps
    wait_for(lambda: no_stage(victim), 60, "the drained host to have no stage worker")
    assert not alive(g.stage_pids[victim_agent])
    for a in (spare, kept):
        daemons.pids.add(g.by_agent[a].wait_worker("stage", timeout=READY_S,
                                                   state="running")["pid"])
    assert g.stats()["up"] == 2


def test_a_silent_group_host_is_healed_onto_the_spare(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    g = Groups(daemons, split_fixture_dir / "llama", ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    (spare,) = set(g.by_agent) - set(g.staged)
    victim_agent, kept = g.staged
    victim = g.by_agent[victim_agent]
    assert victim.proc is not None
    asleep = [victim.proc.pid, g.stage_pids[victim_agent]]
    before = g.mark()
    url = f"http://127.0.0.1:{g.port}/v1"
    try:
        with StreamingLoad(url, clients=CLIENTS) as load:
            time.sleep(WARM_S)
            for pid in asleep:
                os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                healed = wait_for(g.replaced, WAIT_S, "the heal", every=0.1)
                healed_s = time.monotonic() - stopped
                wait_for(lambda: g.stats()["up"] == 2, READY_S, "both groups up again")
            finally:  # the counts until then, healed or not
                print(f"\nuntil healed or given up ({time.monotonic() - stopped:.1f} s): "
                      f"{load.counts()}")
        during = load.counts()
        with StreamingLoad(url, clients=CLIENTS) as after:
            time.sleep(2 * WARM_S)
    finally:
        for pid in asleep:
            os.kill(pid, signal.SIGCONT)
    counts = after.counts()
    print(f"\nreplica group 0's host SIGSTOPped (a spare there), healed {healed_s:.1f} s "
          f"after, under load ({CLIENTS} streaming clients): until healed {during}; "
          f"refused: {load.refused[:3]}; failed: {load.failed[:3]}; after: {counts}")
    assert (counts["refused"], counts["failed"]) == (0, 0), (after.refused[:3],
                                                             after.failed[:3])
    # the streams on the silent host went on on the other group (replicas/pool.py)
    assert (during["refused"], during["failed"]) == (0, 0), (load.refused[:3],
                                                             load.failed[:3])
    assert counts["completed"] > 0 and during["completed"] > 0
    assert [r["address"] for r in healed["peers"]] == [spare, kept], healed
    assert g.coord.worker("router")["pid"] == g.router  # moved live, never restarted
    steps = g.kinds(before, "heal.")
    assert steps[:5] == ["heal.waiting", "heal.started", "heal.planned", "heal.active",
                         "heal.retired"], steps
    # The host back is told its plan is over: its stale stage stops.
    wait_for(lambda: not alive(asleep[1]), 60, "the silent host's stale stage to stop")
    for a in (spare, kept):
        daemons.pids.add(g.by_agent[a].wait_worker("stage", timeout=READY_S,
                                                   state="running")["pid"])


def test_a_drain_without_a_spare_drops_the_group_and_fails_nothing(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    g = Groups(daemons, split_fixture_dir / "llama", ["127.0.0.2", "127.0.0.3"])
    victim_agent, kept = g.staged
    victim = g.by_agent[victim_agent]
    before = g.mark()
    with StreamingLoad(f"http://127.0.0.1:{g.port}/v1", clients=CLIENTS) as load:
        time.sleep(WARM_S)
        drained, took = drain(g, victim)
        time.sleep(WARM_S)
    counts = load.counts()
    print(f"\ndrain of replica group 0's host (no spare: the group is dropped) under load "
          f"({CLIENTS} streaming clients): {counts}; `mlxctl drain` exited "
          f"{drained.returncode} after {took:.1f} s; refused: {load.refused[:3]}; "
          f"failed: {load.failed[:3]}")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    now = g.served()
    assert now["epoch"] > g.first["epoch"] and [r["address"] for r in now["peers"]] == [kept]
    pushing = next(e for e in g.coord.events(400)
                   if e["id"] > before and e["kind"] == "drain.replan_pushing")
    assert pushing["data"]["replicas"] == 1, pushing
    assert "1 of 2 replica groups; replica group 0 lost" in pushing["message"], pushing
    assert "dropped" in pushing["message"], pushing
    assert g.coord.worker("router")["pid"] == g.router
    wait_for(lambda: no_stage(victim), 60, "the drained host to have no stage worker")
    daemons.pids.add(g.by_agent[kept].wait_worker("stage", timeout=READY_S,
                                                  state="running")["pid"])
    stats = g.stats()
    assert [n["id"] for n in stats["nodes"]] == ["replica-0"] and stats["up"] == 1, stats
