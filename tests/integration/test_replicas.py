"""A router over replicas, end to end: real daemons started as a service manager starts
them (``helpers.deploy.Host``: ``mlxceld --config FILE``), one cluster secret, the tiny
llama fixture (the same files on every host). One router (127.0.0.1, configured by
``[serve] node_role = "router"`` and ``replicas``) over two hybrid replicas: A, whose
agent listens on the default wildcard and which the router names ``localhost:PORT``,
and B on 127.0.0.3, named by IP. Asked with the real ``openai`` client.

A second router (127.0.0.1 too) is configured by flags (``--node-role router --replicas``,
both replicas by IP) with ``MLXCEL_ROUTER_STATS_VERBOSE=yes`` in its daemon's environment.

One cluster for the module, in order: outputs, spread, stats redacted and verbose; A's
host dies (kill -9 of its daemon and workers) and comes back (started again as systemd
would); B's host goes silent (SIGSTOP), then answers again. Every process is ended by
pid at the end."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons, alive
from helpers.deploy import Host
from helpers.keys import secret_file
from helpers.ports import free_port
from helpers.router import check_messages_api, check_responses_api, client, greedy, greedy_stream
from helpers.waiting import wait_for

SECRET = b"the replica tests' cluster secret, 44 bytes"
SILENCE_S = 2.0  # [serve] stage_silence_s on the router: a replica silent this long is down
SLACK_S = 8.0  # a loaded machine's scheduling on top of a bound
MODEL = "llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground",
           "It was a dark and stormy night", "Call me", "All happy families",
           "The sky above the port", "Hello"]


@dataclass
class Cluster:
    router: Host
    a: Host
    b: Host
    verbose: DaemonProc  # the second router, by flags
    verbose_port: int
    daemons: Daemons

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.serve_keys['port']}"

    def stats(self, url: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{url or self.url}/router/stats",
                                         timeout=10).json()
        return body

    def node(self, node_id: str) -> dict[str, Any]:
        return next(dict(n) for n in self.stats()["nodes"] if n["id"] == node_id)


def hybrid(daemons: Daemons, name: str, model: Path, ip: str | None) -> Host:
    """A replica: the model served here, its serving listener on its agent's host."""
    host = Host(daemons, name, secret=SECRET,
                serve={"model": str(model), "host": ip or "127.0.0.1",
                       "port": free_port(ip or "127.0.0.1"), "max_batch": 4})
    if ip is not None:
        host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
        host.write()
    return host


def processes(host: Host) -> list[int]:
    """The host's daemon and its workers."""
    return [host.d.pid, *(w["pid"] for w in host.d.status()["workers"] if w["pid"])]


complete = functools.partial(greedy, model=MODEL)
stream = functools.partial(greedy_stream, model=MODEL)


def both_up(c: Cluster, url: str | None = None) -> bool:
    return bool(c.stats(url)["up"] == 2)


@pytest.fixture(scope="module")
def cluster(fixture_dir: Path) -> Iterator[Cluster]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        a = hybrid(daemons, "ra", model, None).start()
        b = hybrid(daemons, "rb", model, "127.0.0.3").start()
        router = Host(daemons, "rr", secret=SECRET,
                      serve={"model": str(model), "port": free_port("127.0.0.1"),
                             "node_role": "router", "stage_silence_s": SILENCE_S,
                             "replicas": [a.address("localhost"), f"127.0.0.3:{b.agent_port}"]}
                      ).start()
        verbose = daemons.make(FAST_POLICY, name="rv")
        port = free_port("127.0.0.1")
        verbose.start("--model", str(model), "--port", str(port), "--node-role", "router",
                      "--replicas", f"127.0.0.1:{a.agent_port},127.0.0.3:{b.agent_port}",
                      "--cluster-secret-file", str(secret_file(verbose.root, SECRET)),
                      env={"MLXCEL_ROUTER_STATS_VERBOSE": "yes"})
        c = Cluster(router, a, b, verbose, port, daemons)
        for d in (a.d, b.d, router.d, verbose):
            d.wait_worker("router", READY_S, state="running")
        wait_for(lambda: both_up(c), 60, "both replicas up behind the router")
        wait_for(lambda: both_up(c, f"http://127.0.0.1:{port}"), 60,
                 "both replicas up behind the second router")
        yield c
    finally:
        daemons.end()


def test_outputs_through_the_router_equal_a_single_hosts(cluster: Cluster) -> None:
    a_url = f"http://127.0.0.1:{cluster.a.serve_keys['port']}"
    for prompt in PROMPTS[:3]:
        assert complete(cluster.url, prompt) == complete(a_url, prompt), prompt
    with client(f"{cluster.url}/v1") as c, client(f"{a_url}/v1") as single:
        messages: Any = [{"role": "user", "content": "Say hello"}]
        ours = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         temperature=0)
        theirs = single.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.usage is not None and theirs.usage is not None
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert [m.id for m in client(f"{cluster.url}/v1").models.list()] == [MODEL]


def test_the_responses_api_through_the_router_is_a_single_hosts(cluster: Cluster) -> None:
    """Its usage's cached_tokens comes through the router: the replica's prompt cache held
    the conversation (asked as a chat first), and the token frame carries the count."""
    a_url = f"http://127.0.0.1:{cluster.a.serve_keys['port']}"
    ours = check_responses_api(cluster.url, MODEL)
    assert ours.usage.input_tokens_details.cached_tokens > 0
    assert ours.output_text == check_responses_api(a_url, MODEL).output_text


def test_the_messages_api_through_the_router_is_a_single_hosts(cluster: Cluster) -> None:
    a_url = f"http://127.0.0.1:{cluster.a.serve_keys['port']}"
    ours = check_messages_api(cluster.url, MODEL)
    assert ours.content == check_messages_api(a_url, MODEL).content


