"""A host that goes silent, measured: how soon the router notices, and how soon it serves again.

A real 2-stage pipeline on loopback (the tests' helpers: a coordinator daemon on
127.0.0.1 serving the OpenAI API, one daemon per stage on 127.0.0.2 and .3, the
4-layer llama fixture split [0, 2) + [2, 4), the default ``[serve]
stage_silence_s``). Each of ``--runs`` rounds starts a long greedy stream,
SIGSTOPs stage-1's daemon and stage worker after its third chunk (a Mac that
sleeps: no RST, the sockets stay open), and measures from the SIGSTOP:

- ``stream``: the in-flight stream's SSE error event (or its end, or ``--cap``);
- ``ready``: ``GET /ready`` answering 503 (polled every 20 ms);
- ``refusal``: how long a new request takes to be answered while the host is
  stopped, and with what status;

then SIGCONTs both and measures ``reattach``: ``GET /ready`` 200 again. It prints
each round and the median and maximum of each. Every process is continued and
ended, whatever happens.

    .venv/bin/python bench/silent_host.py [--runs 5] [--cap 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.daemons import Daemons  # the tests' helpers, one copy
from helpers.models import write_tiny_checkpoints
from helpers.pipeline import Pipeline, start_pipeline

POLL_S = 0.02


@dataclass
class Round:
    stream_s: float
    stream_said: str
    ready_s: float
    refusal_s: float
    refusal_status: int
    reattach_s: float


def ready_status(pipe: Pipeline) -> int:
    try:
        return httpx.get(pipe.url.removesuffix("/v1") + "/ready", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def one_round(pipe: Pipeline, pids: list[int], cap_s: float) -> Round:
    stream_s, said, ready_s = cap_s, "nothing within the cap", cap_s
    with httpx.Client(timeout=cap_s + 10) as http:
        try:
            with http.stream("POST", f"{pipe.url}/completions",
                             json={"model": "llama", "prompt": "Hello", "max_tokens": 1500,
                                   "temperature": 0, "stream": True}) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(line for line in lines if line.startswith("data: "))
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
                for line in lines:
                    if '"error"' in line or line == "data: [DONE]":
                        stream_s = time.monotonic() - stopped
                        said = line[:160]
                        break
                    if time.monotonic() - stopped > cap_s:
                        break
            while time.monotonic() - stopped < cap_s:
                if ready_status(pipe) == 503:
                    ready_s = time.monotonic() - stopped
                    break
                time.sleep(POLL_S)
            started = time.monotonic()
            try:
                refusal = http.post(f"{pipe.url}/completions", timeout=cap_s, json={
                    "model": "llama", "prompt": "Hi", "max_tokens": 4, "temperature": 0})
                status = refusal.status_code
            except httpx.TimeoutException:
                status = 0
            refusal_s = time.monotonic() - started
        finally:
            for pid in reversed(pids):
                os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    while ready_status(pipe) != 200 and time.monotonic() - resumed < 60:
        time.sleep(POLL_S)
    return Round(stream_s, said, ready_s, refusal_s, status, time.monotonic() - resumed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cap", type=float, default=20.0, help="seconds to wait at most")
    args = parser.parse_args()
    daemons = Daemons()
    try:
        with tempfile.TemporaryDirectory(prefix="mxsilent") as tmp:
            model = write_tiny_checkpoints(Path(tmp), layers=4) / "llama"
            pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
            deadline = time.monotonic() + 60
            while ready_status(pipe) != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            host = pipe.stages[1]
            pids = [host.pid, host.worker("stage")["pid"]]
            rounds = []
            for i in range(args.runs):
                r = one_round(pipe, pids, args.cap)
                rounds.append(r)
                print(f"round {i + 1}: stream {r.stream_s:.2f} s, /ready 503 {r.ready_s:.2f} s, "
                      f"new request {r.refusal_status} in {r.refusal_s:.2f} s, reattached "
                      f"{r.reattach_s:.2f} s after SIGCONT; the stream said {r.stream_said}",
                      flush=True)
                time.sleep(1.0)
            for name in ("stream_s", "ready_s", "refusal_s", "reattach_s"):
                values = [getattr(r, name) for r in rounds]
                print(f"{name:11} p50 {statistics.median(values):.2f} s  "
                      f"max {max(values):.2f} s  (n={len(values)})")
    finally:
        daemons.cleanup()


if __name__ == "__main__":
    main()
