"""What a ``Connection`` reports, past tense, as frozen dataclasses (h11 style)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxceld.wire.schedule import Channel


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """Both sides are authenticated and traffic keys are in place.

    ``peer_identity`` is the client's advertised ``host:port`` on the server side
    and ``None`` on the client side (the client knows whom it dialled).
    """

    peer_identity: str | None
    key_id: bytes
    channel: Channel


@dataclass(frozen=True, slots=True)
class HandshakeRefused:
    """Server side: an authenticated client got verdict 1 (at capacity). Flush and close."""

    reason: str


@dataclass(frozen=True, slots=True)
class MessageReceived:
    payload: bytes


@dataclass(frozen=True, slots=True)
class KeyUpdated:
    """The peer moved its sending traffic secret on; so did our receiving side."""


@dataclass(frozen=True, slots=True)
class PeerClosed:
    """The peer sent a close frame: a clean end. Nothing more will arrive."""

    reason: str


Event = HandshakeComplete | HandshakeRefused | MessageReceived | KeyUpdated | PeerClosed
