"""`mlxctl secret rotate` under a long stream through a router over a replica, and through a
disaggregating router over a prefill and a decode node (issue 31: rotation hands over
replica and disaggregated sequences however long they run). Real daemons on 127.0.0.x
started as a service manager starts them (``helpers.deploy.Host``), the tiny llama
fixture, the real ``openai`` client with retries off.

Each member waits at most ``HANDOVER_S`` (``MLXCELD_TEST_HANDOVER_S``, instead of 30 s)
for its streams under the old key to be handed over before it removes that key; the
long stream (``LONG_TOKENS``, end-of-sequence banned) is still running then. Its
sequence moved to the router's stream under the new key (``adopt``), so the removal cut
nothing: the stream completes with every token, its text mlx-lm's greedy one, a short
load beside it loses no request, and afterwards every worker holds only the new key
and the router's links run on it (a request after the rotation is served). Every
process is ended by pid at the end (``Daemons.end``)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxceld.models import preset, write_fixture
from mlxceld.wire.secret import key_id

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.load import StreamingLoad
from helpers.models import eos_ids
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

OLD = b"the rotation under replicas' old secret, 44"
MODEL = "llama"
LONG_PROMPT = "Once upon a time"
# The long stream must outlast the rotation's start, use and the removal's wait (a few
# seconds on a loaded machine): the tiny llama with twice its preset's context (2048),
# run to near its end (about 10 s on a 2-CPU box, 30 s under the suite's load).
CONTEXT = 4096
LONG_TOKENS = 4000
BAN = -100  # OpenAI's logit_bias floor: the token is never chosen
HANDOVER_S = "2"  # each member's wait for the old key's streams to be handed over (30 s)
ENV = {"MLXCELD_TEST_HANDOVER_S": HANDOVER_S}
CLIENTS = 1  # the short load beside the long stream (few threads: the long one keeps up)
ROTATE_S = 120.0  # the CLI's own deadline is longer; a healthy rotation takes seconds


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama checkpoint with a context of ``CONTEXT`` tokens."""
    path = tmp_path_factory.mktemp("long-context") / MODEL
    write_fixture(path, preset("tiny", family=MODEL, context=CONTEXT))
    return path


def node(daemons: Daemons, name: str, model: Path, ip: str, **serve: Any) -> Host:
    """A serving host on ``ip`` (its agent, serving listener and OpenAI port there)."""
    host = Host(daemons, name, secret=OLD,
                serve={"model": str(model), "host": ip, "port": free_port(ip),
                       "max_batch": 4, "serving_port": free_port(ip), **serve})
    host.daemon_keys["agent_addr"] = f"{ip}:{host.agent_port}"
    host.write()
    return host


def agent(host: Host) -> str:
    return str(host.daemon_keys["agent_addr"])


def router(daemons: Daemons, model: Path, members: list[Host], **serve: Any) -> Host:
    """The router on 127.0.0.1, its rotation's members ``members`` (``cluster_peers``)."""
    host = Host(daemons, "r", secret=OLD,
                daemon={"cluster_peers": [agent(m) for m in members]},
                serve={"model": str(model), "port": free_port("127.0.0.1"),
                       "node_role": "router", "max_batch": 8, **serve})
    host.daemon_keys["agent_addr"] = f"127.0.0.1:{host.agent_port}"
    host.write()
    return host


def url(host: Host) -> str:
    return f"http://127.0.0.1:{host.serve_keys['port']}/v1"


def up(r: Host) -> int:
    stats = httpx.get(f"{url(r)[:-3]}/router/stats", timeout=10).json()
    return sum(n["state"] == "up" for n in stats["nodes"])


def endless(model: Path, prompt: str, n: int) -> tuple[str, list[int]]:
    """mlx-lm's greedy text for ``prompt`` with the end-of-sequence tokens banned (``n``
    tokens exactly), and those tokens."""
    m, tok = mlx_lm.load(str(model))[:2]
    banned = eos_ids(model)
    processors = make_logits_processors(logit_bias={t: BAN for t in banned})
    parts = list(mlx_lm.stream_generate(m, tok, prompt, max_tokens=n,
                                        logits_processors=processors))
    assert parts[-1].generation_tokens == n, parts[-1]
    return "".join(p.text for p in parts), banned


@dataclass
class Long:
    """One long stream, read as it comes: its text, tokens (usage), and how it ended."""

    url: str
    banned: list[int]
    began: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    failed: str | None = None
    took_s: float = 0.0

    def run(self) -> None:
        start = time.monotonic()
        parts: list[str] = []
        try:
            with roomy(self.url) as c:
                stream = c.completions.create(
                    model=MODEL, prompt=LONG_PROMPT, stream=True, max_tokens=LONG_TOKENS,
                    temperature=0, logit_bias={str(t): BAN for t in self.banned},
                    stream_options={"include_usage": True})
                for chunk in stream:
                    self.began.set()
                    if chunk.usage is not None:
                        self.tokens = chunk.usage.completion_tokens
                    if chunk.choices:
                        parts.append(chunk.choices[0].text)
                        self.finish = chunk.choices[0].finish_reason or self.finish
        except openai.APIError as exc:
            self.failed = str(exc)
        finally:
            self.began.set()
            self.text = "".join(parts)
            self.took_s = time.monotonic() - start


