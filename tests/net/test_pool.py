"""ConnectionPool: one stream per (peer, channel), redialed once it has ended."""

from __future__ import annotations

import asyncio

import pytest

from mlxceld.net import ConnectionClosed, ConnectionPool, MxclStream, PoolClosed

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, run, serving


def test_pool_reuses_and_redials() -> None:
    accepted: list[MxclStream] = []

    async def handler(stream: MxclStream) -> None:
        accepted.append(stream)
        while True:
            msg = await stream.recv()
            if msg == b"hang up":
                await stream.close("asked to")
                return
            await stream.send(msg)

    async def main() -> None:
        async with serving(handler) as lst, ConnectionPool(keyring=keyring(SECRET),
                                                           identity=CLIENT_ID) as pool:
            first = await pool.get("127.0.0.1", lst.port, 1)
            assert await pool.get("127.0.0.1", lst.port, 1) is first
            same = await asyncio.gather(*(pool.get("127.0.0.1", lst.port, 3) for _ in range(5)))
            assert all(s is same[0] for s in same) and same[0] is not first
            assert len(pool) == 2 and len(accepted) == 2

            await first.send(b"hang up")  # the server closes it
            with pytest.raises(ConnectionClosed) as err:
                await first.recv()
            assert err.value.kind == "closed"
            second = await pool.get("127.0.0.1", lst.port, 1)
            assert second is not first
            await second.send(b"again")
            assert await second.recv() == b"again"

            await second.close()  # closed on our side: also replaced
            third = await pool.get("127.0.0.1", lst.port, 1)
            assert third is not second and len(accepted) == 4
        with pytest.raises(PoolClosed):
            await pool.get("127.0.0.1", lst.port, 1)
        assert third.closed and same[0].closed

    run(main())
