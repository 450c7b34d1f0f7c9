"""MXCL v1 sans-IO core (PROTOCOL.md): secret and key ids, handshake, frames, envelope.

No asyncio, no sockets, no clock, no randomness of its own, and nothing else of
ours is imported here: the shell in mlxceld/net drives it. ``mx_tensors`` (mlx
arrays to blobs) is not imported here, so importing the wire never imports mlx.
The typed messages are ``messages`` (their shape, ping, pong, error),
``agent_messages`` (channel 3), ``link_messages`` (channel 3's link test),
``assignment_messages`` (channel 2) and
``transport_messages`` (channel 1: the words the pipeline's and the replicas' protocols
share), imported from their modules.
"""

from mlxceld.wire.beacon import beacon_key, beacon_mac, build_record, canonical, verify_record
from mlxceld.wire.connection import HANDSHAKE_TIMEOUT_S, Connection
from mlxceld.wire.crypto import Suite
from mlxceld.wire.envelope import (
    ITEMSIZE,
    Envelope,
    MessageSpec,
    Tensor,
    TensorSpec,
    encode_envelope,
    parse_envelope,
)
from mlxceld.wire.errors import (
    BeaconError,
    EnvelopeError,
    LocalProtocolError,
    RemoteProtocolError,
    WireError,
)
from mlxceld.wire.events import (
    Event,
    HandshakeComplete,
    HandshakeRefused,
    KeyUpdated,
    MessageReceived,
    PeerClosed,
)
from mlxceld.wire.frames import Frame, FrameLimits, FrameReceiver, FrameSender, Kind
from mlxceld.wire.handshake import ConnectionRole, Handshake, HandshakeResult, SecretStore
from mlxceld.wire.schedule import Channel
from mlxceld.wire.secret import (
    MIN_SECRET_BYTES,
    Keyring,
    SecretError,
    check_secret,
    key_id,
    trim_secret_file,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "ITEMSIZE",
    "MIN_SECRET_BYTES",
    "BeaconError",
    "Channel",
    "Connection",
    "ConnectionRole",
    "Envelope",
    "EnvelopeError",
    "Event",
    "Frame",
    "FrameLimits",
    "FrameReceiver",
    "FrameSender",
    "Handshake",
    "HandshakeComplete",
    "HandshakeRefused",
    "HandshakeResult",
    "KeyUpdated",
    "Keyring",
    "Kind",
    "LocalProtocolError",
    "MessageReceived",
    "MessageSpec",
    "PeerClosed",
    "RemoteProtocolError",
    "SecretError",
    "SecretStore",
    "Suite",
    "Tensor",
    "TensorSpec",
    "WireError",
    "beacon_key",
    "beacon_mac",
    "build_record",
    "canonical",
    "check_secret",
    "encode_envelope",
    "key_id",
    "parse_envelope",
    "trim_secret_file",
    "verify_record",
]
