"""Liveness: a peer that answers nothing is noticed by the heartbeat within its bound, one that
answers is kept (its round trip timed); a write the peer does not take ends the stream;
sockets keep TCP alive."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mlxceld.net import ConnectionClosed, MxclStream, connect
from mlxceld.net.liveness import PINGS_PER_SILENCE, Heartbeat, keep_alive_socket, watch
from mlxceld.wire import encode_envelope

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, run, serving

SILENCE_S = 0.4


async def dial(port: int) -> MxclStream:
    return await connect("127.0.0.1", port, keyring=keyring(SECRET), identity=CLIENT_ID,
                         channel=1, budget_s=5.0, local_addr=("127.0.0.1", 0))


def test_the_rule_pings_while_quiet_and_calls_silence_at_its_bound() -> None:
    beat = Heartbeat(3.0, heard_at=100.0, pinged_at=100.0)
    assert beat.interval_s == 3.0 / PINGS_PER_SILENCE == 1.0
    assert not beat.ping_due(100.9) and beat.ping_due(101.0)
    beat.pinged(101.0)
    assert not beat.ping_due(101.5) and beat.next_wake() == 102.0
    beat.heard(101.8)  # a pong, or anything else
    assert not beat.ping_due(102.5) and beat.next_wake() == 102.8
    beat.heard(50.0)  # an older time changes nothing
    assert beat.heard_at == 101.8
    assert not beat.silent(104.7) and beat.silent(104.8)
    beat.pinged(104.0)
    assert beat.next_wake() == 104.8  # the silence comes before the next ping
    with pytest.raises(ValueError, match="silence_s must be a number of seconds above 0"):
        Heartbeat(0.0, 0.0, 0.0)


def test_a_peer_that_answers_nothing_is_silent_within_the_bound() -> None:
    """The peer's kernel takes our bytes, its program never reads them (a stopped process)."""
    async def deaf(stream: MxclStream) -> None:
        await asyncio.sleep(30)

    async def main() -> tuple[float, ConnectionClosed]:
        async with serving(deaf) as lst:
            stream = await dial(lst.port)
            loop = asyncio.get_running_loop()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(watch(stream, SILENCE_S, "the test peer"))
                with pytest.raises(ConnectionClosed) as info:
                    await stream.recv()
            return loop.time() - stream.heard_at, info.value

    took, ended = run(main())
    assert ended.kind == "silent"
    assert ended.reason.startswith("nothing heard for ")
    assert ended.reason.endswith(f"(the bound is {SILENCE_S:g} s): the host may be asleep "
                                 "or off the network")
    assert SILENCE_S - 0.01 <= took < SILENCE_S + 0.3, took


def test_a_peer_that_answers_pings_is_kept_and_its_pongs_are_not_delivered() -> None:
    async def quiet_but_alive(stream: MxclStream) -> None:
        while True:
            await stream.recv()  # answers pings on the way, sends nothing of its own

    async def main() -> tuple[bool, list[bytes], float | None, float | None]:
        got: list[bytes] = []
        async with serving(quiet_but_alive) as lst:
            stream = await dial(lst.port)
            before = stream.rtt_s  # no ping answered yet
            async with asyncio.TaskGroup() as tg:
                beating = tg.create_task(watch(stream, SILENCE_S, "the test peer"))

                async def read() -> None:
                    got.append(await stream.recv())
                reading = tg.create_task(read())
                await asyncio.sleep(SILENCE_S * 4)
                alive = not stream.closed and not beating.done()
                beating.cancel()
                reading.cancel()
            # A pong to somebody else's ping (ours, sent by hand) is delivered.
            await stream.send(encode_envelope({"t": "ping", "id": 5}))
            got.append(await asyncio.wait_for(stream.recv(), 5))
            rtt = stream.rtt_s  # the heartbeat's, timed; not changed by the pong to id 5
            await stream.close()
        return alive, got, before, rtt

    alive, got, before, rtt = run(main())
    assert alive
    assert got == [encode_envelope({"t": "pong", "id": 5})]
    assert before is None and rtt is not None and 0 < rtt < SILENCE_S, rtt


def test_a_write_the_peer_does_not_take_ends_the_stream_within_its_deadline() -> None:
    async def deaf(stream: MxclStream) -> None:
        await asyncio.sleep(30)

    async def main() -> tuple[float, ConnectionClosed, int]:
        async with serving(deaf) as lst:
            stream = await dial(lst.port)
            stream.write_timeout_s = 0.3
            loop = asyncio.get_running_loop()
            chunk = bytes(4 << 20)
            sent = 0
            with pytest.raises(ConnectionClosed) as info:
                while sent < 128:  # 512 MiB at most: far beyond any socket buffer
                    started = loop.time()
                    await stream.send(chunk)
                    sent += 1
            took = loop.time() - started
            with pytest.raises(ConnectionClosed):
                await stream.recv()  # the stream is over for the reader too
            return took, info.value, sent

    took, ended, sent = run(main())
    assert ended.kind == "write_timeout" and "0.3 s" in ended.reason
    assert 0.3 <= took < 1.0 and sent < 128, (took, sent)


def test_sockets_get_tcp_keepalive() -> None:
    with socket.socket() as sock:
        keep_alive_socket(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    keep_alive_socket(None)  # a transport without a socket: nothing to do


def test_a_redialer_drops_a_silent_stream_and_dials_afresh() -> None:
    from mlxceld.net import Redialer
    from mlxceld.wire.address import parse_address

    accepted: list[MxclStream] = []

    async def deaf(stream: MxclStream) -> None:
        accepted.append(stream)
        await asyncio.sleep(30)

    async def main() -> float:
        async with serving(deaf) as lst, asyncio.TaskGroup() as tg:
            dialer = Redialer(("127.0.0.1", lst.port), keyring=keyring(SECRET),
                              origin=parse_address(CLIENT_ID), channel=1, what="next stage",
                              budget_s=5.0, on_message=lambda _: None, silence_s=SILENCE_S)
            reading = tg.create_task(dialer.run())
            first = await dialer.stream()
            loop = asyncio.get_running_loop()
            started = loop.time()
            while not first.closed:
                await asyncio.sleep(0.01)
            took = loop.time() - started
            second = await dialer.stream()
            assert second is not first and len(accepted) == 2
            await dialer.aclose("done")
            reading.cancel()
        return took

    assert SILENCE_S - 0.01 <= run(main()) < SILENCE_S + 0.3
