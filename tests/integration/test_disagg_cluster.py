"""Prefill/decode disaggregation end to end: real daemons started as a service manager
starts them (``helpers.deploy.Host``), one cluster secret, the tiny llama fixture. A
router (127.0.0.1, ``node_role = "router"`` with ``prefill_peers`` and ``decode_peers``)
over one prefill node (127.0.0.2, ``MLXCEL_DECODE_ALLOWLIST`` naming both decode nodes)
and two decode nodes (127.0.0.3, 127.0.0.4), every peer by IP; and a hybrid node
(127.0.0.5) for the one host's answers. Asked with the real ``openai`` client; what a
forger sends comes from a test-side MXCL client holding the secret. One cluster for the
module; every process is ended by pid at the end."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxceld.engine import EngineError, GenerationRequest, SamplingParams
from mlxceld.net import connect_as
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.wire import encode_envelope
from mlxceld.wire.names import DEFAULT_CLUSTER_NAME
from mlxceld.workers.router import STATS_EVERY_S

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.keys import keyring
from helpers.metrics import sample, scrape_checked
from helpers.ports import free_port
from helpers.router import check_messages_api, check_responses_api, greedy_stream
from helpers.waiting import wait_for

SECRET = b"the disaggregation tests' secret, 44 bytes."
MODEL = "llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "Call me"]


@dataclass
class Cluster:
    router: Host
    prefill: Host
    decodes: list[Host]
    hybrid: Host
    int8: Host  # a second router: kv_compression int8, MLXCEL_ROUTER_STATS_VERBOSE=1

    def url(self, host: Host) -> str:
        return f"http://127.0.0.1:{host.serve_keys['port']}"

    def stats(self, router: Host | None = None) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url(router or self.router)}/router/stats",
                                         timeout=10).json()
        return body


def node(daemons: Daemons, name: str, model: Path, ip: str, **serve: Any) -> Host:
    host = Host(daemons, name, secret=SECRET,
                serve={"model": str(model), "host": "127.0.0.1",
                       "port": free_port("127.0.0.1"), "max_batch": 4,
                       "serving_port": free_port(ip), **serve})
    host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
    host.daemon_keys["metrics_listen"] = f"{ip}:{free_port(ip)}"
    host.write()
    return host


def handoffs(host: Host, role: str) -> dict[str, float]:
    """The node's handoff counters on its daemon's /metrics ([daemon] metrics_listen)."""
    m = scrape_checked(f"http://{host.daemon_keys['metrics_listen']}/metrics")
    return {name: sample(m, f"mlxceld_{name}_total", worker="router", node_role=role) or 0
            for name in ("kv_handoffs", "kv_handoff_bytes", "kv_handoff_seconds")}


def serving(host: Host) -> str:
    ip = str(host.daemon_keys["agent_addr"]).rsplit(":", 1)[0]
    return f"{ip}:{host.serve_keys['serving_port']}"


def agent(host: Host) -> str:
    return str(host.daemon_keys["agent_addr"])


complete = functools.partial(greedy_stream, model=MODEL, n=8)  # streamed


@pytest.fixture(scope="module")
def cluster(fixture_dir: Path) -> Iterator[Cluster]:
    daemons = Daemons()
    model = fixture_dir / MODEL
    try:
        decodes = [node(daemons, f"d{i}", model, f"127.0.0.{3 + i}", node_role="decode")
                   for i in range(2)]
        prefill = node(daemons, "p", model, "127.0.0.2", node_role="prefill")
        for d in decodes:
            d.serve_keys["prefill_peers"] = [agent(prefill)]
            d.write()
        allow = ",".join(serving(d) for d in decodes)
        prefill.d.start_service(env={"MLXCEL_DECODE_ALLOWLIST": allow})
        hybrid = node(daemons, "h", model, "127.0.0.5").start()
        for d in decodes:
            d.start()
        routers = []
        for name, extra in (("r", {}), ("r8", {"kv_compression": "int8"})):
            router = Host(daemons, name, secret=SECRET,
                          serve={"model": str(model), "port": free_port("127.0.0.1"),
                                 "node_role": "router", "max_batch": 4,
                                 "prefill_peers": [agent(prefill)],
                                 "decode_peers": [agent(d) for d in decodes], **extra})
            router.daemon_keys["agent_addr"] = f"127.0.0.1:{router.agent_port}"
            router.write()
            routers.append(router)
        routers[0].start()
        routers[1].d.start_service(env={"MLXCEL_ROUTER_STATS_VERBOSE": "1"})
        c = Cluster(routers[0], prefill, decodes, hybrid, routers[1])
        for h in (prefill, *decodes, hybrid, *routers):
            h.d.wait_worker("router", READY_S, state="running")
        for r in routers:
            wait_for(lambda r=r: c.stats(r)["up"] == 3, 60, "the prefill and decode nodes up")
        yield c
    finally:
        daemons.end()


def test_outputs_equal_one_hosts_and_both_decode_nodes_serve(cluster: Cluster) -> None:
    """Uncompressed (the default): the hybrid node's greedy text, 4 streams at once,
    spread over both decode nodes; the handoffs' bytes in the stats, addresses redacted;
    mlxctl status names each node's role and serving listener."""
    one = [complete(cluster.url(cluster.hybrid), p) for p in PROMPTS]
    together = threading.Barrier(len(PROMPTS))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        ours = list(pool.map(lambda p: complete(cluster.url(cluster.router), p,
                                                together=together), PROMPTS))
    assert ours == one
    body = httpx.get(f"{cluster.url(cluster.router)}/router/stats", timeout=10)
    stats = body.json()
    assert stats["addresses_redacted"] is True and "127.0.0." not in body.text
    by_id = {n["id"]: n for n in stats["nodes"]}
    assert by_id["decode-0"]["completed"] >= 1 and by_id["decode-1"]["completed"] >= 1
    assert stats["handoff"]["handoffs"] == len(PROMPTS) and stats["handoff"]["bytes"] > 0
    sent = wait_for(lambda: (h := handoffs(cluster.prefill, "prefill"))["kv_handoffs"]
                    >= len(PROMPTS) and h, 30, "the prefill node's handoffs on /metrics")
    assert sent["kv_handoff_bytes"] > 0 and sent["kv_handoff_seconds"] > 0, sent
    wait_for(lambda: sum(handoffs(d, "decode")["kv_handoffs"] for d in cluster.decodes)
             >= len(PROMPTS), 30, "the decode nodes' handoffs on /metrics")
    out = cluster.prefill.d.ctl("status").stdout
    assert f"prefill node: serving listener at {serving(cluster.prefill)}" in out, out
    assert "no OpenAI port" in out


