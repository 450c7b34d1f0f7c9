"""The worker control channel's requests (daemon to worker), typed as MXCL's messages are.

One JSON line out, one back (``channel.call``): each request is a frozen dataclass
whose ``to_wire()`` is its line's object, its fields and then ``op`` (``OP``), as it
has always gone out; ``from_wire`` (the worker's side, ``workers/runtime.py``) checks
the fields and raises ``OpError`` naming the first one out of bounds. The answer is
``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.

========= =============================== ===============================================
op        sent by                         fields
========= =============================== ===============================================
health    the runner's liveness probes    none; answers name, role, pid, state, keys
stats     the supervisor, a stage host    none; answers ``stats``
stop      (tests; a worker stops itself)  none
activate  a stage host (a standby stage)  none
keyring   the runner, at every change     ``primary_hex``, ``accepted_hex`` (``keys.py``)
api_key   the runner, at every change     ``api_key``: the OpenAI port's key, or null
streams   the runner, for a rotation      ``kid``: answers ``streams`` under that key
drain     the daemon's drains             ``drains``: ``[{"node", "deadline"}, ...]``
replicas  a router's discovered replicas  ``candidates``: ``[{"node_id", "agent"}, ...]``
pipeline  a plan's router moved live      ``options``: the router's new options
retiring  a coordinator, after a switch     none; answers ``retiring``: old engines left
========= =============================== ===============================================

``drain``, ``replicas``, ``pipeline`` and ``retiring`` are the router worker's own ops
(``WorkerContext.ops``), which check what they read themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol, Self

from mlxceld.types import JSON
from mlxceld.wire.secret import MIN_SECRET_BYTES

MAX_KEYS: Final = 16  # a keyring holds a primary and a rotation's overlap: a few keys
MIN_API_KEY: Final = 8  # as config/serve.py's read_api_key asks of the file


class OpError(ValueError):
    """A request whose field ``field`` is out of bounds; the message never carries a
    secret."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class WorkerRequest(Protocol):
    OP: ClassVar[str]

    def to_wire(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _Bare:
    """A request with nothing but its op."""

    OP: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP}

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> Self:
        return cls()


class Health(_Bare):
    OP = "health"


class Stats(_Bare):
    OP = "stats"


class Stop(_Bare):
    OP = "stop"


class Activate(_Bare):
    OP = "activate"


@dataclass(frozen=True)
class KeyringUpdate:
    """The worker's new keyring (``keys.py``): its primary and every other key it accepts,
    as hex secrets."""

    OP: ClassVar[str] = "keyring"
    primary_hex: str
    accepted_hex: tuple[str, ...] = ()

    def __repr__(self) -> str:  # never a secret, not even in a traceback
        return f"KeyringUpdate(<{1 + len(self.accepted_hex)} secrets>)"

    @classmethod
    def of(cls, primary: bytes, accepted: Sequence[bytes]) -> Self:
        return cls(primary.hex(), tuple(s.hex() for s in accepted))

    def secrets(self) -> tuple[bytes, list[bytes]]:
        return bytes.fromhex(self.primary_hex), [bytes.fromhex(a) for a in self.accepted_hex]

    def to_wire(self) -> dict[str, Any]:
        return {"primary_hex": self.primary_hex, "accepted_hex": list(self.accepted_hex),
                "op": self.OP}

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> Self:
        primary = _secret_hex(request.get("primary_hex"), "primary_hex")
        accepted = request.get("accepted_hex", [])
        if not isinstance(accepted, list) or len(accepted) > MAX_KEYS:
            raise OpError("accepted_hex", f"'accepted_hex' must be a list of at most "
                                          f"{MAX_KEYS} hex secrets")
        return cls(primary, tuple(_secret_hex(a, "accepted_hex") for a in accepted))


@dataclass(frozen=True)
class ApiKeyUpdate:
    """The OpenAI port's new API key (``keys.py``), or None: no key asked of clients."""

    OP: ClassVar[str] = "api_key"
    api_key: str | None

    def __repr__(self) -> str:  # never the key, not even in a traceback
        return f"ApiKeyUpdate(<{'a key' if self.api_key is not None else 'no key'}>)"

    def to_wire(self) -> dict[str, Any]:
        return {"api_key": self.api_key, "op": self.OP}

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> Self:
        key = request.get("api_key")
        if key is not None and (not isinstance(key, str) or len(key) < MIN_API_KEY
                                or any(c.isspace() for c in key)):
            raise OpError("api_key", f"'api_key' must be null or one key of at least "
                                     f"{MIN_API_KEY} characters without spaces")
        return cls(key)


def _secret_hex(value: object, name: str) -> str:
    try:
        secret = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise OpError(name, f"{name!r} must hold secrets as hex, each at least "
                            f"{MIN_SECRET_BYTES} bytes")
    assert isinstance(value, str)
    return value


@dataclass(frozen=True)
class StreamsUnder:
    """How many of the worker's open MXCL streams are under key id ``kid`` (hex)."""

    OP: ClassVar[str] = "streams"
    kid: str

    def to_wire(self) -> dict[str, Any]:
        return {"kid": self.kid, "op": self.OP}

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> Self:
        kid = request.get("kid")
        try:
            raw = bytes.fromhex(kid) if isinstance(kid, str) else b""
        except ValueError:
            raw = b""
        if not raw:
            raise OpError("kid", "'kid' must be a key id in hex")
        assert isinstance(kid, str)
        return cls(kid)


@dataclass(frozen=True)
class Drain:
    """Every drain in force (``[]``: none), for the router to hold their nodes."""

    OP: ClassVar[str] = "drain"
    drains: tuple[JSON, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"drains": list(self.drains), "op": self.OP}


@dataclass(frozen=True)
class Replicas:
    """Every candidate discovery knows now, for a router finding its replicas."""

    OP: ClassVar[str] = "replicas"
    candidates: tuple[JSON, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "op": self.OP}


class Retiring(_Bare):
    OP = "retiring"


@dataclass(frozen=True)
class Pipeline:
    """A plan's router moved to its new stages without a restart: its new options."""

    OP: ClassVar[str] = "pipeline"
    options: JSON

    def to_wire(self) -> dict[str, Any]:
        return {"options": self.options, "op": self.OP}
