"""The typed answers of the control API write the JSON its published schemas name
(``mlxctl/schemas.py``, ``contrib/json-schema/``): every key the schema requires, in the
order the schema lists them, each of the schema's type. The expectations are read from
the schemas, never from the records under test."""

from __future__ import annotations

from typing import Any

from mlxceld.supervisor.views import WorkerView
from mlxceld.types import WorkerState
from mlxctl.schemas import schema_of

from helpers.jsonschema_lite import errors


def item_schema(output: str, key: str) -> dict[str, Any]:
    """The schema of one element of the list ``key`` of ``mlxctl.OUTPUT/1``."""
    items: dict[str, Any] = schema_of(output)["properties"][key]["items"]
    return items


def field_schema(output: str, key: str) -> dict[str, Any]:
    schema: dict[str, Any] = schema_of(output)["properties"][key]
    return schema


def conforms(doc: Any, schema: dict[str, Any]) -> None:
    found = errors(doc, schema)
    assert not found, found
    if isinstance(doc, dict):  # the schema's keys first, in its order
        listed = [k for k in schema["properties"] if k in doc]
        assert list(doc)[:len(listed)] == listed


def worker(**more: Any) -> WorkerView:
    fields: dict[str, Any] = {
        "name": "alpha", "role": "echo", "group": None, "state": WorkerState.RUNNING,
        "pid": 4242, "healthy": True, "reason": "ready", "restarts": 1,
        "last_exit": "exited 0", "started_at": 1000.5, "rss_bytes": 1 << 20,
        "log": "/var/log/alpha.log", "keys": {"primary": "ab" * 8, "ids": ["ab" * 8]}}
    return WorkerView(**{**fields, **more})


def test_a_worker_has_every_key_of_the_workers_schema() -> None:
    schema = item_schema("workers", "workers")
    assert set(worker().to_json()) == set(schema["required"])
    conforms(worker().to_json(), schema)
    stopped = worker(state=WorkerState.EXITED, pid=None, healthy=None, started_at=None,
                     rss_bytes=None, keys=None, group="g").to_json()
    conforms(stopped, schema)
    assert (stopped["state"], stopped["pid"], stopped["keys"]) == ("exited", None, None)


def test_a_starting_worker_says_how_far_its_load_is_after_the_rest() -> None:
    loading = {"done": 5, "total": 10, "since": 1.0}
    row = worker(state=WorkerState.STARTING, loading=loading).to_json()
    conforms(row, item_schema("workers", "workers"))
    assert list(row)[-1] == "loading" and row["loading"] == loading
    assert "loading" not in worker().to_json()
