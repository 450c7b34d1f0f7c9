"""A chat turn, timed: through an OpenAI-compatible server (``Endpoint``: the ``openai``
client's streamed ``chat.completions``) or through mlx-lm in this process (``InProcess``:
``stream_generate`` with a prompt cache kept from a turn to the next), as
bench/conversation.py chats with each.

Both time a turn the same way: from the request (before the chat template is applied, in
process) to the first piece of content (a server's first chunk whose ``delta.content`` is
not empty: our router opens a chat stream with an empty role chunk, mlx_lm.server does not;
in process, the first non-empty text of ``stream_generate``, whose detokenizer holds back a
token that is not whole text yet, as both servers do). A server's refusal or broken stream
is ``TurnFailed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WARMUP_PROMPT = "The quick brown fox"  # raw: no chat template, so no prefix of any chat


@dataclass
class Turn:
    """One request of a chat: seconds to its first content, what it answered, and the
    prompt tokens (and those reused from a cache) as the target reported them."""

    ttft: float
    answer: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    no_content: bool = False  # nothing but empty chunks: ttft is the stream's end


Messages = list[dict[str, str]]


class TurnFailed(Exception):
    """A server refused or broke off a turn (its status and message)."""


@dataclass
class Endpoint:
    """An OpenAI-compatible server: its chat turns through the ``openai`` client."""

    name: str
    url: str
    model_id: str
    # openai.OpenAI, made once: a timed request must not pay for building one
    client: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import openai

        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0,
                                    timeout=600)

    def warm_up(self) -> None:
        self.client.completions.create(model=self.model_id, prompt=WARMUP_PROMPT,
                                       max_tokens=4, temperature=0)

    def turn(self, messages: Messages, max_tokens: int) -> Turn:
        import openai

        start = time.perf_counter()
        first = 0.0
        pieces: list[str] = []
        usage = None
        try:
            stream = self.client.chat.completions.create(
                model=self.model_id, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            with stream:
                for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        if choice.delta.content:
                            first = first or time.perf_counter()
                            pieces.append(choice.delta.content)
        except openai.APIError as exc:  # a status, an error event, a broken connection
            raise TurnFailed(f"{exc} (after {time.perf_counter() - start:.1f} s)") from exc
        end = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return Turn((first or end) - start, "".join(pieces),
                    usage.prompt_tokens if usage else None,
                    getattr(details, "cached_tokens", None) if details else None,
                    usage.completion_tokens if usage else None, no_content=not first)

    def close(self) -> None:
        self.client.close()


class InProcess:
    """mlx-lm in this process, greedy, one prompt cache kept from a turn to the next and
    trimmed to the prefix the next shares with what it holds (a one-entry version of
    mlx_lm.server's prompt cache)."""

    name = "mlx-lm"

    def __init__(self, model: Path) -> None:
        import mlx_lm

        loaded: tuple[Any, ...] = mlx_lm.load(str(model))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.cache: list[Any] = []
        self.held: list[int] = []  # the tokens whose KV the cache holds
        self.forget()

    def forget(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache, self.held = make_prompt_cache(self.model), []

    def warm_up(self) -> None:
        self.turn([{"role": "user", "content": WARMUP_PROMPT}], 4)
        self.forget()

    def turn(self, messages: Messages, max_tokens: int) -> Turn:
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import trim_prompt_cache

        start = time.perf_counter()
        ids: list[int] = self.tokenizer.apply_chat_template(messages,
                                                            add_generation_prompt=True)
        reused = 0
        for a, b in zip(self.held, ids[:-1], strict=False):  # at least one token to feed
            if a != b:
                break
            reused += 1
        trim_prompt_cache(self.cache, len(self.held) - reused)
        first = 0.0
        pieces: list[str] = []
        generated: list[int] = []
        for r in stream_generate(self.model, self.tokenizer, ids[reused:],
                                 max_tokens=max_tokens, prompt_cache=self.cache):
            if r.text:
                first = first or time.perf_counter()
                pieces.append(r.text)
            if r.finish_reason == "stop":  # the EOS: not a generated token
                break
            generated.append(int(r.token))
        end = time.perf_counter()
        known = ids + generated
        offset = int(self.cache[0].offset)
        if offset > len(known):  # fed a token we did not keep (the EOS): not ours to reuse
            trim_prompt_cache(self.cache, offset - len(known))
        self.held = known[:offset]
        return Turn((first or end) - start, "".join(pieces), len(ids), reused, len(generated),
                    no_content=not first)

    def close(self) -> None:
        import mlx.core as mx

        del self.model, self.cache
        mx.clear_cache()
