"""`mlxctl secret rotate` under a continuous load through a real 2-stage pipeline (issue 16:
rotation under load, with nothing lost): coordinator on 127.0.0.1, stages on .2 and .3,
brought up by `mlxctl cluster activate`, ``CLIENTS`` real `openai` clients streaming
completions back to back from before the rotation to ``AFTER_S`` after it. No request
fails, every completion is mlx-lm's greedy text (one long stream, begun before the
rotation, included: it moved to the new key's stream without a pause), the rotation is
done and every member (and every worker) holds only the new key: the links handed over
to the new primary at ``use`` (pipeline/links.py, net/redialer.py), so that removing
the old key cut nothing."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxceld.wire.secret import key_id

from helpers.cluster import POLL_WAIT_S, activate, agent, settled, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.models import PROMPT, eos_ids, expected
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

CLIENTS = 3
TOKENS = 24
LONG_PROMPT = "Once upon a time"
# One stream begun before the rotation, read to its end after it. Its reader stops after
# the first chunk, but the router writes the rest into the socket's buffers and ends the
# sequence as fast as the stages decode: it must outlast the rotation (about 2 s) at the
# tiny pipeline's speed under load. Its end-of-sequence tokens are banned (logit_bias),
# so that it runs all LONG_TOKENS: the fixture's greedy text ends by itself after about
# 145 tokens, which ended before the rotation twice (CI, 2026-12-01 and 2026-12-06).
LONG_TOKENS = 1500
BEFORE_S = 1.5  # load before the rotation starts
AFTER_S = 2.0  # load after it is done, over the links made under the new key
ROTATE_S = 120.0  # the CLI's own deadline is longer; a healthy rotation takes seconds


@dataclass
class Load:
    """``CLIENTS`` threads streaming the same greedy completion back to back until ``stop``;
    each text that came back, and each failure in words."""

    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    texts: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    long: list[str] = field(default_factory=list)
    long_began: threading.Event = field(default_factory=threading.Event)
    rotated: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with client(self.url) as c:
            while not self.stop.is_set():
                self.texts_append(self.one(c, PROMPT, TOKENS))

    def run_long(self, banned: list[int]) -> None:
        with client(self.url) as c:
            text = self.one(c, LONG_PROMPT, LONG_TOKENS, self.long_began,
                            {str(t): BAN for t in banned})
        if text is not None:
            self.long.append(text)

    def one(self, c: openai.OpenAI, prompt: str, tokens: int,
            began: threading.Event | None = None,
            bias: dict[str, int] | None = None) -> str | None:
        """One streamed completion's text; None (and the failure noted) if it failed."""
        with self.lock:
            self.sent += 1
        try:
            stream = c.completions.create(model="llama", prompt=prompt, stream=True,
                                          max_tokens=tokens, temperature=0,
                                          logit_bias=bias or {})
            parts, finish = [], None
            for chunk in stream:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                if began is not None and not began.is_set():  # the long one: its sequence
                    began.set()  # stays on the router until read, so it spans the rotation
                    self.rotated.wait(ROTATE_S)
            if finish:
                return "".join(parts)
            why = "no finish_reason"
        except openai.APIError as exc:
            why = str(exc)
        with self.lock:
            self.failed.append(why)
        return None

    def texts_append(self, text: str | None) -> None:
        if text is not None:
            with self.lock:
                self.texts.append(text)


BAN = -100  # OpenAI's logit_bias floor: the token is never chosen


def endless(model: Path, prompt: str, n: int) -> tuple[str, list[int]]:
    """mlx-lm's greedy text for ``prompt`` with the end-of-sequence tokens banned (``n``
    tokens exactly), and those tokens: logit_bias is additive, as in OpenAI's definition."""
    m, tok = mlx_lm.load(str(model))[:2]
    banned = eos_ids(model)
    processors = make_logits_processors(logit_bias={t: BAN for t in banned})
    parts = list(mlx_lm.stream_generate(m, tok, prompt, max_tokens=n,
                                        logits_processors=processors))
    assert parts[-1].generation_tokens == n, parts[-1]  # no end of sequence came
    return "".join(p.text for p in parts), banned


