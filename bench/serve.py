"""Serving speed: mlx_lm.server (the baseline) and our router, side by side, one run.

Both serve the same checkpoint (by default the `small` fixture with the tools chat
template: 8 layers, hidden 512) on loopback. For each: time to first token and
single-stream decode tok/s (median of --runs), then aggregate tok/s with --streams
concurrent streams, then a chat request with `tools` in it (whole answers: tok/s and
seconds each, median of --runs; a model whose template has no tool calling skips the
row). All requests are greedy with the same prompts, so both produce the same tokens.

Then structured output on our router alone: the same measures with a ``response_format``
json_schema (``SCHEMA``: an object with one free string, which a random-weight model never
closes, so that every request runs to max_tokens as the free ones do) against none, and
their ratio (the aim: constrained decode at 0.9 or more of free decode).

    .venv/bin/python bench/serve.py [--model DIR] [--max-tokens 64] [--streams 8]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from loopback import free_port
from mlxlm import start_server, wait_ready
from streams import Stream, timed

PROMPT = "Once upon a time in a small village by the sea, there lived"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}},
          "required": ["story"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}


def stream_once(url: str, model: str, max_tokens: int, prompt: str = PROMPT,
                extra: dict[str, Any] | None = None) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=600) as r:
        return timed(r, start)


def concurrent(url: str, model: str, max_tokens: int, n: int,
               extra: dict[str, Any] | None = None) -> float:
    results: list[Stream] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        stream_once(url, model, max_tokens, f"{PROMPT} (story {i})", extra)))
        for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r.tokens for r in results) / (time.perf_counter() - start)


def measure(url: str, model: str, max_tokens: int, runs: int, streams: int,
            extra: dict[str, Any] | None = None) -> dict[str, float]:
    stream_once(url, model, 8, extra=extra)  # warm up: compile, caches
    singles = [stream_once(url, model, max_tokens, extra=extra) for _ in range(runs)]
    if extra is not None:  # each ran to max_tokens, as the free ones do
        assert all(s.tokens == max_tokens for s in singles), [s.tokens for s in singles]
    return {
        "ttft_ms": statistics.median(s.ttft for s in singles) * 1000,
        "decode_tps": statistics.median(s.decode_tps for s in singles),
        "aggregate_tps": concurrent(url, model, max_tokens, streams, extra),
    }


def measure_tools(url: str, model: str, max_tokens: int, runs: int) -> dict[str, float]:
    """A chat request with ``tools`` (tool_choice auto), whole: the template renders the
    tools, the answer is read for reasoning and calls. Median tok/s and seconds."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "tools": TOOLS,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}
    httpx.post(f"{url}/chat/completions", json=body, timeout=600).raise_for_status()  # warm
    rates, seconds = [], []
    for _ in range(runs):
        start = time.perf_counter()
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        took = time.perf_counter() - start
        seconds.append(took)
        rates.append(r.json()["usage"]["completion_tokens"] / took)
    return {"tools_tps": statistics.median(rates), "tools_s": statistics.median(seconds)}


def has_tool_calling(model: Path) -> bool:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return bool(load_tokenizer(Path(model)).has_tool_calling)


def compare(url: str, model: str, max_tokens: int, runs: int, streams: int,
            extra: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``measure`` without and with ``extra``, a round of each in turn, so that a busy
    machine slows both alike; the median of the rounds."""
    rounds = [(measure(url, model, max_tokens, 1, streams),
               measure(url, model, max_tokens, 1, streams, extra)) for _ in range(runs)]
    return {name: {key: statistics.median(r[i][key] for r in rounds) for key in rounds[0][i]}
            for i, name in enumerate(("free", "json_schema"))}


def table(names: tuple[str, str], res: dict[str, dict[str, float]], streams: int) -> None:
    """Two columns and their ratio (> 1: the second is better)."""
    first, second = (res[n] for n in names)
    print(f"{'':24}{names[0]:>14}{names[1]:>12}{'ratio':>8}")
    for key, label, better_low in (("decode_tps", "single-stream tok/s", False),
                                   ("ttft_ms", "time to first token ms", True),
                                   ("aggregate_tps", f"{streams} streams tok/s", False)):
        ratio = first[key] / second[key] if better_low else second[key] / first[key]
        print(f"{label:24}{first[key]:14.1f}{second[key]:12.1f}{ratio:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model dir (default: the small fixture)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from mlxceld.models import fixture_cache, preset

        model = fixture_cache(preset("small", chat_template="tools"))
    root = Path(tempfile.mkdtemp(prefix="mxbench", dir="/tmp"))
    our_port = free_port("127.0.0.1")
    base = start_server(model, None, "--decode-concurrency", str(args.streams))
    procs = [
        base.proc,
        subprocess.Popen([sys.executable, "-m", "mlxceld", "--state-dir", str(root / "state"),
                          "--socket", str(root / "ctl.sock"), "--model", str(model),
                          "--port", str(our_port), "--log-level", "warning"],
                         stdout=subprocess.DEVNULL),
    ]
    try:
        urls = {"mlx_lm.server": base.url,
                "mlxceld": f"http://127.0.0.1:{our_port}/v1"}
        for (name, url), p in zip(urls.items(), procs, strict=True):
            wait_ready(url, p, name)
        # mlx_lm.server calls its --model "default_model"; ours serves the directory's name.
        ids = {"mlx_lm.server": base.model_id, "mlxceld": Path(model).name}
        print(f"model: {model}  max_tokens: {args.max_tokens}  streams: {args.streams}")
        res = {name: measure(urls[name], ids[name], args.max_tokens, args.runs, args.streams)
               for name in urls}
        rows = [("decode_tps", "single-stream tok/s", False),
                ("ttft_ms", "time to first token ms", True),
                ("aggregate_tps", f"{args.streams} streams tok/s", False)]
        if has_tool_calling(model):
            for name in urls:
                res[name].update(measure_tools(urls[name], ids[name], args.max_tokens,
                                               args.runs))
            rows += [("tools_tps", "chat with tools tok/s", False),
                     ("tools_s", "chat with tools s", True)]
        else:
            print("(no tools row: the model's template has no tool calling)")
        base, ours = res["mlx_lm.server"], res["mlxceld"]
        print(f"{'':24}{'mlx_lm.server':>14}{'mlxceld':>10}{'ratio':>8}")
        for key, label, better_low in rows:
            ratio = base[key] / ours[key] if better_low else ours[key] / base[key]
            print(f"{label:24}{base[key]:14.1f}{ours[key]:10.1f}{ratio:8.2f}")
        print("(ratio > 1 means mlxceld is better)")
        structured = compare(urls["mlxceld"], ids["mlxceld"], args.max_tokens, args.runs,
                             args.streams, {"response_format": JSON_SCHEMA})
        print("\nstructured output on mlxceld (response_format json_schema, llguidance; "
              f"free and constrained interleaved, {args.runs} rounds):")
        table(("free", "json_schema"), structured, args.streams)
        print("(ratio: constrained over free; the aim is 0.9 or more)")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
