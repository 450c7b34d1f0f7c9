"""A tensor-parallel group's rank that goes silent or dies, for real (``engine/heartbeats.py``):
one daemon with ``[serve] tp_size = 2`` over tiny llama (the router rank 0, ``tp-1`` rank
1). A stream in flight when ``tp-1`` is stopped (SIGSTOP) ends with an SSE error event
naming the rank within the pipeline's bound for a silent stage (3 s), ``/ready`` is 503
naming it and a new request 503 with Retry-After while it is; when ``tp-1`` is killed
(SIGKILL) the stream ends with the group's error too, not a cut connection. Streams are
read with httpx (an SSE error event is what is asserted). One daemon for the module;
``tp-1`` is continued and every process ended by pid at the end."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import Daemons
from helpers.deploy import Host
from helpers.models import eos_ids
from helpers.ports import free_port
from helpers.waiting import wait_for

BOUND_S = 3.0  # heartbeats.SILENCE_S: the pipeline's stage_silence_s default
SLACK_S = 2.0  # a loaded machine's scheduling on top of it
BACK_S = 90.0  # a restarted group serves again within this (see test_tensor_group.py)
# tp-1's failed health probes restart the group: 4 probes, each every 0.5 s and up to 2 s
# unanswered, ~10 s after the stop: the checks of the silent group fit before that.
LIVENESS_FAILURES = 4


@dataclass
class Group:
    host: Host
    daemons: Daemons
    url: str
    banned: dict[str, int]  # the fixture's end-of-sequence ids, biased away

    def pids(self) -> dict[str, int | None]:
        workers = {w["name"]: w for w in self.host.d.status()["workers"]}
        return {n: workers[n]["pid"] if workers[n]["state"] == "running" else None
                for n in ("router", "tp-1")}

    def serving(self) -> dict[str, int]:
        """Both ranks running and the group answering a request (within ``BACK_S``)."""
        def answered() -> dict[str, int] | None:
            pids = self.pids()
            if not all(pids.values()):
                return None
            try:
                ok = httpx.post(f"{self.url}/completions", timeout=30, json={
                    "model": "llama", "prompt": "Hi", "max_tokens": 2}).status_code == 200
            except httpx.HTTPError:
                return None
            return {n: int(p) for n, p in pids.items() if p} if ok else None
        pids: dict[str, int] = wait_for(answered, BACK_S, "the group serving", every=0.5)
        self.daemons.pids |= set(pids.values())
        return pids


@pytest.fixture(scope="module")
def group(fixture_dir: Path) -> Iterator[Group]:
    daemons = Daemons()
    try:
        port = free_port("127.0.0.1")
        host = Host(daemons, "tp", secret=None,
                    serve={"model": str(fixture_dir / "llama"), "port": port, "tp_size": 2})
        text = host.d.config.read_text()
        host.d.config.write_text(text.replace(
            "health_interval_s = 0.5", f"health_interval_s = 0.5\nliveness_failures = "
            f"{LIVENESS_FAILURES}", 1))
        host.start()
        banned = {str(t): -100 for t in eos_ids(fixture_dir / "llama")}
        g = Group(host, daemons, f"http://127.0.0.1:{port}/v1", banned)
        g.serving()
        yield g
    finally:
        daemons.end()


def stream_until_error(g: Group, pid: int, sig: signal.Signals
                       ) -> tuple[dict[str, Any] | None, float, str]:
    """A long stream; after its first tokens ``pid`` gets ``sig``. The SSE error event
    (None: the stream ended without one), how long after the signal the stream ended,
    and how it ended."""
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{g.url}/completions",
            json={"model": "llama", "prompt": "Hello", "max_tokens": 1500, "temperature": 0,
                  "stream": True, "logit_bias": g.banned}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        os.kill(pid, sig)
        signalled = time.monotonic()
        try:
            for line in lines:
                if line.startswith("data: {") and '"error"' in line:
                    return (json.loads(line.removeprefix("data: ")),
                            time.monotonic() - signalled, "an error event")
        except httpx.HTTPError as exc:
            return None, time.monotonic() - signalled, f"cut: {exc!r}"
    return None, time.monotonic() - signalled, "ended without an error event"


def test_a_stopped_rank_is_named_within_the_bound_and_ready_says_so(group: Group) -> None:
    pids = group.serving()
    try:
        error, took, how = stream_until_error(group, pids["tp-1"], signal.SIGSTOP)
        print(f"\nSIGSTOP of tp-1: the stream ended after {took:.2f} s with {how}")
        assert error is not None, how
        body = error["error"]
        assert body["code"] == "engine_unavailable", body
        assert str(body["message"]).startswith(
            "tensor-parallel rank 1 (worker tp-1) is silent: nothing heard from it for 3 s"), body
        assert took < BOUND_S + SLACK_S, took
        ready = httpx.get(f"{group.url.removesuffix('/v1')}/ready", timeout=10)
        assert ready.status_code == 503, ready.text
        assert "tensor-parallel rank 1 (worker tp-1) is silent" in ready.json()["reason"]
        refused = httpx.post(f"{group.url}/completions", timeout=10, json={
            "model": "llama", "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert "tensor-parallel rank 1 (worker tp-1) is silent" in refused.text
    finally:
        if pids["tp-1"] in group.pids().values():
            os.kill(pids["tp-1"], signal.SIGCONT)
    after = group.serving()  # the probes restarted the group, or tp-1 beat again
    assert httpx.get(f"{group.url.removesuffix('/v1')}/ready", timeout=10).status_code == 200
    assert after["router"] != pids["router"] or after["tp-1"] == pids["tp-1"]


def test_a_killed_rank_ends_the_stream_with_the_groups_error(group: Group) -> None:
    pids = group.serving()
    error, took, how = stream_until_error(group, pids["tp-1"], signal.SIGKILL)
    print(f"\nSIGKILL of tp-1: the stream ended after {took:.2f} s with {how}")
    assert error is not None, how
    body = error["error"]
    assert body["code"] == "engine_unavailable", body
    assert str(body["message"]).startswith("the tensor-parallel group broke: "), body
    assert "tensor-parallel rank 1 (worker tp-1) is gone" in body["message"] \
        or "[ring]" in body["message"], body
    assert took < BOUND_S + SLACK_S, took
    group.serving()
