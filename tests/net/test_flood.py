"""Silent sockets from 16 sources keep the pending pool full; a keyed peer still gets in at
once, the pool's bounds hold, and the log holds a few lines, not one per socket. The same
for sockets from 8 sources that each send a complete ClientHello with the cluster's key id
(public) and then stall: they fill the pool without being silent, and a keyed peer still
gets in within 1.5 s each time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxceld.net import HandshakeFailed, connect, source_bucket
from mlxceld.wire import key_id

from helpers.flood import keyed_hello_flood, silent_flood, sources
from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, Refusals, run, serving
from helpers.waiting import until

SOURCES = sources(16)  # 127.0.0.2..17: 16 x 8 = 128 silent sockets for a pool of 64
KEYED_WITHIN_S = 1.5
DIALS = 3
KEYED_DIALS = 4
HELLO_SOURCES = sources(8)  # 127.0.0.2..9: 8 x 8 = 64 stalled hellos, the pool's bound


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


async def timed_dial(port: int, budget_s: float = 2 * KEYED_WITHIN_S) -> float | str:
    """Seconds to an echoed message through a keyed dial from 127.0.0.1, or the failure."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        stream = await connect("127.0.0.1", port, keyring=keyring(SECRET), identity=CLIENT_ID,
                               channel=1, budget_s=budget_s)
    except HandshakeFailed as exc:
        return f"failed after {loop.time() - start:.1f} s: {exc}"
    try:
        await stream.send(b"through the flood")
        assert await stream.recv() == b"through the flood"
        return loop.time() - start
    finally:
        await stream.close()


def test_stalled_keyed_hellos_from_8_sources_do_not_lock_a_keyed_peer_out() -> None:
    took: list[float | str] = []
    refusals = Refusals()

    async def main() -> None:
        async with (serving(on_refused=refusals) as lst,  # the protocol's bounds: 64, 8
                    keyed_hello_flood("127.0.0.1", lst.port, HELLO_SOURCES, key_id(SECRET),
                                      channel=1) as flood):
            await flood.all_opened()
            await until(lambda: lst.pending == 64, "the pending pool full of stalled hellos")
            for _ in range(KEYED_DIALS):
                took.append(await timed_dial(lst.port))
                assert lst.pending <= 64
                assert max(lst.pending_from(source_bucket(s)) for s in HELLO_SOURCES) <= 8
            assert flood.closed_by_server > 0
        assert lst.pending == 0 and lst.established == 0

    run(main())
    print("keyed dials under stalled hellos:", took)
    assert all(isinstance(t, float) and t < KEYED_WITHIN_S for t in took), took
    assert "evicted" in refusals.kinds()  # stalled hellos made room, none refused the peer
