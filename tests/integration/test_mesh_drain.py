"""`mlxctl drain` of a host of a mesh (a stage that is a tensor-parallel group across
hosts), between real daemons on 127.0.0.x: a coordinator (.1) with ``--mesh tp`` over
three plain ``--pp-peer`` daemons, or ``--mesh 2d`` (2 stages x 2 ranks) over five, one
a spare; a rank host drained, or a stage's rank 0 host; under ``CLIENTS`` streaming `openai`
clients with retries off (``helpers/load.py``: every refusal and every broken stream is
counted) and a conversation resent whole each turn (each answer mlx-lm's, each turn
answered within ``HELD_S``).

A drain of the group's rank host re-plans over the hosts left (``--mesh auto``: the spare
in its place), serves the new plan, and the drained host holds no worker: the group was
stopped before the new plan's stages loaded (``stagehost.py``: no make before break for a
tensor group), and the requests meanwhile were held and replayed on the new plan
(``pipeline/replay.py``), none failed nor refused. The counts, the longest request and
the time to the new plan are printed (``pytest -s``). Where no plan fits without the
host, the drain goes on without one, as for a pipeline (the last test)."""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.cluster import activate, agent, coordinator, start
from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.load import StreamingLoad
from helpers.memory import two_stages_but_not_one
from helpers.mesh import complete
from helpers.models import PROMPT, expected
from helpers.router import client, greedy_stream
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLIENTS = 3
TOKENS = 16  # per request of the load
TURNS = 6  # of the conversation, then it begins again, until stopped
HELD_S = 60.0  # a turn held across the break answers within this (the hold is 122 s)
WARM_S = 2.0  # load before the drain, and on the new plan after it
LOAD_S = 240.0  # the load's bound
WAIT_S = 200.0  # generous waits on a loaded 2-core machine; the times are printed


def mesh(daemons: Daemons, model: Path, hosts: int, n: int, mode: str
         ) -> tuple[DaemonProc, list[DaemonProc], int]:
    """A coordinator over ``hosts`` --pp-peer daemons (127.0.0.2 ..), ``mlxctl cluster
    activate --stages n --mesh mode`` served; its router's port."""
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}", config=FAST_POLICY) for i in range(2, 2 + hosts)]
    coord, port, _ = coordinator(daemons, secret, peers, FAST_POLICY)
    out = coord.ctl("cluster", "activate", "--model", str(model), "--stages", str(n),
                    "--mesh", mode, timeout=WAIT_S)
    assert out.returncode == 0, (out.stdout, out.stderr, coord.stderr()[-3000:])
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    return coord, peers, port


def workers_of(daemons: Daemons, coord: DaemonProc, peers: list[DaemonProc]) -> dict[str, str]:
    """Each host of the plan served: its agent -> its offer's node (``stage-0-tp-1``); each
    one's worker noted to be ended by pid."""
    rows = {r["address"]: r["stage"] for r in coord.status()["bringup"]["peers"]}
    for p in peers:
        node = rows.get(agent(p))
        if node is not None:
            name = "stage-tp-1" if node.endswith("-tp-1") else "stage"
            daemons.pids.add(p.wait_worker(name, timeout=READY_S, state="running")["pid"])
    return rows


def conversation(model: Path, turns: int) -> list[tuple[str, str]]:
    """Each turn's prompt (the conversation so far, resent whole) and mlx-lm's answer."""
    prompt, out = PROMPT, []
    for turn in range(turns):
        answer = expected(model, prompt, 8)
        out.append((prompt, answer))
        prompt += answer + f" and then {turn}"
    return out


