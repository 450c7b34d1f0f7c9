"""A router worker's OpenAI port, asked with the real ``openai`` client."""

from __future__ import annotations

import openai

from helpers.models import PROMPT


def client(url: str, key: str = "none") -> openai.OpenAI:
    """The client for the API at ``url`` (``http://HOST:PORT/v1``): no retries, 60 s."""
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def complete(port: int, model: str, n: int = 8) -> str:
    """The greedy completion of PROMPT, ``n`` tokens at most, from the router on
    ``127.0.0.1:port``."""
    with client(f"http://127.0.0.1:{port}/v1") as c:
        text: str = c.completions.create(model=model, prompt=PROMPT, max_tokens=n,
                                         temperature=0).choices[0].text
        return text
