"""Reading a control request: its query parameters and JSON bodies, in one place.

Every refusal is a ``BadRequest`` naming the query parameter or body field at
fault, with the body's whole shape and where to read more. A value is never
echoed from a body: a secret's body carries the secret. A body is at most
``MAX_BODY_BYTES`` (413, ``RequestTooLarge``, refused as soon as it grows past it);
one nested too deep for the parser is refused (400) saying so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import Request

from mlxceld.errors import BadRequest, RequestTooLarge
from mlxceld.guard.bodies import read_bounded
from mlxceld.types import (
    DEFAULT_MESH,
    MAX_DRAIN_DEADLINE_S,
    MAX_LINK_MIB,
    MAX_LINK_PINGS,
    MAX_PIPELINE_STAGES,
    MAX_REPLICAS,
    MESH_MODES,
    MeshMode,
    parse_mesh,
)
from mlxceld.wire.address import MAX_ADDRESS

QUERY_HINT: Final = "check the query parameters"
MAX_BODY_BYTES: Final = 1 << 20  # the largest body mlxctl sends is a few hundred bytes


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(name, f"query parameter {name!r} must be an integer, not {raw!r}",
                         hint=QUERY_HINT) from None
    if not low <= value <= high:
        raise BadRequest(name, f"query parameter {name!r} must be between {low} and {high}",
                         hint=QUERY_HINT)
    return value


def flag_param(request: Request, name: str) -> bool:
    """``?follow=1`` or ``?follow=true``; anything else is off."""
    return request.query_params.get(name) in ("1", "true")


def text_param(request: Request, name: str) -> str | None:
    return request.query_params.get(name) or None


class Body:
    """A request's JSON object; each refusal names its field, the shape and the hint."""

    def __init__(self, fields: dict[str, Any], shape: str, hint: str) -> None:
        self._fields, self._shape, self._hint = fields, shape, hint

    @classmethod
    async def read(cls, request: Request, shape: str, hint: str) -> Body:
        try:
            value = json.loads(await _bounded_body(request, hint))
        except RecursionError:  # the C parser's guard: caught here, never logged
            raise BadRequest("body", "the body is nested too deeply to be parsed; it must be "
                             f"{shape}", hint=hint) from None
        except ValueError:  # not JSON, not UTF-8
            raise BadRequest("body", f"the body is not JSON; it must be {shape}",
                             hint=hint) from None
        if not isinstance(value, dict):
            raise BadRequest("body", f"the body is not a JSON object; it must be {shape}",
                             hint=hint)
        return cls(value, shape, hint)

    def refuse(self, name: str, problem: str) -> BadRequest:
        return BadRequest(name, f"body field {name!r} {problem}; the body must be JSON: "
                          f"{self._shape}", hint=self._hint)

    def required(self, name: str) -> Any:
        if name not in self._fields:
            raise self.refuse(name, "is missing")
        return self._fields[name]

    def text(self, name: str) -> str:
        value = self.required(name)
        if not isinstance(value, str) or not value:
            raise self.refuse(name, "must be a non-empty string")
        return value

    def optional_text(self, name: str) -> str | None:
        value = self._fields.get(name)
        if not isinstance(value, str | None):
            raise self.refuse(name, "must be a string")
        return value

    def integer(self, name: str, low: int, high: int) -> int:
        value = self.required(name)
        if type(value) is not int or not low <= value <= high:  # a bool is no count
            raise self.refuse(name, f"must be an integer from {low} to {high}")
        return value

    def optional_integer(self, name: str, low: int, high: int, default: int) -> int:
        return default if self._fields.get(name) is None else self.integer(name, low, high)

    def optional_number(self, name: str, low: float, high: float) -> float | None:
        value = self._fields.get(name)
        if value is None:
            return None
        if type(value) not in (int, float) or not low <= value <= high:  # a bool is none
            raise self.refuse(name, f"must be a number from {low:g} to {high:g}")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._fields.get(name, default)
        if not isinstance(value, bool):
            raise self.refuse(name, "must be true or false")
        return value

    def hex_bytes(self, name: str) -> bytes:
        value = self.required(name)
        try:
            return bytes.fromhex(value)
        except (TypeError, ValueError):
            raise self.refuse(name, "must be a string of hex digits") from None


async def _bounded_body(request: Request, hint: str) -> bytes:
    return await read_bounded(
        request, MAX_BODY_BYTES,
        too_large=RequestTooLarge("body", f"the request body is larger than {MAX_BODY_BYTES} "
                                  "bytes, the most the control API takes", hint=hint),
        went_away=BadRequest("body", "the client went away before sending the whole body",
                             hint=hint))


