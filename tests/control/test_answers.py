"""The typed answers of the control API write the JSON its published schemas name
(``mlxctl/schemas.py``, ``contrib/json-schema/``): every key the schema requires, in the
order the schema lists them, each of the schema's type. The expectations are read from
the schemas, never from the records under test."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxceld.control.answers import (
    ClusterNodes,
    Detector,
    DrainView,
    KeyChange,
    Reloaded,
    ServedModel,
    Undrained,
    Unserved,
)
from mlxceld.state import KeyInfo
from mlxceld.state.drains import DrainRow
from mlxceld.state.rotations import RotationRow
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


def test_cluster_nodes_have_every_key_of_their_schema() -> None:
    detector = Detector(True, 1.0, 3.0, 10.0)
    nodes = ClusterNodes("lab", "mac-a", "ab" * 8, {"mode": "static", "running": True},
                         [{"address": "10.0.0.2:19000", "liveness": None, "key_stale": False}],
                         detector, [{"address": "10.0.0.2:19000", "state": "alive"}])
    schema = field_schema_of("cluster_nodes")
    doc = nodes.to_json()
    assert set(doc) == set(schema["properties"])
    conforms(doc, schema)
    # the detector's settings as [liveness] names them (mlxceld(8)), and whether it runs
    assert doc["detector"] == {"running": True, "ping_interval_s": 1.0,
                               "suspect_after_s": 3.0, "dead_after_s": 10.0}
    conforms(replace(nodes, key_id=None).to_json(), schema)  # no cluster secret yet


def test_a_rotation_has_the_keys_mlxctl_reads() -> None:
    """`mlxctl secret rotate` says old_key_id, new_key_id and members (secret.py); `mlxctl
    status` the id, new_key_id, step, members and started_at (render.py)."""
    row = RotationRow(3, "aa" * 8, "bb" * 8, ("10.0.0.1:19000", "10.0.0.2:19000"), "done",
                      {}, 100.0, 101.0)
    doc = row.to_json()
    conforms({"rotation": doc}, field_schema_of("secret_rotate"))
    assert (doc["id"], doc["old_key_id"], doc["new_key_id"], doc["step"]) == (
        3, "aa" * 8, "bb" * 8, "done")
    assert doc["members"] == ["10.0.0.1:19000", "10.0.0.2:19000"]
    assert doc["started_at"] == 100.0 and doc["failures"] == {}


def field_schema_of(output: str) -> dict[str, Any]:
    """``mlxctl.OUTPUT/1``'s schema less ``schema`` and ``version`` (the daemon's answer's
    envelope), as one object."""
    props = {k: v for k, v in schema_of(output)["properties"].items()
             if k not in ("schema", "version")}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_key_has_every_key_of_the_secrets_schema() -> None:
    key = KeyInfo("ab" * 8, "primary", 100.0, "/etc/mlxceld/secret")
    schema = item_schema("secrets", "keys")
    assert list(key.to_json()) == list(schema["properties"])
    conforms(key.to_json(), schema)


def test_a_key_change_is_the_key_then_what_the_workers_made_of_it() -> None:
    key = KeyInfo("ab" * 8, "installed", 100.0, "mlxctl secret install")
    for output in ("secret_install", "secret_use", "secret_remove"):
        schema = field_schema(output, "key")
        for change in (KeyChange(key, {}), KeyChange(key, {"stage": "did not answer"}),
                       KeyChange(key, None)):
            conforms(change.to_json(), schema)
    assert KeyChange(key, {}).to_json()["workers"] == {"failed": {}}
    assert KeyChange(key, {"stage": "no"}).to_json()["workers"] == {"failed": {"stage": "no"}}
    assert KeyChange(key, None).to_json()["workers"] == {}  # the last key: nothing to push
    assert list(KeyChange(key, {}).to_json())[-1] == "workers"


def test_what_is_served_has_every_key_of_the_serve_schema() -> None:
    """`mlxctl chat` reads ``api_key_file`` too (mlxctl(1): where the key is, never it)."""
    served = ServedModel("/models/m", "m", "http://127.0.0.1:8000/v1", True, "/etc/key")
    schema = field_schema("serve", "serving")
    doc = served.to_json()
    conforms(doc, schema)
    assert list(doc) == [*schema["properties"], "api_key_file"]
    conforms(replace(served, api_key=False, api_key_file=None).to_json(), schema)


def test_unserved_is_what_was_served_or_null() -> None:
    schema = field_schema_of("unserve")
    served = ServedModel("/models/m", "m", "http://127.0.0.1:8000/v1", False, None)
    conforms(Unserved(served).to_json(), schema)
    conforms(Unserved(None).to_json(), schema)
    assert Unserved(None).to_json() == {"unserved": None}
    assert Unserved(served).to_json() == {"unserved": served.to_json()}


def drain_row(**more: Any) -> DrainRow:
    return replace(DrainRow("mac-b", "draining", 100.0, 160.0, False, 100.0,
                            "mlxctl drain: deadline in 60 s"), **more)


def test_a_drain_has_every_key_of_the_drain_schema() -> None:
    schema = field_schema("drain", "drain")
    doc = drain_row().to_json()
    assert list(doc) == list(schema["properties"])
    conforms(doc, schema)
    conforms(drain_row(deadline=None, state="drained").to_json(), schema)


def test_a_listed_drain_is_its_row_then_replanning_and_in_flight() -> None:
    """mlxctl(1), `mlxctl drains`: whether it waits for a re-plan, requests in flight,
    and who still sends them."""
    schema = field_schema("drain", "drain")  # the row of `mlxctl drains` is a drain's
    senders = [{"sender": "router 127.0.0.1:7001", "sequences": 2}]
    view = DrainView(drain_row(finished=4, ended=1), True, 2, senders).to_json()
    conforms(view, schema)
    assert list(view)[-3:] == ["replanning", "in_flight", "senders"]
    assert (view["finished"], view["ended"], view["replanning"], view["in_flight"]) == (
        4, 1, True, 2)
    assert view["senders"] == senders
    unknown = DrainView(drain_row(), False, None).to_json()
    assert unknown["in_flight"] is None and unknown["senders"] is None


def test_an_undrain_names_the_node_and_its_drain_as_it_was() -> None:
    schema = field_schema_of("undrain")
    conforms(Undrained("mac-b", drain_row()).to_json(), schema)
    conforms(Undrained("mac-b", None).to_json(), schema)
    assert Undrained("mac-b", None).to_json() == {"node": "mac-b", "was": None}


def test_a_reload_says_the_file_what_changed_and_what_waits_for_a_start() -> None:
    schema = field_schema_of("reload")
    changed = [{"key": "daemon.log_level", "old": "info", "new": "debug"},
               {"key": "daemon.socket", "old": "/run/a.sock", "new": "/run/b.sock"}]
    doc = Reloaded("/etc/mlxceld/mlxceld.toml", changed, ["daemon.socket"]).to_json()
    assert list(doc) == list(schema["properties"])
    conforms(doc, schema)
    conforms(Reloaded(None, [], []).to_json(), schema)  # flags only: no file to name
