"""The control app through httpx's ASGI transport, over a small fake of its seam (DaemonView).

What is refused is answered where it is raised: a bad query parameter or body
field is a 400 naming it, each domain error has its status (control/errors.py),
and an exception of any other kind is our bug: a 500 that says nothing of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxceld import __version__
from mlxceld.control.app import build_app
from mlxceld.errors import (
    BadRequest,
    BringUpInProgress,
    ChannelError,
    ConfigError,
    DaemonError,
    KeyringError,
    MlxceldError,
    ModelRefused,
    NoActivePlan,
    PlanRefused,
    PrimaryKeyRemoval,
    ShuttingDown,
    StateError,
    UnknownKey,
    UnknownWorker,
    UnserveRefused,
    WorkerError,
)
from mlxceld.net.errors import LinkTestFailed
from mlxceld.state import EventLog
from mlxceld.state.db import open_db
from mlxceld.types import JSON

from helpers.views import Answer, view_of

PLAN = {"model": "/models/m", "stages": 2}
KID = "00112233445566ff"


class FakeDaemon:
    """The daemon, flat (``helpers.views.view_of`` makes its parts), with one worker,
    ``alpha``; every call raises ``fail`` when it is set."""

    def __init__(self, tmp_path: Path) -> None:
        self.db = open_db(tmp_path / "state.db")
        self.events = EventLog(self.db)
        self.log = tmp_path / "alpha.log"
        self.log.write_text("hello\n")
        self.stopping = False
        self.fail: Exception | None = None
        self.calls: list[str] = []

    def _called(self, name: str) -> None:
        self.calls.append(name)
        if self.fail is not None:
            raise self.fail

    def status(self) -> JSON:
        self._called("status")
        return {"daemon": {"pid": 1}, "workers": [{"name": "alpha", "state": "running"}]}

    def workers(self) -> list[JSON]:
        self._called("workers")
        return []

    async def worker_stats(self) -> dict[str, JSON]:
        return {}

    def cluster_nodes(self) -> Answer:
        self._called("cluster_nodes")
        return Answer({"nodes": []})

    async def plan_cluster(self, model: str, stages: int, replicas: int = 1,
                           mesh: str = "pp") -> Answer:
        self._called("plan_cluster")
        return Answer({"model": model, "stages": stages, "mesh": mesh})

    async def activate_cluster(self, model: str, stages: int, replicas: int = 1,
                               mesh: str = "pp") -> JSON:
        self._called("activate_cluster")
        said = {"mesh": mesh} if mesh != "pp" else {}
        return {"state": "planning", "model": model, "stages": stages, **said}

    async def deactivate_cluster(self) -> JSON:
        self._called("deactivate_cluster")
        return {"state": "deactivated"}

    def log_path(self, name: str) -> str | None:
        return str(self.log) if name == "alpha" else None

    def restart_worker(self, name: str) -> None:
        self._called("restart_worker")

    async def serve_model(self, model: str, name: str | None) -> Answer | None:
        self._called("serve_model")
        return Answer({"model": model, "model_name": name})

    async def unserve(self) -> Answer:
        self._called("unserve")
        return Answer({"unserved": None})

    def request_stop(self) -> None:
        self._called("request_stop")

    async def link_test(self, peer: str, pings: int, size: int) -> Answer:
        self._called("link_test")
        return Answer({"peer": peer, "pings": pings, "size": size})

    def secrets(self) -> list[Answer]:
        self._called("secrets")
        return []

    async def install_secret(self, secret: bytes, primary: bool, source: str) -> Answer:
        self._called("install_secret")
        return Answer({"key_id": KID})

    async def use_secret(self, kid: str) -> Answer:
        self._called("use_secret")
        return Answer({"key_id": kid})

    async def remove_secret(self, kid: str) -> Answer:
        self._called("remove_secret")
        return Answer({"key_id": kid})


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(tmp_path)
    yield fake
    fake.db.close()


def call(daemon: FakeDaemon, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(view_of(daemon)))
        async with httpx.AsyncClient(transport=transport, base_url="http://control") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def refusal(response: httpx.Response, status: int) -> dict[str, str]:
    """The error of an error answer, after checking its status and shape."""
    assert response.status_code == status, response.text
    assert response.headers["mlxceld-version"] == __version__
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"code", "message", "hint"}
    error: dict[str, str] = body["error"]
    return error


def test_answers_carry_the_schema_and_the_version(daemon: FakeDaemon) -> None:
    r = call(daemon, "GET", "/v1/version")
    assert r.status_code == 200 and r.headers["mlxceld-version"] == __version__
    assert r.json() == {"schema": "mlxceld.version/1", "version": __version__, "api": 1}
    r = call(daemon, "POST", "/v1/cluster/activate", json=PLAN)
    assert r.status_code == 202
    assert r.json()["bringup"] == {"state": "planning", **PLAN}


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/events?after=x", "after"),
    ("/v1/events?limit=0", "limit"),
    ("/v1/events?after=-5000", "after"),
    ("/v1/workers/alpha/logs?lines=many", "lines"),
])
def test_a_bad_query_parameter_is_a_400_that_names_it(daemon: FakeDaemon, path: str,
                                                      param: str) -> None:
    error = refusal(call(daemon, "GET", path), 400)
    assert set(error) == {"code", "message", "hint"}
    assert error["code"] == "bad_request"
    assert error["message"].startswith(f"query parameter {param!r} must be")
    assert error["hint"] == "check the query parameters"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/cluster/plan", {"model": "/m"}, "stages"),
    ("/v1/cluster/plan", {"model": "/m", "stages": 0}, "stages"),
    ("/v1/cluster/plan", {"model": "/m", "stages": True}, "stages"),
    ("/v1/cluster/activate", {"model": "", "stages": 2}, "model"),
    ("/v1/cluster/activate", {"model": "/m", "stages": 1, "replicas": 9}, "replicas"),
    ("/v1/cluster/plan", {"model": "/m", "stages": 1, "replicas": 0}, "replicas"),
    ("/v1/cluster/plan", {"model": "/m", "stages": 4, "mesh": "ring"}, "mesh"),
    ("/v1/cluster/activate", {"model": "/m", "stages": 4, "mesh": 2}, "mesh"),
    ("/v1/serve", {"model": 3}, "model"),
    ("/v1/serve", {"model": "/m", "model_name": 5}, "model_name"),
    ("/v1/secrets", {"primary": True}, "secret_hex"),
    ("/v1/secrets", {"secret_hex": "00ff", "primary": "yes"}, "primary"),
    ("/v1/secrets", {"secret_hex": "00ff", "source": ["x"]}, "source"),
    ("/v1/cluster/link-test", {"peer": "b", "pings": 1, "size_mib": 65}, "size_mib"),
    ("/v1/cluster/link-test", {"peer": "b", "pings": 0, "size_mib": 1}, "pings"),
    ("/v1/cluster/link-test", {"peer": "b\n", "pings": 1, "size_mib": 1}, "peer"),
    ("/v1/cluster/link-test", {"pings": 1, "size_mib": 1}, "peer"),
])
def test_a_bad_body_field_is_a_400_that_names_it(daemon: FakeDaemon, path: str,
                                                 body: dict[str, Any], field: str) -> None:
    error = refusal(call(daemon, "POST", path, json=body), 400)
    assert error["code"] == "bad_request"
    assert error["message"].startswith(f"body field {field!r} ")
    assert "the body must be JSON: {" in error["message"] and "--help" in error["hint"]
    assert daemon.calls == []


@pytest.mark.parametrize("content", [b"{", b"[1, 2]", b"\xff"])
def test_a_body_that_is_no_json_object_is_a_400(daemon: FakeDaemon, content: bytes) -> None:
    error = refusal(call(daemon, "POST", "/v1/cluster/plan", content=content), 400)
    assert error["code"] == "bad_request" and error["message"].startswith("the body is not")
    assert error["hint"] == "see `mlxctl cluster plan --help`"


@pytest.mark.parametrize("content", [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                     b'{"a": ' * 100_000 + b"1" + b"}" * 100_000])
def test_a_body_nested_too_deeply_is_a_400_that_says_so(
        daemon: FakeDaemon, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    error = refusal(call(daemon, "POST", "/v1/cluster/plan", content=content), 400)
    assert error["code"] == "bad_request"
    assert error["message"].startswith("the body is nested too deeply to be parsed; it must be {")
    assert error["hint"] == "see `mlxctl cluster plan --help`"
    assert "RecursionError" not in caplog.text and daemon.calls == []
    assert call(daemon, "GET", "/v1/version").status_code == 200


def test_a_body_over_the_limit_is_a_413_that_names_it(daemon: FakeDaemon) -> None:
    from mlxceld.control.requests import MAX_BODY_BYTES

    async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        yield b'{"model": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"m" * 65536
        yield b'"}'

    declared = b'{"model": "' + b"m" * MAX_BODY_BYTES + b'"}'
    for content in (declared, streamed()):
        error = refusal(call(daemon, "POST", "/v1/serve", content=content), 413)
        assert error["code"] == "request_too_large"
        assert error["message"] == (f"the request body is larger than {MAX_BODY_BYTES} bytes, "
                                    "the most the control API takes")
        assert error["hint"] == "see `mlxctl serve --help`"
    assert daemon.calls == []


def test_a_secret_is_never_echoed(daemon: FakeDaemon) -> None:
    r = call(daemon, "POST", "/v1/secrets", json={"secret_hex": "not-hex-SECRET"})
    assert refusal(r, 400)["message"].startswith("body field 'secret_hex' must be a string of hex")
    assert "SECRET" not in r.text


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/status", None),
    ("POST", "/v1/cluster/plan", PLAN),
    ("POST", "/v1/serve", {"model": "/m"}),
    ("POST", f"/v1/secrets/{KID}/primary", None),
    ("POST", "/v1/stop", None),
])
@pytest.mark.parametrize("bug", [ValueError, TypeError, KeyError])
def test_an_unexpected_exception_is_a_500_that_leaks_nothing(
        daemon: FakeDaemon, caplog: pytest.LogCaptureFixture, method: str, path: str,
        body: JSON | None, bug: type[Exception]) -> None:
    daemon.fail = bug("internals: /private/path 42")
    with caplog.at_level(logging.ERROR, logger="mlxceld.control"):
        r = call(daemon, method, path, json=body)
    error = refusal(r, 500)
    assert error == {"code": "internal",
                     "message": f"the daemon failed to answer {method} {path}",
                     "hint": "a bug in mlxceld: the daemon's log has the traceback; please "
                     "report it"}
    assert "internals" not in r.text and "private" not in r.text
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.exc_info is not None and record.exc_info[0] is bug
    assert f"{method} {path}" in record.getMessage()


@pytest.mark.parametrize(("exc", "status"), [
    (BadRequest("model", "no such field"), 400),
    (ConfigError("no secret", hint="install one"), 400),
    (ModelRefused("model directory /m does not exist"), 400),
    (KeyringError("'x' is not a key id"), 400),
    (NoActivePlan("nothing to deactivate: no plan was pushed from here"), 400),
    (UnknownWorker("no worker named 'x'"), 404),
    (UnknownKey("no key 00"), 404),
    (UnserveRefused("the model /m comes from --model"), 409),
    (PrimaryKeyRemoval("key 00 is the primary"), 409),
    (BringUpInProgress("a bring-up is in progress (plan 3)", hint="wait"), 409),
    (ShuttingDown("the daemon is shutting down"), 503),
    (DaemonError("the daemon is shutting down and starts no bring-up"), 503),
    (StateError("state database x cannot be written"), 500),
    (WorkerError("worker 'router' cannot be spawned"), 500),
    (ChannelError("worker 'router' did not answer"), 500),
    (MlxceldError("something on purpose"), 500),
])
def test_each_domain_error_has_its_status_code_message_and_hint(
        daemon: FakeDaemon, exc: MlxceldError, status: int) -> None:
    daemon.fail = exc
    error = refusal(call(daemon, "POST", "/v1/cluster/plan", json=PLAN), status)
    assert error == {"code": exc.code, "message": exc.message, "hint": exc.hint}


def test_a_link_test_reads_its_body_and_a_failed_one_is_a_502(daemon: FakeDaemon) -> None:
    body = {"peer": "node-b", "pings": 5, "size_mib": 2}
    r = call(daemon, "POST", "/v1/cluster/link-test", json=body)
    assert r.status_code == 200 and r.json()["schema"] == "mlxceld.cluster_link_test/1"
    assert (r.json()["peer"], r.json()["pings"], r.json()["size"]) == ("node-b", 5, 2 << 20)
    daemon.fail = LinkTestFailed("connect", "cannot reach peer node-b: refused",
                                 peer="node-b", hint="is its daemon running?")
    error = refusal(call(daemon, "POST", "/v1/cluster/link-test", json=body), 502)
    assert error == {"code": "link_test_failed", "message": "cannot reach peer node-b: refused",
                     "hint": "is its daemon running?"}


def test_a_refused_plan_names_its_shortfalls(daemon: FakeDaemon) -> None:
    shortfall = {"stage": "stage-1", "node_id": "n2", "address": "10.0.0.2:1",
                 "needed_bytes": 10, "usable_bytes": 4, "short_bytes": 6}
    daemon.fail = PlanRefused("plan refused: stage-1 does not fit", hint="add a node",
                              shortfalls=(shortfall,))
    error = refusal(call(daemon, "POST", "/v1/cluster/activate", json=PLAN), 409)
    assert error == {"code": "plan_refused", "message": "plan refused: stage-1 does not fit",
                     "hint": "add a node", "shortfalls": [shortfall]}


def test_the_endpoints_own_refusals(daemon: FakeDaemon) -> None:
    for method, path in (("GET", "/v1/workers/ghost/logs"),
                         ("POST", "/v1/workers/ghost/restart")):
        assert refusal(call(daemon, method, path), 404) == {
            "code": "unknown_worker", "message": "no worker named 'ghost'",
            "hint": "see `mlxctl workers` for the names"}
    assert refusal(call(daemon, "GET", "/v1/nope"), 404)["code"] == "not_found"
    assert refusal(call(daemon, "GET", "/v1/stop"), 405)["code"] == "method_not_allowed"
    daemon.stopping = True
    for path in ("/v1/unserve", "/v1/cluster/deactivate", "/v1/workers/alpha/restart"):
        assert refusal(call(daemon, "POST", path), 503)["code"] == "stopping"
    assert daemon.calls == []


class Coordinating(FakeDaemon):
    """A coordinator serving plan 4 over one peer that missed a secret rotation."""

    def status(self) -> JSON:
        self._called("status")
        return {"daemon": {"pid": 1}, "healing": None, "serving": None,
                "bringup": {"state": "active", "epoch": 4, "model": "/m", "peers": [
                    {"stage": "stage-0", "node_id": "mac-b", "address": "10.0.0.2:19000",
                     "layers": [0, 4], "state": "active"}]},
                "workers": [{"name": "router", "role": "router", "state": "running"}],
                "problems": []}

    async def worker_stats(self) -> dict[str, JSON]:
        return {"router": {"url": "http://h:1/v1", "tokens": 9, "tokens_per_s": 1.5,
                           "stages": [{"stage": "stage-0", "layers": [0, 4],
                                       "connected": True, "state": "attached", "error": None,
                                       "since": 1.0, "address": "10.0.0.2:4000",
                                       "rtt_ms": 0.5}]}}

    def cluster_nodes(self) -> Answer:
        self._called("cluster_nodes")
        return Answer({"key_id": KID, "liveness": [], "nodes": [
            {"address": "10.0.0.2:19000", "node_id": "mac-b", "key_id": "ab" * 8,
             "key_stale": True, "liveness": None}]})

    def drains(self) -> list[Answer]:
        self._called("drains")
        return []

    def rotation(self) -> Answer | None:
        self._called("rotation")
        return None


def test_a_coordinators_status_carries_its_cluster_view_and_its_problems(
        tmp_path: Path) -> None:
    daemon = Coordinating(tmp_path)
    try:
        body = call(daemon, "GET", "/v1/status").json()
    finally:
        daemon.db.close()
    view = body["pipeline"]
    assert (view["epoch"], view["router"]["tokens_per_s"]) == (4, 1.5)
    [stage] = view["stages"]
    assert (stage["node_id"], stage["link"]["rtt_ms"], stage["peer"]["key_stale"]) == (
        "mac-b", 0.5, True)
    assert [p["subject"] for p in body["problems"]] == ["mac-b"]
    # what the daemon keeps in memory or in its database: no peer is asked
    assert daemon.calls == ["status", "cluster_nodes", "drains", "rotation"]


def test_a_plan_carries_its_mesh_to_the_daemon(daemon: FakeDaemon) -> None:
    """``mesh`` is passed on as said, pp when left out (`mlxctl cluster plan|activate
    --mesh`)."""
    r = call(daemon, "POST", "/v1/cluster/plan", json={**PLAN, "mesh": "2d"})
    assert r.status_code == 200 and r.json()["mesh"] == "2d"
    assert call(daemon, "POST", "/v1/cluster/plan", json=PLAN).json()["mesh"] == "pp"
    r = call(daemon, "POST", "/v1/cluster/activate", json={**PLAN, "mesh": "auto"})
    assert r.status_code == 202 and r.json()["bringup"]["mesh"] == "auto"