def test_a_chats_next_turn_prefills_only_its_new_part_on_the_prefill_node(
        cluster: Cluster) -> None:
    """The prefill node keeps each prompt it prefilled (``LocalEngine.prefill``): a prompt
    that extends one prefills only the rest, its greedy text still the one host's; its
    prompt cache in ``mlxctl status``."""
    def read() -> dict[str, Any] | None:
        stats = (cluster.prefill.d.worker("router").get("stats") or {}).get("prompt_cache")
        return dict(stats) if stats else None

    def cache(more_than: int) -> dict[str, Any]:
        """The stats once they count more than ``more_than`` lookups and have settled: the
        worker refreshes them every second (``STATS_EVERY_S``), so a read may be a second
        old; unchanged over two refreshes, they count every lookup made before."""
        def settled() -> dict[str, Any] | None:
            now = read()
            if now is None or now["hits"] + now["misses"] <= more_than:
                return None
            time.sleep(2 * STATS_EVERY_S + 0.5)
            return now if read() == now else None
        found: dict[str, Any] = wait_for(settled, 30, "the prefill node's prompt cache stats")
        return found

    turn1 = "The knight rode north through the long winter, looking for"
    turn2 = turn1 + " the dragon that had burned his village, and he found"
    assert complete(cluster.url(cluster.router), turn1) == \
        complete(cluster.url(cluster.hybrid), turn1)
    first = cache(0)
    assert complete(cluster.url(cluster.router), turn2) == \
        complete(cluster.url(cluster.hybrid), turn2)
    second = cache(first["hits"] + first["misses"])
    assert second["hits"] == first["hits"] + 1
    assert second["tokens_reused"] - first["tokens_reused"] > 8  # turn 1's tokens, about
    assert second["entries"] >= 1 and second["bytes"] > 0
    out = cluster.prefill.d.ctl("status").stdout
    assert "prompt cache: " in out and " tokens reused; holds " in out, out


