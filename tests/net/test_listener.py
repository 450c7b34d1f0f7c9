"""Listener and dialer over real loopback TCP: handshake, echo, ping, refusals, bounds."""

from __future__ import annotations

import asyncio
import resource

import pytest

from mlxceld.net import (
    ConnectionClosed,
    HandshakeFailed,
    Listener,
    MxclStream,
    connect,
    source_bucket,
)
from mlxceld.net.listener import established_cap
from mlxceld.wire import Channel, PeerClosed, encode_envelope, key_id, parse_envelope
from mlxceld.wire.envelope import MessageSpec

from helpers.keys import keyring
from helpers.mxcl import (
    CLIENT_ID,
    OTHER_SECRET,
    SECRET,
    LyingKeyring,
    Refusals,
    echo,
    raw_client,
    read_to_eof,
    run,
    serving,
)

PONG = {"pong": MessageSpec()}


async def dial(port: int, **kwargs: object) -> MxclStream:
    kwargs.setdefault("keyring", keyring(SECRET))
    kwargs.setdefault("identity", CLIENT_ID)
    kwargs.setdefault("channel", 1)
    return await connect("127.0.0.1", port, **kwargs)  # type: ignore[arg-type]


def test_source_bucket() -> None:
    assert source_bucket("10.1.2.3") == "10.1.2.3"
    assert source_bucket("::ffff:10.1.2.3") == "10.1.2.3"
    a = source_bucket("2001:db8:1:2:aaaa::1")
    assert a == "2001:db8:1:2::/64" == source_bucket("2001:db8:1:2:bbbb:cccc:dddd:eeee")
    assert source_bucket("2001:db8:1:3::1") != a


def test_echo_both_ways() -> None:
    seen: asyncio.Queue[MxclStream] = asyncio.Queue()

    async def greet_then_echo(stream: MxclStream) -> None:
        await seen.put(stream)
        await stream.send(b"hello from the server")
        while True:
            await stream.send(await stream.recv())

    async def main() -> None:
        async with serving(greet_then_echo) as lst:
            stream = await dial(lst.port, channel=3)
            assert stream.channel is Channel.AGENT and stream.key_id == key_id(SECRET)
            assert await stream.recv() == b"hello from the server"
            for payload in (b"one", b"x" * 200_000, b""):
                await stream.send(payload)
                assert await stream.recv() == payload
            server_side = await seen.get()
            assert server_side.peer_identity == CLIENT_ID
            assert server_side.channel is Channel.AGENT
            await stream.close("done")
            with pytest.raises(ConnectionClosed):
                await stream.recv()

    run(main())


def test_ping_answered_on_both_sides() -> None:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        await got.put(await stream.recv())  # the client's ping never shows up here
        await stream.send(encode_envelope({"t": "ping", "id": 7}))
        await got.put(await stream.recv())  # the client's automatic pong
        await stream.send(b"bye")

    async def main() -> None:
        async with serving(handler) as lst:
            stream = await dial(lst.port)
            await stream.send(encode_envelope({"t": "ping", "id": 41}))
            pong = parse_envelope(await stream.recv(), PONG)
            assert pong.header == {"t": "pong", "id": 41}
            await stream.send(b"not a ping")
            assert await got.get() == b"not a ping"
            assert await stream.recv() == b"bye"  # the server's ping was answered on the way
            assert parse_envelope(await got.get(), PONG).header == {"t": "pong", "id": 7}
            await stream.close()

    run(main())


def test_wrong_secret_seen_by_the_client() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals) as lst:
            lying = LyingKeyring(claimed=SECRET, actual=OTHER_SECRET)
            with pytest.raises(HandshakeFailed) as err:
                await dial(lst.port, keyring=lying)
            assert err.value.kind == "wrong_secret_client"
            assert f"127.0.0.1:{lst.port}" in str(err.value)
            await refusals.wait_for("abort")  # the client hung up before its ClientAuth
            assert refusals.kinds() == ["abort"]  # and did not retry

    run(main())


def test_wrong_secret_seen_by_the_server() -> None:
    def flip(out: bytes) -> bytes:
        return out[:-1] + bytes([out[-1] ^ 1])

    async def main() -> None:
        refusals = Refusals()
        async with (serving(on_refused=refusals) as lst,
                    raw_client(lst.port, tamper=flip) as (conn, reader, _)):
            await refusals.wait_for("wrong_secret_server")
            assert not conn.established
            assert await read_to_eof(reader) == b""  # closed without a verdict

    run(main())


def test_unknown_key_id() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals) as lst:
            with pytest.raises(HandshakeFailed) as err:
                await dial(lst.port, keyring=keyring(OTHER_SECRET))
            assert err.value.kind == "unknown_key_id"
            assert refusals.kinds() == ["unknown_key_id"]

    run(main())


def test_identity_not_owned_is_not_retried() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals) as lst:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(HandshakeFailed) as err:
                await dial(lst.port, identity="127.0.0.3:1234", local_addr=("127.0.0.2", 0))
            assert err.value.kind == "identity_not_owned"
            assert loop.time() - start < 1.0
            assert refusals.kinds() == ["identity_not_owned"]
            assert refusals.seen[0][1].startswith("127.0.0.2:")

    run(main())


def test_at_capacity_is_retried_until_a_slot_frees() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals, max_established=1) as lst:
            first = await dial(lst.port)
            async with asyncio.TaskGroup() as tg:
                second = tg.create_task(dial(lst.port, budget_s=10.0))
                await refusals.wait_for("at_capacity")
                assert lst.established == 1
                await first.close()
            stream = second.result()
            await stream.send(b"in at last")
            assert await stream.recv() == b"in at last"
            await stream.close()

    run(main())


