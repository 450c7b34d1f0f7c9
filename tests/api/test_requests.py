"""Request bodies: what is accepted, what is refused and how; fuzzed with hypothesis."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxceld.api import ApiError, ChatMessage
from mlxceld.api.requests import Options, parse_chat, parse_completion, sampling_params
from mlxceld.engine import Constraint

MODEL = "m"
CHAT: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}],
    "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": ["x"],
    "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "u",
    "frequency_penalty": 0, "presence_penalty": 0.5, "logit_bias": {},
}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "once upon", "max_tokens": 3}


def chat(**changes: Any) -> bytes:
    return json.dumps({**CHAT, **changes}).encode()


def refusal(body: bytes, parse: Any = parse_chat) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, model_id=MODEL)
    return caught.value


def test_a_full_chat_body() -> None:
    request = parse_chat(chat(), model_id=MODEL)
    assert request.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hi"))
    assert request.options == Options(model=MODEL, max_tokens=5, temperature=0.5, top_p=0.9,
                                      top_k=40, seed=7, presence_penalty=0.5, stop=("x",),
                                      stream=True, include_usage=True)


def test_sampling_controls_and_logprobs() -> None:
    options = parse_chat(chat(min_p=0.1, repetition_penalty=1.2, frequency_penalty=-1,
                              logit_bias={"7": 100, "03": -5.5}, logprobs=True,
                              top_logprobs=3), model_id=MODEL).options
    assert (options.min_p, options.repetition_penalty, options.frequency_penalty) == \
        (0.1, 1.2, -1.0)
    assert options.logit_bias == ((3, -5.5), (7, 100.0)) and options.logprobs == 3
    assert parse_chat(chat(logprobs=True), model_id=MODEL).options.logprobs == 0
    assert parse_chat(chat(logprobs=False), model_id=MODEL).options.logprobs is None
    body = json.dumps({**COMPLETION, "logprobs": 2}).encode()
    assert parse_completion(body, model_id=MODEL).options.logprobs == 2
    params = sampling_params(options, prompt_tokens=1, context_length=100,
                             max_tokens_bound=8, prompt_param="messages", vocab_size=8)
    assert (params.logit_bias, params.logprobs, params.min_p) == (options.logit_bias, 3, 0.1)
    with pytest.raises(ApiError) as caught:
        sampling_params(options, prompt_tokens=1, context_length=100, max_tokens_bound=8,
                        prompt_param="messages", vocab_size=7)
    assert caught.value.param == "logit_bias" and "token id 7" in caught.value.message
    # OpenAI's seed is a signed 64-bit integer; the engines' is unsigned (two's complement)
    negative = parse_chat(chat(seed=-1), model_id=MODEL).options
    assert sampling_params(negative, prompt_tokens=1, context_length=100, max_tokens_bound=8,
                           prompt_param="messages").seed == 2**64 - 1


def test_defaults_and_nulls_as_absent() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "model": None, "max_tokens": None,
            "temperature": None, "stop": None, "stream": None, "n": None, "seed": None}
    options = parse_chat(json.dumps(body).encode(), model_id=MODEL).options
    assert options == Options(model=MODEL, max_tokens=None)


def test_content_parts_roles_and_null_assistant_content() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42"},
    ]
    request = parse_chat(chat(messages=messages), model_id=MODEL)
    assert request.messages == (ChatMessage("system", "rules"), ChatMessage("user", "a\nb"),
                                ChatMessage("assistant", ""), ChatMessage("tool", "42"))


def test_max_completion_tokens_wins_and_stop_may_be_one_string() -> None:
    options = parse_chat(chat(max_completion_tokens=9, stop="END"), model_id=MODEL).options
    assert (options.max_tokens, options.stop) == (9, ("END",))


def test_stream_options_are_read_only_when_streaming() -> None:
    assert not parse_chat(chat(stream=False), model_id=MODEL).options.include_usage


def test_completion_prompts() -> None:
    assert parse_completion(json.dumps(COMPLETION).encode(), model_id=MODEL).prompt == "once upon"
    body = json.dumps({**COMPLETION, "prompt": ["only one"]}).encode()
    assert parse_completion(body, model_id=MODEL).prompt == "only one"


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    (b"{", 400, None, "not valid JSON"),
    (b"\xff\xfe\x00", 400, None, "not valid JSON"),
    (b'{"messages": NaN}', 400, None, "not valid JSON"),
    (b"[" * 100_000, 400, None, "nested too deeply"),
    (b"[1]", 400, None, "must be a JSON object, not an array"),
    (chat(messages=None), 400, "messages", "required"),
    (chat(messages=[]), 400, "messages", "empty"),
    (chat(messages="hi"), 400, "messages", "array of messages, not a string"),
    (chat(messages=[3]), 400, "messages[0]", "must be an object"),
    (chat(messages=[{"content": "x"}]), 400, "messages[0].role", "required"),
    (chat(messages=[{"role": "bot", "content": "x"}]), 400, "messages[0].role", "one of"),
    (chat(messages=[{"role": "user"}]), 400, "messages[0].content", "not null"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type", "only text"),
    (chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages[0].content",
     "surrogate"),
    (chat(model="gpt-4"), 404, "model", "does not exist"),
    (chat(model=4), 400, "model", "must be a string, not an integer"),
    (chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    (chat(max_tokens=-3), 400, "max_tokens", ">= 1"),
    (chat(max_tokens=2.5), 400, "max_tokens", "an integer, not a number"),
    (chat(max_tokens=True), 400, "max_tokens", "not a boolean"),
    (chat(max_completion_tokens=0), 400, "max_completion_tokens", ">= 1"),
    (chat(temperature=2.5), 400, "temperature", "[0, 2]"),
    (chat(temperature=-0.1), 400, "temperature", "[0, 2]"),
    (chat(temperature="hot"), 400, "temperature", "a number, not a string"),
    (chat(top_p=0), 400, "top_p", "(0, 1]"),
    (chat(top_k=-2), 400, "top_k", ">= 0 (0 or -1: off)"),
    (chat(top_k=1.5), 400, "top_k", "an integer"),
    (chat(min_tokens=-1), 400, "min_tokens", ">= 0"),
    (chat(ignore_eos=1), 400, "ignore_eos", "a boolean"),
    (chat(min_tokens=2, response_format={"type": "json_object"}), 400, "min_tokens",
     "constrained"),
    (chat(ignore_eos=True, guided_json={"type": "object"}), 400, "ignore_eos", "constrained"),
    (chat(guided_json={"type": "object"}, response_format={"type": "json_object"}), 400,
     "guided_json", "one of them"),
    (chat(guided_json="x"), 400, "guided_json", "an object"),
    (chat(reasoning_effort="max"), 400, "reasoning_effort", "none, minimal, low"),
    (chat(reasoning={"effort": "huge"}), 400, "reasoning.effort", "none, minimal, low"),
    (chat(reasoning={"effort": "low", "max_tokens": 100}), 400, "reasoning.max_tokens",
     "budget"),
    (chat(reasoning={"effort": "low", "summary": "auto"}), 400, "reasoning.summary",
     "unknown field"),
    (chat(reasoning={"enabled": False, "effort": "high"}), 400, "reasoning.enabled",
     "one of them"),
    (chat(reasoning_effort="low", reasoning={"effort": "high"}), 400, "reasoning",
     "one of them"),
    (chat(reasoning="low"), 400, "reasoning", "an object"),
    (chat(seed=2**64), 400, "seed", "between"),
    (chat(n=2), 400, "n", "must be 1"),
    (chat(stop=[str(i) for i in range(17)]), 400, "stop", "at most 16"),
    (chat(stop=[""]), 400, "stop", "1 to"),
    (chat(stop=[1]), 400, "stop", "a string or an array of strings"),
    (chat(stream="yes"), 400, "stream", "a boolean"),
    (chat(stream_options=[]), 400, "stream_options", "an object"),
    (chat(stream_options={"include_usage": 1}), 400, "stream_options.include_usage", "boolean"),
    (chat(frequency_penalty=3), 400, "frequency_penalty", "[-2, 2]"),
    (chat(presence_penalty=-2.5), 400, "presence_penalty", "[-2, 2]"),
    (chat(repetition_penalty=0), 400, "repetition_penalty", "(0, 10]"),
    (chat(min_p=1.5), 400, "min_p", "[0, 1]"),
    (chat(logit_bias=[1]), 400, "logit_bias", "an object"),
    (chat(logit_bias={"a": 1}), 400, "logit_bias", "token ids"),
    (chat(logit_bias={"-1": 1}), 400, "logit_bias", "token ids"),
    (chat(logit_bias={"5": 101}), 400, "logit_bias.5", "[-100, 100]"),
    (chat(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias", "at most 300"),
    (chat(logprobs=1), 400, "logprobs", "a boolean"),
    (chat(top_logprobs=2), 400, "top_logprobs", "needs 'logprobs'"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "between 0 and 20"),
])
def test_chat_refusals(body: bytes, status: int, param: str | None, words: str) -> None:
    error = refusal(body)
    assert (error.status, error.param) == (status, param)
    assert words in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"
    if status == 404:
        assert error.code == "model_not_found"


@pytest.mark.parametrize(("prompt", "words"), [
    ("", "empty"), ([], "empty"), (None, "required"), (["a", "b"], "holds 2 prompts"),
    ([1, 2, 3], "token ids"), ({"text": "x"}, "must be a string"), ([["a"]], "must be a string"),
])
def test_completion_refusals(prompt: Any, words: str) -> None:
    error = refusal(json.dumps({**COMPLETION, "prompt": prompt}).encode(), parse_completion)
    assert (error.status, error.param) == (400, "prompt")
    assert words in error.message


@pytest.mark.parametrize("logprobs", [6, -1, True, 1.5])
def test_completion_logprobs_refusals(logprobs: Any) -> None:
    error = refusal(json.dumps({**COMPLETION, "logprobs": logprobs}).encode(), parse_completion)
    assert (error.status, error.param) == (400, "logprobs")


def test_context_length_checks() -> None:
    options = Options(model=MODEL, max_tokens=None)
    assert sampling_params(options, prompt_tokens=10, context_length=100, max_tokens_bound=512,
                           prompt_param="messages").max_tokens == 90
    assert sampling_params(options, prompt_tokens=10, context_length=1000, max_tokens_bound=512,
                           prompt_param="messages").max_tokens == 512
    # No operator bound: what is left of the context, however much that is.
    assert sampling_params(options, prompt_tokens=10, context_length=40960,
                           max_tokens_bound=None, prompt_param="messages").max_tokens == 40950
    with pytest.raises(ApiError) as caught:
        sampling_params(options, prompt_tokens=120, context_length=100, max_tokens_bound=512,
                        prompt_param="prompt")
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "120" in error.message and "100" in error.message and "leaves 0" in error.message
    with pytest.raises(ApiError) as caught:
        sampling_params(Options(model=MODEL, max_tokens=50), prompt_tokens=60, context_length=100,
                        max_tokens_bound=512, prompt_param="prompt")
    assert caught.value.param == "max_tokens" and "leaves 40" in caught.value.message


def test_other_servers_extras_reach_the_engine() -> None:
    """vLLM's ``top_k: -1`` (off), ``min_tokens``, ``ignore_eos`` and ``guided_json``;
    reasoning effort by either name; an assistant's ``reasoning`` as its
    ``reasoning_content``; Continue's 6 stops."""
    stops = ["<|im_end|>", "<|endoftext|>", "```", "\n\n\n", "<|fim_pad|>", "</s>"]
    request = parse_chat(chat(top_k=-1, min_tokens=3, ignore_eos=True, stop=stops),
                         model_id=MODEL)
    options = request.options
    assert (options.top_k, options.min_tokens, options.ignore_eos) == (0, 3, True)
    assert options.stop == tuple(stops)
    params = sampling_params(options, prompt_tokens=1, context_length=100,
                             max_tokens_bound=None, prompt_param="messages")
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.max_tokens) == \
        (0, 3, True, 5)
    with pytest.raises(ApiError) as caught:
        sampling_params(replace(options, min_tokens=6), prompt_tokens=1, context_length=100,
                        max_tokens_bound=None, prompt_param="messages")
    assert caught.value.param == "min_tokens" and "lower 'min_tokens'" in caught.value.message
    guided = parse_chat(chat(guided_json={"type": "object"}), model_id=MODEL).options
    assert guided.constraint == Constraint("json_schema", '{"type": "object"}')
    assert parse_chat(chat(reasoning_effort="low"), model_id=MODEL).reasoning_effort == "low"
    for reasoning, effort in (({"effort": "high"}, "high"), ({"enabled": False}, "none"),
                              ({"enabled": True}, None), ({"exclude": False}, None)):
        parsed = parse_chat(chat(reasoning=reasoning), model_id=MODEL)
        assert parsed.reasoning_effort == effort, reasoning
    assert parse_chat(chat(reasoning_effort="low", reasoning={"effort": "low"}),
                      model_id=MODEL).reasoning_effort == "low"
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "a", "reasoning": "thought"},
               {"role": "assistant", "content": "b", "reasoning": "same",
                "reasoning_content": "same"}]
    messages = parse_chat(chat(messages=history), model_id=MODEL).messages
    assert [m.reasoning for m in messages] == [None, "thought", "same"]
    history[2]["reasoning_content"] = "other"
    error = refusal(chat(messages=history))
    assert (error.status, error.param) == (400, "messages[2].reasoning")
    assert "differ" in error.message


