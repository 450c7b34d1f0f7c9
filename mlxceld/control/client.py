"""The typed client of the control API (used by mlxctl and the tests).

Failures become our errors once: reaching the socket fails in ``transport`` (nothing
listening is DaemonNotRunning, a refused socket PermissionDenied); here a 403 is
PermissionDenied, any other error answer a ControlError carrying the daemon's code,
message and hint, and a deadline that passes a ControlError saying so. Every request
has its own connection (one ``transport.Exchange``); closing the client is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from mlxceld.control.transport import Exchange
from mlxceld.errors import ControlError, PermissionDenied
from mlxceld.types import JSON

REQUEST_TIMEOUT_S = 10.0
PLAN_TIMEOUT_S = 30.0  # the daemon's candidate poll (10 s at most) and the planning
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a heartbeat line every 15 s

T = TypeVar("T")

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

    async def plan_cluster(self, model: str, stages: int) -> JSON:
        """Plan (never assign): the daemon polls every candidate first, up to 10 s."""
        return await self._request("POST", "/v1/cluster/plan", timeout=PLAN_TIMEOUT_S,
                                   body={"model": model, "stages": stages})

    async def activate_cluster(self, model: str, stages: int) -> JSON:
        """Plan, then push and serve in the daemon's background (answer: the bring-up with
        its epoch); poll ``status()["bringup"]`` for each peer's progress."""
        return await self._request("POST", "/v1/cluster/activate", timeout=PLAN_TIMEOUT_S,
                                   body={"model": model, "stages": stages})

    async def events(self, after: int = -20, limit: int = 100) -> JSON:
        return await self._get("/v1/events", after=after, limit=limit)

    async def restart(self, worker: str) -> JSON:
        return await self._request("POST", f"/v1/workers/{_segment(worker)}/restart")

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
        return await self._request("POST", f"/v1/secrets/{_segment(kid)}/primary")

    async def remove_secret(self, kid: str) -> JSON:
        return await self._request("DELETE", f"/v1/secrets/{_segment(kid)}")

    async def stop(self) -> JSON:
        return await self._request("POST", "/v1/stop")

    def follow_events(self, after: int = -20) -> AsyncIterator[JSON]:
        return self._stream("/v1/events", {"after": after, "follow": 1})

    def logs(self, worker: str, lines: int = 50, follow: bool = False) -> AsyncIterator[JSON]:
        return self._stream(f"/v1/workers/{_segment(worker)}/logs",
                            {"lines": lines, "follow": int(follow)})

    async def _get(self, path: str, **params: Any) -> JSON:
        return await self._request("GET", path, params=params or None)

    async def _request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                       body: JSON | None = None, timeout: float = REQUEST_TIMEOUT_S) -> JSON:
        data = None if body is None else json.dumps(body).encode()
        status, content = await self._within(timeout, self._exchange(method, path, params,
                                                                     data))
        if status >= 400:
            raise _answer_error(status, content)
        try:
            answer: JSON = json.loads(content)
        except ValueError as exc:
            raise ControlError(f"the daemon at {self.socket_path} answered {path} with "
                               "something that is not JSON") from exc
        return answer

    async def _exchange(self, method: str, path: str, params: dict[str, Any] | None,
                        data: bytes | None) -> tuple[int, bytes]:
        exchange = await Exchange.open(self.socket_path, method, _target(path, params), data)
        try:
            return exchange.status, await exchange.read()
        finally:
            await exchange.aclose()

    async def _stream(self, path: str, params: dict[str, Any]) -> AsyncIterator[JSON]:
        """NDJSON lines as they come. Opening and an error answer have
        ``REQUEST_TIMEOUT_S``, every later read ``STREAM_READ_TIMEOUT_S`` (the server sends
        an empty line every 15 s)."""
        exchange = await self._within(REQUEST_TIMEOUT_S,
                                      Exchange.open(self.socket_path, "GET",
                                                    _target(path, params)))
        try:
            if exchange.status >= 400:
                content = await self._within(REQUEST_TIMEOUT_S, exchange.read())
                raise _answer_error(exchange.status, content)
            pending = b""
            async with contextlib.aclosing(exchange.chunks()) as chunks:
                while (chunk := await self._within(STREAM_READ_TIMEOUT_S,
                                                   anext(chunks, None))) is not None:
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield _item(line)
            if pending.strip():
                yield _item(pending)
        finally:
            await exchange.aclose()

    async def _within(self, seconds: float, step: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(seconds):
                return await step
        except TimeoutError as exc:
            raise ControlError(f"the daemon at {self.socket_path} did not answer in time",
                               hint="it may be overloaded or stuck; see its log") from exc


def _target(path: str, params: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(params)}" if params else path


def _item(line: bytes) -> JSON:
    item: JSON = json.loads(line)
    return item


def _segment(text: str) -> str:
    return quote(text, safe="")


def _answer_error(status: int, content: bytes) -> ControlError:
    try:
        err = json.loads(content)["error"]
        code, message, hint = str(err["code"]), str(err["message"]), str(err.get("hint", ""))
    except (ValueError, KeyError, TypeError):
        code, message, hint = "http_error", f"the daemon answered HTTP {status}", ""
    if status == 403 and code == "permission_denied":
        return PermissionDenied(message, hint=hint, code=code, status=status)
    return ControlError(message, hint=hint, code=code, status=status)
