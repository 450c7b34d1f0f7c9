"""The daemon's MXCL agent listener, against the real dialer over loopback."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mlxceld.net import ConnectionClosed, HandshakeFailed, connect
from mlxceld.wire import key_id
from mlxceld.wire.envelope import MessageSpec, encode_envelope, parse_envelope
from mlxceld.wire.errors import EnvelopeError

from helpers.daemons import DaemonProc, Daemons
from helpers.keys import keyring, secret_file
from helpers.waiting import wait_for


def address(status: dict[str, object]) -> tuple[str, int]:
    agent = status["agent"]
    assert isinstance(agent, dict) and agent["address"], agent
    host, port = str(agent["address"]).rsplit(":", 1)
    return host, int(port)


def reply_type(payload: bytes) -> str:
    try:
        return parse_envelope(payload, {"pong": MessageSpec(), "error": MessageSpec()}).type
    except EnvelopeError as exc:  # pragma: no cover - shown in the assertion
        return f"unparseable: {exc}"


@dataclass
class Keyed:
    """A daemon started with ``secret`` in its --cluster-secret-file."""

    d: DaemonProc
    secret: bytes


@pytest.fixture(scope="module")
def keyed() -> Iterator[Keyed]:
    """One daemon with a secret, so an agent, for the two tests below that talk to it (the
    one that installs a second key removes it again)."""
    secret = secrets.token_hex(16).encode()
    owner = Daemons()
    try:
        d = owner.make()
        d.start("--cluster-secret-file", str(secret_file(d.root, secret)))
        yield Keyed(d, secret)
    finally:
        owner.end()


def test_no_secret_no_agent_listener(daemons: Daemons) -> None:
    d = daemons.make().start()
    assert d.status()["agent"] == {"address": None, "error": None, "keys": 0}


def test_agent_answers_ping_and_refuses_strangers(keyed: Keyed) -> None:
    d, secret = keyed.d, keyed.secret
    host, port = address(d.status())

    async def talk() -> None:
        stream = await connect(host, port, keyring=keyring(secret), identity="127.0.0.1:19100",
                               channel=3, budget_s=5)
        try:
            await stream.send(encode_envelope({"t": "ping", "id": 7}))
            pong = await stream.recv()
            assert parse_envelope(pong, {"pong": MessageSpec()}).header == {"t": "pong", "id": 7}
            await stream.send(encode_envelope({"t": "inventory?"}))
            assert reply_type(await stream.recv()) == "error"  # and the stream stays open
            await stream.send(encode_envelope({"t": "ping", "id": 8}))
            assert reply_type(await stream.recv()) == "pong"
        finally:
            await stream.close()
        with pytest.raises(HandshakeFailed) as wrong:
            await connect(host, port, keyring=keyring(b"another-secret-0123456789"),
                          identity="127.0.0.1:19100", channel=3, budget_s=2)
        assert wrong.value.kind == "unknown_key_id"  # another secret has another key id
        with pytest.raises((HandshakeFailed, ConnectionClosed)):
            s1 = await connect(host, port, keyring=keyring(secret), identity="127.0.0.1:19100",
                               channel=1, budget_s=1)  # transport is not the agent's
            await s1.recv()

    asyncio.run(talk())
    wait_for(lambda: "unknown_key_id" in d.stderr(), 10, "the refusal in the security log")
    assert secret.decode() not in d.stderr()


def test_installing_a_first_secret_starts_the_agent(daemons: Daemons) -> None:
    d = daemons.make().start()
    assert d.status()["agent"]["address"] is None
    secret = secrets.token_bytes(32)
    d.api(lambda c: c.install_secret(secret, primary=True))
    seen: list[str] = []

    def listening() -> bool:
        agent_address = d.status()["agent"]["address"]
        seen.append(agent_address or "")
        return bool(agent_address)

    wait_for(listening, 10, "the agent listener")
    # never the port asked for (0) while binding: a demo dialed '127.0.0.3:0' from that
    assert not [a for a in seen if a.endswith(":0")], seen
    host, port = address(d.status())

    async def talk() -> None:
        stream = await connect(host, port, keyring=keyring(secret), identity="127.0.0.1:19100",
                               channel=2, budget_s=5)
        await stream.send(encode_envelope({"t": "ping", "id": 1}))
        assert reply_type(await stream.recv()) == "pong"
        await stream.close()

    asyncio.run(talk())


def test_a_second_installed_key_is_accepted(keyed: Keyed) -> None:
    """A peer still on a key installed beside the primary (a rotation under way) gets in."""
    d, second = keyed.d, secrets.token_bytes(32)
    d.api(lambda c: c.install_secret(second, primary=False))
    host, port = address(d.status())

    async def talk() -> None:
        stream = await connect(host, port, keyring=keyring(second), identity="127.0.0.1:19100",
                               channel=3, budget_s=5)
        assert stream.key_id == key_id(second)
        await stream.send(encode_envelope({"t": "ping", "id": 2}))
        assert reply_type(await stream.recv()) == "pong"
        await stream.close()

    try:
        asyncio.run(talk())
    finally:  # the shared daemon's keys as they were: its primary alone
        d.api(lambda c: c.remove_secret(key_id(second).hex()))