def test_concurrent_streams_spread_over_both_replicas(cluster: Cluster) -> None:
    before = {n["id"]: n for n in cluster.stats()["nodes"]}
    together = threading.Barrier(len(PROMPTS))  # all 8 in flight at once
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: stream(cluster.url, p, together=together), PROMPTS))
    assert all(texts), texts

    def settled() -> dict[str, Any] | None:
        # a stream's account ends as the router closes it, maybe just after the [DONE]
        nodes = {n["id"]: n for n in cluster.stats()["nodes"]}
        return None if any(n["in_flight"] for n in nodes.values()) else nodes

    after = wait_for(settled, 10, "the router's accounts of the streams ended")
    # each stream completed on one replica; a try a replica refused before its first token
    # (busy, its link just down) was tried on the other and counts as dispatched there too
    spread = {k: {c: after[k][c] - before[k][c] for c in ("dispatched", "completed", "retried")}
              for k in after}
    assert sorted(spread) == ["replica-0", "replica-1"]
    assert all(v["completed"] > 0 for v in spread.values()), (spread, after)
    assert sum(v["completed"] for v in spread.values()) == 8, (spread, after)
    assert sum(v["dispatched"] - v["retried"] for v in spread.values()) == 8, (spread, after)


def test_stats_are_redacted_unless_the_daemon_is_told_and_status_shows_the_replicas(
        cluster: Cluster) -> None:
    body = httpx.get(f"{cluster.url}/router/stats", timeout=10)
    assert body.status_code == 200
    stats = body.json()
    assert stats["addresses_redacted"] is True
    assert "127.0.0." not in body.text and "localhost" not in body.text
    assert all("address" not in n for n in stats["nodes"])
    verbose = cluster.stats(f"http://127.0.0.1:{cluster.verbose_port}")
    assert verbose["addresses_redacted"] is False
    addresses = [n["address"] for n in verbose["nodes"]]
    assert addresses[0].startswith("127.0.0.1:") and addresses[1].startswith("127.0.0.3:"), \
        addresses
    out = cluster.router.d.ctl("status").stdout
    assert "replicas of router: 2 of 2 up" in out, out
    assert cluster.a.address("localhost") in out and f"127.0.0.3:{cluster.b.agent_port}" in out


def test_a_replica_host_that_dies_is_routed_around_and_used_again_when_back(
        cluster: Cluster) -> None:
    a = cluster.a
    pids = processes(a)
    cluster.daemons.pids |= set(pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert a.d.proc is not None and a.d.proc.wait(10) == -signal.SIGKILL
    wait_for(lambda: not any(alive(p) for p in pids), 10, "host A's processes gone")
    started = time.monotonic()
    for prompt in PROMPTS[:4]:  # none hangs; the first may find A's link not yet down
        t0 = time.monotonic()
        assert complete(cluster.url, prompt)
        assert time.monotonic() - t0 < SILENCE_S + SLACK_S
    print(f"\n4 requests served by B {time.monotonic() - started:.2f} s after A's kill -9")
    assert cluster.node("replica-0")["state"] == "down"
    error = cluster.node("replica-0")["last_error"]
    assert error and "replica-0" in error and "127.0.0" not in error, error
    wait_for(lambda: "cannot use replica replica-0" in cluster.router.d.ctl("status").stdout,
             10, "mlxctl status naming replica-0 as a problem")

    a.d.start_service()  # back, as systemd's Restart= starts it
    a.d.wait_worker("router", READY_S, state="running")
    wait_for(lambda: both_up(cluster), 60, "replica-0 up again behind the router")
    before = cluster.node("replica-0")["dispatched"]
    # Prompts B has not cached (prefix affinity would keep those it has on B).
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda p: stream(cluster.url, p + " again"), PROMPTS[4:]))
    assert cluster.node("replica-0")["dispatched"] > before


def test_a_silent_replica_host_is_routed_around_within_the_bound(cluster: Cluster) -> None:
    b = cluster.b
    wait_for(lambda: both_up(cluster), 60, "both replicas up")
    pids = processes(b)
    cluster.daemons.pids |= set(pids)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()

        def timed(prompt: str) -> float:
            t0 = time.monotonic()
            assert complete(cluster.url, prompt)
            return time.monotonic() - t0

        with ThreadPoolExecutor(4) as pool:
            took = list(pool.map(timed, PROMPTS[:4]))
        print(f"\nrequests during B's SIGSTOP took {', '.join(f'{t:.2f}' for t in took)} s")
        assert max(took) < SILENCE_S + SLACK_S, took
        wait_for(lambda: cluster.node("replica-1")["state"] != "up",
                 SILENCE_S + SLACK_S, "replica-1 down while its host is stopped")
        print(f"replica-1 down {time.monotonic() - stopped:.2f} s after SIGSTOP")
        assert complete(cluster.url, PROMPTS[5])
    finally:
        for pid in reversed(pids):
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
    wait_for(lambda: both_up(cluster), 60, "replica-1 up again after SIGCONT")


def test_a_router_without_the_cluster_secret_refuses_to_start(tmp_path: Path,
                                                              fixture_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}
    done = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--state-dir", str(tmp_path / "s"), "--socket",
         str(tmp_path / "ctl.sock"), "--model", str(fixture_dir / MODEL),
         "--node-role", "router", "--replicas", "localhost"],
        capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "--node-role router needs the cluster secret" in done.stderr
    for source in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE",
                   "MLXCEL_CLUSTER_SECRET,", "[daemon] cluster_secret_file", "keyring"):
        assert source in done.stderr, source
