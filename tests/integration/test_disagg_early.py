"""A decode node's held handoffs with real daemons (``replicas/held.py``): a router
(127.0.0.1) over one prefill node (127.0.0.2, serving listener on an ephemeral port, so
that a restart moves it) and one decode node (127.0.0.3) that takes each router's
``expect`` 1 s late (``MLXCELD_TEST_EXPECT_DELAY_S``: the prefill node's handoff comes
first, as it may when the router's link is slow) and asks its prefill peers' agents only
every 600 s (``MLXCELD_TEST_PEERS_EVERY_S``: a prefill node's restart falls between two
asks, as it does within 5 s of one). Asked with the real ``openai`` client, retries
off. One cluster for the module; every process is ended by pid at the end."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.ports import free_port
from helpers.router import greedy_stream
from helpers.waiting import wait_for

SECRET = b"the held handoffs tests' secret, 44 bytes.."
MODEL = "llama"
# A request's answer within this: the router's own bound for a handoff the decode node
# lost is 30 s (disagg.FIRST_TOKEN_S); a held one adds the 1 s of the delayed expect.
ANSWER_S = 10.0

complete = functools.partial(greedy_stream, model=MODEL, n=8)  # streamed


@dataclass
class Cluster:
    router: Host
    prefill: Host
    decode: Host

    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.serve_keys['port']}"

    def up(self) -> int:
        body = httpx.get(f"{self.url()}/router/stats", timeout=10).json()
        return int(body["up"])


def node(daemons: Daemons, name: str, model: Path, ip: str, serving_port: int,
         **serve: Any) -> Host:
    host = Host(daemons, name, secret=SECRET,
                serve={"model": str(model), "host": "127.0.0.1",
                       "port": free_port("127.0.0.1"), "max_batch": 4,
                       "serving_port": serving_port, **serve})
    host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
    host.write()
    return host


def agent(host: Host) -> str:
    return str(host.daemon_keys["agent_addr"])


def handoffs(host: Host) -> dict[str, Any]:
    return dict((host.d.worker("router").get("stats") or {}).get("handoffs") or {})


def serving(host: Host) -> str | None:
    """The node's serving listener's address, as its worker says (None: not serving)."""
    found = (host.d.worker("router").get("stats") or {}).get("serving")
    return str(found) if found else None


@pytest.fixture(scope="module")
def cluster(fixture_dir: Path) -> Iterator[Cluster]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        decode_port = free_port("127.0.0.3")
        decode = node(daemons, "d", model, "127.0.0.3", decode_port, node_role="decode")
        prefill = node(daemons, "p", model, "127.0.0.2", 0, node_role="prefill")
        decode.serve_keys["prefill_peers"] = [agent(prefill)]
        decode.write()
        prefill.d.start_service(env={"MLXCEL_DECODE_ALLOWLIST": f"127.0.0.3:{decode_port}"})
        decode.d.start_service(env={"MLXCELD_TEST_EXPECT_DELAY_S": "1",
                                    "MLXCELD_TEST_PEERS_EVERY_S": "600"})
        router = Host(daemons, "r", secret=SECRET,
                      serve={"model": str(model), "port": free_port("127.0.0.1"),
                             "node_role": "router", "max_batch": 4,
                             "prefill_peers": [agent(prefill)],
                             "decode_peers": [agent(decode)]})
        router.daemon_keys["agent_addr"] = f"127.0.0.1:{router.agent_port}"
        router.write()
        router.start()
        c = Cluster(router, prefill, decode)
        for h in (prefill, decode, router):
            h.d.wait_worker("router", READY_S, state="running")
        wait_for(lambda: c.up() == 2, 60, "the prefill and decode nodes up")
        yield c
    finally:
        daemons.end()


def timed(c: Cluster, prompt: str) -> tuple[str, float]:
    """The request's text and how long it took; a refusal raised with its time."""
    started = time.monotonic()
    try:
        text = complete(c.url(), prompt)
    except openai.APIStatusError as exc:
        raise AssertionError(f"HTTP {exc.status_code} after {time.monotonic() - started:.1f} "
                             f"s: {exc.message}") from None
    took = time.monotonic() - started
    print(f"{prompt!r}: HTTP 200 in {took:.2f} s")  # for the closing note (pytest -rP)
    return text, took


def test_a_handoff_that_beats_its_expect_is_held_and_the_request_succeeds(
        cluster: Cluster) -> None:
    held = handoffs(cluster.decode).get("held", 0)
    text, took = timed(cluster, "The quick brown fox")
    assert text and took < ANSWER_S, (text, took)
    got = wait_for(lambda: (h := handoffs(cluster.decode)).get("held", 0) > held and h, 10,
                   "the decode node's count of held handoffs")
    assert got["dropped"] == 0, got


@pytest.mark.slow
def test_right_after_a_prefill_nodes_restart_on_a_new_port_the_request_succeeds(
        cluster: Cluster) -> None:
    """The decode node still knows the old port (its next ask is minutes away): the
    handoff from the new one is held while it asks the agent again, then taken."""
    before = serving(cluster.prefill)
    assert cluster.prefill.d.ctl("restart", "router").returncode == 0
    moved = wait_for(lambda: (s := serving(cluster.prefill)) not in (None, before) and s,
                     READY_S, "the prefill node serving again on a new port")
    wait_for(lambda: cluster.up() == 2, 30, "the router's link to the restarted node")
    text, took = timed(cluster, "Once upon a time")
    assert text and took < ANSWER_S, (before, moved, text, took)
    got = handoffs(cluster.decode)
    assert got["dropped"] == 0, got
