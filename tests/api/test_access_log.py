"""The access log's line (in process, ASGI): its fields, a client gone, a path that tries
to forge a line; and the JSON formatter's object."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from mlxceld.logformat import JsonFormatter

from helpers.api import KEY, http_client, make_app

ACCESS = "mlxceld.api.access"


def test_a_refused_request_and_a_forged_path_each_log_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    answered: list[str] = []

    async def main() -> None:
        async with http_client(make_app(api_key=KEY)) as client:
            refused = await client.get("/v1/models")
            assert refused.status_code == 401
            answered.append(refused.headers["x-request-id"])
            await client.get("/nope%0A2026-01-01 INFO mlxceld.api.access: GET /x 200")

    with caplog.at_level(logging.INFO, ACCESS):
        asyncio.run(main())
    records = [r for r in caplog.records if r.name == ACCESS]
    assert len(records) == 2
    fields = [r.fields for r in records]  # type: ignore[attr-defined]
    assert (fields[0]["method"], fields[0]["path"], fields[0]["status"]) == \
        ("GET", "/v1/models", 401)
    assert fields[0]["completion_id"] is None and fields[0]["duration_ms"] >= 0
    assert fields[0]["request_id"] == answered[0]  # the answer's x-request-id
    forged = records[1].getMessage()
    assert "\n" not in forged and "\\n2026" in forged
    assert KEY not in "".join(r.getMessage() for r in records)


def test_probes_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """/health, /ready and /metrics, polled every few seconds, do not bury the requests."""
    async def main() -> None:
        async with http_client(make_app()) as client:
            for path in ("/health", "/ready", "/metrics", "/v1/models"):
                await client.get(path)

    with caplog.at_level(logging.DEBUG, ACCESS):
        asyncio.run(main())
    levels = {r.fields["path"]: r.levelno for r in caplog.records  # type: ignore[attr-defined]
              if r.name == ACCESS}
    assert levels == {"/health": logging.DEBUG, "/ready": logging.DEBUG,
                      "/metrics": logging.DEBUG, "/v1/models": logging.INFO}


def test_the_json_formatter_keeps_the_four_and_adds_the_fields() -> None:
    record = logging.LogRecord("mlxceld.x", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    record.fields = {"status": 200, "message": "not this one"}
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["message"], line["status"]) == \
        ("WARNING", "mlxceld.x", "a b", 200)
    assert line["time"].endswith("Z") and "T" in line["time"]
