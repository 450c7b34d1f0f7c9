"""Timing one streamed completion (shared by bench/serve.py and bench/pipeline.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class Stream:
    """One request's timings: seconds to the first token, and the decode span after it;
    ``text``, what it streamed (``timed`` keeps it)."""

    ttft: float
    tokens: int
    decode_s: float
    total_s: float
    text: str = ""

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first (the first token's time is prefill's)."""
        return (self.tokens - 1) / self.decode_s


def timed(response: httpx.Response, start: float) -> Stream:
    """Read an OpenAI SSE completion stream; time its first and last text chunks."""
    first = last = 0.0
    chunks, usage, pieces = 0, None, []
    if response.status_code >= 400:
        response.read()
        response.raise_for_status()
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            usage = data["usage"]
        texts = [c["text"] for c in data.get("choices", []) if c.get("text")]
        if texts:
            pieces += texts
            last = time.perf_counter()
            first = first or last
            chunks += 1
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return Stream(first - start, tokens, max(last - first, 1e-9), time.perf_counter() - start,
                  "".join(pieces))