def roomy(url: str) -> openai.OpenAI:
    """A client whose socket holds up to 4 MiB unread (``SO_RCVBUF``): the fixture decodes
    the long stream at hundreds of tokens/s, so a reading thread descheduled for a moment
    on a loaded machine would lag past the router's outbox and be cut as a slow reader
    (``api/outbox.py``); a real model's stream gives any client tens of seconds."""
    transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF,
                                                     4 << 20)])
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=transport, timeout=60))


def rotate_under_a_long_stream(r: Host, members: list[Host], model: Path) -> None:
    """The scenario and its assertions (see the module doc), on router ``r``."""
    greedy, banned = endless(model, LONG_PROMPT, LONG_TOKENS)
    long = Long(url(r), banned)
    reading = threading.Thread(target=long.run)
    with StreamingLoad(url(r), clients=CLIENTS, model=MODEL) as load:
        reading.start()
        try:
            assert long.began.wait(60), "the long stream's first chunk"
            began = time.monotonic()
            done = r.d.ctl("secret", "rotate", "--json", timeout=ROTATE_S)
            took = time.monotonic() - began
            running_at_end = reading.is_alive()
        finally:
            reading.join(120)
    counts = load.counts()
    print(f"\nrotation ({took:.1f} s) under a {LONG_TOKENS}-token stream (running when it "
          f"ended: {running_at_end}; {long.took_s:.1f} s; {long.tokens} tokens, finish "
          f"{long.finish}, failed {long.failed!r}) and {CLIENTS} short streaming clients: "
          f"{counts}")
    assert done.returncode == 0, (done.stdout, done.stderr, r.d.stderr()[-3000:])
    assert running_at_end  # the long stream outlasted the old key's removal
    assert long.failed is None and long.finish == "length", (long.failed, long.finish)
    assert long.tokens == LONG_TOKENS and long.text == greedy
    assert (load.refused, load.failed) == ([], []), (load.refused[:3], load.failed[:3])
    rotation = json.loads(done.stdout)["rotation"]
    new_id = rotation["new_key_id"]
    assert rotation["step"] == "done" and rotation["old_key_id"] == key_id(OLD).hex()
    only_new = {"primary": new_id, "ids": [new_id]}
    for d in (r.d, *(m.d for m in members)):
        wait_for(lambda d=d: d.worker("router").get("keys") == only_new, 20,
                 f"the worker of {d.root.name} on the new key only")
    cut = [line for d in (r.d, *(m.d for m in members)) for line in d.stderr().splitlines()
           if "still use it after" in line]
    assert cut == []  # the removal cut no stream: every one had been handed over
    log = (r.d.state_dir / "logs" / "router.log").read_text()
    moved = [int(n) for n in re.findall(rf"handed over to key {new_id}; (\d+) sequence\(s\) "
                                        "move over", log)]
    assert moved and max(moved) >= 1, moved  # the long one at least, on its decode link
    with client(url(r)) as c:  # the links run on the new key
        after = c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8,
                                     temperature=0)
    assert after.choices[0].text == greedy[:len(after.choices[0].text)] != ""


def started(hosts: list[Host]) -> None:
    for h in hosts:
        h.d.start_service(env=ENV)
    for h in hosts:
        h.d.wait_worker("router", READY_S, state="running")


@pytest.mark.slow
def test_a_replicas_long_sequence_outlasts_the_old_key(long_context: Path) -> None:
    daemons = Daemons()
    model = long_context
    try:
        replica = node(daemons, "ra", model, "127.0.0.2")
        r = router(daemons, model, [replica], replicas=[agent(replica)])
        started([replica, r])
        wait_for(lambda: up(r) == 1, 60, "the replica up behind the router")
        rotate_under_a_long_stream(r, [replica], model)
    finally:
        daemons.end()


@pytest.mark.slow
def test_a_decode_nodes_long_sequence_outlasts_the_old_key(long_context: Path) -> None:
    daemons = Daemons()
    model = long_context
    try:
        prefill = node(daemons, "p", model, "127.0.0.3", node_role="prefill")
        decode = node(daemons, "d", model, "127.0.0.4", node_role="decode",
                      prefill_peers=[agent(prefill)])
        r = router(daemons, model, [prefill, decode], prefill_peers=[agent(prefill)],
                   decode_peers=[agent(decode)])
        started([prefill, decode, r])
        wait_for(lambda: up(r) == 2, 60, "the prefill and decode nodes up behind the router")
        rotate_under_a_long_stream(r, [prefill, decode], model)
    finally:
        daemons.end()
