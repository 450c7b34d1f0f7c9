"""The JSON Schema of every ``mlxctl --json`` output, one per ``schema`` name
(``mlxctl.NAME/1``), written to ``contrib/json-schema/`` by ``python -m mlxctl.schemas DIR``.

One spelling everywhere: a schema's NAME and every key are snake_case (``cluster_nodes``,
``key_id``, ``started_at``); only data is spelled otherwise (a worker's or node's name as
a key of ``failed``). A schema says the keys a script may rely on, their types, and which
may be null; an object that grows with the daemon (a worker's ``stats``, a bring-up's
peers) admits more keys than it lists. ``tests/ctl/test_json_schemas.py`` holds the files
to this module and validates real outputs of a running daemon against them.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Final, Literal, Union, get_args, get_origin

from mlxceld.cluster.plan.candidates import ProposalJSON
from mlxceld.config.changes import Change

Schema = dict[str, Any]
DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"


def t(kind: str | list[str], **more: Any) -> Schema:
    return {"type": kind, **more}


def obj(props: dict[str, Schema], *, nullable: bool = False, closed: bool = False,
        optional: tuple[str, ...] = ()) -> Schema:
    """An object with ``props``, each required but those ``optional``."""
    out: Schema = {"type": ["object", "null"] if nullable else "object", "properties": props,
                   "required": [k for k in props if k not in optional]}
    if closed:
        out["additionalProperties"] = False
    return out


def items(schema: Schema) -> Schema:
    return {"type": "array", "items": schema}


_SCALARS: Final = {str: "string", int: "integer", float: "number", bool: "boolean",
                   type(None): "null"}


def from_type(hint: Any) -> Schema:
    """The JSON Schema of a type of ours: a TypedDict (its ``NotRequired`` keys optional),
    a list, a ``Literal``, a union with None, a scalar; ``Any`` is anything."""
    if hint is Any:
        return {}
    if typing.is_typeddict(hint):
        hints = typing.get_type_hints(hint)
        return {"type": "object", "properties": {k: from_type(v) for k, v in hints.items()},
                "required": [k for k in hints if k in hint.__required_keys__]}
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        return {"type": "array", "items": from_type(args[0])}
    if origin is Literal:
        return {"enum": list(args)} if len(args) > 1 else {"const": args[0]}
    if origin in (Union, types.UnionType):
        parts = [from_type(a) for a in args]
        if all(set(p) == {"type"} for p in parts):
            return {"type": [p["type"] for p in parts]}
        return {"anyOf": parts}
    return {"type": _SCALARS[hint]}


STR, INT, NUM, BOOL = t("string"), t("integer"), t("number"), t("boolean")
STR_N, INT_N, NUM_N = t(["string", "null"]), t(["integer", "null"]), t(["number", "null"])
ANY_OBJ, ANY_OBJ_N = t("object"), t(["object", "null"])
VERSION = STR  # the daemon's version, beside every answer of the control API

WORKER = obj({"name": STR, "role": STR, "group": STR_N, "state": STR, "pid": INT_N,
              "healthy": t(["boolean", "null"]), "reason": STR, "restarts": INT,
              "last_exit": STR, "started_at": NUM_N, "rss_bytes": INT_N, "log": STR,
              "keys": t(["object", "array", "null"])})
STATUS_WORKER = {**WORKER, "properties": {**WORKER["properties"], "stats": ANY_OBJ_N}}
DAEMON = obj({"pid": INT, "version": STR, "node_id": STR, "hostname": STR,
              "started_at": NUM, "uptime_s": NUM, "state": t("string", enum=["running",
                                                                               "stopping"]),
              "state_dir": STR, "socket": STR, "socket_group": STR_N, "config_file": STR_N,
              "log_level": STR, "schema_version": INT,
              "compute_units": obj({"units": NUM_N, "source": STR, "dtype": STR,
                                    "error": STR_N})})  # discovery/speed.py
EVENT = obj({"id": INT, "ts": NUM, "kind": STR, "subject": STR, "message": STR,
             "data": ANY_OBJ})
KEY = obj({"key_id": STR, "state": STR, "created_at": NUM, "source": STR_N})
DRAIN = obj({"node_id": STR, "state": STR, "started_at": NUM, "deadline": NUM_N,
             "force": BOOL, "updated_at": NUM, "reason": STR, "finished": INT, "ended": INT},
            optional=("started_at", "deadline", "force", "updated_at", "reason", "finished",
                      "ended"))
SERVING = obj({"model": STR, "model_name": STR, "url": STR, "api_key": BOOL}, nullable=True)
CHANGE = from_type(Change)  # config/changes.py
BRINGUP = obj({"state": STR, "summary": STR, "peers": t(["array", "null"])}, nullable=True,
              optional=("summary", "peers"))
ROUTER = obj({"state": STR}, optional=("state",))
RTT = obj({"count": INT, "min": NUM, "median": NUM, "p90": NUM, "max": NUM})  # link-test
TRANSFER = obj({"bytes": INT, "seconds": NUM, "mb_per_s": NUM})

# Each output: its keys besides "schema" (every one has that, spelled mlxctl.NAME/1).
OUTPUTS: Final[dict[str, dict[str, Schema]]] = {
    "status": {"version": VERSION, "daemon": DAEMON, "serving": SERVING,
               "cluster": ANY_OBJ_N, "assignment": ANY_OBJ_N, "bringup": ANY_OBJ_N,
               "healing": ANY_OBJ_N, "agent": ANY_OBJ_N, "workers": items(STATUS_WORKER),
               "problems": items(ANY_OBJ), "drains": items(DRAIN),
               "pipeline": ANY_OBJ_N},
    "workers": {"version": VERSION, "workers": items(WORKER)},
    "events": {"version": VERSION, "events": items(EVENT)},
    "event": EVENT["properties"],  # one line of `events -f --json`
    "log": {"worker": STR, "data": STR},  # one line of `logs --json` (-f: one per chunk)
    "version": {"client": STR, "daemon": STR, "api": INT},
    "check": {"healthy": BOOL, "findings": items(STR)},  # status --check (verdict.py)
    "reload": {"version": VERSION, "config_file": STR_N, "changed": items(CHANGE),
               "at_next_start": items(STR)},
    "restart": {"version": VERSION, "worker": STR, "restarting": BOOL},
    "serve": {"version": VERSION, "serving": SERVING},
    "unserve": {"version": VERSION, "unserved": SERVING},
    "stop": {"version": VERSION, "stopping": BOOL, "pid": INT, "stopped": BOOL},
    "drain": {"version": VERSION, "drain": DRAIN},
    "undrain": {"version": VERSION, "node": STR, "was": {**DRAIN, "type": ["object", "null"]}},
    "cluster_nodes": {"version": VERSION, "cluster": STR, "node_id": STR, "key_id": STR_N,
                      "discovery": ANY_OBJ, "nodes": items(ANY_OBJ), "detector": ANY_OBJ,
                      "liveness": items(ANY_OBJ)},
    "cluster_plan": {"version": VERSION,  # cluster/plan/candidates.py, report.py
                     **from_type(ProposalJSON)["properties"]},
    "cluster_activate": {"ok": BOOL, "bringup": BRINGUP, "router": ROUTER,
                         "serving": SERVING},
    "cluster_deactivate": {"ok": BOOL, "bringup": BRINGUP},
    "cluster_link_test": {"version": VERSION, "peer": STR, "address": STR, "node_id": STR_N,
                          "connect_ms": NUM, "rtt_ms": RTT, "sent": TRANSFER,
                          "received": TRANSFER, "chunk_bytes": INT},
    "secrets": {"version": VERSION, "keys": items(KEY), "rotation": ANY_OBJ_N},
    "secret_generate": {"key_id": STR, "file": STR_N},
    "secret_install": {"version": VERSION, "key": KEY},
    "secret_use": {"version": VERSION, "key": KEY},
    "secret_remove": {"version": VERSION, "key": KEY, "removed": BOOL},
    "secret_rotate": {"version": VERSION, "rotation": ANY_OBJ},
    "error": {"error": obj({"code": STR, "message": STR, "hint": STR}, closed=True)},
}
# Keys an output has only sometimes.
OPTIONAL: Final[dict[str, tuple[str, ...]]] = {
    "serve": ("router", "problem"),  # with --wait: the router's row, and what went wrong
    "secret_generate": ("secret",),  # the secret itself, when no FILE is given
}
EXTRA: Final[dict[str, dict[str, Schema]]] = {
    "serve": {"router": ANY_OBJ_N, "problem": STR},
    "secret_generate": {"secret": STR},
}


def schema_of(name: str) -> Schema:
    """The whole JSON Schema of ``mlxctl.NAME/1``."""
    props = {"schema": t("string", const=f"mlxctl.{name}/1"), **OUTPUTS[name],
             **EXTRA.get(name, {})}
    out = obj(props, optional=OPTIONAL.get(name, ()))
    return {"$schema": DRAFT, "$id": f"mlxctl.{name}/1", "title": f"mlxctl.{name}/1",
            **out}


def write(directory: Path) -> list[Path]:
    """Every schema as ``directory/mlxctl.NAME.schema.json``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in OUTPUTS:
        path = directory / f"mlxctl.{name}.schema.json"
        path.write_text(json.dumps(schema_of(name), indent=2) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write(Path(sys.argv[1] if len(sys.argv) > 1 else "contrib/json-schema")):
        print(written)
