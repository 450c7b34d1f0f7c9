"""The typed client of the control API (used by mlxctl and the tests), on asyncio.

Requests, answers and their errors are ``exchange``'s; a deadline that passes is a
ControlError saying so. Every request has its own connection; closing the client is a
no-op. mlxctl's read-only commands use ``blocking.BlockingClient``, the same without
asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from mlxceld.control.clients.exchange import (
    PLAN_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    STREAM_READ_TIMEOUT_S,
    Lines,
    answer_error,
    decode,
    segment,
    target,
    timed_out,
)
from mlxceld.control.clients.transport import Connection
from mlxceld.types import DEFAULT_MESH, JSON

T = TypeVar("T")

# The daemon's bounds on a deactivation (deactivation.CONNECT_S + ANSWER_S per peer, in
# parallel with the router's stop), and slack.
DEACTIVATE_TIMEOUT_S = 60.0
# A rotation: its probe (20 s), five steps of at most 50 s each, the removal's handover
# (cluster/rotation.py HANDOVER_S: 30 s) and some slack.
ROTATE_TIMEOUT_S = 340.0
# A reload: the config file, a model's metadata (a repo id: fetched) and the workers'
# reconcile (an added one started, a removed one stopped within its stop timeout).
RELOAD_TIMEOUT_S = 120.0
UNSERVE_TIMEOUT_S = 40.0  # the router's stop: open streams get 10 s, SIGKILL after 20 s
# A link test: the dial (net/link.py CONNECT_S, 3 s), the measurement (TEST_S, 60 s) and
# slack.
LINK_TEST_TIMEOUT_S = 75.0


class ControlClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Nothing stays open between requests."""

    async def version(self) -> JSON:
        return await self._get("/v1/version")

    async def status(self) -> JSON:
        return await self._get("/v1/status")

    async def workers(self) -> JSON:
        return await self._get("/v1/workers")

    async def cluster_nodes(self) -> JSON:
        return await self._get("/v1/cluster/nodes")

    async def plan_cluster(self, model: str, stages: int, replicas: int = 1,
                           mesh: str = DEFAULT_MESH) -> JSON:
        """Plan (never assign): the daemon polls every candidate first, up to 10 s."""
        return await self._request("POST", "/v1/cluster/plan", timeout=PLAN_TIMEOUT_S,
                                   body=_plan_body(model, stages, replicas, mesh))

    async def activate_cluster(self, model: str, stages: int, replicas: int = 1,
                               mesh: str = DEFAULT_MESH) -> JSON:
        """Plan, then push and serve in the daemon's background (answer: the bring-up with
        its epoch); poll ``status()["bringup"]`` for each peer's progress."""
        return await self._request("POST", "/v1/cluster/activate", timeout=PLAN_TIMEOUT_S,
                                   body=_plan_body(model, stages, replicas, mesh))

    async def deactivate_cluster(self) -> JSON:
        """End the plan on every peer and stop the router; the answer names each peer's
        outcome (``bringup``)."""
        return await self._request("POST", "/v1/cluster/deactivate",
                                   timeout=DEACTIVATE_TIMEOUT_S)

    async def link_test(self, peer: str, pings: int, size_mib: int) -> JSON:
        """`mlxctl cluster link-test`: ``pings`` round trips and ``size_mib`` MiB each way
        with ``peer``'s agent (a node id or an agent address)."""
        return await self._request("POST", "/v1/cluster/link-test",
                                   timeout=LINK_TEST_TIMEOUT_S,
                                   body={"peer": peer, "pings": pings, "size_mib": size_mib})

    async def unserve(self) -> JSON:
        return await self._request("POST", "/v1/unserve", timeout=UNSERVE_TIMEOUT_S)

    async def events(self, after: int = -20, limit: int = 100) -> JSON:
        return await self._get("/v1/events", after=after, limit=limit)

    async def restart(self, worker: str) -> JSON:
        return await self._request("POST", f"/v1/workers/{segment(worker)}/restart")

    async def serve(self, model: str, model_name: str | None = None) -> JSON:
        return await self._request("POST", "/v1/serve",
                                   body={"model": model, "model_name": model_name})

    async def secrets(self) -> JSON:
        return await self._get("/v1/secrets")

    async def install_secret(self, secret: bytes, *, primary: bool = False,
                             source: str | None = None) -> JSON:
        """Send a secret (hex in the body, over the 0600 peer-checked socket) to the keyring."""
        return await self._request("POST", "/v1/secrets", body={
            "secret_hex": secret.hex(), "primary": primary, "source": source})

    async def use_secret(self, kid: str) -> JSON:
        return await self._request("POST", f"/v1/secrets/{segment(kid)}/primary")

    async def remove_secret(self, kid: str) -> JSON:
        return await self._request("DELETE", f"/v1/secrets/{segment(kid)}")

    async def rotate_secret(self, secret: bytes | None) -> JSON:
        """`mlxctl secret rotate`: waits for the whole rotation (``ROTATE_TIMEOUT_S``)."""
        return await self._request("POST", "/v1/secrets/rotate", timeout=ROTATE_TIMEOUT_S,
                                   body={"secret_hex": secret.hex() if secret else None})

    async def drains(self) -> JSON:
        return await self._get("/v1/drains")

    async def drain(self, node: str | None, deadline_s: float | None = None,
                    force: bool = False) -> JSON:
        return await self._request("POST", "/v1/drain", body={
            "node": node, "deadline_s": deadline_s, "force": force})

    async def undrain(self, node: str | None) -> JSON:
        return await self._request("POST", "/v1/undrain", body={"node": node})

    async def reload(self) -> JSON:
        """Re-read the daemon's config file, as SIGHUP does; a bad one is a ControlError."""
        return await self._request("POST", "/v1/reload", timeout=RELOAD_TIMEOUT_S)

    async def stop(self) -> JSON:
        return await self._request("POST", "/v1/stop")

    def follow_events(self, after: int = -20) -> AsyncIterator[JSON]:
        return self._stream("/v1/events", {"after": after, "follow": 1})

    def logs(self, worker: str, lines: int = 50, follow: bool = False) -> AsyncIterator[JSON]:
        return self._stream(f"/v1/workers/{segment(worker)}/logs",
                            {"lines": lines, "follow": int(follow)})

    async def _get(self, path: str, **params: Any) -> JSON:
        return await self._request("GET", path, params=params or None)

    async def _request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                       body: JSON | None = None, timeout: float | None = None) -> JSON:
        where = target(path, params)
        data = None if body is None else json.dumps(body).encode()
        seconds = REQUEST_TIMEOUT_S if timeout is None else timeout
        status, content = await self._within(seconds, self._exchange(method, where, data))
        return decode(self.socket_path, where, status, content)

    async def _exchange(self, method: str, where: str, data: bytes | None
                        ) -> tuple[int, bytes]:
        conn = await Connection.open(self.socket_path, method, where, data)
        try:
            return conn.status, await conn.read()
        finally:
            await conn.aclose()

    async def _stream(self, path: str, params: dict[str, Any]) -> AsyncIterator[JSON]:
        """NDJSON lines as they come. Opening and an error answer have
        ``REQUEST_TIMEOUT_S``, every later read ``STREAM_READ_TIMEOUT_S`` (the server sends
        an empty line every 15 s)."""
        conn = await self._within(REQUEST_TIMEOUT_S, Connection.open(
            self.socket_path, "GET", target(path, params)))
        try:
            if conn.status >= 400:
                raise answer_error(conn.status, await self._within(REQUEST_TIMEOUT_S,
                                                                   conn.read()))
            items = Lines()
            async with contextlib.aclosing(conn.chunks()) as chunks:
                while (chunk := await self._within(STREAM_READ_TIMEOUT_S,
                                                   anext(chunks, None))) is not None:
                    for item in items.feed(chunk):
                        yield item
            for item in items.feed(b""):
                yield item
        finally:
            await conn.aclose()

    async def _within(self, seconds: float, step: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(seconds):
                return await step
        except TimeoutError as exc:
            raise timed_out(self.socket_path) from exc


def _plan_body(model: str, stages: int, replicas: int, mesh: str) -> JSON:
    """`cluster plan|activate`'s body; ``replicas`` only when more than one, ``mesh`` only
    when not the default (as before)."""
    body: JSON = {"model": model, "stages": stages}
    if replicas != 1:
        body["replicas"] = replicas
    if mesh != DEFAULT_MESH:
        body["mesh"] = mesh
    return body
