"""A flood of idle sockets takes no established slot and does not lock a real client out."""

from __future__ import annotations

import asyncio
import contextlib

from mlxceld.net import connect

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, Refusals, run, serving

FLOOD = 200
SOURCES = [f"127.0.0.{i}" for i in range(2, 9)]  # seven IPv4 sources
# The protocol's defaults: 64 pending, 8 per source. Seven flooding sources hold 56 slots
# and the rest of their sockets are closed at accept; eight or more would fill the pool
# until their 5 s handshake deadlines expire (the dialer then gets in on a retry).
PER_SOURCE = 8


def test_idle_flood_does_not_block_an_authenticated_client() -> None:
    async def main() -> None:
        refusals = Refusals()
        writers: list[asyncio.StreamWriter] = []
        try:
            async with serving(on_refused=refusals, max_pending=64,
                               max_pending_per_source=PER_SOURCE) as lst:
                for i in range(FLOOD):
                    _, writer = await asyncio.open_connection(
                        "127.0.0.1", lst.port, local_addr=(SOURCES[i % len(SOURCES)], 0))
                    writers.append(writer)
                held = PER_SOURCE * len(SOURCES)
                await refusals.wait_for("noise", FLOOD - held)  # closed at accept
                assert lst.pending == held and lst.established == 0
                async with asyncio.timeout(5.0):
                    stream = await connect("127.0.0.1", lst.port, keyring=keyring(SECRET),
                                           identity=CLIENT_ID, channel=1)
                assert lst.established == 1
                await stream.send(b"through the flood")
                assert await stream.recv() == b"through the flood"
                await stream.close()
        finally:
            for writer in writers:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    run(main())
