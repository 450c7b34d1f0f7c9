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
