"""``response_format`` end to end: a real daemon serving a tiny fixture, alone (the local
engine) and as a 2-stage pipeline (the last stage masks), asked with the real ``openai``
client. Random weights end no free string or number by themselves, so every schema here
bounds its strings and numbers and forbids other keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.daemons import READY_S, Daemons
from helpers.pipeline import start_pipeline
from helpers.ports import free_port
from helpers.router import client

MODEL = "qwen3"
ROOM = 400  # max_tokens: each schema's output ends well within it
USER = [{"role": "user", "content": "Describe a thing in JSON."}]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Colour(Strict):
    colour: Literal["red", "green", "blue"]
    n: int = Field(ge=3, le=17)


class Item(Strict):
    name: str = Field(max_length=6)
    qty: Annotated[int, Field(ge=0, le=99)]


class Order(Strict):
    items: list[Item] = Field(max_length=3)
    urgent: bool
    note: str | None = Field(max_length=10)


SCHEMAS: list[type[BaseModel]] = [Colour, Item, Order]


@pytest.fixture(scope="module", params=["local", "pipeline"])
def served(request: pytest.FixtureRequest, split_fixture_dir: Path) -> Iterator[str]:
    """The OpenAI URL of a daemon serving the qwen3 fixture whole, or of a 2-stage pipeline."""
    daemons = Daemons()
    try:
        model = split_fixture_dir / MODEL
        if request.param == "local":
            port = free_port()
            d = daemons.make().start("--model", str(model), "--port", str(port))
            daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
            yield f"http://127.0.0.1:{port}/v1"
        else:
            yield start_pipeline(daemons, model, [(0, 2), (2, 4)]).url
    finally:
        daemons.cleanup()


def response_format(model: type[BaseModel]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "strict": True,
                                                   "schema": model.model_json_schema()}}


def test_json_schema_chat_and_completion_validate(served: str) -> None:
    with client(served) as c:
        for model in SCHEMAS:
            for seed in (1, 2):
                chat = c.chat.completions.create(
                    model=MODEL, messages=USER, max_tokens=ROOM, temperature=1.0, seed=seed,
                    response_format=response_format(model))
                choice = chat.choices[0]
                assert choice.finish_reason == "stop", choice.message.content
                model.model_validate_json(choice.message.content or "")
            comp = c.completions.create(model=MODEL, prompt="JSON:", max_tokens=ROOM,
                                        temperature=0,
                                        extra_body={"response_format": response_format(model)})
            assert comp.choices[0].finish_reason == "stop", comp.choices[0].text
            model.model_validate_json(comp.choices[0].text)


def test_parse_with_a_pydantic_model_and_stream(served: str) -> None:
    with client(served) as c:
        parsed = c.beta.chat.completions.parse(model=MODEL, messages=USER, max_tokens=ROOM,
                                               temperature=0, response_format=Order)
        order = parsed.choices[0].message.parsed
        assert isinstance(order, Order)
        stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=ROOM,
                                           temperature=1.0, seed=3, stream=True,
                                           response_format=response_format(Colour))
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Colour.model_validate_json(text)


def test_json_object_is_an_object(served: str) -> None:
    """Any JSON object: with random weights a key string rarely ends, so what came before
    max_tokens is checked as the start of an object, the whole of it if it ended."""
    with client(served) as c:
        chat = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24,
                                         temperature=0,
                                         response_format={"type": "json_object"})
    choice = chat.choices[0]
    text = choice.message.content or ""
    assert text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text == "{}" or text.startswith('{"')  # a key, then free text
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


REFUSED: list[tuple[Any, str, str]] = [
    ({"type": "json_schema", "json_schema": {"name": "x",
                                             "schema": {"type": "nonsense"}}},
     "response_format", "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}, "response_format", "no-such-format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema.schema", "required"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     "response_format.json_schema.name", "letters"),
    # compiles, but admits no finite value: was 200 with empty content and "stop"
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
     "response_format.json_schema.schema", "admits no finite value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}}},
     "response_format.json_schema.schema", "its references loop with no way out"),
    ({"type": "yaml"}, "response_format.type", "yaml"),
    ("json", "response_format", "an object"),
]


def test_a_bad_response_format_is_a_400_naming_it(served: str) -> None:
    with client(served) as c:
        for body, param, says in REFUSED:
            with pytest.raises(openai.BadRequestError) as caught:
                c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                          response_format=body)
            assert caught.value.status_code == 400
            error = caught.value.body
            assert isinstance(error, dict) and error["param"] == param, error
            assert says in error["message"], error
        # and the daemon serves on
        ok = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=ROOM,
                                       temperature=0, response_format=response_format(Colour))
        Colour.model_validate_json(ok.choices[0].message.content or "")
