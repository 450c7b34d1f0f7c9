"""A stage worker does not hold the sequences of a router that went silent: a real ``stage``
worker subprocess (the whole 4-layer fixture as one stage, fed its bootstrap as the
supervisor does) and a stand-in router in a subprocess of its own (an MXCL client dialing
from the coordinator's address: attach, prepare, then read). The router is stopped with
SIGSTOP (no RST, its socket stays open): the stage frees its sequence within the bound
(``silence_s``), saying why in its log; SIGCONT, and the router finds its link gone,
re-dials and prepares again, as the pipeline engine does after any lost link."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.models.identity import model_identity
from mlxceld.roles.options import StageOptions
from mlxceld.supervisor import channel
from mlxceld.supervisor.process import WorkerSpec, child_environment
from mlxceld.types import JSON

from helpers.ports import free_port
from helpers.waiting import wait_for
from helpers.workerops import Op

SECRET = b"stage-silence-test-secret-0123456789"
SILENCE_S = 1.0
SLACK_S = 1.5  # a loaded machine: the loop's timers and this test's polling
WAIT_S = 60.0  # generous: a worker loading its model on a busy CPU
RELEASED = "released 1 sequences of 127.0.0.1:"
RUNS = 3

ROUTER = textwrap.dedent("""
    import asyncio, sys
    from mlxceld.net import ConnectionClosed, connect
    from mlxceld.pipeline import protocol as p
    from mlxceld.wire import Keyring, encode_envelope, parse_envelope

    host, port, me, model, secret, runs = sys.argv[1:]
    ring = Keyring()
    ring.add(secret.encode())

    async def ask(stream, header):
        await stream.send(encode_envelope(header))
        answer = parse_envelope(await stream.recv(), p.ENGINE_SPECS).header
        assert answer["t"] != "error", answer
        return answer

    async def prepared():
        stream = await connect(host, int(port), keyring=ring, identity=me, channel=1,
                               local_addr=("127.0.0.1", 0), budget_s=10)
        await ask(stream, {"t": "attach", "model": model, "cluster": "test"})
        await ask(stream, {"t": "prepare", "seq": "s1", "params": {
            "max_tokens": 4, "temperature": 0, "top_p": 1, "top_k": 0, "seed": None,
            "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0,
            "repetition_penalty": 1, "logit_bias": [], "logprobs": None}})
        return stream

    async def main():
        for _ in range(int(runs)):
            stream = await prepared()
            print("prepared", flush=True)
            try:
                while True:
                    await stream.recv()  # pings answered on the way
            except ConnectionClosed as exc:
                print(f"closed: {exc.kind}", flush=True)
        stream = await prepared()
        print("prepared again", flush=True)
        await stream.close()

    asyncio.run(main())
""")


class StageWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        for d in (spec.control_socket.parent, spec.log_path.parent):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        with spec.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxceld.workers", "--role", spec.role,
                 "--name", spec.name], stdin=subprocess.PIPE, stdout=out, stderr=out,
                cwd=spec.state_dir, env=child_environment(), start_new_session=True)
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(json.dumps(spec.bootstrap()).encode())

    def call(self, op: str) -> JSON:
        try:
            return asyncio.run(channel.call(self.spec.control_socket, Op(op), timeout_s=2.0))
        except Exception:  # not up yet
            return {}

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.call("stats").get("stats", {})
        return stats

    def log(self) -> str:
        return self.spec.log_path.read_text(errors="replace")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.mark.slow
def test_a_silent_router_loses_its_sequences_and_prepares_again(
        split_fixture_dir: Path, state_dir: Path, processes: list[subprocess.Popen[Any]]
) -> None:
    model = split_fixture_dir / "llama"
    port, coordinator = free_port("127.0.0.2"), f"127.0.0.1:{free_port('127.0.0.1')}"
    identity = model_identity(model)
    options = StageOptions(
        model=str(model), layers=(0, 4), node_id="stage-0", rank=0,
        address=f"127.0.0.2:{port}", coordinator=coordinator, upstream=None,
        downstream=None, first=None, last=None, model_identity=identity, cluster="test",
        silence_s=SILENCE_S)
    stage = StageWorker(WorkerSpec("stage", state_dir, options, secret=SECRET))
    processes.append(stage.proc)
    wait_for(lambda: stage.call("health").get("state") == "ready" or stage.proc.poll(),
             WAIT_S, "the stage worker ready")
    assert stage.proc.poll() is None, stage.log()

    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, "127.0.0.2", str(port), coordinator, identity,
         SECRET.decode(), str(RUNS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    processes.append(router)
    assert router.stdout is not None
    took: list[float] = []
    for run in range(RUNS):
        assert router.stdout.readline().strip() == "prepared", router.stdout.read()
        wait_for(lambda: stage.stats().get("sequences") == 1, WAIT_S, "the sequence held")
        os.kill(router.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda run=run: stage.log().count(RELEASED) > run, WAIT_S,
                     "the stage to free the sequence", every=0.02)
            took.append(time.monotonic() - stopped)
            wait_for(lambda: stage.stats().get("sequences") == 0, WAIT_S, "no sequence held")
        finally:
            os.kill(router.pid, signal.SIGCONT)
        # Back: the router's link is gone; it dials again and prepares afresh.
        assert router.stdout.readline().strip() == "closed: abort"
    print(f"\nthe stopped router's sequence freed after (bound {SILENCE_S:g} s), {RUNS} "
          f"runs: p50 {statistics.median(took):.2f} s, max {max(took):.2f} s")
    line = next(x for x in stage.log().splitlines() if RELEASED in x)
    assert "(connection closed (silent): nothing heard for" in line, line
    assert "is silent: nothing heard from 127.0.0.1:" in stage.log()
    assert all(t <= SILENCE_S + SLACK_S for t in took), took
    assert router.stdout.readline().strip() == "prepared again"
    assert router.wait(timeout=WAIT_S) == 0
