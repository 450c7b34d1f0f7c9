"""Messages larger than one read arrive whole; a body cut short is an abort."""

from __future__ import annotations

import asyncio
import os

from mlxceld.net import ConnectionClosed, MxclStream, connect
from mlxceld.net.stream import READ_CHUNK

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, raw_client, run, serving


def test_large_messages_echo_whole() -> None:
    payloads = [os.urandom(4 * READ_CHUNK + 3), b"small after large", os.urandom(2 << 20)]

    async def main() -> list[bytes]:
        async with serving() as lst:  # echoes
            stream = await connect("127.0.0.1", lst.port, keyring=keyring(SECRET),
                                   identity=CLIENT_ID, channel=1)
            try:
                await stream.send(memoryview(payloads[0]))
                await stream.send(bytearray(payloads[1]))
                await stream.send(payloads[2])
                return [await stream.recv() for _ in payloads]
            finally:
                await stream.close()

    assert run(main()) == payloads


def test_a_large_body_cut_short_is_an_abort() -> None:
    ended: asyncio.Queue[ConnectionClosed | bytes] = asyncio.Queue()

    async def handler(stream: MxclStream) -> None:
        try:
            await ended.put(await stream.recv())
        except ConnectionClosed as exc:
            await ended.put(exc)

    async def main() -> ConnectionClosed | bytes:
        async with serving(handler) as lst, raw_client(lst.port) as (conn, _r, writer):
            conn.send_message(bytes(3 * READ_CHUNK))
            frame = conn.data_to_send()
            writer.write(frame[:len(frame) // 2])
            await writer.drain()
            writer.transport.abort()
            async with asyncio.timeout(5):
                return await ended.get()

    got = run(main())
    assert isinstance(got, ConnectionClosed) and got.kind == "abort"
