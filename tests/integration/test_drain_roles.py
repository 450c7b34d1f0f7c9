"""`mlxctl drain` on every node role, end to end: real daemons on 127.0.0.x started as a
service manager starts them (``helpers.deploy.Host``), one cluster secret, the tiny llama
fixture, the real ``openai`` client with retries off.

- A replica (a hybrid node) behind a router node (``--node-role router``), drained on its
  own daemon under streaming load through the router: the router's clients see no error
  (its serving listener refuses new sequences with ``draining`` and the router tries the
  other replica before the first token), the drain's status names the router still
  sending while the replica's sequences run, the command exits 0 saying "drained" only
  once they ended, and no sequence reaches the replica until it is undrained.
- A prefill node and a decode node behind a disaggregating router (two of each), each
  drained on its own daemon under load: no client error, exit status 0.
- A stage host's own daemon refuses to drain its node (exit 1, ``drain_refused``, naming
  the coordinator and the command to run there), recording nothing.

Every process is ended by pid at the end (``Daemons.end``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.load import StreamingLoad
from helpers.pipeline import start_pipeline
from helpers.ports import free_port
from helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

SECRET = b"the drain-on-every-role tests' secret, 44 b."
MODEL = "llama"
CLIENTS = 4
# Each stream: long enough that a replica still runs some when its drain starts (at 160,
# a few tenths of a second each, CI once drained A between two of its streams: nothing to
# wait for, "0 finished").
TOKENS = 600
LONG_PROMPT = "Once upon a time"  # the tiny fixture: no EOS within 1500 greedy tokens
LOAD_S = 3.0  # load while drained, before the undrain
DRAIN_S = 120  # the command's own bound (its deadline is 60 s: never reached here)


def node(daemons: Daemons, name: str, model: Path, ip: str, **serve: Any) -> Host:
    """A serving host on ``ip`` (its agent, serving listener and OpenAI port there)."""
    host = Host(daemons, name, secret=SECRET,
                serve={"model": str(model), "host": ip, "port": free_port(ip),
                       "max_batch": 4, "serving_port": free_port(ip), **serve})
    host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
    host.write()
    return host


def agent(host: Host) -> str:
    return str(host.daemon_keys["agent_addr"])


def router(daemons: Daemons, model: Path, **serve: Any) -> Host:
    host = Host(daemons, "r", secret=SECRET,
                serve={"model": str(model), "port": free_port("127.0.0.1"),
                       "node_role": "router", "max_batch": 8, **serve})
    host.daemon_keys["agent_addr"] = f"127.0.0.1:{host.agent_port}"
    host.write()
    return host


def url(host: Host) -> str:
    return f"http://127.0.0.1:{host.serve_keys['port']}"


def nodes(r: Host) -> dict[str, dict[str, Any]]:
    stats = httpx.get(f"{url(r)}/router/stats", timeout=10).json()
    return {n["id"]: n for n in stats["nodes"]}


@dataclass
class Watch:
    """The drained host's drains, polled while its drain runs: each ``senders`` seen."""

    host: Host
    senders: list[dict[str, Any]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.is_set():
            rows = self.host.d.api(lambda c: c.drains())["drains"]
            for row in rows:
                self.senders += [s for s in row.get("senders") or []]
            time.sleep(0.1)


def drain_watched(host: Host) -> tuple[Any, dict[str, Any], Watch]:
    """`mlxctl drain --deadline 60s --json` on ``host``'s own daemon, its drains watched
    meanwhile: the command's result, its row, the watch."""
    watch = Watch(host)
    watching = threading.Thread(target=watch.run)
    watching.start()
    try:
        done = host.d.ctl("drain", "--deadline", "60s", "--json", timeout=DRAIN_S)
    finally:
        watch.done.set()
        watching.join(30)
    row = json.loads(done.stdout)["drain"] if done.returncode == 0 else {}
    return done, row, watch


def describe(done: Any) -> str:
    """A drain command's outcome in a line: its row's state and counts, or its error."""
    try:
        row = json.loads(done.stdout)["drain"]
    except (ValueError, KeyError):
        return (done.stdout + done.stderr).strip()[:300]
    return (f"{row['state']} in {row['updated_at'] - row['started_at']:.1f} s, "
            f"{row['finished']} finished, {row['ended']} ended")


# -- a replica behind a router node ---------------------------------------------------


@dataclass
class Replicas:
    router: Host
    a: Host
    b: Host


@pytest.fixture(scope="module")
def replicas(fixture_dir: Path) -> Iterator[Replicas]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        a = node(daemons, "ra", model, "127.0.0.2").start()
        b = node(daemons, "rb", model, "127.0.0.3").start()
        r = router(daemons, model, replicas=[agent(a), agent(b)]).start()
        for h in (a, b, r):
            h.d.wait_worker("router", READY_S, state="running")
        wait_for(lambda: sum(n["state"] == "up" for n in nodes(r).values()) == 2, 60,
                 "both replicas up behind the router")
        yield Replicas(r, a, b)
    finally:
        daemons.end()


@pytest.mark.slow
def test_a_replica_drains_under_load_through_a_router_node(replicas: Replicas) -> None:
    """The drain of replica A (``replica-0`` at the router) on its own daemon, under 4
    streaming clients of the router: none fails; its status named the router while A's
    sequences ran; "drained" (exit 0) only once they ended (``finished`` > 0, none at the
    deadline) and A got no sequence after that until the undrain, which admits again."""
    r, a = replicas.router, replicas.a
    with StreamingLoad(f"{url(r)}/v1", clients=CLIENTS, max_tokens=TOKENS,
                       prompt=LONG_PROMPT, model=MODEL) as load:
        for _ in range(3):
            wait_for(lambda: nodes(r)["replica-0"]["in_flight"] > 0, 60,
                     "replica A running sequences of the router")
            before = load.counts()
            done, row, watch = drain_watched(a)
            if done.returncode != 0 or row["finished"] > 0 or watch.senders:
                break
            # A held none as its drain began (on a loaded host the router's sequences for
            # it were still on their way: A refused them, the router sent them to B), so
            # it was drained at once, rightly; what is tested needs held sequences: again.
            print(f"\nA held nothing at its drain's start ({describe(done)}): again")
            assert a.d.ctl("undrain").returncode == 0
        wait_for(lambda: nodes(r)["replica-0"]["in_flight"] == 0, 5,
                 "the router's account of A's last sequences closed")
        at_drained = nodes(r)["replica-0"]
        time.sleep(LOAD_S)
        while_drained = nodes(r)["replica-0"]
        during = load.counts()
        assert a.d.ctl("undrain").returncode == 0
        wait_for(lambda: nodes(r)["replica-0"]["completed"] > while_drained["completed"], 60,
                 "A serving the router's requests again after the undrain")
    after = load.counts()
    print(f"\nreplica drain through a router ({CLIENTS} streaming clients): before {before}, "
          f"while drained {during}, at the end {after}; exit {done.returncode}: "
          f"{describe(done)}; senders seen {watch.senders[:2]}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert row["state"] == "drained" and row["ended"] == 0, row
    assert row["finished"] > 0, row  # it waited for the sequences A held
    assert (load.refused, load.failed) == ([], []), (load.refused[:3], load.failed[:3])
    assert any(s["sender"].startswith("router ") and s["sequences"] > 0
               for s in watch.senders), watch.senders
    # nothing ran on A while it was drained: a try it refused counts as dispatched and
    # retried (the router asks it again now and then), none as taken or completed
    taken = [n["dispatched"] - n["retried"] for n in (at_drained, while_drained)]
    assert taken[0] == taken[1], (at_drained, while_drained)
    assert while_drained["completed"] == at_drained["completed"], (at_drained, while_drained)
    assert during["completed"] > before["completed"]  # the other replica served meanwhile


# -- prefill and decode nodes behind a disaggregating router ----------------------------


@dataclass
class Disagg:
    router: Host
    prefills: list[Host]
    decodes: list[Host]


@pytest.fixture(scope="module")
def disagg(fixture_dir: Path) -> Iterator[Disagg]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        prefills = [node(daemons, f"p{i}", model, f"127.0.0.{2 + i}", node_role="prefill")
                    for i in range(2)]
        decodes = [node(daemons, f"d{i}", model, f"127.0.0.{4 + i}", node_role="decode",
                        prefill_peers=[agent(p) for p in prefills]) for i in range(2)]
        allow = ",".join(f"127.0.0.{4 + i}:{d.serve_keys['serving_port']}"
                         for i, d in enumerate(decodes))
        for p in prefills:
            p.d.start_service(env={"MLXCEL_DECODE_ALLOWLIST": allow})
        for d in decodes:
            d.start()
        r = router(daemons, model, prefill_peers=[agent(p) for p in prefills],
                   decode_peers=[agent(d) for d in decodes]).start()
        for h in (*prefills, *decodes, r):
            h.d.wait_worker("router", READY_S, state="running")
        wait_for(lambda: sum(n["state"] == "up" for n in nodes(r).values()) == 4, 60,
                 "the prefill and decode nodes up behind the router")
        yield Disagg(r, prefills, decodes)
    finally:
        daemons.end()


@pytest.mark.slow
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_prefill_or_decode_node_drains_under_load(disagg: Disagg, role: str) -> None:
    """The drain of one prefill (or decode) node on its own daemon, under 4 streaming
    clients of the router: none fails (the router tries the other node of that pool), the
    command exits 0 saying "drained", no request completes on the node while it is
    drained, and the undrain admits again."""
    r = disagg.router
    host = (disagg.prefills if role == "prefill" else disagg.decodes)[0]
    drained, other = f"{role}-0", f"{role}-1"  # the router's names, by --*-peers order
    with StreamingLoad(f"{url(r)}/v1", clients=CLIENTS, max_tokens=TOKENS,
                       prompt=LONG_PROMPT, model=MODEL) as load:
        wait_for(lambda: load.counts()["completed"] >= CLIENTS, 120, "the load under way")
        before = load.counts()
        done, row, _ = drain_watched(host)
        wait_for(lambda: nodes(r)[drained]["in_flight"] == 0, 5,
                 "the router's account of the node's last requests closed")
        at_drained = nodes(r)
        time.sleep(LOAD_S)
        while_drained = nodes(r)
        during = load.counts()
        assert host.d.ctl("undrain").returncode == 0
        wait_for(lambda: nodes(r)[drained]["completed"]
                 > while_drained[drained]["completed"], 60,
                 "the node serving the router's requests again after the undrain")
    after = load.counts()
    print(f"\n{role} node drain through a router ({CLIENTS} streaming clients): before "
          f"{before}, while drained {during}, at the end {after}; exit {done.returncode}: "
          f"{describe(done)}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert row["state"] == "drained" and row["ended"] == 0, row
    assert (load.refused, load.failed) == ([], []), (load.refused[:3], load.failed[:3])
    assert during["completed"] > before["completed"]
    assert while_drained[drained]["completed"] == at_drained[drained]["completed"]
    assert while_drained[other]["completed"] > at_drained[other]["completed"]


# -- a stage host's own daemon ----------------------------------------------------------


@pytest.mark.slow
def test_a_stage_hosts_own_daemon_refuses_to_drain_naming_its_coordinator(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """Its coordinator sends it the work and only the coordinator can re-plan around it:
    exit 1, ``drain_refused``, naming the coordinator node and `mlxctl drain STAGE` to
    run there; nothing recorded, so it is never said to be drained."""
    pipe = start_pipeline(daemons, split_fixture_dir / MODEL, [(0, 2), (2, 4)])
    host = pipe.stages[1]
    refused = host.ctl("drain", "--json")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "drain_refused", error
    assert "coordinator" in error["message"] and "stage-1" in error["message"], error
    assert "mlxctl drain stage-1" in error["hint"], error
    said = host.ctl("drain", "stage-1")
    assert said.returncode == 1 and "coordinated by node coordinator" in said.stderr
    assert "drained" not in said.stdout
    assert host.api(lambda c: c.drains())["drains"] == []
    assert [e["kind"] for e in host.events() if e["kind"].startswith("drain.")] == []