def test_unknown_fields_may_be_ignored_and_listed() -> None:
    """``[serve] unknown_fields = "warn"``: the parser lists what it did not read, paths and
    all; known fields are still checked."""
    ignored: list[str] = []
    body = chat(frobnicate=1, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "x_part": 1}], "x_msg": True}],
                reasoning={"effort": "low", "x_r": 2})
    parsed = parse_chat(body, model_id=MODEL, ignored=ignored)
    assert parsed.messages[0].content == "hi" and parsed.reasoning_effort == "low"
    assert sorted(ignored) == ["frobnicate", "messages[0].content[0].x_part",
                               "messages[0].x_msg", "reasoning.x_r"]
    assert refusal(chat(frobnicate=1)).param == "frobnicate"
    with pytest.raises(ApiError) as caught:
        parse_chat(chat(frobnicate=1, audio={"voice": "x"}), model_id=MODEL, ignored=[])
    assert caught.value.param == "audio"
    listed: list[str] = []
    parse_completion(json.dumps({**COMPLETION, "zz": 1}).encode(), model_id=MODEL,
                     ignored=listed)
    assert listed == ["zz"]


def test_the_operators_bound_refuses_more_by_the_name_asked() -> None:
    asked = parse_chat(json.dumps({**CHAT, "max_completion_tokens": 65}).encode(),
                       model_id=MODEL).options
    with pytest.raises(ApiError) as caught:
        sampling_params(asked, prompt_tokens=1, context_length=1000, max_tokens_bound=64,
                        prompt_param="messages")
    error = caught.value
    assert (error.status, error.param) == (400, "max_completion_tokens")
    assert "at most 64 tokens" in error.message and "65" in error.message
    within = replace(asked, max_tokens=64)
    assert sampling_params(within, prompt_tokens=1, context_length=1000, max_tokens_bound=64,
                           prompt_param="messages").max_tokens == 64


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
keys = st.sampled_from(sorted({*CHAT, *COMPLETION, "max_completion_tokens", "logprobs",
                               "top_logprobs", "min_p", "repetition_penalty"}))


def check_only_api_errors(body: bytes) -> None:
    for parse in (parse_chat, parse_completion):
        try:
            request = parse(body, model_id=MODEL)
        except ApiError as error:
            assert error.status in {400, 404, 413}
            assert error.body()["error"]["message"]
            continue
        for length in (1, 50, 5000):
            try:
                sampling_params(request.options, prompt_tokens=length, context_length=100,
                                max_tokens_bound=16, prompt_param="prompt", vocab_size=50)
            except ApiError as error:
                assert error.status == 400


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_any_body(body: bytes) -> None:
    check_only_api_errors(body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([CHAT, COMPLETION]),
       st.lists(st.tuples(keys, st.none() | json_values, st.booleans()), max_size=4),
       st.integers(0, 40))
def test_fuzz_mutated_bodies(base: dict[str, Any], edits: list[tuple[str, Any, bool]],
                             cut: int) -> None:
    body = dict(base)
    for key, value, delete in edits:
        if delete:
            body.pop(key, None)
        else:
            body[key] = value
    raw = json.dumps(body).encode()
    check_only_api_errors(raw)
    check_only_api_errors(raw[:-cut] if cut else raw)  # truncated JSON too
