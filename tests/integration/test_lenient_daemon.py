"""``[serve] unknown_fields = "warn"`` and ``reasoning_field = "both"`` from a real TOML
config file, through a real daemon's router worker serving the Qwen3-style tools fixture
(its template opens ``<think>``): an unknown field is ignored and named in a header (chat,
Responses and Messages APIs alike), the clients' request shapes
(``helpers/clientshapes.py``) are answered, and the reasoning comes under both keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlxceld.api.ignoring import HEADER
from mlxceld.models import preset, write_fixture

from helpers.clientshapes import CLIENT_SHAPES
from helpers.daemons import READY_S, Daemons
from helpers.ports import free_port
from helpers.router import client


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_fixture(tmp_path_factory.mktemp("lenient") / "qwen3",
                          preset("tiny", chat_template="tools"))
    daemons = Daemons()
    try:
        port = free_port()
        d = daemons.make(f'[serve]\nmodel = "{model}"\nport = {port}\n'
                         'unknown_fields = "warn"\nreasoning_field = "both"\n').start()
        daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        daemons.cleanup()


def chat(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=60,
                      json={"model": "qwen3", "max_tokens": 6, "temperature": 0, **body})


def test_an_unknown_field_is_ignored_and_named(url: str) -> None:
    response = chat(url, {"messages": [{"role": "user", "content": "hi"}],
                          "x_client_trace": {"id": 1}, "top_k": -1, "min_tokens": 2,
                          "reasoning": {"effort": "low"}, "stop": [str(i) for i in range(16)]})
    assert response.status_code == 200, response.text
    assert response.headers[HEADER] == "x_client_trace"
    message = response.json()["choices"][0]["message"]
    # The template opened <think>: all six tokens are reasoning, under both keys.
    assert message["reasoning"] == message["reasoning_content"], message
    refused = chat(url, {"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_effort_none_answers_without_reasoning(url: str) -> None:
    response = chat(url, {"messages": [{"role": "user", "content": "hi"}],
                          "reasoning_effort": "none"})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message, message
    assert HEADER not in response.headers


def test_the_responses_and_messages_apis_ignore_and_name_too(url: str) -> None:
    """The one setting covers OpenAI's Responses API and Anthropic's Messages API."""
    responses = httpx.post(f"{url}/responses", timeout=60, json={
        "model": "qwen3", "input": "hi", "max_output_tokens": 4, "x_client_trace": 1})
    messages = httpx.post(f"{url}/messages", timeout=60, json={
        "model": "qwen3", "max_tokens": 4, "x_client_trace": 1,
        "messages": [{"role": "user", "content": "hi", "x_turn": 1}]})
    for response in (responses, messages):
        assert response.status_code == 200, response.text
    assert responses.headers[HEADER] == "x_client_trace"
    assert responses.json()["object"] == "response"
    assert messages.headers[HEADER] == "x_client_trace, messages[].x_turn"
    assert messages.json()["type"] == "message"


@pytest.mark.parametrize("name", sorted(CLIENT_SHAPES))
def test_each_clients_request_shape_is_answered_by_the_daemon(url: str, name: str) -> None:
    """Through the ``openai`` client (the fields it does not know as ``extra_body``), whole
    and streamed."""
    body = dict(CLIENT_SHAPES[name])
    messages, max_tokens = body.pop("messages"), body.pop("max_tokens")
    body.pop("stream", None)
    with client(url) as c:
        answer = c.chat.completions.create(model="qwen3", messages=messages,
                                           max_tokens=max_tokens, extra_body=body)
        assert answer.choices[0].finish_reason in ("stop", "length")
        extra = answer.choices[0].message.model_extra or {}
        assert answer.usage is not None and answer.usage.completion_tokens >= 1, answer
        # Most shapes set no temperature: sampled, an answer may end at its first token
        # (CI: "assistant-reasoning" once sampled the end of turn first). One that ran to
        # its length has text to show.
        if answer.choices[0].finish_reason == "length":
            assert answer.choices[0].message.content or extra.get("reasoning_content"), answer
        chunks = list(c.chat.completions.create(model="qwen3", messages=messages,
                                                max_tokens=max_tokens, extra_body=body,
                                                stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
