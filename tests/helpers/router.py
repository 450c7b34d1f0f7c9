"""A router worker's OpenAI port, asked with the real ``openai`` client."""

from __future__ import annotations

import threading

import openai

from helpers.models import PROMPT


def client(url: str, key: str = "none") -> openai.OpenAI:
    """The client for the API at ``url`` (``http://HOST:PORT/v1``): no retries, 60 s."""
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def complete(port: int, model: str, n: int = 8) -> str:
    """The greedy completion of PROMPT, ``n`` tokens at most, from the router on
    ``127.0.0.1:port``."""
    return greedy(f"http://127.0.0.1:{port}", PROMPT, n, model=model)


def greedy(url: str, prompt: str, n: int = 8, *, model: str) -> str:
    """The greedy completion of ``prompt``, ``n`` tokens at most, from the API at ``url``
    (``http://HOST:PORT``)."""
    with client(f"{url}/v1") as c:
        text: str = c.completions.create(model=model, prompt=prompt, max_tokens=n,
                                         temperature=0).choices[0].text
        return text


def greedy_stream(url: str, prompt: str, n: int = 16, *, model: str,
                  together: threading.Barrier | None = None) -> str:
    """The same, streamed. With ``together``, its first chunk is read before the barrier
    is passed, so that every stream of the barrier is in flight at once."""
    with client(f"{url}/v1") as c:
        chunks = iter(c.completions.create(model=model, prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True))
        first = next(chunks)
        if together is not None:
            together.wait(60)
        return "".join(ch.choices[0].text for ch in (first, *chunks) if ch.choices)