def test_int8_keeps_the_greedy_text_here_and_verbose_stats_name_addresses(
        cluster: Cluster) -> None:
    """int8 on this fixture keeps every greedy token (its error is within half a group's
    scale: engine/handoff.py's tests); in fewer bytes than none; the second router's
    daemon has MLXCEL_ROUTER_STATS_VERBOSE=1: its stats name each node's address."""
    for prompt in PROMPTS[:2]:
        assert complete(cluster.url(cluster.int8), prompt) == \
            complete(cluster.url(cluster.hybrid), prompt)
    stats = cluster.stats(cluster.int8)
    assert stats["kv_compression"] == "int8" and stats["addresses_redacted"] is False
    assert {n["address"] for n in stats["nodes"]} == {
        serving(cluster.prefill), *(serving(d) for d in cluster.decodes)}
    plain = cluster.stats()["handoff"]
    per_plain = plain["bytes"] / plain["handoffs"]
    assert 0 < stats["handoff"]["bytes"] / stats["handoff"]["handoffs"] < per_plain


def test_the_responses_api_through_prefill_and_decode_nodes_is_one_hosts(
        cluster: Cluster) -> None:
    """Run after the int8 test, which compares its bytes per handoff with the plain
    router's: this longer prompt would skew those. The prefill node's prompt cache held
    the conversation (asked as a chat first): its count comes with the handoff's first
    token, through the decode node, to the usage."""
    ours = check_responses_api(cluster.url(cluster.router), MODEL)
    assert ours.usage.input_tokens_details.cached_tokens > 0
    assert ours.output_text == check_responses_api(cluster.url(cluster.hybrid), MODEL).output_text


def test_the_messages_api_through_prefill_and_decode_nodes_is_one_hosts(
        cluster: Cluster) -> None:
    ours = check_messages_api(cluster.url(cluster.router), MODEL)
    assert ours.content == check_messages_api(cluster.url(cluster.hybrid), MODEL).content


def test_a_forged_decode_target_is_refused_and_nothing_is_sent(cluster: Cluster) -> None:
    async def main() -> None:
        async def resolve() -> str:
            return serving(cluster.prefill)

        forger = RemoteEngine("p", resolve, keyring=keyring(SECRET),
                              origin="127.0.0.1:19109", model_identity=identity(cluster),
                              cluster=DEFAULT_CLUSTER_NAME, silence_s=5.0, role="prefill")
        linking = asyncio.create_task(forger.keep_linked())
        try:
            async with asyncio.timeout(30):
                while forger.state() != "up":
                    await asyncio.sleep(0.05)
                request = GenerationRequest("f", [1, 2, 3], SamplingParams(max_tokens=2))
                with pytest.raises(EngineError, match="MLXCEL_DECODE_ALLOWLIST"):
                    await forger.prefill("forged", request, decode_target="127.0.0.9:9",
                                         compression="none", within_s=20)
        finally:
            linking.cancel()
            await asyncio.gather(linking, return_exceptions=True)
            await forger.aclose()

    asyncio.run(main())
    log = cluster.prefill.d.ctl("logs", "router").stdout
    assert "decode target 127.0.0.9:9 is not in node" in log, log[-3000:]


def test_a_handoff_from_a_non_peer_is_dropped_with_a_warning(cluster: Cluster) -> None:
    async def main() -> None:
        forger = await connect_as("127.0.0.1:19108", serving(cluster.decodes[0]),
                                  keyring=keyring(SECRET), channel=1, budget_s=10)
        try:
            await forger.send(encode_envelope(
                {"t": "handoff", "seq": "s1", "part": 0, "parts": 1,
                 "first": {"token": 1}, "cache": {}}, [("k0", "u8", (4,), b"\0" * 4)]))
            await asyncio.sleep(0.5)
        finally:
            await forger.close()

    asyncio.run(main())
    wait_for(lambda: "[router_drop]" in cluster.decodes[0].d.ctl("logs", "router").stdout,
             20, "the decode node's drop warning")
    assert complete(cluster.url(cluster.router), PROMPTS[0]) == \
        complete(cluster.url(cluster.hybrid), PROMPTS[0])


def identity(cluster: Cluster) -> str:
    from mlxceld.models.identity import model_identity

    return model_identity(Path(str(cluster.hybrid.serve_keys["model"])))