def keys(d: DaemonProc) -> dict[str, str]:
    return {k["key_id"]: k["state"] for k in d.api(lambda c: c.secrets())["keys"]}


@pytest.mark.slow
def test_rotation_under_load_fails_no_request(daemons: Daemons,
                                               split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    old = b"5a" * 16
    peers = [start(daemons, f"127.0.0.{i}", old, "--pp-peer", "--model", str(model),
                   name=f"p{i}") for i in (2, 3)]
    port = free_port("127.0.0.1")
    coord = start(daemons, "127.0.0.1", old, "--cluster-peers",
                  ",".join(agent(p) for p in peers), "--port", str(port), name="c")
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
    activate(coord, model, 2)
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(coord.worker("router")["pid"])
    greedy = expected(model, PROMPT, TOKENS)
    long_greedy, banned = endless(model, LONG_PROMPT, LONG_TOKENS)

    load = Load(f"http://127.0.0.1:{port}/v1")
    threads = [threading.Thread(target=load.run) for _ in range(CLIENTS)]
    threads.append(threading.Thread(target=load.run_long, args=(banned,)))
    for t in threads:
        t.start()
    try:
        time.sleep(BEFORE_S)
        assert load.long_began.wait(30)
        began = time.monotonic()
        done = coord.ctl("secret", "rotate", "--json", timeout=ROTATE_S)
        took = time.monotonic() - began
        load.rotated.set()
        sent_by_then = load.sent
        time.sleep(AFTER_S)
    finally:
        load.rotated.set()
        load.stop.set()
        for t in threads:
            t.join(60)
    print(f"\nrotation under load ({CLIENTS} streaming clients, {TOKENS} tokens each, and one "
          f"of {LONG_TOKENS} tokens open from before the rotation to after it): sent "
          f"{load.sent} ({sent_by_then} by the rotation's end, which took {took:.1f} s), "
          f"completed {len(load.texts) + len(load.long)}, failed {len(load.failed)}")
    assert done.returncode == 0, (done.stdout, done.stderr, coord.stderr()[-3000:])
    assert load.failed == [], load.failed[:3]
    assert load.texts and all(t == greedy for t in load.texts), \
        [t for t in load.texts if t != greedy][:2]
    assert load.long == [long_greedy]
    rotation = json.loads(done.stdout)["rotation"]
    assert rotation["step"] == "done"
    new_id = rotation["new_key_id"]
    assert rotation["old_key_id"] == key_id(old).hex() != new_id
    only_new = {"primary": new_id, "ids": [new_id]}
    for d, worker in ((coord, "router"), *((p, "stage") for p in peers)):
        assert keys(d) == {new_id: "primary"}, d.root
        wait_for(lambda d=d, w=worker: d.worker(w).get("keys") == only_new, 20,
                 f"{worker} of {d.root.name} on the new key only")
    cut = [line for d in (coord, *peers) for line in d.stderr().splitlines()
           if "still use it after" in line]
    assert cut == []  # the removal cut no stream: every one had been handed over
    logs = {name: (d.state_dir / "logs" / f"{worker}.log").read_text()
            for name, d, worker in (("router", coord, "router"), ("stage-0", peers[0], "stage"),
                                    ("stage-1", peers[1], "stage"))}
    assert f"handed over to key {new_id}" in logs["router"]  # router -> stage-0, stage-1
    moved = [int(n) for n in re.findall(r"sequence\(s\) on the stream under key \w+, (\d+) "
                                        "move over", logs["router"])]
    assert len(moved) == 2 and min(moved) >= 1, moved  # the long one at least, on each link
    assert f"handed the next stage over to a stream under key {new_id}" in logs["stage-0"]
    assert f"handed the first stage over to a stream under key {new_id}" in logs["stage-1"]
