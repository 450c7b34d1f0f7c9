"""A real replica host under keyed-hello floods: one daemon started from its config file as
a service manager starts it (tests/helpers/deploy.py), serving the tiny llama fixture,
with its agent listener and its serving listener (``[serve] serving_port``) on 127.0.0.1.

8 loopback sources (127.0.0.2..9, the source address bound) hold 8 sockets each on both
ports at once; each socket sends a complete ClientHello carrying the cluster's key id
(public: in every hello and the mDNS record, no secret needed) and then stalls after the
ServerHello, and whatever the daemon closes is opened again. That is 64 sockets per
port, the pending pool's bound, none of them silent. A keyed peer (the secret, from
127.0.0.1) still completes its handshake and a ping on each port within 1.5 s, every
time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlxceld.net import HandshakeFailed, connect
from mlxceld.wire import encode_envelope, key_id, parse_envelope
from mlxceld.wire.envelope import MessageSpec

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.flood import keyed_hello_flood, sources
from helpers.keys import keyring
from helpers.ports import free_port
from helpers.waiting import wait_for

SECRET = b"the hello-flood tests' cluster secret, 44 b"
KEYED_WITHIN_S = 1.5
DIAL_BUDGET_S = 2 * KEYED_WITHIN_S  # a dial that has not made it by then has failed
DIALS = 4  # per port
FLOOD_FILLS_S = 1.0  # after every flood socket is open, for the pools to be full
SERVING_READY_S = 60.0  # the serving listener binds once the router has loaded the model
PONG = {"pong": MessageSpec()}


async def keyed_ping(port: int, channel: int, budget_s: float = DIAL_BUDGET_S) -> float | str:
    """Seconds from the dial to a pong, as a keyed peer on 127.0.0.1, or the failure."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        stream = await connect("127.0.0.1", port, keyring=keyring(SECRET),
                               identity="127.0.0.1:19100", channel=channel, budget_s=budget_s)
    except HandshakeFailed as exc:
        return f"failed after {loop.time() - start:.1f} s: {exc}"
    try:
        await stream.send(encode_envelope({"t": "ping", "id": 1}))
        assert parse_envelope(await stream.recv(), PONG).header == {"t": "pong", "id": 1}
        return loop.time() - start
    finally:
        await stream.close()


def serving_up(port: int) -> bool:
    """Whether the serving listener answers a keyed ping (one dial of 1 s)."""
    return isinstance(asyncio.run(keyed_ping(port, 1, budget_s=1.0)), float)


def test_stalled_keyed_hellos_do_not_lock_keyed_peers_out_of_agent_and_serving_ports(
    daemons: Daemons, fixture_dir: Path
) -> None:
    serving_port = free_port("127.0.0.1")
    host = Host(daemons, "hf", secret=SECRET,
                serve={"model": str(fixture_dir / "llama"), "host": "127.0.0.1",
                       "port": free_port("127.0.0.1"), "max_batch": 2,
                       "serving_port": serving_port})
    host.daemon_keys["agent_addr"] = f"127.0.0.1:{host.agent_port}"
    host.write()
    host.start()
    router = host.d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(router["pid"])
    wait_for(lambda: serving_up(serving_port), SERVING_READY_S, "the serving listener")

    async def main() -> dict[str, list[float | str]]:
        took: dict[str, list[float | str]] = {"agent": [], "serving": []}
        flooders, kid = sources(8), key_id(SECRET)
        async with (keyed_hello_flood("127.0.0.1", host.agent_port, flooders, kid,
                                      channel=3) as on_agent,
                    keyed_hello_flood("127.0.0.1", serving_port, flooders, kid,
                                      channel=1) as on_serving):
            await asyncio.wait_for(asyncio.gather(on_agent.all_opened(),
                                                  on_serving.all_opened()), 30.0)
            await asyncio.sleep(FLOOD_FILLS_S)
            for _ in range(DIALS):
                took["agent"].append(await keyed_ping(host.agent_port, 3))
                took["serving"].append(await keyed_ping(serving_port, 1))
            # The floods met the bound: the daemon closed some of their sockets.
            assert on_agent.closed_by_server > 0 and on_serving.closed_by_server > 0
        return took

    took = asyncio.run(main())
    print("keyed dials under stalled hellos:", took)
    assert all(isinstance(t, float) and t < KEYED_WITHIN_S
               for t in took["agent"] + took["serving"]), took
    assert host.d.status()["agent"]["address"]  # the daemon and its router still serve
    assert host.d.worker("router")["state"] == "running"
