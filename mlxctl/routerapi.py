"""The router's OpenAI port as ``mlxctl chat`` uses it: where it is, its key, one
streamed chat completion read delta by delta.

Where: ``--url``, else the daemon's ``mlxctl status`` (``serving.url``, a wildcard
listen address such as 0.0.0.0 or :: reached on loopback). The key: ``--api-key-file``,
else the daemon's ``[serve] api_key_file`` (``serving.api_key_file``), read here and
sent only as the ``Authorization`` header: never in argv, the environment or a message.

Every wait has a deadline: connecting (``CONNECT_S``), a request's head and each piece of
a streamed answer (``READ_S``: a long prompt's prefill comes before the first piece).
What goes wrong is a ``RouterError`` with one line to show and a hint: ``dead`` when
nothing answers at the URL (``mlxctl chat`` then exits 1), else the router refused or
broke off one request (the chat goes on).
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx

from mlxceld.config.serve import read_api_key
from mlxceld.errors import ConfigError

CONNECT_S: Final = 10.0
READ_S: Final = 300.0
WILDCARDS: Final = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


class RouterError(Exception):
    """What went wrong talking to the router, in one line, and what to do."""

    def __init__(self, message: str, hint: str = "", *, dead: bool = False) -> None:
        super().__init__(message)
        self.message, self.hint, self.dead = message, hint, dead


@dataclass(frozen=True)
class Router:
    url: str  # ends with /v1
    model: str | None
    key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Delta:
    """One piece of an answer: ``content`` or ``reasoning`` text, or the answer's end
    (``finish``: its reason, ``usage``: the router's counts)."""

    kind: Literal["content", "reasoning", "finish"]
    text: str = ""
    usage: dict[str, Any] | None = None


def from_status(status: dict[str, Any], key_file: Path | None) -> Router:
    """The router a daemon's status names; ``key_file`` beats the daemon's key file."""
    serving = status.get("serving")
    if not serving or not serving.get("url"):
        raise RouterError("this daemon serves no model (no router here)",
                          "mlxctl serve MODEL_DIR; or mlxctl chat --url URL for a router "
                          "elsewhere", dead=True)
    url = loopback(str(serving["url"]))
    if key_file is not None:
        return Router(url, serving.get("model_name"), key_from(key_file, "--api-key-file"))
    if not serving.get("api_key"):
        return Router(url, serving.get("model_name"))
    where = serving.get("api_key_file")
    if not where:  # a daemon from before serving.api_key_file
        raise RouterError(f"the router at {url} wants an API key",
                          "pass --api-key-file FILE (the daemon's [serve] api_key_file)",
                          dead=True)
    return Router(url, serving.get("model_name"), key_from(Path(where), "the daemon's "
                                                           "[serve] api_key_file"))


def key_from(path: Path, what: str) -> str:
    try:
        return read_api_key(path)
    except ConfigError as exc:
        raise RouterError(f"{what}: {exc.message}", "pass --api-key-file FILE with a copy "
                          "of the key this user can read (one line, chmod 600)",
                          dead=True) from exc


def loopback(url: str) -> str:
    """``url`` with a wildcard host (what the router listens on) as loopback (what
    reaches it from here): ``http://0.0.0.0:8080/v1`` -> ``http://127.0.0.1:8080/v1``."""
    scheme, sep, rest = url.partition("://")
    hostport, slash, path = rest.partition("/")
    host, colon, port = hostport.rpartition(":")
    if not colon or not sep:
        return url
    if ":" in host and not host.startswith("["):
        host = WILDCARDS.get(host, f"[{host}]")
    return f"{scheme}://{WILDCARDS.get(host, host)}:{port}{slash}{path}"


def client(router: Router) -> httpx.Client:
    headers = {"authorization": f"Bearer {router.key}"} if router.key else {}
    return httpx.Client(base_url=router.url.rstrip("/") + "/", headers=headers,
                        timeout=httpx.Timeout(READ_S, connect=CONNECT_S),
                        trust_env=False)


def models(http: httpx.Client, url: str) -> list[str]:
    """The router's model ids (``GET /v1/models``): it answers, the key is right."""
    with _answer(http, url, "GET", "models") as response:
        body = _json(response, url)
    try:
        return [str(m["id"]) for m in body["data"]]
    except (KeyError, TypeError) as exc:
        raise RouterError(f"the router at {url} did not list its models", "is --url the "
                          "router's /v1 URL?", dead=True) from exc


def stream_chat(http: httpx.Client, url: str, body: dict[str, Any]) -> Generator[Delta, None, None]:
    """``POST chat/completions`` streamed; its pieces as they come. Closing the iterator
    (an interrupted answer) closes the connection, which ends the request there."""
    with _answer(http, url, "POST", "chat/completions",
                 {**body, "stream": True, "stream_options": {"include_usage": True}}
                 ) as response:
        finish: str | None = None
        usage: dict[str, Any] | None = None
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk.get("error"), dict):
                    raise RouterError(f"the router broke off the answer: "
                                      f"{chunk['error'].get('message')}",
                                      "mlxctl logs router")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        yield Delta("reasoning", str(thought))
                    if delta.get("content"):
                        yield Delta("content", str(delta["content"]))
                    finish = choice.get("finish_reason") or finish
        except httpx.TransportError as exc:
            raise _transport(exc, url) from exc
        except ValueError as exc:
            raise RouterError(f"the router at {url} sent a piece that is not JSON",
                              "mlxctl logs router") from exc
        yield Delta("finish", finish or "", usage)


