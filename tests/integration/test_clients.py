"""The tools people point at a local server, each with the request shapes it sends, against
one real daemon serving the tiny fixture with the tools chat template (``<think>``
reasoning, json tool calls): every one gets an answer.

Where the client is a Python package that installs here, the package itself sends its
requests (``langchain-openai``'s ``ChatOpenAI``; ``openai`` and ``anthropic`` have their own
tests: tests/api/test_openai_client.py, the Responses and Messages API tests). Where it
is not (Continue is TypeScript inside an editor, Open WebUI a web app, aider talks through
LiteLLM), the body it sends is written out here as that client builds it, with the source
of the shape named above each one, and posted as it is, streamed as those clients stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.served import serving_daemon, tools_model

MODEL = "qwen3"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a daemon serving the tools fixture, started as a user
    would (``--model``, ``--port``, the default listen address)."""
    with serving_daemon(tools_model(tmp_path_factory, MODEL)) as url:
        yield url


def streamed(base: str, path: str, body: dict[str, Any]) -> tuple[str, str, list[Any]]:
    """POST ``body`` as a stream the way these clients read one: the content and the
    reasoning gathered from the deltas, and every chunk."""
    chunks: list[Any] = []
    content, reasoning = [], []
    with httpx.stream("POST", base + path, json=body, timeout=120,
                      headers={"Authorization": "Bearer none"}) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
    return "".join(content), "".join(reasoning), chunks


def finish_reason(chunks: list[Any]) -> str | None:
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", [])
               if c.get("finish_reason")]
    return reasons[-1] if reasons else None


# Continue (continuedev/continue, core/llm/llms/OpenAI.ts, ``_convertArgs``): the chat
# body for an "openai" provider with a local apiBase sends the template's whole stop list
# (sliced to 4 only for api.openai.com, groq, azure and port 1337), max_tokens,
# temperature, top_p, both penalties, and stream true; an empty message content is sent
# as " " (LM Studio's workaround). Six stops: Continue's ChatML-style list.
CONTINUE_CHAT: Any = {
    "messages": [{"role": "system", "content": "You are a coding assistant."},
                 {"role": "user", "content": "Write a function that adds two numbers."},
                 {"role": "assistant", "content": " "},
                 {"role": "user", "content": "Now in Rust."}],
    "model": MODEL, "max_tokens": 16, "temperature": 0, "top_p": 1,
    "frequency_penalty": 0, "presence_penalty": 0, "stream": True,
    "stop": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>",
             "\n\n\n\n"],
}


def test_continue_chat_with_its_whole_stop_list(base: str) -> None:
    content, reasoning, chunks = streamed(base, "/v1/chat/completions", CONTINUE_CHAT)
    assert finish_reason(chunks) in ("stop", "length")
    assert content or reasoning  # sixteen tokens said something


# Open WebUI (open-webui/open-webui, its OpenAI router): the model's "reasoning effort"
# setting goes out as ``reasoning: {"effort": ...}``, a message's parts keep their
# ``cache_control`` (set for Anthropic-style prompt caching), usage is asked in the stream.
OPEN_WEBUI_CHAT: Any = {
    "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
    "reasoning": {"effort": "low"},
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly.",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?",
                                      "cache_control": {"type": "ephemeral"}}]}],
    "max_tokens": 16,
}


def test_open_webui_chat_with_reasoning_effort_and_cache_control(base: str) -> None:
    content, reasoning, chunks = streamed(base, "/v1/chat/completions", OPEN_WEBUI_CHAT)
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] <= 16
    assert finish_reason(chunks) in ("stop", "length")
    assert content or reasoning


# aider through LiteLLM (BerriAI/litellm, its openai chat transformation, as aider
# calls ``litellm.completion`` with ``--reasoning-effort``): ``reasoning_effort`` at the
# top level, temperature 0, usage in the stream; the history carries an earlier answer's
# ``reasoning`` (the field vLLM returns today) beside its content.
AIDER_CHAT: Any = {
    "model": MODEL, "temperature": 0, "stream": True,
    "stream_options": {"include_usage": True}, "reasoning_effort": "high",
    "messages": [
        {"role": "system", "content": "Act as an expert software developer."},
        {"role": "user", "content": "Rename foo to bar."},
        {"role": "assistant", "content": "Done.", "reasoning": "The user wants a rename."},
        {"role": "user", "content": "And baz to qux."}],
    "max_tokens": 16,
}


def test_aider_through_litellm_with_reasoning_effort(base: str) -> None:
    content, reasoning, chunks = streamed(base, "/v1/chat/completions", AIDER_CHAT)
    assert finish_reason(chunks) in ("stop", "length")
    assert content or reasoning


def test_vllm_style_extras_top_k_off_and_min_tokens(base: str) -> None:
    """What scripts written for vLLM send: ``top_k: -1`` (off), ``min_tokens``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 12, "min_tokens": 12, "top_k": -1, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
    assert answer["usage"]["completion_tokens"] == 12, answer
    assert answer["choices"][0]["finish_reason"] == "length"


def test_langchain_chat_openai_invoke_and_stream(base: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=base + "/v1", api_key="none", model=MODEL,
                                       temperature=0, max_tokens=12, max_retries=0,
                                       timeout=120)
    message = chat.invoke([("system", "Answer briefly."), ("human", "Hello there")])
    assert message.usage_metadata is not None
    assert 0 < message.usage_metadata["output_tokens"] <= 12
    pieces = list(chat.stream([("system", "Answer briefly."), ("human", "Hello there")]))
    streamed_text = "".join(str(p.content) for p in pieces)
    assert streamed_text == message.content  # greedy: the same answer both ways
