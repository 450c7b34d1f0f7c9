"""``response_format`` as the router reads it (in process, a fake engine): what reaches the
engine as ``SamplingParams.constraint``; refusals are in tests/integration/
test_structured_output.py, against a real daemon."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from mlxceld.engine import Constraint

from helpers.api import MODEL, http_client, make_app
from helpers.fakes import FakeEngine

SCHEMA = {"type": "object", "properties": {"é": {"type": "integer"}}}


@pytest.mark.parametrize(("response_format", "constraint"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, Constraint("json_object")),
    ({"type": "json_schema", "json_schema": {"name": "a-b_1", "schema": SCHEMA,
                                             "strict": True, "description": "d"}},
     Constraint("json_schema", json.dumps(SCHEMA, ensure_ascii=False))),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_engine_is_given_the_constraint(path: str, response_format: Any,
                                            constraint: Constraint | None) -> None:
    engine = FakeEngine(reply=b"{}")
    body: dict[str, Any] = {"model": MODEL, "response_format": response_format}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                else {"prompt": "hi"})

    async def main() -> None:
        async with http_client(make_app(engine)) as http:
            answer = await http.post(path, json=body)
            assert answer.status_code == 200, answer.text

    asyncio.run(main())
    [request] = engine.requests
    assert request.params.constraint == constraint


def test_a_refused_response_format_never_reaches_the_engine() -> None:
    engine = FakeEngine(reply=b"{}")
    body = {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}

    async def main() -> None:
        async with http_client(make_app(engine)) as http:
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("response_format", "invalid_response_format")
        assert "cannot be honoured" in error["message"]

    asyncio.run(main())
    assert engine.requests == []


ENDLESS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": ENDLESS}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "guided_json": ENDLESS}, "guided_json"),
    ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": ENDLESS}}}, "text.format.schema"),
])
def test_a_schema_no_finite_value_matches_is_refused_naming_its_field(
        path: str, body: dict[str, Any], param: str) -> None:
    # It compiles, but llguidance would end the answer at once, empty, with finish_reason
    # "stop" (or never close the object): refused before the engine, naming the schema.
    engine = FakeEngine(reply=b"{}")

    async def main() -> None:
        async with http_client(make_app(engine)) as http:
            answer = await http.post(path, json={"model": MODEL, **body})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_response_format")
        assert "admits no finite value" in error["message"]
        assert "'$ref' '#' at #/properties/a" in error["message"]

    asyncio.run(main())
    assert engine.requests == []
