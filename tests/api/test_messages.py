"""A Messages API body read into a chat (``api/anthropic/request.py``): what each field becomes,
and every refusal naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxceld.api.anthropic.request import parse_messages
from mlxceld.api.errors import ApiError
from mlxceld.api.reasoning import template_kwargs

MODEL = "m"
USER: Any = [{"role": "user", "content": "hi"}]
TOOL: Any = {"name": "f", "input_schema": {"type": "object"}}


def parse(count: bool = False, **body: Any) -> Any:
    body.setdefault("model", MODEL)
    body.setdefault("messages", USER)
    if not count:
        body.setdefault("max_tokens", 10)
    return parse_messages(json.dumps(body).encode(), model_id=MODEL, count=count)


def template(parsed: Any) -> dict[str, Any]:
    """What the chat template is given (``chatting.py`` applies the one effort rule)."""
    return template_kwargs(dict(parsed.chat.template_kwargs), parsed.chat.reasoning_effort)


def refused(status: int = 400, **body: Any) -> str:
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == status, caught.value
    return caught.value.message


def test_turns_tool_results_and_thinking_history() -> None:
    parsed = parse(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                           {"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                   messages=[
                       *USER,
                       {"role": "assistant", "content": [
                           {"type": "thinking", "thinking": "hmm", "signature": "s"},
                           {"type": "redacted_thinking", "data": "opaque"},
                           {"type": "text", "text": "calling"},
                           {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                            "content": [{"type": "text", "text": "boom"}]},
                           {"type": "text", "text": "now?"}]}],
                   tools=[TOOL])
    roles = [(m.role, m.content) for m in parsed.chat.messages]
    assert roles == [("system", "sys"), ("user", "hi"), ("assistant", "calling"),
                     ("tool", "Error: boom"), ("user", "now?")]
    assistant = parsed.chat.messages[2]
    assert assistant.reasoning == "hmm"  # the redacted block is dropped
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == \
        [("toolu_1", "f", {"a": 1})]
    assert parsed.chat.messages[3].tool_call_id == "toolu_1"
    assert parsed.max_tokens == 10 and parsed.chat.options.max_tokens is None
    assert template(parsed) == {"enable_thinking": False}


def test_tool_choice_thinking_and_effort() -> None:
    forced = parse(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert forced.chat.tools is not None
    assert (forced.chat.tools.choice, forced.chat.tools.parallel) == ("required", False)
    named = parse(tools=[TOOL], tool_choice={"type": "tool", "name": "f"})
    assert (named.chat.tools.choice, named.chat.tools.function) == ("function", "f")
    assert parse(tools=[TOOL], tool_choice={"type": "none"}).chat.tools.offered == ()
    thinking = parse(thinking={"type": "enabled", "budget_tokens": 20000, "display": "omitted"})
    assert template(thinking) == {"enable_thinking": True,
                                                   "reasoning_effort": "high"}
    assert thinking.show_thinking is False
    effort = parse(thinking={"type": "adaptive"}, output_config={"effort": "max"})
    assert template(effort) == {"enable_thinking": True,
                                                 "reasoning_effort": "high"}
    assert template(parse(thinking={"type": "disabled"})) == \
        {"enable_thinking": False}


def test_context_management_keeps_the_last_turns_reasoning() -> None:
    def turn(n: int) -> list[Any]:
        return [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"t{n}", "signature": ""},
            {"type": "text", "text": f"a{n}"}]}]
    messages = [*turn(1), *turn(2), *turn(3), *USER]
    keep: Any = {"edits": [{"type": "clear_thinking_20251015",
                            "keep": {"type": "thinking_turns", "value": 1}}]}
    kept = parse(messages=messages, context_management=keep)
    assert [m.reasoning for m in kept.chat.messages if m.role == "assistant"] == \
        [None, None, "t3"]
    everything = parse(messages=messages, context_management={
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert [m.reasoning for m in everything.chat.messages if m.role == "assistant"] == \
        ["t1", "t2", "t3"]


def test_accepted_labels_and_hints() -> None:
    parsed = parse(metadata={"user_id": "u"}, service_tier="standard_only", speed="standard",
                   cache_control={"type": "ephemeral"}, user_profile_id="p",
                   stop_sequences=["a", "b"], temperature=0, top_p=0.5, top_k=4,
                   tools=[{**TOOL, "type": "custom", "strict": True,
                           "cache_control": {"type": "ephemeral"}}])
    options = parsed.chat.options
    assert (options.stop, options.temperature, options.top_p, options.top_k) == \
        (("a", "b"), 0.0, 0.5, 4)
    assert parse(count=True, system="s").max_tokens == 1  # a count needs no max_tokens


@pytest.mark.parametrize(("body", "named"), [
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"container": "c"}, "container"),
    ({"metadata": {"user_id": "u", "email": "e"}}, "metadata.email"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "clear_tool_uses_20250919"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{**TOOL, "input_examples": [{}]}]}, "tools[0].input_examples"),
    ({"tools": [TOOL, TOOL]}, "declared twice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "prefill"),
    ({"messages": [{"role": "tool", "content": "q"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "q", "name": "n"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "document"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q",
                                                 "citations": [{"x": 1}]}]}]}, "citations"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}, *USER]},
     "server_tool_use"),
])
def test_refused_by_name(body: dict[str, Any], named: str) -> None:
    assert named in refused(**body)


def test_another_model_is_not_found() -> None:
    assert "ANTHROPIC_MODEL" in refused(404, model="claude-opus-4-1")
