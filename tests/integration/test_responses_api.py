"""``POST /v1/responses`` end to end: real daemons serving the tiny fixture with the tools
chat template (json_tools calls, ``<think>``), alone (the local engine) and as a 2-stage
pipeline, asked with the real ``openai`` client's ``responses.create``, whole and
streamed.

Random weights end nothing by themselves: every answer is bounded by
``max_output_tokens``, forced calls by the grammar and bounded arguments, JSON by a
bounded schema (as in test_tool_calling.py and test_structured_output.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers import served
from helpers.daemons import Daemons
from helpers.pipeline import start_pipeline
from helpers.router import client
from helpers.served import serving_daemon

MODEL = "qwen3"
QUESTION = "What is the weather in Paris?"
WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}
DIGIT: Any = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return served.tools_model(tmp_path_factory, MODEL)


@pytest.fixture(scope="module")
def local(tools_model: Path) -> Iterator[str]:
    with serving_daemon(tools_model) as base:
        yield base + "/v1"


def check_text_and_stream(url: str) -> None:
    """Reasoning then text, whole and streamed; instructions; effort none; the bound."""
    with client(url) as c:
        whole = c.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                   max_output_tokens=12, temperature=0)
        events = list(c.responses.create(model=MODEL, input=QUESTION,
                                         instructions="Be brief.", max_output_tokens=12,
                                         temperature=0, stream=True))
        plain = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8,
                                   temperature=0, reasoning={"effort": "none"})
    # The template opens <think>: 12 tokens of random weights are all reasoning.
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    [reasoning] = [i for i in whole.output if i.type == "reasoning"]
    assert reasoning.content and reasoning.content[0].text
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 12
    assert whole.instructions == "Be brief."
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    [item] = [i for i in final.output if i.type == "reasoning"]
    assert item.content and streamed == item.content[0].text == reasoning.content[0].text
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == texts == whole.output_text
    # effort "none" reached the template as enable_thinking false: all of it is text.
    assert plain.output_text and [i.type for i in plain.output] == ["message"]
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 0


def check_tools_and_json(url: str) -> None:
    """A forced call, its result fed back, and text.format json_schema."""
    with client(url) as c:
        forced = c.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    parallel_tool_calls=False, max_output_tokens=200,
                                    temperature=0)
        [call] = [i for i in forced.output if i.type == "function_call"]
        args = json.loads(call.arguments)
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
        assert forced.status == "completed"
        history: Any = [{"role": "user", "content": QUESTION},
                        call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": "sunny"}]
        after = c.responses.create(model=MODEL, input=history, tools=[WEATHER],
                                   max_output_tokens=4, temperature=0)
        shaped = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20,
                                    temperature=0, text={"format": {
                                        "type": "json_schema", "name": "digit",
                                        "schema": DIGIT, "strict": True}})
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model=MODEL, input=QUESTION, extra_body={"frobnicate": 1})
    assert after.status in ("completed", "incomplete") and after.usage is not None
    assert forced.usage is not None
    assert after.usage.input_tokens > forced.usage.input_tokens + 10  # the call and result
    assert json.loads(shaped.output_text)["a"] in range(10)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "frobnicate"


def test_text_reasoning_and_stream_local(local: str) -> None:
    check_text_and_stream(local)


def test_tools_and_json_local(local: str) -> None:
    check_tools_and_json(local)


def test_responses_over_a_pipeline(tools_model: Path) -> None:
    daemons = Daemons()
    try:
        url = start_pipeline(daemons, tools_model, [(0, 2), (2, 4)]).url
        check_text_and_stream(url)
        check_tools_and_json(url)
    finally:
        daemons.cleanup()
