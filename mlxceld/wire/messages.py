"""Typed MXCL messages (PROTOCOL.md section 4): frozen dataclasses, as h11's events are.

Each message class names its type in ``T``. ``to_wire()`` is its envelope header: a
dict with ``t`` first and the fields in the order they have always gone out, so that
the bytes on the wire are those of the literals it replaced. ``from_wire(header)``
checks every field and raises ``MessageError`` naming the first one out of bounds.

Here, what every channel shares: ``Ping`` and ``Pong`` (answered by the net shell on
every channel) and ``Error`` (a listener's answer to a type it does not serve, or a
refusal). The vocabularies of the agent listener's channels are ``agent_messages``
(channel 3) and ``assignment_messages`` (channel 2). ``decode`` turns a header into the
message of a vocabulary its ``t`` names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, TypeVar

from mlxceld.wire.errors import EnvelopeError

T = TypeVar("T")


class MessageError(EnvelopeError, ValueError):
    """A message header whose field ``field`` is missing or out of bounds; ``reason`` says
    which and why. A ``ValueError`` too: a bad value."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field


class Message(Protocol):
    """What every typed message has."""

    T: ClassVar[str]

    def to_wire(self) -> dict[str, Any]: ...

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self: ...


def field(header: Mapping[str, Any], name: str, kind: type[T], what: str) -> T:
    """``header[name]`` if it is a ``kind`` (a bool is no int); ``MessageError`` naming it
    (``what``: the message, as the error says it) otherwise."""
    value = header.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise MessageError(name, f"{what} field {name!r} is missing or not a "
                                 f"{kind.__name__}")
    return value


def optional(header: Mapping[str, Any], name: str, kind: type[T], what: str) -> T | None:
    """``header[name]``, None when absent or null; ``MessageError`` if it is another type."""
    if header.get(name) is None:
        return None
    return field(header, name, kind, what)


def exact_keys(header: Mapping[str, Any], keys: Iterable[str], what: str) -> None:
    """``MessageError`` unless ``header`` has exactly ``keys`` (``t`` included)."""
    expected = sorted(keys)
    if sorted(header) != expected:
        raise MessageError("t", f"{what} has keys {sorted(header)}, expected {expected}")


@dataclass(frozen=True)
class Ping:
    T: ClassVar[str] = "ping"
    id: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "id": self.id}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "id", int, cls.T))


@dataclass(frozen=True)
class Pong:
    T: ClassVar[str] = "pong"
    id: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "id": self.id}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "id", int, cls.T))


@dataclass(frozen=True)
class Error:
    """A listener's refusal; ``reason`` is safe to log (no secret, no payload)."""

    T: ClassVar[str] = "error"
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "reason": self.reason}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(str(header.get("reason")))  # whatever it is, it is said as text


def vocabulary(*kinds: type[Message]) -> dict[str, type[Message]]:
    """The message classes of a channel by their type (``t``)."""
    return {kind.T: kind for kind in kinds}


def decode(header: Mapping[str, Any], kinds: Mapping[str, type[Message]]) -> Message:
    """The message of ``kinds`` that ``header``'s ``t`` names, checked; ``MessageError``
    for a type not in ``kinds`` or a field out of bounds."""
    kind = kinds.get(str(header.get("t")))
    if kind is None:
        raise MessageError("t", f"unexpected message type {str(header.get('t'))[:40]!r}")
    return kind.from_wire(header)