class _answer:
    """A request whose answer is checked before it is read: a refusal as one line."""

    def __init__(self, http: httpx.Client, url: str, method: str, path: str,
                 body: dict[str, Any] | None = None) -> None:
        self._request = http.build_request(method, path, json=body)
        self._http, self._url = http, url
        self._response: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        try:
            response = self._http.send(self._request, stream=True)
        except httpx.TransportError as exc:
            raise _transport(exc, self._url) from exc
        if response.status_code >= 400:
            try:
                response.read()
            except httpx.TransportError as exc:
                raise _transport(exc, self._url) from exc
            finally:
                response.close()
            raise _refusal(response, self._url)
        self._response = response
        return response

    def __exit__(self, *exc: object) -> None:
        if self._response is not None:
            self._response.close()


def _json(response: httpx.Response, url: str) -> Any:
    try:
        response.read()
        return response.json()
    except httpx.TransportError as exc:
        raise _transport(exc, url) from exc
    except ValueError as exc:
        raise RouterError(f"the router at {url} answered something that is not JSON",
                          "is --url an mlxceld router (or another OpenAI server)?",
                          dead=True) from exc


def _refusal(response: httpx.Response, url: str) -> RouterError:
    status = response.status_code
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    if status in (401, 403):
        return RouterError(f"the router at {url} refused the API key (HTTP {status}): "
                           f"{message}", "pass --api-key-file FILE holding the router's "
                           "key ([serve] api_key_file)", dead=True)
    if status == 404:
        return RouterError(f"the router at {url} has no such endpoint or model (HTTP 404): "
                           f"{message}", "is --url the router's /v1 URL? the models it "
                           "serves: curl URL/models", dead=True)
    hint = ("the router is busy or still loading; try again in a moment, see: mlxctl status"
            if status >= 500 else "change what the message names (/reset clears the "
            "history; --max-tokens, --temperature)")
    return RouterError(f"the router refused the request (HTTP {status}): {message}", hint)


def _transport(exc: httpx.TransportError, url: str) -> RouterError:
    if isinstance(exc, httpx.TimeoutException):
        return RouterError(f"the router at {url} did not answer within its deadline "
                           f"({exc.__class__.__name__})",
                           "it may be overloaded or stuck; see: mlxctl status, mlxctl logs "
                           "router", dead=isinstance(exc, httpx.ConnectTimeout))
    return RouterError(f"the router at {url} does not answer ({exc or exc.__class__.__name__})",
                       "is it running (or still loading its model)? see: mlxctl status, mlxctl "
                       "logs router", dead=True)
