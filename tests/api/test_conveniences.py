"""What every comparable server has, in process: ``x-request-id`` on every answer, CORS
(opt-in, preflights before the key), the paths without ``/v1`` (counted as their ``/v1``
names), the model's aliases (echoed as asked), ``max_model_len``, and the sampling
defaults a request that leaves them out gets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from mlxceld.api.edge.requestid import MAX_CHARS
from mlxceld.models.generation import SamplingDefaults

from helpers.api import KEY, MODEL, http_client, make_app, metric, sse_events
from helpers.fakes import FakeEngine

CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
ORIGIN = "http://localhost:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}


def run(app: Any, *calls: tuple[str, str, dict[str, Any]]) -> list[httpx.Response]:
    """Each (method, path, httpx keyword arguments) sent to ``app``, in order."""
    async def main() -> list[httpx.Response]:
        async with http_client(app) as client:
            return [await client.request(method, path, **kw) for method, path, kw in calls]

    return asyncio.run(main())


def test_every_answer_carries_the_clients_request_id_or_a_fresh_one() -> None:
    app = make_app(api_key=KEY)
    sane = "req-42_ab.CD:/x"
    answers = run(
        app,
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {**AUTH, "x-request-id": sane}}),
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "stream": True},
                                          "headers": {**AUTH, "x-request-id": sane}}),
        ("GET", "/v1/models", {"headers": {"x-request-id": sane}}),  # 401: no key
        ("GET", "/nowhere", {"headers": {**AUTH, "x-request-id": sane}}),  # 404
        ("POST", "/v1/completions", {"json": {"prompt": ""}, "headers": {
            **AUTH, "x-request-id": sane}}),  # 400
        ("GET", "/health", {"headers": {"x-request-id": "x" * (MAX_CHARS + 1)}}),
        ("GET", "/health", {"headers": {"x-request-id": "has space"}}),
        ("GET", "/health", {}),
        ("GET", "/health", {}),
    )
    statuses = [a.status_code for a in answers]
    assert statuses == [200, 200, 401, 404, 400, 200, 200, 200, 200]
    assert [a.headers["x-request-id"] for a in answers[:5]] == [sane] * 5
    assert sse_events(answers[1].text)[-1] == "[DONE]"  # the stream went through whole
    made = [a.headers["x-request-id"] for a in answers[5:]]
    assert all(len(m) == 32 and int(m, 16) >= 0 for m in made), made
    assert len(set(made)) == 4  # a fresh one each, never the bad ones offered
    # The completion's id stays its own: unique in the engine, whatever the client sends.
    assert answers[0].json()["id"].startswith("chatcmpl-") and sane not in answers[0].json()["id"]


def test_without_allowed_origins_no_cors_header_is_sent() -> None:
    app = make_app(api_key=KEY)
    get, preflight = run(
        app,
        ("GET", "/v1/models", {"headers": {**AUTH, "Origin": ORIGIN}}),
        ("OPTIONS", "/v1/chat/completions", {"headers": {
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}}),
    )
    assert get.status_code == 200 and preflight.status_code == 401  # the key is asked
    for answer in (get, preflight):
        assert not [h for h in answer.headers if h.startswith("access-control-")], answer.headers


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key() -> None:
    app = make_app(api_key=KEY, allowed_origins=[ORIGIN])
    preflight, refused, get, other, chat = run(
        app,
        ("OPTIONS", "/v1/chat/completions", {"headers": {
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}}),
        ("OPTIONS", "/v1/chat/completions", {"headers": {
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}}),
        ("GET", "/v1/models", {"headers": {**AUTH, "Origin": ORIGIN}}),
        ("GET", "/v1/models", {"headers": {**AUTH, "Origin": "http://evil.example"}}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {**AUTH, "Origin": ORIGIN}}),
    )
    assert preflight.status_code == 204, preflight.text
    h = preflight.headers
    assert h["access-control-allow-origin"] == ORIGIN
    assert {"GET", "POST", "OPTIONS"} <= set(h["access-control-allow-methods"].split(", "))
    allowed = set(h["access-control-allow-headers"].split(", "))
    assert {"authorization", "content-type", "x-api-key", "anthropic-version",
            "x-request-id", "x-stainless-os"} <= allowed
    assert h["vary"] == "Origin" and "x-request-id" in h
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "origin_not_allowed"
    assert "http://evil.example" in refused.json()["error"]["message"]
    assert "access-control-allow-origin" not in refused.headers
    assert get.status_code == 200 and chat.status_code == 200
    for answer in (get, chat):
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert answer.headers["access-control-expose-headers"] == "*"
        assert "Origin" in answer.headers["vary"]
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert "Origin" in other.headers["vary"]


def test_any_origin() -> None:
    app = make_app(allowed_origins=["*"])
    preflight, get = run(
        app,
        ("OPTIONS", "/v1/models", {"headers": {"Origin": "https://a.example",
                                               "Access-Control-Request-Method": "GET"}}),
        ("GET", "/v1/models", {"headers": {"Origin": "https://b.example"}}),
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://a.example"
    assert get.headers["access-control-allow-origin"] == "*"


def test_the_paths_without_v1_and_their_metrics() -> None:
    app = make_app()
    answers = run(
        app,
        ("GET", "/models", {}),
        ("GET", f"/models/{MODEL}", {}),
        ("POST", "/chat/completions", {"json": CHAT}),
        ("POST", "/completions", {"json": {"model": MODEL, "prompt": "ab", "max_tokens": 2}}),
        ("POST", "/v1/completions", {"json": {"model": MODEL, "prompt": "ab", "max_tokens": 2}}),
        ("GET", "/metrics", {}),
    )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert answers[0].json()["data"][0]["id"] == MODEL
    assert answers[2].json()["object"] == "chat.completion"
    assert answers[3].json()["choices"][0]["text"] == "ab"
    text = answers[-1].text
    assert metric(text, 'mlxceld_http_requests_total{endpoint="/v1/models",status="200"}') == 1
    assert metric(text, 'mlxceld_http_requests_total{endpoint="/v1/chat/completions",'
                        'status="200"}') == 1
    assert metric(text, 'mlxceld_http_requests_total{endpoint="/v1/completions",'
                        'status="200"}') == 2
    assert 'endpoint="/models"' not in text and 'endpoint="/completions"' not in text


def test_aliases_are_listed_served_and_echoed() -> None:
    app = make_app(model_aliases=["gpt-4o-mini", "org/other"])
    listed, one, chat, comp, plain, unknown, unknown_card = run(
        app,
        ("GET", "/v1/models", {}),
        ("GET", "/v1/models/org/other", {}),
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "model": "gpt-4o-mini"}}),
        ("POST", "/v1/completions", {"json": {"model": "org/other", "prompt": "ab",
                                              "max_tokens": 2, "stream": True}}),
        ("POST", "/v1/chat/completions", {"json": {k: v for k, v in CHAT.items()
                                                   if k != "model"}}),
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "model": "gpt-5"}}),
        ("GET", "/v1/models/gpt-5", {}),
    )
    cards = listed.json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "gpt-4o-mini", "org/other"]
    context = FakeEngine().context_length
    assert all(c["context_length"] == c["max_model_len"] == context for c in cards)
    assert one.json()["id"] == "org/other"
    assert chat.json()["model"] == "gpt-4o-mini"
    assert {e["model"] for e in sse_events(comp.text)[:-1]} == {"org/other"}
    assert plain.json()["model"] == MODEL  # left out: the primary name
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
    assert unknown_card.status_code == 404


def test_sampling_defaults_fill_what_a_request_leaves_out() -> None:
    engine = FakeEngine()
    defaults = SamplingDefaults(temperature=0.0, top_p=0.8, top_k=20, min_p=0.05,
                                repetition_penalty=1.1)
    app = make_app(engine, sampling_defaults=defaults)
    run(app,
        ("POST", "/v1/chat/completions", {"json": CHAT}),
        ("POST", "/v1/completions", {"json": {"prompt": "ab", "max_tokens": 2, "top_k": 0,
                                              "temperature": 0.7}}))
    left_out, given = (r.params for r in engine.requests)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p,
            left_out.repetition_penalty) == (0.0, 0.8, 20, 0.05, 1.1)
    assert (given.temperature, given.top_k, given.top_p) == (0.7, 0, 0.8)


def test_openais_defaults_without_any() -> None:
    engine = FakeEngine()
    run(make_app(engine), ("POST", "/v1/chat/completions", {"json": CHAT}))
    params = engine.requests[0].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("body", [{"model": "gpt-4o-mini", "prompt": "a"}])
def test_an_alias_is_not_a_model_without_aliases(body: dict[str, Any]) -> None:
    (answer,) = run(make_app(), ("POST", "/v1/completions", {"content": json.dumps(body)}))
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"


def test_the_responses_api_takes_aliases_and_the_sampling_defaults() -> None:
    engine = FakeEngine()
    defaults = SamplingDefaults(temperature=0.0, top_p=0.8, top_k=20, min_p=0.05,
                                repetition_penalty=1.1)
    app = make_app(engine, model_aliases=["gpt-4o-mini"], sampling_defaults=defaults)
    aliased, given, unknown = run(
        app,
        ("POST", "/v1/responses", {"json": {"model": "gpt-4o-mini", "input": "hi",
                                            "max_output_tokens": 3}}),
        ("POST", "/responses", {"json": {"input": "hi", "max_output_tokens": 3,
                                         "temperature": 0.5}}),
        ("POST", "/v1/responses", {"json": {"model": "gpt-5", "input": "hi"}}))
    assert aliased.json()["model"] == "gpt-4o-mini"
    assert given.json()["model"] == MODEL
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (404, "model")
    left_out, asked = (r.params for r in engine.requests)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p,
            left_out.repetition_penalty) == (0.0, 0.8, 20, 0.05, 1.1)
    assert (asked.temperature, asked.top_k) == (0.5, 20)


def test_the_messages_api_takes_aliases_and_the_sampling_defaults() -> None:
    engine = FakeEngine()
    defaults = SamplingDefaults(temperature=0.0, top_p=0.8, top_k=20, min_p=0.05,
                                repetition_penalty=1.1)
    app = make_app(engine, model_aliases=["claude-sonnet-4-5"], sampling_defaults=defaults)
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    aliased, given, unknown = run(
        app,
        ("POST", "/v1/messages", {"json": {**body, "model": "claude-sonnet-4-5"}}),
        ("POST", "/v1/messages", {"json": {**body, "model": MODEL, "top_k": 0,
                                           "temperature": 0.5}}),
        ("POST", "/v1/messages", {"json": {**body, "model": "claude-opus-4-1"}}))
    assert aliased.json()["model"] == "claude-sonnet-4-5"
    assert given.json()["model"] == MODEL
    assert (unknown.status_code, unknown.json()["error"]["type"]) == (404, "not_found_error")
    left_out, asked = (r.params for r in engine.requests)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p,
            left_out.repetition_penalty) == (0.0, 0.8, 20, 0.05, 1.1)
    assert (asked.temperature, asked.top_k) == (0.5, 0)
