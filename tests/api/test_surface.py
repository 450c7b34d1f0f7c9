"""Every request field is honoured or refused by name (``api/surface.py``), never silently
ignored: through the parser, and through the real ``openai`` client (in process)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from mlxceld.api import ApiError
from mlxceld.api.requests import parse_chat, parse_completion
from mlxceld.api.surface import CHAT_FIELDS, COMPLETION_FIELDS

from helpers.api import MODEL, make_app, openai_client

USER = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": MODEL, "messages": USER}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "once"}

# A value of each refused field that asks for something this server does not do.
# Other servers' extras (vLLM, llama.cpp, Ollama) refused on both endpoints.
REFUSED_EXTRAS: dict[str, Any] = {
    "n_predict": 5, "typical_p": 0.9, "tfs_z": 0.5, "mirostat": 2,
    "options": {"num_ctx": 4096}, "skip_special_tokens": False,
    "include_stop_str_in_output": True, "use_beam_search": True, "length_penalty": 0.8,
    "stop_token_ids": [7], "return_tokens_as_token_ids": True, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": "start: x", "priority": 3}
REFUSED_CHAT: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "functions": [{"name": "f"}], "function_call": "auto",
    "service_tier": "flex", "store": True, "verbosity": "low",
    "moderation": True, "prompt_cache_retention": "24h", "prompt_cache_options": {},
    "echo": True, "best_of": 2, "add_generation_prompt": False,
    "continue_final_message": True, **REFUSED_EXTRAS,
}
REFUSED_COMPLETION: dict[str, Any] = {"echo": True, "best_of": 2, "suffix": "}",
                                      **REFUSED_EXTRAS}
# Values of refused fields that ask for nothing more than is served, and hints: accepted.
ALLOWED_EXTRAS: dict[str, Any] = {
    "typical_p": 1.0, "tfs_z": 1, "mirostat": 0, "skip_special_tokens": True,
    "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
    "stop_token_ids": [], "return_tokens_as_token_ids": False, "priority": 0,
    "cache_prompt": True, "keep_alive": "5m", "num_ctx": 8192,
    "spaces_between_special_tokens": False, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
    "request_id": "r-1"}
ALLOWED_CHAT: dict[str, Any] = {"modalities": ["text"], "service_tier": "auto",
                                "store": False, "user": "u-1", "safety_identifier": "s",
                                "prompt_cache_key": "k", "metadata": {"a": "b"},
                                "echo": False, "best_of": 1, "add_generation_prompt": True,
                                "continue_final_message": False, **ALLOWED_EXTRAS}
ALLOWED_COMPLETION: dict[str, Any] = {"echo": False, "best_of": 1, "suffix": "", "user": "u",
                                      **ALLOWED_EXTRAS}


def refusal(body: dict[str, Any], parse: Any = parse_chat) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(json.dumps(body).encode(), model_id=MODEL)
    return caught.value


def test_the_tables_cover_every_refused_field_tested_here() -> None:
    refused = {n for n, r in CHAT_FIELDS.items() if r.state == "refused"}
    assert refused == set(REFUSED_CHAT)
    refused = {n for n, r in COMPLETION_FIELDS.items() if r.state == "refused"}
    assert refused == set(REFUSED_COMPLETION)


@pytest.mark.parametrize(("name", "value"), sorted(REFUSED_CHAT.items()))
def test_each_refused_chat_field_is_named(name: str, value: Any) -> None:
    error = refusal({**CHAT, name: value})
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")
    assert name in error.message and ("leave" in error.message or "send" in error.message)


@pytest.mark.parametrize(("name", "value"), sorted(REFUSED_COMPLETION.items()))
def test_each_refused_completion_field_is_named(name: str, value: Any) -> None:
    error = refusal({**COMPLETION, name: value}, parse_completion)
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")


def test_values_that_ask_for_nothing_more_are_accepted() -> None:
    parse_chat(json.dumps({**CHAT, **ALLOWED_CHAT}).encode(), model_id=MODEL)
    parse_completion(json.dumps({**COMPLETION, **ALLOWED_COMPLETION}).encode(), model_id=MODEL)
    # null is absent, for refused and unknown fields alike
    parse_chat(json.dumps({**CHAT, "audio": None, "typo": None}).encode(), model_id=MODEL)


def test_opaque_fields_are_checked_for_their_type() -> None:
    error = refusal({**CHAT, "user": 5})
    assert (error.status, error.param) == (400, "user")
    assert "'user' must be a string, not an integer" in error.message
    assert refusal({**CHAT, "metadata": "x"}).param == "metadata"
    for name, value, words in (("cache_prompt", 1, "a boolean"), ("num_ctx", "4k", "an integer"),
                               ("keep_alive", True, "a string or a number"),
                               ("mirostat_tau", "5", "a number"), ("request_id", 3, "a string")):
        error = refusal({**CHAT, name: value})
        assert (error.status, error.param) == (400, name)
        assert f"{name!r} must be {words}" in error.message, error.message


def test_unknown_fields_are_each_named() -> None:
    error = refusal({**CHAT, "max_token": 5, "temprature": 0.2})
    assert (error.status, error.param, error.code) == (400, "max_token", "unknown_parameter")
    assert '"max_token", "temprature"' in error.message
    many = {f"x{i}": 1 for i in range(8)}
    assert "and 3 more" in refusal({**CHAT, **many}).message
    # A chat-only field on the completions endpoint is unknown there.
    error = refusal({**COMPLETION, "messages": USER}, parse_completion)
    assert error.param == "messages" and error.code == "unknown_parameter"


def test_the_openai_client_gets_a_400_naming_each_field() -> None:
    async def main() -> None:
        async with openai_client(make_app()) as client:
            for name, value in [*sorted(REFUSED_CHAT.items()), ("typo_field", 1)]:
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.chat.completions.create(model=MODEL, messages=USER,
                                                         extra_body={name: value})
                body = caught.value.body
                assert isinstance(body, dict) and body["param"] == name, name
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=USER, n=2)
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"
            for name, value in sorted(REFUSED_COMPLETION.items()):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.completions.create(model=MODEL, prompt="once", max_tokens=2,
                                                    extra_body={name: value})
                assert isinstance(caught.value.body, dict) and caught.value.body["param"] == name
            answer = await client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=2, extra_body=ALLOWED_CHAT)
            assert answer.choices[0].finish_reason == "length"

    asyncio.run(main())


def test_message_fields_are_honoured_or_refused_by_name() -> None:
    """A message's own fields by its role: ``name`` and an assistant's
    ``reasoning_content`` reach the template; the rest is refused naming its path."""
    messages = [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}], "refusal": None},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    parsed = parse_chat(json.dumps({**CHAT, "messages": messages}).encode(), model_id=MODEL)
    dicts = [m.template_dict() for m in parsed.messages]
    assert dicts[0]["name"] == "ops" and dicts[1]["name"] == "ann"
    assert dicts[2]["reasoning_content"] == "think" and "name" not in dicts[2]
    assert parsed.messages[2].size == len("think") + len("f{}")
    for message, param, code in (
            ({"role": "assistant", "content": "x", "audio": {"id": "a1"}},
             "messages[0].audio", "unsupported_parameter"),
            ({"role": "assistant", "content": "", "refusal": "no"},
             "messages[0].refusal", "unsupported_parameter"),
            ({"role": "assistant", "content": "", "function_call": {"name": "f"}},
             "messages[0].function_call", "unsupported_parameter"),
            ({"role": "user", "content": "x", "tool_calls": []},
             "messages[0].tool_calls", "unknown_parameter"),
            ({"role": "user", "content": "x", "reasoning_content": "r"},
             "messages[0].reasoning_content", "unknown_parameter"),
            ({"role": "user", "content": "x", "cache_control": "ephemeral"},
             "messages[0].cache_control", None),
            ({"role": "user", "content": [{"type": "text", "text": "x",
                                           "cache_control": ["ephemeral"]}]},
             "messages[0].content[0].cache_control", None),
            ({"role": "user", "content": "x", "reasoning": "r"},
             "messages[0].reasoning", "unknown_parameter")):
        error = refusal({**CHAT, "messages": [message]})
        assert (error.status, error.param, error.code) == (400, param, code), error.message
        assert param in error.message


def test_the_documented_table_is_the_codes() -> None:
    """docs/api-fields.md is generated from every endpoint's tables (``python -m
    mlxceld.api.fielddoc``): it fails here when one changed without the other; regenerate
    it. Each API's section is there, with fields only that API has."""
    from pathlib import Path

    from mlxceld.api.fielddoc import markdown

    doc = Path(__file__).parents[2] / "docs" / "api-fields.md"
    assert doc.read_text() == markdown(), "regenerate: python -m mlxceld.api.fielddoc " \
        "> docs/api-fields.md"
    text = doc.read_text()
    for name in ("cache_prompt", "num_ctx", "min_tokens", "reasoning_effort", "n_predict",
                 "max_output_tokens", "previous_response_id", "call_id",  # Responses
                 "stop_sequences", "budget_tokens", "tool_use_id", "mcp_servers"):  # Messages
        assert f"| `{name}` |" in text, name
    for heading in ("## Responses API", "## Messages API", "### A `function_call` item",
                    "### A `tool_result` block", "### `output_config`"):
        assert heading in text, heading