class Chat(threading.Thread):
    """The conversation's turns through one `openai` client (retries off) until stopped:
    each answer checked to be mlx-lm's; what went wrong, and the longest turn."""

    def __init__(self, url: str, turns: list[tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        self.url, self.turns, self.stop = url, turns, threading.Event()
        self.answered, self.longest_s = 0, 0.0
        self.wrong: list[str] = []

    def run(self) -> None:
        with client(self.url) as c:
            for prompt, want in itertools.cycle(self.turns):  # a new one after the last
                if self.stop.is_set():
                    return
                began = time.monotonic()
                try:
                    text = c.completions.create(model="llama", prompt=prompt, max_tokens=8,
                                                temperature=0).choices[0].text
                except openai.APIError as exc:
                    self.wrong.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.longest_s = max(self.longest_s, time.monotonic() - began)
                self.answered += 1
                if text != want:
                    self.wrong.append(f"turn {self.answered}: {text!r} != {want!r}")


def events_after(d: DaemonProc, after: int, prefix: str) -> list[dict[str, Any]]:
    return [e for e in d.events(400) if e["id"] > after and e["kind"].startswith(prefix)]


@pytest.mark.parametrize(("hosts", "n", "mode", "node"), [
    (3, 2, "tp", "stage-0-tp-1"),  # a tp 2 group's rank host, a spare
    (3, 2, "tp", "stage-0"),  # its rank 0's host
    (5, 4, "2d", "stage-1-tp-1"),  # 2 stages of tp 2 groups, a spare: a rank host
    (5, 4, "2d", "stage-0"),  # a stage's rank 0 host
], ids=["tp-rank1", "tp-rank0", "2d-rank1", "2d-rank0"])
def test_a_drain_of_a_mesh_host_loses_no_request(
        daemons: Daemons, split_fixture_dir: Path, hosts: int, n: int, mode: str,
        node: str) -> None:
    model = split_fixture_dir / "llama"
    turns = conversation(model, TURNS)
    coord, peers, port = mesh(daemons, model, hosts, n, mode)
    first = coord.status()["bringup"]
    rows = workers_of(daemons, coord, peers)
    by_agent = {agent(p): p for p in peers}
    node_of = {a: p.status()["daemon"]["node_id"] for a, p in by_agent.items()}
    (rank,) = [a for a, offered in rows.items() if offered == node]
    victim = by_agent[rank]
    assert complete(port) == expected(model, PROMPT, 8)

    before = max(e["id"] for e in coord.events(1))
    url = f"http://127.0.0.1:{port}/v1"
    chat = Chat(url, turns)
    with StreamingLoad(url, clients=CLIENTS, max_tokens=TOKENS, bound_s=LOAD_S) as load:
        chat.start()
        time.sleep(WARM_S)
        began = time.monotonic()
        drained = coord.ctl("drain", node_of[rank], "--deadline", "120s", "--json",
                            timeout=WAIT_S)
        drain_s = time.monotonic() - began
        try:
            new = wait_for(lambda: (b := coord.status()["bringup"])["epoch"] > first["epoch"]
                           and b["state"] == "active" and b, WAIT_S, "the new plan",
                           every=0.2)
        except BaseException:
            for d in (coord, *peers):
                print(d.stderr()[-2500:], [(e["kind"], e["message"]) for e in d.events()[-12:]],
                      "----", sep="\n")
            raise
        time.sleep(WARM_S)  # serving goes on, on the new plan
        chat.stop.set()
        chat.join(WAIT_S)
    counts = load.counts()
    replanned = events_after(coord, before, "drain.replanned")
    took = replanned[0]["data"]["took_s"] if replanned else None
    print(f"\ndrain of {node}'s host {node_of[rank]} of a --mesh {mode} plan of {n} "
          f"hosts, the new plan {sorted(r['stage'] for r in new['peers'])}, under load ({CLIENTS} "
          f"streaming clients, {TOKENS} tokens each): {counts}, refused {load.refused[:3]}, "
          f"failed {load.failed[:3]}; the conversation: {chat.answered} turns answered, "
          f"wrong {chat.wrong[:3]}, longest turn {chat.longest_s:.1f} s; the new plan served "
          f"{took} s after the drain began; `mlxctl drain` returned after {drain_s:.1f} s")
    assert drained.returncode == 0, (drained.stdout, drained.stderr)
    assert json.loads(drained.stdout)["drain"]["node_id"] == node_of[rank]
    assert rank not in {r["address"] for r in new["peers"]}, new
    new_rows = workers_of(daemons, coord, peers)
    wait_for(lambda: not [w for w in victim.status()["workers"] if w["state"] == "running"],
             60, "no worker left on the drained host")
    assert victim.status().get("tensor") is None
    row = wait_for(lambda: (r := [d for d in coord.api(lambda c: c.drains())["drains"]
                                  if d["node_id"] == node_of[rank]]) and r[0]["state"]
                   == "drained" and r[0], WAIT_S, "the drain to end", every=0.2)
    assert row["reason"].startswith("re-planned around"), row
    assert complete(port) == expected(model, PROMPT, 8), new_rows
    assert counts["completed"] > 0 and chat.answered > 0
    assert load.refused == [], load.refused[:3]
    assert load.failed == [], load.failed[:3]
    assert chat.wrong == [], chat.wrong[:3]
    assert chat.longest_s < HELD_S


def test_a_mesh_drain_with_no_plan_without_the_host_ends_no_stream_and_says_why(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """tp 2 over two hosts with memory for two stages but not one, no spare: no plan fits
    without a host. The drain is accepted and not re-planned (``drain.no_fit`` names the
    memory short, as for a pipeline): the streams running finish with mlx-lm's tokens,
    a new request is refused 503 naming the node draining, the plan stays; undrained, it
    serves again."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    memory = {"MLXCELD_TEST_MEMORY_AVAILABLE": str(two_stages_but_not_one(model))}
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}", config=FAST_POLICY, env=memory) for i in (2, 3)]
    coord, port, _ = coordinator(daemons, secret, peers, FAST_POLICY)
    activate(coord, model, 2, "--mesh", "tp")
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    first = coord.status()["bringup"]
    rows = workers_of(daemons, coord, peers)
    (rank,) = [a for a, offered in rows.items() if offered == "stage-0-tp-1"]
    node = {agent(p): p for p in peers}[rank].status()["daemon"]["node_id"]
    url = f"http://127.0.0.1:{port}/v1"
    want = expected(model, PROMPT, 48)
    got: list[str] = []
    begun = threading.Barrier(3)

    def stream() -> None:
        got.append(greedy_stream(url.removesuffix("/v1"), PROMPT, 48, model="llama",
                                 together=begun))

    streams = [threading.Thread(target=stream) for _ in range(2)]
    for t in streams:
        t.start()
    before = max(e["id"] for e in coord.events(1))
    begun.wait(60)
    out = coord.ctl("drain", node, "--deadline", "60s", timeout=WAIT_S)
    for t in streams:
        t.join(WAIT_S)
    print(f"\nno plan without {node}: `mlxctl drain` {out.returncode}: {out.stdout.strip()}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert got == [want, want], got
    (no_fit,) = wait_for(lambda: events_after(coord, before, "drain.no_fit"), WAIT_S,
                         "drain.no_fit", every=0.2)
    print(f"no fit: {no_fit['message']}")
    assert no_fit["subject"] == node and "short" in no_fit["message"], no_fit
    assert coord.status()["bringup"]["epoch"] == first["epoch"]
    wait_for(lambda: refused_draining(url, node), 30, "a new request refused: draining",
             every=0.2)
    assert coord.ctl("undrain", node).returncode == 0
    assert wait_for(lambda: served(port), WAIT_S, "serving once undrained",
                    every=0.5) == expected(model, PROMPT, 8)


def refused_draining(url: str, node: str) -> bool:
    with client(url) as c:
        try:
            c.completions.create(model="llama", prompt=PROMPT, max_tokens=2)
        except openai.APIStatusError as exc:
            return exc.status_code == 503 and f"node {node} draining" in str(exc)
    return False


def served(port: int) -> str | None:
    try:
        return complete(port)
    except openai.APIError:
        return None
