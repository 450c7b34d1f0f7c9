"""A router over replicas placed by one cluster TOML, as a fleet is deployed: every daemon
(a router on 127.0.0.1, hybrids on 127.0.0.2 and 127.0.0.3) started with only
``--distributed-config FILE --node-id ID`` beside its own ports; the model and the secret
come from the file. Greedy output through the router equals a hybrid's own, and
concurrent requests reach both hybrids (``/router/stats``). Every process is ended by
pid at the end."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import eos_ids
from helpers.ports import free_port
from helpers.router import greedy, greedy_stream
from helpers.waiting import wait_for

SECRET = b"the cluster file's replica secret, 40 byte"
MODEL = "llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "Call me", "Hello"]


@dataclass
class Fleet:
    router: str  # the OpenAI URLs: the router's, and each hybrid's own
    hybrids: list[str]

    def stats(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.router}/router/stats", timeout=10).json()
        return body


complete = functools.partial(greedy, model=MODEL)
stream = functools.partial(greedy_stream, model=MODEL)
LONG = 96  # tokens of each of the concurrent streams


@pytest.fixture(scope="module")
def fleet(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    secret_file(root, SECRET)
    ips = {"router": "127.0.0.1", "h1": "127.0.0.2", "h2": "127.0.0.3"}
    agents = {node: f"{ip}:{free_port(ip)}" for node, ip in ips.items()}
    roles = {"router": "router", "h1": "hybrid", "h2": "hybrid"}
    nodes = "".join(f'\n[[nodes]]\nid = "{n}"\naddress = "{agents[n]}"\nrole = "{roles[n]}"\n'
                    for n in ips)
    path = root / "serve.toml"
    path.write_text(f'[cluster]\nname = "fleet"\nmodel = "{fixture_dir / MODEL}"\n'
                    f'secret_file = "cluster.secret"\n{nodes}')
    daemons = Daemons()
    try:
        urls: dict[str, str] = {}
        procs: list[DaemonProc] = []
        for node, ip in ips.items():
            port = free_port(ip)
            d = daemons.make(FAST_POLICY, name=f"f{node}")
            # --agent-addr as the file says: the test helper otherwise binds 127.0.0.1:0
            d.start("--distributed-config", str(path), "--node-id", node,
                    "--agent-addr", agents[node], "--host", ip, "--port", str(port))
            urls[node], procs = f"http://{ip}:{port}", [*procs, d]
        for d in procs:
            d.wait_worker("router", READY_S, state="running")
            daemons.note(d)
        f = Fleet(urls["router"], [urls["h1"], urls["h2"]])
        wait_for(lambda: f.stats()["up"] == 2, 60, "both hybrids up behind the router")
        yield f
    finally:
        daemons.end()


def test_a_router_placed_by_the_file_serves_as_its_hybrids_do(fleet: Fleet,
                                                               fixture_dir: Path) -> None:
    for prompt in PROMPTS[:2]:
        assert complete(fleet.router, prompt) == complete(fleet.hybrids[0], prompt), prompt
    before = {n["id"]: n["dispatched"] for n in fleet.stats()["nodes"]}
    # All in flight at once: each runs its LONG tokens (no end-of-sequence), so that its
    # sequence still runs on its replica when the next one is routed (a stream's sequence
    # no longer waits for its client to read: api/outbox.py).
    together, banned = threading.Barrier(len(PROMPTS)), eos_ids(fixture_dir / MODEL)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: stream(fleet.router, p, LONG, together=together,
                                               banned=banned), PROMPTS))
    assert all(texts), texts
    after = {n["id"]: n["dispatched"] for n in fleet.stats()["nodes"]}
    spread = {k: after[k] - before.get(k, 0) for k in after}
    assert len(spread) == 2 and all(v > 0 for v in spread.values()), spread


def test_a_node_of_the_file_is_refused_without_the_secret_or_beside_a_contradicting_flag(
        daemons: Daemons, fixture_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(f'[cluster]\nmodel = "{fixture_dir / MODEL}"\n'
                    '[[nodes]]\nid = "r"\naddress = "127.0.0.1:19000"\nrole = "router"\n'
                    '[[nodes]]\nid = "h"\naddress = "127.0.0.2:19000"\nrole = "hybrid"\n')
    d = daemons.make(FAST_POLICY, name="fno")
    for flags, said in (
            (("--node-id", "h"), f"{path}: node 'h' (hybrid) needs the cluster secret"),
            (("--node-id", "h", "--kv-compression", "int8"),
             f"--kv-compression (int8) contradicts --distributed-config: {path}: node 'h' "
             "says kv_compression = none")):
        seen = len(d.stderr())
        d.start("--distributed-config", str(path), *flags, wait=False)
        assert d.proc is not None
        assert d.proc.wait(timeout=60) == 2, d.stderr()[seen:]
        out = d.stderr()[seen:]
        assert said in out and "Traceback" not in out, out
