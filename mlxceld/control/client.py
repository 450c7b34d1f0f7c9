"""The typed client of the control API (used by mlxctl and the tests).

Failures become our errors once, here: nothing listening is DaemonNotRunning,
a refused socket or a 403 is PermissionDenied, any other error answer is a
ControlError carrying the daemon's code, message and hint.
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied
from mlxceld.types import JSON

REQUEST_TIMEOUT_S = 10.0
PLAN_TIMEOUT_S = 30.0  # the daemon's candidate poll (10 s at most) and the planning
# The daemon's bounds on a deactivation (deactivation.CONNECT_S + ANSWER_S per peer, in
# parallel with the router's stop), and slack.
DEACTIVATE_TIMEOUT_S = 60.0
UNSERVE_TIMEOUT_S = 40.0  # the router's stop: open streams get 10 s, SIGKILL after 20 s
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a heartbeat line every 15 s
START_HINT = ("start it with `mlxceld` (or `brew services start mlxceld`, "
              "`systemctl start mlxceld`), or point --socket / MLXCELD_SOCKET at a running one")


class ControlClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._http = httpx.AsyncClient(
            # No TLS on a Unix socket: verify=False skips loading a CA bundle on every command.
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path), verify=False),
            base_url="http://mlxceld", timeout=REQUEST_TIMEOUT_S,
        )

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

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
                                   json={"model": model, "stages": stages})

    async def activate_cluster(self, model: str, stages: int) -> JSON:
        """Plan, then push and serve in the daemon's background (answer: the bring-up with
        its epoch); poll ``status()["bringup"]`` for each peer's progress."""
        return await self._request("POST", "/v1/cluster/activate", timeout=PLAN_TIMEOUT_S,
                                   json={"model": model, "stages": stages})

    async def deactivate_cluster(self) -> JSON:
        """End the plan on every peer and stop the router; the answer names each peer's
        outcome (``bringup``)."""
        return await self._request("POST", "/v1/cluster/deactivate",
                                   timeout=DEACTIVATE_TIMEOUT_S)

    async def unserve(self) -> JSON:
        return await self._request("POST", "/v1/unserve", timeout=UNSERVE_TIMEOUT_S)

    async def events(self, after: int = -20, limit: int = 100) -> JSON:
        return await self._get("/v1/events", after=after, limit=limit)

    async def restart(self, worker: str) -> JSON:
        return await self._request("POST", f"/v1/workers/{worker}/restart")

    async def serve(self, model: str, model_name: str | None = None) -> JSON:
        return await self._request("POST", "/v1/serve",
                                   json={"model": model, "model_name": model_name})

    async def secrets(self) -> JSON:
        return await self._get("/v1/secrets")

    async def install_secret(self, secret: bytes, *, primary: bool = False,
                             source: str | None = None) -> JSON:
        """Send a secret (hex in the body, over the 0600 peer-checked socket) to the keyring."""
        return await self._request("POST", "/v1/secrets", json={
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
        return self._stream(f"/v1/workers/{worker}/logs",
                            {"lines": lines, "follow": int(follow)})

    async def _get(self, path: str, **params: Any) -> JSON:
        return await self._request("GET", path, params=params or None)

    async def _request(self, method: str, path: str, **kw: Any) -> JSON:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if response.status_code >= 400:
            raise _answer_error(response.status_code, response.content)
        try:
            body: JSON = response.json()
        except ValueError as exc:
            raise ControlError(f"the daemon at {self.socket_path} answered {path} with "
                               "something that is not JSON") from exc
        return body

    async def _stream(self, path: str, params: dict[str, Any]) -> AsyncIterator[JSON]:
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=STREAM_READ_TIMEOUT_S)
        try:
            async with self._http.stream("GET", path, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    raise _answer_error(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if line.strip():
                        item: JSON = json.loads(line)
                        yield item
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc

    def _transport_error(self, exc: httpx.HTTPError) -> ControlError:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        code = cause.errno if isinstance(cause, OSError) else None
        where = self.socket_path
        if code in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
            return DaemonNotRunning(f"mlxceld is not running (nothing listens on {where})",
                                    hint=START_HINT)
        if code in (errno.EACCES, errno.EPERM):
            return PermissionDenied(f"permission denied on the control socket {where}",
                                    hint="run mlxctl as the user that runs mlxceld, or as root")
        if isinstance(exc, httpx.TimeoutException):
            return ControlError(f"the daemon at {where} did not answer in time",
                                hint="it may be overloaded or stuck; see its log")
        if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
            return ControlError(f"the daemon at {where} closed the connection",
                                hint="it may be stopping; check `mlxctl status` again")
        return ControlError(f"cannot talk to the daemon at {where}: {exc}")


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