def test_end_of_stream_without_close_is_an_abort() -> None:
    ended: asyncio.Queue[ConnectionClosed] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        try:
            msg = await stream.recv()
        except ConnectionClosed as exc:
            await ended.put(exc)
            return
        if msg == b"abort me":
            await stream.abort()

    async def main() -> None:
        async with serving(handler) as lst:
            stream = await dial(lst.port)
            await stream.abort()
            assert (await ended.get()).kind == "abort"
            stream = await dial(lst.port)
            await stream.send(b"abort me")
            with pytest.raises(ConnectionClosed) as err:
                await stream.recv()
            assert err.value.kind == "abort"
            await stream.close()

    run(main())


def test_oversized_frame_closes_before_the_body() -> None:
    ended: asyncio.Queue[ConnectionClosed] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        try:
            await stream.recv()
        except ConnectionClosed as exc:
            await ended.put(exc)

    async def main() -> None:
        async with serving(handler) as lst, raw_client(lst.port) as (conn, reader, writer):
            assert conn.established
            writer.write(bytes([1]) + (0xFFFF_FFF0).to_bytes(4, "big"))  # no body follows
            assert (await ended.get()).kind == "oversized_frame"
            conn.receive_data(await read_to_eof(reader), asyncio.get_running_loop().time())
            events = [conn.next_event(), conn.next_event()]
            closed = events[-1]
            assert isinstance(closed, PeerClosed) and "exceeds" in closed.reason

    run(main())


def test_handshake_deadline() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals, handshake_timeout=0.3) as lst:
            reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
            try:
                assert await read_to_eof(reader) == b""
                assert refusals.kinds() == ["handshake_timeout"]
                assert lst.pending == 0
            finally:
                writer.close()
                await writer.wait_closed()

    run(main())


def test_hello_deadline() -> None:
    """A socket silent, or dribbling its ClientHello, is closed at the hello deadline."""
    async def main() -> None:
        refusals = Refusals()
        loop = asyncio.get_running_loop()
        async with serving(on_refused=refusals, hello_timeout=0.3) as lst:
            for first_bytes in (b"", b"MXCL"):
                reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
                try:
                    start = loop.time()
                    writer.write(first_bytes)
                    assert await read_to_eof(reader) == b""
                    assert loop.time() - start < 3.0  # 0.3 s, not the handshake's 5 s
                finally:
                    writer.close()
                    await writer.wait_closed()
            assert refusals.kinds() == ["hello_timeout", "hello_timeout"]
            assert lst.pending == 0
            stream = await dial(lst.port)  # a client sends its hello at once: unaffected
            await stream.close()

    run(main())


def test_a_second_installed_key_is_accepted() -> None:
    """A client whose primary is the listener's second, non-primary key gets in."""
    async def main() -> None:
        async with serving(keyring=keyring(SECRET, OTHER_SECRET)) as lst:
            stream = await dial(lst.port, keyring=keyring(OTHER_SECRET))
            assert stream.key_id == key_id(OTHER_SECRET) != key_id(SECRET)
            await stream.send(b"under the second key")
            assert await stream.recv() == b"under the second key"
            await stream.close()

    run(main())


def test_the_established_cap_stays_under_the_open_file_limit() -> None:
    assert established_cap(512, 64, None) == 512
    assert established_cap(512, 64, 100_000) == 512
    assert established_cap(512, 64, 1024) == 448  # 64 + 448 = half of 1024
    assert established_cap(512, 64, 256) == 64  # macOS launchd's default soft limit
    assert established_cap(512, 64, 100) == 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        lst = Listener("127.0.0.1", 0, keyring=keyring(SECRET), identity_of_server="x:1",
                       channels={1}, handler=echo)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert lst.max_established == 64


def test_channel_not_served_is_closed() -> None:
    async def main() -> None:
        refusals = Refusals()
        async with serving(on_refused=refusals, channels={1}) as lst:
            stream = await dial(lst.port, channel=2)
            with pytest.raises(ConnectionClosed) as err:
                await stream.recv()
            assert err.value.kind == "closed" and "not served" in err.value.reason
            await stream.close()

    run(main())


def test_unreachable_peer_is_retried_until_the_budget_ends() -> None:
    async def main() -> None:
        async with serving() as lst:
            port = lst.port
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(HandshakeFailed) as err:
            await dial(port, budget_s=0.5, initial_backoff_s=0.02, max_backoff_s=0.1)
        assert err.value.kind == "unreachable"
        assert 0.3 <= loop.time() - start < 1.5
        assert "attempts" in str(err.value) and f"127.0.0.1:{port}" in str(err.value)

    run(main())


def test_a_handler_that_raises_ends_its_connection_only(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    async def handler(stream: MxclStream) -> None:
        msg = await stream.recv()
        if msg == b"crash":
            raise RuntimeError("a bug in the handler")
        await stream.send(msg)
        await stream.send(await stream.recv())

    async def main() -> None:
        async with serving(handler) as lst:
            calm = await dial(lst.port)
            await calm.send(b"one")
            assert await calm.recv() == b"one"
            crashing = await dial(lst.port)
            await crashing.send(b"crash")
            with pytest.raises(ConnectionClosed):  # closed by the listener, not left open
                await crashing.recv()
            await calm.send(b"two")  # the other connection is still served
            assert await calm.recv() == b"two"
            later = await dial(lst.port)  # and the listener still accepts
            await later.send(b"three")
            assert await later.recv() == b"three"
            for stream in (calm, crashing, later):
                await stream.close()

    run(main())
    assert any(r.exc_info and "a bug in the handler" in str(r.exc_info[1])
               for r in caplog.records)
