"""Silent sockets from 16 sources keep the pending pool full; a keyed peer still gets in at
once, the pool's bounds hold, and the log holds a few lines, not one per socket."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxceld.net import connect, source_bucket

from helpers.flood import silent_flood, sources
from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, Refusals, run, serving
from helpers.waiting import until

SOURCES = sources(16)  # 127.0.0.2..17: 16 x 8 = 128 silent sockets for a pool of 64
KEYED_WITHIN_S = 1.5
DIALS = 3


def test_silent_sockets_from_16_sources_do_not_starve_a_keyed_peer(
    caplog: pytest.LogCaptureFixture
) -> None:
    took: list[float] = []

    async def main() -> None:
        refusals = Refusals()
        loop = asyncio.get_running_loop()
        async with (serving(on_refused=refusals) as lst,  # the protocol's bounds: 64, 8
                    silent_flood("127.0.0.1", lst.port, SOURCES) as flood):
            await flood.all_opened()
            await until(lambda: lst.pending == 64, "the pending pool full of silent sockets")
            for _ in range(DIALS):
                start = loop.time()
                stream = await connect("127.0.0.1", lst.port, keyring=keyring(SECRET),
                                       identity=CLIENT_ID, channel=1, budget_s=10.0)
                took.append(loop.time() - start)
                await stream.send(b"through the flood")
                assert await stream.recv() == b"through the flood"
                await stream.close()
                assert lst.pending <= 64
                assert max(lst.pending_from(source_bucket(s)) for s in SOURCES) <= 8
            assert flood.closed_by_server > 0 and "evicted" in refusals.kinds()
        assert lst.pending == 0 and lst.established == 0

    with caplog.at_level(logging.DEBUG, logger="mlxceld"):
        run(main())
    assert max(took) < KEYED_WITHIN_S, took
    # Hundreds of refusals, a few lines: 5 warnings per class and window, and the summary
    # with the counts written when the listener closes.
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(lines) <= 6, lines
    assert "suppressed" in lines[-1] and "x evicted" in lines[-1]
    assert not [r for r in caplog.records if r.name == "mlxceld.net.listener"
                and "refused" in r.getMessage()]
