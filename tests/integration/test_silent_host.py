"""A host that goes silent, as a Mac that sleeps or loses its cable does: its daemon and its
stage worker SIGSTOPped (no RST, the sockets stay open). Real daemons on 127.0.0.1 (the
coordinator's router), .2 and .3 (the stages), the default bound (`[serve] stage_silence_s`,
3 s). The times measured are printed (`pytest -s`); bench/silent_host.py repeats them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from helpers.daemons import Daemons
from helpers.models import PROMPT, expected
from helpers.pipeline import Pipeline, start_pipeline
from helpers.router import client
from helpers.waiting import wait_for

BOUND_S = 3.0  # the default stage_silence_s
SLACK_S = 1.5  # a loaded machine's scheduling on top of it
LONG_PROMPT = "Hello"  # greedy on the llama split fixture: no end-of-sequence for 800+ tokens


def stage_address(pipe: Pipeline, node: str) -> str:
    lines = pipe.toml.read_text().splitlines()
    at = lines.index(f'id = "{node}"')
    return lines[at + 1].split('"')[1]


def ready(pipe: Pipeline) -> httpx.Response:
    return httpx.get(pipe.url.removesuffix("/v1") + "/ready", timeout=10)


def stream_until_error(http: httpx.Client, pipe: Pipeline, pids: list[int],
                       ) -> tuple[dict[str, object], float]:
    """A long stream; after its first tokens ``pids`` are stopped (still stopped on
    return). The SSE error event, and how long after the stop it came."""
    with http.stream("POST", f"{pipe.url}/completions",
                     json={"model": "llama", "prompt": LONG_PROMPT, "max_tokens": 1500,
                           "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                return json.loads(line.removeprefix("data: ")), time.monotonic() - stopped_at
    raise AssertionError("the stream ended without an error event")


@pytest.mark.slow
def test_a_silent_stage_host_is_noticed_refused_by_name_and_reattached(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
    address = stage_address(pipe, "stage-1")
    wait_for(lambda: ready(pipe).status_code == 200, 30, "/ready 200 with both stages")
    host = pipe.stages[1]
    pids = [host.pid, host.worker("stage")["pid"]]
    try:
        with httpx.Client(timeout=30) as http:
            # 1. An in-flight stream ends with a clear error, naming the node, within the bound.
            error, noticed_s = stream_until_error(http, pipe, pids)
            print(f"\nsilent stage noticed by the in-flight stream {noticed_s:.2f} s after "
                  f"SIGSTOP (bound {BOUND_S:g} s)")
            body = error["error"]
            assert isinstance(body, dict)
            assert body["code"] == "engine_unavailable"
            assert str(body["message"]).startswith("stage stage-1 is silent: "), body
            assert address not in str(body["message"])
            assert noticed_s < BOUND_S + SLACK_S, noticed_s

            # 2. New requests: 503 at once, Retry-After, the node named, not its address.
            for stream in (False, True):
                started = time.monotonic()
                refused = http.post(f"{pipe.url}/completions", json={
                    "model": "llama", "prompt": PROMPT, "max_tokens": 4, "stream": stream})
                took = time.monotonic() - started
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "3"
                message = refused.json()["error"]["message"]
                assert message.startswith("stage stage-1 is silent (for "), message
                assert address not in refused.text and took < 1.0, (took, refused.text)

            # 3. /ready is 503 naming the node; mlxctl status says since when, and what to do.
            down = ready(pipe)
            assert down.status_code == 503
            assert [s["stage"] for s in down.json()["stages"]] == ["stage-1"]
            assert down.json()["stages"][0]["state"] == "silent"
            assert "stage-1 is silent" in down.json()["message"]
            assert address not in down.text
            shown = wait_for(lambda: (out := pipe.coordinator.ctl("status").stdout)
                             and "(silent) since" in out and out, 10,
                             "mlxctl status showing stage-1 silent")
            assert "worker router cannot reach stage stage-1 (silent) since " in shown, shown
            assert f"next: check that the host of stage stage-1 ({address}) is awake" in shown
            assert "stages of router: 1 of 2 attached" in shown
    finally:
        for pid in reversed(pids):
            os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()

    # 4. Answering again: attached again with no operator action, and serving.
    wait_for(lambda: ready(pipe).status_code == 200, 30, "/ready 200 once stage-1 answers")
    print(f"stage-1 attached again {time.monotonic() - resumed:.2f} s after SIGCONT")
    with client(pipe.url) as c:
        text = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                    temperature=0).choices[0].text
    assert text == expected(model, PROMPT, 8)
    wait_for(lambda: "stages of router: 2 of 2 attached" in pipe.coordinator.ctl("status")
             .stdout, 10, "mlxctl status showing both stages attached again")
