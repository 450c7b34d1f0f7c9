"""A router worker's OpenAI port, asked with the real ``openai`` client (and its
Messages API with the real ``anthropic`` client)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai

from helpers.models import PROMPT, expected


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


def growing_prompt(url: str, model: str, path: Path, prompt: str, turns: int,
                   n: int) -> list[int]:
    """A conversation as a client that resends it whole each turn sends it: ``turns``
    greedy completions of ``n`` tokens from the API at ``url`` (``http://HOST:PORT/v1``),
    each of the prompt so far with the last answer and a new line added, each answer
    checked to be mlx-lm's on the whole model at ``path``; the prompt tokens each turn
    took from the prompt cache (``cached_tokens``)."""
    cached = []
    with client(url) as c:
        for turn in range(turns):
            answer = c.completions.create(model=model, prompt=prompt, max_tokens=n,
                                          temperature=0)
            text = answer.choices[0].text
            assert text == expected(path, prompt, n), turn
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            took = answer.usage.prompt_tokens_details.cached_tokens
            assert took is not None, turn
            cached.append(took)
            prompt += text + f" and then {turn}"
    return cached


def greedy_stream(url: str, prompt: str, n: int = 16, *, model: str,
                  together: threading.Barrier | None = None,
                  banned: Sequence[int] = ()) -> str:
    """The same, streamed. With ``together``, its first chunk is read before the barrier
    is passed, so that every stream of the barrier is in flight at once. ``banned``: token
    ids never chosen (logit_bias -100), e.g. the end-of-sequence ids, so that it runs all
    ``n`` tokens."""
    with client(f"{url}/v1") as c:
        chunks = iter(c.completions.create(model=model, prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True,
                                           logit_bias={str(t): -100 for t in banned}))
        first = next(chunks)
        if together is not None:
            together.wait(60)
        return "".join(ch.choices[0].text for ch in (first, *chunks) if ch.choices)


INSTRUCTIONS = "Be brief."
QUESTION = "Say hello"
DIGIT: Any = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}


def check_responses_api(url: str, model: str, n: int = 8) -> Any:
    """``POST /v1/responses`` at ``url`` (``http://HOST:PORT``), asked with the real
    ``openai`` client's ``responses.create``, whole and then streamed, greedy, for at most
    ``n`` tokens: both are the text (not empty) and usage that ``/v1/chat/completions``
    gives at ``url`` for the same conversation (instructions as its system message), and
    the stream's deltas joined are that text. Then ``text.format`` json_schema (the
    constraint carried to wherever the engine samples). The whole Response is returned (its
    ``usage.input_tokens_details.cached_tokens`` for a caller that knows the engine)."""
    messages: Any = [{"role": "system", "content": INSTRUCTIONS},
                     {"role": "user", "content": QUESTION}]
    asked: Any = {"model": model, "instructions": INSTRUCTIONS, "input": QUESTION,
                  "max_output_tokens": n, "temperature": 0}
    with client(f"{url}/v1") as c:
        chat = c.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                         temperature=0)
        whole = c.responses.create(**asked)
        events = list(c.responses.create(**asked, stream=True))
        shaped = c.responses.create(**{**asked, "max_output_tokens": 20}, text={"format": {
            "type": "json_schema", "name": "digit", "schema": DIGIT, "strict": True}})
    assert json.loads(shaped.output_text)["a"] in range(10)
    text = chat.choices[0].message.content
    assert text and whole.output_text == text, (whole.output_text, text)
    assert (whole.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    done = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert events[-1].type == done, [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == text
    for usage in (whole.usage, final.usage):
        assert usage is not None and chat.usage is not None
        assert usage.input_tokens == chat.usage.prompt_tokens
        assert usage.output_tokens == chat.usage.completion_tokens
    return whole


def check_messages_api(url: str, model: str, n: int = 8) -> Any:
    """``POST /v1/messages`` at ``url`` (``http://HOST:PORT``), asked with the real
    ``anthropic`` client's ``messages.create``, whole and then streamed, greedy, for at
    most ``n`` tokens: both are the text (not empty) and usage that
    ``/v1/chat/completions`` gives at ``url`` for the same conversation (``system`` as its
    system message: Anthropic's input tokens and cache reads add up to its prompt tokens),
    in Anthropic's events, whose text deltas joined are that text; ``count_tokens`` says
    the same prompt. The whole message is returned."""
    messages: Any = [{"role": "user", "content": QUESTION}]
    asked: Any = {"model": model, "system": INSTRUCTIONS, "messages": messages,
                  "max_tokens": n, "extra_body": {"temperature": 0}}
    with client(f"{url}/v1") as c:
        chat = c.chat.completions.create(
            model=model, max_tokens=n, temperature=0,
            messages=[{"role": "system", "content": INSTRUCTIONS}, *messages])
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60) as a:
        whole = a.messages.create(**asked)
        events = list(a.messages.create(**asked, stream=True))
        counted = a.messages.count_tokens(model=model, system=INSTRUCTIONS, messages=messages)
    text = chat.choices[0].message.content
    assert text and [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == text, (whole.content, text)
    stop = "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    assert whole.stop_reason == stop
    names = [e.type for e in events]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta"
                     and e.delta.type == "text_delta")
    assert deltas == text
    ending = events[-2]
    assert ending.delta.stop_reason == stop  # type: ignore[union-attr]
    assert chat.usage is not None and counted.input_tokens == chat.usage.prompt_tokens
    for usage in (whole.usage, ending.usage):  # type: ignore[union-attr]
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == \
            chat.usage.prompt_tokens
        assert usage.output_tokens == chat.usage.completion_tokens
    return whole
