"""`mlxctl drain` and `undrain` on a real daemon serving the tiny fixture to the real `openai`
client: under a continuous load of streaming requests a drain with a generous deadline
fails none of them (new ones are refused 503 "draining", with Retry-After, until the
undrain); `--force` ends running streams with a clear error; the drain survives a
restart of the daemon; a drain of a node nobody knows is refused naming it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from mlxceld.control.clients.typed import ControlClient

from helpers.daemons import READY_S, Daemons
from helpers.models import PROMPT
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

CLIENTS = 4
LOAD_S = 4.0  # each phase: before the drain, while drained, after the undrain
LONG_PROMPT = "Once upon a time"  # the tiny fixture: no EOS within 1500 greedy tokens


@dataclass
class Load:
    """``CLIENTS`` threads streaming completions back to back until ``stop``."""

    url: str
    max_tokens: int = 48
    prompt: str = PROMPT
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    completed: int = 0
    refused: int = 0  # 503 "draining" with Retry-After, before anything was streamed
    failed: list[str] = field(default_factory=list)
    streaming: int = 0  # streams begun and not ended

    def run(self) -> None:
        with client(self.url) as c:
            while not self.stop.is_set():
                with self.lock:
                    self.sent += 1
                self.one(c)

    def one(self, c: openai.OpenAI) -> None:
        begun = False
        try:
            stream = c.completions.create(model="llama", prompt=self.prompt, stream=True,
                                          max_tokens=self.max_tokens, temperature=0)
            with self.lock:
                self.streaming += 1
            begun = True
            finish = None
            for chunk in stream:
                finish = chunk.choices[0].finish_reason or finish
            outcome = "completed" if finish else "failed: no finish_reason"
        except openai.APIStatusError as exc:
            body = exc.response.json()["error"] if exc.status_code == 503 else {}
            outcome = ("refused" if body.get("code") == "draining"
                       and exc.response.headers.get("retry-after") else f"failed: {exc}")
        except openai.APIError as exc:
            outcome = f"failed: {exc}"
        with self.lock:
            if begun:
                self.streaming -= 1
            if outcome == "completed":
                self.completed += 1
            elif outcome == "refused":
                self.refused += 1
            else:
                self.failed.append(outcome)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"sent": self.sent, "completed": self.completed, "refused": self.refused,
                    "failed": len(self.failed)}


@pytest.mark.slow
def test_a_drain_under_streaming_load_fails_no_request(daemons: Daemons,
                                                       fixture_dir: Path) -> None:
    port = free_port()
    d = daemons.make().start("--model", str(fixture_dir / "llama"), "--port", str(port))
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    node = d.status()["daemon"]["node_id"]
    load = Load(f"http://127.0.0.1:{port}/v1")
    threads = [threading.Thread(target=load.run) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(LOAD_S)
        before = load.counts()
        drained = d.ctl("drain", "--deadline", "60s", "--json", timeout=90)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        row = json.loads(drained.stdout)["drain"]
        assert row["node_id"] == node and row["state"] == "drained" and row["ended"] == 0
        time.sleep(LOAD_S)  # drained: every new request is refused
        during = load.counts()
        assert during["refused"] > before["refused"]
        undrained = d.ctl("undrain")
        assert undrained.returncode == 0 and "undrained (was drained)" in undrained.stdout
        time.sleep(LOAD_S)
    finally:
        load.stop.set()
        for t in threads:
            t.join(60)
    after = load.counts()
    print(f"\ndrain under load ({CLIENTS} streaming clients): before the drain {before}, "
          f"while drained {during}, at the end {after}; the drain: {row}")
    assert load.failed == [], load.failed[:3]
    assert after["completed"] > during["completed"] > 0  # the undrain admits again
    kinds = [e["kind"] for e in d.events() if e["subject"] == node]
    assert kinds[-3:] == ["drain.started", "drain.drained", "drain.ended"]


def test_force_ends_running_streams_and_the_drain_survives_a_restart(
        daemons: Daemons, fixture_dir: Path) -> None:
    port = free_port()
    d = daemons.make().start("--model", str(fixture_dir / "llama"), "--port", str(port))
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    url = f"http://127.0.0.1:{port}/v1"
    # Greedy from this prompt, the tiny fixture runs to max_tokens (mlx-lm's own
    # generation: 1500 tokens in 3.5 s, alone): the streams run until the drain ends them.
    load = Load(url, max_tokens=1900, prompt=LONG_PROMPT)
    threads = [threading.Thread(target=load.one, args=(client(url),))
               for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    wait_for(lambda: load.streaming == CLIENTS, 60, "every stream to begin")
    forced = d.ctl("drain", "--force", timeout=60)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert f"{CLIENTS} ended at the deadline" in forced.stdout
    for t in threads:
        t.join(30)
    assert len(load.failed) == CLIENTS  # each ended, with the drain's own words
    assert all("drain_deadline" in f or "drain reached its deadline" in f
               for f in load.failed), load.failed
    print(f"\ndrain --force: {load.counts()}; {forced.stdout.strip()}")

    assert d.terminate() == 0  # its router stops too; a new one is started below
    d.start("--model", str(fixture_dir / "llama"), "--port", str(port))
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    assert [r["state"] for r in d.api(lambda c: c.drains())["drains"]] == ["drained"]
    with client(url) as c:
        def refused() -> bool:
            try:
                c.completions.create(model="llama", prompt=PROMPT, max_tokens=2)
            except openai.APIStatusError as exc:
                return exc.status_code == 503 and "draining" in exc.message
            return False

        wait_for(refused, 10, "the restarted router to refuse: the node is drained")
        assert d.ctl("undrain").returncode == 0
        wait_for(lambda: not refused(), 10, "the router to admit again")


PAIRS = 200


def test_an_undrain_right_after_a_drain_always_wins(daemons: Daemons,
                                                    fixture_dir: Path) -> None:
    """``POST /v1/drain`` then ``POST /v1/undrain`` back to back, ``PAIRS`` times: the
    undrain is the later operator action, so the node ends undrained every time (no row
    shortly after; before the fix, the drain's push brought the row back as drained in
    most pairs), and the router admits at the end."""
    port = free_port()
    d = daemons.make().start("--model", str(fixture_dir / "llama"), "--port", str(port))
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])

    async def pairs(c: ControlClient) -> list[int]:
        left = []
        for i in range(PAIRS):
            await c.drain(None)
            await c.undrain(None)
            await asyncio.sleep(0.03)  # the push that was asking the router has answered
            if (await c.drains())["drains"]:
                left.append(i)
        return left

    assert d.api(pairs) == []
    time.sleep(1.0)  # two pushes (PUSH_EVERY_S)
    assert d.api(lambda c: c.drains())["drains"] == []
    with client(f"http://127.0.0.1:{port}/v1") as c:
        done = c.completions.create(model="llama", prompt=PROMPT, max_tokens=2)
    assert done.choices[0].text is not None


def test_a_drain_of_a_node_nobody_knows_is_refused_naming_it(daemons: Daemons) -> None:
    """`mlxctl drain` of a node this daemon does not know (not its own, none its router
    needs, no peer of its cluster) is refused: exit 1, ``unknown_node``, naming the node
    and the nodes it knows; nothing is recorded, so it is never said to be drained. Its
    own node, named the same way, is drained (no router runs here: at once)."""
    d = daemons.make().start()
    node = d.status()["daemon"]["node_id"]
    refused = d.ctl("drain", "ghost", "--json")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "unknown_node"
    assert "'ghost'" in error["message"] and node in error["message"], error
    said = d.ctl("drain", "ghost")
    assert said.returncode == 1 and "no node 'ghost' is known here" in said.stderr
    assert "drained" not in said.stdout + said.stderr
    assert d.ctl("undrain", "ghost").returncode == 1  # nor undrained: it was never drained
    assert d.api(lambda c: c.drains())["drains"] == []
    assert [e["kind"] for e in d.events() if e["kind"].startswith("drain.")] == []
    own = d.ctl("drain", node, "--json")
    assert own.returncode == 0, own.stdout + own.stderr
    assert json.loads(own.stdout)["drain"]["state"] == "drained"
