"""SIGTERM of a pipeline stage worker drains it (workers/stage.py, StageService.drain):
the stream it serves completes with mlx-lm's greedy text, a new request meanwhile is
refused with 503 naming the stage (and ``/ready`` says it drains), and the worker then
exits cleanly; a stage of the
running pipeline, it is started again by its daemon. Real daemons on 127.0.0.x
(tests/helpers/pipeline.py), the real `openai` client."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.daemons import READY_S, Daemons, alive
from helpers.models import PROMPT, expected
from helpers.pipeline import start_pipeline
from helpers.router import client
from helpers.waiting import wait_for

LONG_PROMPT = "Hello"  # greedy on the llama split fixture: no end-of-sequence for 800+ tokens
TOKENS = 300  # long enough to outlast the refused request, short enough for the drain


@pytest.mark.slow
def test_sigterm_of_a_stage_drains_its_stream_and_refuses_new_requests(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
    victim = pipe.stages[1].worker("stage")
    parts: list[str] = []
    refused: openai.APIStatusError | None = None
    with client(pipe.url) as c, client(pipe.url) as other:

        def refused_while_draining() -> openai.APIStatusError | None:
            try:  # served while the signal is on its way; refused once the stage drains
                other.completions.create(model="llama", prompt=PROMPT, max_tokens=2,
                                         temperature=0)
            except openai.APIStatusError as exc:
                return exc
            return None

        stream = c.completions.create(model="llama", prompt=LONG_PROMPT, max_tokens=TOKENS,
                                      temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            parts.extend(ch.text for ch in chunk.choices)
            if i == 3:
                os.kill(victim["pid"], signal.SIGTERM)
                signalled = time.monotonic()
                refused = wait_for(refused_while_draining, 10, "a request refused", every=0.05)
                refused_after = time.monotonic() - signalled
                ready = httpx.get(pipe.url.removesuffix("/v1") + "/ready", timeout=10)
                streamed_before = len(parts)
        finished_after = time.monotonic() - signalled
    print(f"refused {refused_after:.2f} s after SIGTERM with {streamed_before} chunks "
          f"streamed; the stream ended {finished_after:.2f} s after SIGTERM")
    assert "".join(parts) == expected(model, LONG_PROMPT, TOKENS)
    assert refused is not None and refused.status_code == 503, refused
    assert "stage stage-1 is draining" in str(refused), refused
    assert refused.response.headers["retry-after"] == "5"
    assert ready.status_code == 503 and "stage stage-1 is draining" in ready.text, ready.text
    # The drain is over with the stream: the worker exits 0 at once, well before SIGKILL.
    wait_for(lambda: not alive(victim["pid"]), 10, "the drained stage worker to exit")
    stage = pipe.stages[1]
    # A clean exit of another worker stays down, but this is the stage of the running
    # pipeline: its daemon starts it again by itself (stage_watch.STAGE_BACK_S), same port.
    back = wait_for(lambda: (w := stage.worker("stage"))["state"] == "running"
                    and w["pid"] != victim["pid"] and w, READY_S, "the stage to come back",
                    every=0.1)
    daemons.pids.add(back["pid"])
    seen = [e for e in stage.events(400) if e["subject"] == "stage"]
    exits = [e for e in seen if e["kind"] == "worker.exited"]
    assert exits and exits[-1]["data"]["cause"] == "clean", [e["message"] for e in seen]

    # The daemon's SIGTERM stops its stage the same way: the stream in flight completes.
    with client(pipe.url) as c:
        def answered() -> str | None:
            try:
                return c.completions.create(model="llama", prompt=PROMPT, max_tokens=4,
                                            temperature=0).choices[0].text
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                return None

        assert wait_for(answered, 60, "a completion after the restart", every=0.5) \
            == expected(model, PROMPT, 4)
        parts = []
        stream = c.completions.create(model="llama", prompt=LONG_PROMPT, max_tokens=TOKENS,
                                      temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            parts.extend(ch.text for ch in chunk.choices)
            if i == 3:
                assert stage.proc is not None
                stage.proc.send_signal(signal.SIGTERM)
    assert "".join(parts) == expected(model, LONG_PROMPT, TOKENS)
    assert stage.proc.wait(30) == 0