@dataclass(frozen=True)
class PlanRequest:
    """`mlxctl cluster plan` and `mlxctl cluster activate` (``replicas``: 1 when left
    out; ``mesh``: pp when left out)."""

    model: str
    stages: int
    replicas: int = 1
    mesh: MeshMode = DEFAULT_MESH

    @classmethod
    async def read(cls, request: Request, command: str) -> PlanRequest:
        body = await Body.read(request, f'{{"model": DIR, "stages": 1..{MAX_PIPELINE_STAGES}, '
                               f'"replicas": 1..{MAX_REPLICAS} (optional), "mesh": '
                               f'{"|".join(MESH_MODES)} (optional)}}',
                               f"see `mlxctl cluster {command} --help`")
        said = body.optional_text("mesh")
        try:
            mesh = DEFAULT_MESH if said is None else parse_mesh(said, "mesh")
        except ValueError as exc:
            raise body.refuse("mesh", f"must be one of {', '.join(MESH_MODES)}") from exc
        return cls(body.text("model"), body.integer("stages", 1, MAX_PIPELINE_STAGES),
                   body.optional_integer("replicas", 1, MAX_REPLICAS, 1), mesh)


@dataclass(frozen=True)
class LinkTestRequest:
    """`mlxctl cluster link-test`: the ``peer`` (a node id or an agent address), how many
    round trips (``pings``) and how many bytes each way (``size``, whole MiB)."""

    peer: str
    pings: int
    size: int

    @classmethod
    async def read(cls, request: Request) -> LinkTestRequest:
        body = await Body.read(request, f'{{"peer": NODE-OR-ADDRESS, "pings": 1..{MAX_LINK_PINGS}, '
                               f'"size_mib": 1..{MAX_LINK_MIB}}}',
                               "see `mlxctl cluster link-test --help`")
        peer = body.text("peer")
        if len(peer) > MAX_ADDRESS or not peer.isprintable():
            raise body.refuse("peer", f"must be at most {MAX_ADDRESS} printable characters")
        return cls(peer, body.integer("pings", 1, MAX_LINK_PINGS),
                   body.integer("size_mib", 1, MAX_LINK_MIB) << 20)


@dataclass(frozen=True)
class ServeRequest:
    """`mlxctl serve`; ``model_name`` is None for the model's own name."""

    model: str
    model_name: str | None

    @classmethod
    async def read(cls, request: Request) -> ServeRequest:
        body = await Body.read(request, '{"model": PATH-OR-REPO, "model_name": optional '
                               'string}', "see `mlxctl serve --help`")
        return cls(body.text("model"), body.optional_text("model_name"))


@dataclass(frozen=True)
class DrainRequest:
    """`mlxctl drain` and `mlxctl undrain`: ``node`` None is this daemon's own node;
    ``deadline_s`` None is no deadline."""

    node: str | None
    deadline_s: float | None
    force: bool

    @classmethod
    async def read(cls, request: Request, command: str) -> DrainRequest:
        body = await Body.read(request, f'{{"node": optional string, "deadline_s": optional '
                               f'number 0..{MAX_DRAIN_DEADLINE_S:g}, "force": optional bool}}',
                               f"see `mlxctl {command} --help`")
        deadline = body.optional_number("deadline_s", 0.0, MAX_DRAIN_DEADLINE_S)
        return cls(body.optional_text("node") or None, deadline, body.flag("force", False))


@dataclass(frozen=True, repr=False)
class SecretRequest:
    """`mlxctl secret install`; ``source`` (cut to 200 characters) says where it came from."""

    secret: bytes
    primary: bool
    source: str

    @classmethod
    async def read(cls, request: Request) -> SecretRequest:
        body = await Body.read(request, '{"secret_hex": HEX, "primary": optional bool, '
                               '"source": optional string}',
                               "see `mlxctl secret install --help`")
        secret = body.hex_bytes("secret_hex")
        primary = body.flag("primary", False)
        source = body.optional_text("source") or "the control API"
        return cls(secret, primary, source[:200])

    def __repr__(self) -> str:  # never the secret, not even in a traceback's locals
        return f"SecretRequest(primary={self.primary}, source={self.source!r})"


@dataclass(frozen=True, repr=False)
class RotateRequest:
    """`mlxctl secret rotate`: the new secret, or None to have the daemon generate one."""

    secret: bytes | None

    @classmethod
    async def read(cls, request: Request) -> RotateRequest:
        body = await Body.read(request, '{"secret_hex": optional HEX}',
                               "see `mlxctl secret rotate --help`")
        given = body.optional_text("secret_hex")
        return cls(body.hex_bytes("secret_hex") if given is not None else None)

    def __repr__(self) -> str:  # never the secret, not even in a traceback's locals
        return f"RotateRequest(given={self.secret is not None})"
