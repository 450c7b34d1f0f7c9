"""Redialer: one outgoing stream, dialed on first use and again once it broke, read by ``run``."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from mlxceld.net import ConnectionClosed, MxclStream, Redialer
from mlxceld.wire import encode_envelope, parse_envelope
from mlxceld.wire.address import parse_address
from mlxceld.wire.envelope import MessageSpec
from mlxceld.wire.secret import key_id

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, OTHER_SECRET, SECRET, run, serving


def redialer(port: int, got: list[bytes]) -> Redialer:
    return Redialer(("127.0.0.1", port), keyring=keyring(SECRET), origin=parse_address(CLIENT_ID),
                    channel=1, what="test peer", budget_s=5.0, on_message=got.append)


async def until(check: object) -> None:
    while not check():  # type: ignore[operator]
        await asyncio.sleep(0.01)


def test_one_stream_shared_and_redialed_once_it_broke() -> None:
    accepted: list[MxclStream] = []
    heard: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        accepted.append(stream)
        while True:
            msg = await stream.recv()
            if msg == b"hang up":
                await stream.close("asked to")
                return
            await heard.put(msg)

    async def main() -> None:
        got: list[bytes] = []
        async with serving(handler) as lst, asyncio.TaskGroup() as tg:
            dialer = redialer(lst.port, got)
            reading = tg.create_task(dialer.run())
            same = await asyncio.gather(*(dialer.stream() for _ in range(5)))
            first = same[0]
            assert all(s is first for s in same) and len(accepted) == 1
            await first.send(b"one")
            assert await heard.get() == b"one"

            await first.send(b"hang up")  # closed by the peer: noticed by run, unsent to
            await until(lambda: first.closed)
            second = await dialer.stream()
            assert second is not first and len(accepted) == 2
            await second.send(b"two")
            assert await heard.get() == b"two"

            dialer.forget()  # a send failed on it, say: the next call dials
            third = await dialer.stream()
            assert third is not second and len(accepted) == 3
            await second.close()  # forgotten, not closed: that is the caller's to do
            await dialer.aclose("done")
            assert third.closed
            reading.cancel()
        assert got == []

    run(main())


def test_run_answers_pings_and_hands_over_anything_else() -> None:
    pongs: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        await stream.send(encode_envelope({"t": "ping", "id": 3}))
        pong = parse_envelope(await stream.recv(), {"pong": MessageSpec()})
        await pongs.put(dict(pong.header))
        await stream.send(b"unexpected")
        with pytest.raises(ConnectionClosed):
            await stream.recv()

    async def main() -> None:
        got: list[bytes] = []
        async with serving(handler) as lst, asyncio.TaskGroup() as tg:
            dialer = redialer(lst.port, got)
            reading = tg.create_task(dialer.run())
            await dialer.stream()
            assert await pongs.get() == {"t": "pong", "id": 3}
            await until(lambda: got)
            assert got == [b"unexpected"]
            await dialer.aclose()
            reading.cancel()

    run(main())


def test_cancelling_run_ends_every_reader() -> None:
    async def handler(stream: MxclStream) -> None:
        await stream.recv()  # holds the connection open

    async def main() -> None:
        async with serving(handler) as lst:
            dialer = redialer(lst.port, [])
            reading = asyncio.create_task(dialer.run())
            first = await dialer.stream()
            dialer.forget()
            await dialer.stream()  # two streams open, each read by a task of run's group

            def readers() -> list[asyncio.Task[object]]:
                return [t for t in asyncio.all_tasks()
                        if t.get_coro().__qualname__ == "Redialer._read"]  # type: ignore[union-attr]

            await until(lambda: len(readers()) == 2)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert readers() == []
            await first.close()
            await dialer.aclose()

    run(main())


def test_hand_over_to_a_new_primary_loses_and_reorders_nothing() -> None:
    """Messages sent back to back while the keyring's primary changes: the old stream is
    finished (its close answered) before anything goes over the new one, so the peer takes
    every message once, in order; a send that raced the handover went over the new one."""
    seen: list[tuple[bytes, int]] = []  # (key id of the stream, message), as handled
    accepted: list[MxclStream] = []

    async def handler(stream: MxclStream) -> None:
        accepted.append(stream)
        with contextlib.suppress(ConnectionClosed):
            while True:
                message = await stream.recv()
                await asyncio.sleep(0.002 if stream.key_id == key_id(SECRET) else 0)
                seen.append((stream.key_id, int(message)))

    async def main() -> None:
        ring = keyring(SECRET, OTHER_SECRET)
        async with serving(handler, keyring=keyring(SECRET, OTHER_SECRET)) as lst, \
                asyncio.TaskGroup() as tg:
            dialer = Redialer(("127.0.0.1", lst.port), keyring=ring,
                              origin=parse_address(CLIENT_ID), channel=1, what="test peer",
                              budget_s=5.0, on_message=lambda _: None)
            reading = tg.create_task(dialer.run())
            assert not await dialer.hand_over()  # nothing dialed: nothing to hand over

            for i in range(100):  # a backlog on the old stream (its peer is slow)
                await dialer.send(str(i).encode())
            old = await dialer.stream()
            assert not dialer.stale
            ring.replace_all(OTHER_SECRET, [SECRET])
            assert dialer.stale
            handing = tg.create_task(dialer.hand_over())
            for i in range(100, 300):  # racing the handover, then after it
                await dialer.send(str(i).encode())
                await asyncio.sleep(0.001)
            assert await handing
            assert old.closed and not dialer.stale
            await until(lambda: len(seen) == 300)
            await dialer.aclose("done")
            reading.cancel()
        assert [i for _, i in seen] == list(range(300))
        kids = [k for k, _ in seen]
        switch = kids.index(key_id(OTHER_SECRET))
        assert set(kids[:switch]) == {key_id(SECRET)} and set(kids[switch:]) == {
            key_id(OTHER_SECRET)}
        assert len(accepted) == 2

    run(main())
