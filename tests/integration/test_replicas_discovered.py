"""A router that finds its replicas by discovery, end to end: real daemons started as a
service manager starts them (``helpers.deploy.Host``), one cluster secret, the tiny
llama fixture. Two hybrid replicas (A on the wildcard agent address, B on 127.0.0.3)
and a router (127.0.0.1, ``[serve] node_role = "router"``, no ``replicas``) whose
daemon's ``[daemon] cluster_peers`` names both agents: its discovery's candidates
become its replicas, ``replica-<node id>``. B's daemon then stops (SIGTERM): B leaves
the pool (retired once its candidate's poll fails) or shows down, and A serves; then
A's host dies (kill -9 of its daemon and workers) and ``/ready`` is 503. Every process
is ended by pid at the end."""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.models import eos_ids
from helpers.ports import free_port
from helpers.router import greedy, greedy_stream
from helpers.waiting import wait_for

SECRET = b"the discovered replicas' cluster secret, 48 b"
SILENCE_S = 2.0
MODEL = "llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "Hello"]


@dataclass
class Cluster:
    router: Host
    a: Host
    b: Host
    ids: dict[str, str]  # host name -> its member id at the router
    daemons: Daemons

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.serve_keys['port']}"

    def stats(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/router/stats", timeout=10).json()
        return body

    def states(self) -> dict[str, str]:
        return {n["id"]: n["state"] for n in self.stats()["nodes"] if not n.get("retired")}


def hybrid(daemons: Daemons, name: str, model: Path, ip: str) -> Host:
    host = Host(daemons, name, secret=SECRET,
                serve={"model": str(model), "host": ip, "port": free_port(ip),
                       "max_batch": 4})
    if ip != "127.0.0.1":
        host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
        host.write()
    return host


complete = functools.partial(greedy, model=MODEL, n=6)
# Long enough that the four streams overlap at the router however loaded the machine is
# (12 tokens each ended before the next was routed once, all four on one replica): the
# end-of-sequence ids are banned, so each runs all LONG tokens.
LONG = 300
stream = functools.partial(greedy_stream, model=MODEL, n=LONG)


@pytest.fixture(scope="module")
def cluster(fixture_dir: Path) -> Iterator[Cluster]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        a = hybrid(daemons, "da", model, "127.0.0.1").start()
        b = hybrid(daemons, "db", model, "127.0.0.3").start()
        router = Host(daemons, "dr", secret=SECRET,
                      daemon={"cluster_peers": [f"127.0.0.1:{a.agent_port}",
                                                f"127.0.0.3:{b.agent_port}"]},
                      serve={"model": str(model), "port": free_port("127.0.0.1"),
                             "node_role": "router", "stage_silence_s": SILENCE_S}).start()
        ids = {h.d.root.name: f"replica-{h.d.status()['daemon']['node_id']}" for h in (a, b)}
        c = Cluster(router, a, b, {"a": ids[a.d.root.name], "b": ids[b.d.root.name]},
                    daemons)
        for d in (a.d, b.d, router.d):
            d.wait_worker("router", READY_S, state="running")
        wait_for(lambda: c.states() == {c.ids["a"]: "up", c.ids["b"]: "up"}, 60,
                 "both replicas found and up behind the router")
        yield c
    finally:
        daemons.end()


def test_discovered_replicas_both_serve_and_show_in_status(cluster: Cluster,
                                                          fixture_dir: Path) -> None:
    together, banned = threading.Barrier(len(PROMPTS)), eos_ids(fixture_dir / MODEL)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: stream(cluster.url, p, together=together,
                                               banned=banned), PROMPTS))
    assert all(texts), texts
    # a try a replica refused before its first token was retried on the other: not taken
    took = {n["id"]: n["dispatched"] - n["retried"] for n in cluster.stats()["nodes"]}
    assert sorted(took) == sorted(cluster.ids.values())
    assert all(v > 0 for v in took.values()) and sum(took.values()) == len(PROMPTS), took
    assert httpx.get(f"{cluster.url}/ready", timeout=10).status_code == 200

    def both_in_status() -> str | None:
        out: str = cluster.router.d.ctl("status").stdout
        return out if "replicas of router: 2 of 2 up" in out else None

    out = wait_for(both_in_status, 30,
                   "mlxctl status showing both replicas (the worker's stats lag a little)")
    assert f"127.0.0.3:{cluster.b.agent_port}" in out and cluster.ids["b"] in out, out


def test_a_stopped_replica_leaves_or_is_down_and_ready_fails_with_none(
        cluster: Cluster) -> None:
    assert cluster.b.d.terminate() == 0
    wait_for(lambda: cluster.states().get(cluster.ids["b"], "gone") != "up", 30,
             "B retired or down at the router")
    for prompt in PROMPTS[:2]:
        assert complete(cluster.url, prompt)
    assert cluster.states()[cluster.ids["a"]] == "up"
    assert httpx.get(f"{cluster.url}/ready", timeout=10).status_code == 200
    pids = [cluster.a.d.pid, *(w["pid"] for w in cluster.a.d.status()["workers"] if w["pid"])]
    cluster.daemons.pids |= set(pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: httpx.get(f"{cluster.url}/ready", timeout=10).status_code == 503, 30,
             "/ready 503 with no replica up")
