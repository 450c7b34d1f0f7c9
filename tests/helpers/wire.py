"""Helpers for the wire tests: the vectors, scripted randomness, and a fake link.

The fake link moves bytes between two sans-IO connections, one byte at a time
if asked (h11's ConnectionPair), and never touches a socket or a clock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

from mlxceld.wire import (
    Channel,
    Connection,
    ConnectionRole,
    Event,
    FrameLimits,
    Suite,
)
from mlxceld.wire.frames import DEFAULT_LIMITS

from helpers.keys import keyring

# The contract's vectors live in ../shared beside the repository (CI has it too); the copy
# in tests/wire serves a checkout without it, and test_vectors checks the two are the same.
SHARED_VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors" / "mxcl-v1.json"
LOCAL_VECTORS = Path(__file__).resolve().parents[1] / "wire" / "mxcl-v1.json"
VECTORS: dict[str, Any] = json.loads(
    (SHARED_VECTORS if SHARED_VECTORS.exists() else LOCAL_VECTORS).read_text())
SECRET = VECTORS["secret_utf8"].encode()
OTHER_SECRET = b"a different cluster secret, 40 bytes...."
IDENTITY = "127.0.0.2:19100"
SOURCE_IP = "127.0.0.2"
# The settings every hypothesis test of a wire parser runs under.
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def scripted(chunks: Iterable[bytes]) -> Callable[[int], bytes]:
    """A ``random`` that hands out ``chunks`` in order, checking each requested length."""
    it = iter(chunks)

    def draw(n: int) -> bytes:
        chunk = next(it)
        assert len(chunk) == n, (len(chunk), n)
        return chunk

    return draw


def h(vector: dict[str, Any], key: str) -> bytes:
    return bytes.fromhex(vector[key])


def vector_randoms(vector: dict[str, Any]) -> tuple[Callable[[int], bytes],
                                                    Callable[[int], bytes]]:
    client = scripted([h(vector, "client_nonce"), h(vector, "client_ephemeral_private")])
    server = scripted([h(vector, "server_nonce"), h(vector, "server_ephemeral_private")])
    return client, server


def make_pair(*, channel: Channel = Channel.TRANSPORT, suite: Suite = Suite.AES_256_GCM,
              server_suite: Suite | None = None, client_keyring: Any = None,
              server_keyring: Any = None, identity: str = IDENTITY, peer_ip: str = SOURCE_IP,
              capacity_ok: Callable[[], bool] = lambda: True,
              limits: FrameLimits = DEFAULT_LIMITS, client_limits: FrameLimits | None = None,
              server_limits: FrameLimits | None = None,
              randoms: tuple[Callable[[int], bytes], Callable[[int], bytes]] | None = None,
              now: float = 0.0) -> tuple[Connection, Connection]:
    crand, srand = randoms or (os.urandom, os.urandom)
    client = Connection(ConnectionRole.CLIENT, keyring=client_keyring or keyring(SECRET),
                        random=crand,
                        now=now, channel=channel, identity=identity, suite=suite,
                        limits=client_limits or limits)
    server = Connection(ConnectionRole.SERVER, keyring=server_keyring or keyring(SECRET),
                        random=srand,
                        now=now, peer_ip=peer_ip, suite=server_suite or suite,
                        capacity_ok=capacity_ok, limits=server_limits or limits)
    return client, server


def pump(src: Connection, dst: Connection, now: float = 0.0, *, bytewise: bool = True) -> int:
    """Move what ``src`` has to send into ``dst``; answer how many bytes moved."""
    data = src.data_to_send()
    if bytewise:
        for i in range(len(data)):
            dst.receive_data(data[i:i + 1], now)
    elif data:
        dst.receive_data(data, now)
    return len(data)


def shuttle(a: Connection, b: Connection, now: float = 0.0, *, bytewise: bool = True) -> None:
    """Pump both ways until neither side has anything to send."""
    while pump(a, b, now, bytewise=bytewise) + pump(b, a, now, bytewise=bytewise):
        pass


def drain(conn: Connection) -> list[Event]:
    events = []
    while (event := conn.next_event()) is not None:
        events.append(event)
    return events


def connected(**kwargs: Any) -> tuple[Connection, Connection]:
    client, server = make_pair(**kwargs)
    shuttle(client, server, bytewise=False)
    assert client.established and server.established
    drain(client)
    drain(server)
    return client, server
