"""A real stage host under silent sockets: one daemon started from a cluster TOML as a user
starts it (tests/helpers/deploy.py), with its agent listener and its stage worker's
listener. 16 loopback sources hold 8 silent sockets each on both ports at once; a keyed
peer still completes its handshake (and a ping) on each port within 1.5 s, and the
daemon's log and the stage's log grow by a few lines, not one per refused socket."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

from mlxceld.net import connect
from mlxceld.wire import encode_envelope, parse_envelope
from mlxceld.wire.envelope import MessageSpec

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.flood import silent_flood, sources
from helpers.keys import keyring
from helpers.ports import free_port

SECRET = b"silent-flood-test-secret-0123456789"
KEYED_WITHIN_S = 1.5
DIALS = 2  # per port
FLOOD_FILLS_S = 0.5  # after every flood socket is open, for the pools to be full
MAX_NEW_LINES = 12  # per log: 5 warnings of a class, a few more of others and of start-up
PONG = {"pong": MessageSpec()}


def write_cluster(root: Path, model: Path, stage: str) -> Path:
    (root / "secret").write_bytes(SECRET + b"\n")
    (root / "secret").chmod(0o600)
    toml = root / "cluster.toml"
    toml.write_text(textwrap.dedent(f"""
        [cluster]
        name = "flood-cluster"
        pipeline_parallel_size = 2
        model = "{model}"
        secret_file = "secret"

        [[nodes]]
        id = "coordinator"
        address = "127.0.0.1:{free_port('127.0.0.1')}"
        role = "coordinator"

        [[nodes]]
        id = "stage-0"
        address = "{stage}"
        role = "pipeline_stage"
        rank = 0
        layers = [0, 2]

        [[nodes]]
        id = "stage-1"
        address = "127.0.0.18:{free_port('127.0.0.18')}"
        role = "pipeline_stage"
        rank = 1
        layers = [2, 4]
        """))
    return toml


def line_count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


async def keyed_ping(host: str, port: int, channel: int) -> float:
    """Seconds from the dial to a pong, as the cluster's own peer on 127.0.0.1."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    stream = await connect(host, port, keyring=keyring(SECRET),
                           identity="127.0.0.1:19100", channel=channel, budget_s=10.0)
    try:
        await stream.send(encode_envelope({"t": "ping", "id": 1}))
        assert parse_envelope(await stream.recv(), PONG).header == {"t": "pong", "id": 1}
        return loop.time() - start
    finally:
        await stream.close()


def test_a_keyed_peer_gets_through_silent_floods_on_the_agent_and_stage_ports(
    daemons: Daemons, split_fixture_dir: Path
) -> None:
    stage_port = free_port("127.0.0.2")
    host = Host(daemons, "fl", secret=None)
    toml = write_cluster(host.d.root, split_fixture_dir / "qwen3", f"127.0.0.2:{stage_port}")
    host.daemon_keys.update(distributed_config=str(toml), node_id="stage-0")
    host.write()
    host.start()
    stage = host.d.wait_worker("stage", timeout=READY_S, state="running")
    daemons.pids.add(stage["pid"])
    stage_log = Path(stage["log"])
    before = line_count(host.d.stderr_path), line_count(stage_log)

    async def main() -> dict[str, list[float]]:
        took: dict[str, list[float]] = {"agent": [], "stage": []}
        flooders = sources(16)  # 127.0.0.2..17: 128 silent sockets per port, pools of 64
        async with (silent_flood("127.0.0.1", host.agent_port, flooders) as on_agent,
                    silent_flood("127.0.0.2", stage_port, flooders) as on_stage):
            await asyncio.wait_for(asyncio.gather(on_agent.all_opened(), on_stage.all_opened()),
                                   30.0)
            await asyncio.sleep(FLOOD_FILLS_S)
            for _ in range(DIALS):
                took["agent"].append(await keyed_ping("127.0.0.1", host.agent_port, 3))
                took["stage"].append(await keyed_ping("127.0.0.2", stage_port, 1))
            assert on_agent.closed_by_server > 0 and on_stage.closed_by_server > 0
        return took

    took = asyncio.run(main())
    assert max(took["agent"] + took["stage"]) < KEYED_WITHIN_S, took
    added = line_count(host.d.stderr_path) - before[0], line_count(stage_log) - before[1]
    assert added[0] <= MAX_NEW_LINES, host.d.stderr().splitlines()[before[0]:]
    assert added[1] <= MAX_NEW_LINES, stage_log.read_text().splitlines()[before[1]:]
    assert host.d.status()["agent"]["address"]  # the daemon and its stage still serve
    assert host.d.worker("stage")["state"] == "running"
