"""Every `mlxctl --json` output has a published JSON Schema (contrib/json-schema/, written by
``python -m mlxctl.schemas``), its name and every key spelled snake_case, and the outputs of
a real daemon validate against them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxctl.schemas import OUTPUTS, schema_of

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.jsonschema_lite import errors

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "contrib" / "json-schema"
SNAKE = re.compile(r"[a-z][a-z0-9_]*")


def test_the_published_files_are_the_generated_ones() -> None:
    files = {p.name: json.loads(p.read_text()) for p in PUBLISHED.glob("*.json")}
    assert files == {f"mlxctl.{n}.schema.json": schema_of(n) for n in OUTPUTS}, \
        "run: python -m mlxctl.schemas contrib/json-schema"


def test_every_name_mlxctl_prints_has_a_schema() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "mlxctl").glob("*.py"))
    printed = set(re.findall(r'emit\(\s*as_json,\s*"([^"]+)"', source))
    printed |= set(re.findall(r'"mlxctl\.([a-z_]+)/1"', source))
    printed |= {"error"}  # edge.fail's
    assert printed, "the scan finds nothing: the test would pass on anything"
    assert printed <= set(OUTPUTS), sorted(printed - set(OUTPUTS))
    assert all(SNAKE.fullmatch(n) for n in OUTPUTS), sorted(OUTPUTS)


def keys(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        found = set(schema.get("properties", {}))
        for v in schema.values():
            found |= keys(v)
        return found
    if isinstance(schema, list):
        return set().union(*(keys(v) for v in schema)) if schema else set()
    return set()


def test_every_key_is_snake_case() -> None:
    every = set().union(*(keys(schema_of(n)) for n in OUTPUTS))
    assert {"key_id", "started_at", "node_address"} <= every
    assert not [k for k in every if not SNAKE.fullmatch(k)]


def check(name: str, doc: dict[str, Any]) -> None:
    assert doc.get("schema") == f"mlxctl.{name}/1"
    found = errors(doc, schema_of(name))
    assert not found, found


def ctl_json(d: DaemonProc, *args: str, ok: bool = True) -> dict[str, Any]:
    done = d.ctl(*args, "--json")
    assert (done.returncode == 0) is ok, done.stdout + done.stderr
    body: dict[str, Any] = json.loads(done.stdout)
    return body


def test_the_validator_finds_what_is_wrong() -> None:
    doc = {"schema": "mlxctl.reload/1", "version": "1", "config_file": None,
           "changed": [{"key": "daemon.log_level", "old": "info", "new": "debug"}],
           "at_next_start": []}
    check("reload", doc)
    assert errors({**doc, "changed": [{"key": 3, "old": 1, "new": 2}]},
                  schema_of("reload")) == ["$.changed[0].key: int 3 is not string"]
    assert errors({k: v for k, v in doc.items() if k != "version"},
                  schema_of("reload")) == ["$: 'version' is missing"]


ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.2 }
"""


@pytest.mark.slow
def test_real_outputs_validate(daemons: Daemons, tmp_path: Path) -> None:
    d = daemons.make(ECHO).start()
    d.wait_worker("alpha", state="running")
    daemons.note(d)
    check("status", ctl_json(d, "status"))
    check("workers", ctl_json(d, "workers"))
    check("events", ctl_json(d, "events"))
    check("version", ctl_json(d, "version"))
    d.config.write_text(ECHO.replace("interval_s = 0.2", "interval_s = 0.3"))
    reload = ctl_json(d, "reload")
    check("reload", reload)
    assert reload["changed"][0]["key"] == "workers.alpha"
    check("restart", ctl_json(d, "restart", "alpha"))
    check("unserve", ctl_json(d, "unserve"))
    check("drain", ctl_json(d, "drain", "--detach", "--deadline", "5s"))
    check("undrain", ctl_json(d, "undrain"))
    check("cluster_nodes", ctl_json(d, "cluster", "nodes"))
    check("error", ctl_json(d, "restart", "nope", ok=False))
    check("secret_generate", ctl_json(d, "secret", "generate"))
    files = [tmp_path / "one", tmp_path / "two"]
    kids = [ctl_json(d, "secret", "generate", str(f))["key_id"] for f in files]
    check("secret_generate", ctl_json(d, "secret", "generate", str(tmp_path / "three")))
    for f in files:
        check("secret_install", ctl_json(d, "secret", "install", str(f)))
    check("secrets", ctl_json(d, "secret", "list"))
    check("secret_use", ctl_json(d, "secret", "use", kids[1]))
    check("secret_remove", ctl_json(d, "secret", "remove", kids[0]))
    logs = d.ctl("logs", "alpha", "-n", "3", "--json")
    assert logs.returncode == 0
    for line in logs.stdout.splitlines():
        check("log", json.loads(line))
    check("event", _first_followed_event(d))
    stop = ctl_json(d, "stop")
    check("stop", stop)
    assert stop["stopped"] is True


def _first_followed_event(d: DaemonProc) -> dict[str, Any]:
    """The first line of `mlxctl events -f --json -n 1`, then the follower ended by pid."""
    follower = subprocess.Popen(
        [sys.executable, "-m", "mlxctl", "--socket", str(d.socket), "events", "-f", "-n",
         "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
    try:
        assert follower.stdout is not None
        line = follower.stdout.readline()  # the last event is there already: no wait
    finally:
        follower.send_signal(signal.SIGTERM)
        try:
            follower.wait(timeout=20)
        except subprocess.TimeoutExpired:
            follower.kill()
            follower.wait()
        if follower.stdout is not None:
            follower.stdout.close()
    event: dict[str, Any] = json.loads(line)
    return event


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_schema_says_its_name(name: str) -> None:
    schema = schema_of(name)
    assert schema["$id"] == f"mlxctl.{name}/1"
    assert schema["properties"]["schema"]["const"] == f"mlxctl.{name}/1"
    assert "schema" in schema["required"]
