"""A cluster as users deploy it (tests/helpers/deploy.py): `mlxceld --config FILE` only, agents on
the default wildcard host, peers named by host name or by the address another host
reaches them on, the secret from the service's environment."""

from __future__ import annotations

import secrets
import textwrap
from pathlib import Path

from helpers.cluster import ACTIVATE_S, POLL_WAIT_S, activate, settled
from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for


def bring_up(daemons: Daemons, model: Path, peer_names: list[str], *,
             pp_auto: bool) -> tuple[Host, list[Host]]:
    """Two `pp_peer` hosts and a coordinator that names them ``peer_names[i]:port``, and
    plans and assigns two stages over them: by itself (`pp_auto = 2` in its config file)
    or when told to (`mlxctl cluster activate`)."""
    secret = secrets.token_hex(16).encode()
    peers = [Host(daemons, f"p{i}", secret=secret, daemon={"pp_peer": True},
                  serve={"model": str(model)}).start() for i in range(2)]
    named = [p.address(name) for p, name in zip(peers, peer_names, strict=True)]
    coord = Host(daemons, "c", secret=secret,
                 daemon={"cluster_peers": named, **({"pp_auto": 2} if pp_auto else {})},
                 serve={"port": free_port(), **({"model": str(model)} if pp_auto else {})})
    coord.start()
    if pp_auto:
        wait_for(lambda: (coord.d.status().get("bringup") or {}).get("state")
                 in ("active", "failed"), ACTIVATE_S, "the bring-up to end")
        assert coord.d.status()["bringup"]["state"] == "active", coord.d.stderr()[-3000:]
    else:
        wait_for(lambda: settled(coord.d, dict.fromkeys(named, "reachable")), POLL_WAIT_S,
                 f"the coordinator to reach {named}", every=0.2)
        activate(coord.d, model, 2)
    for p in peers:
        daemons.pids.add(p.d.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(coord.d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    return coord, peers


def test_agents_on_the_wildcard_take_stages_at_the_address_they_are_reached_on(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """Every agent on `0.0.0.0:<port>` (the default host of agent_addr), the coordinator
    with `pp_auto = 2` in its config file naming its peers 127.0.0.2 and 127.0.0.3: each
    stage listens there, not on a wildcard."""
    model = split_fixture_dir / "llama"
    coord, peers = bring_up(daemons, model, ["127.0.0.2", "127.0.0.3"], pp_auto=True)
    assert coord.d.status()["agent"]["address"] == f"0.0.0.0:{coord.agent_port}"
    port = int(coord.serve_keys["port"])
    assert complete(port, "llama") == expected(model, PROMPT, 8)
    for i, p in enumerate(peers):
        stage = p.d.worker("stage")["stats"]
        assert stage["address"].startswith(f"127.0.0.{2 + i}:"), stage


def test_peers_named_by_host_name(daemons: Daemons, split_fixture_dir: Path) -> None:
    """`cluster_peers = ["localhost:P1", "localhost:P2"]`: planned, assigned and served by
    name (the stage links' handshakes bind the names' addresses)."""
    model = split_fixture_dir / "qwen3"
    coord, peers = bring_up(daemons, model, ["localhost", "localhost"], pp_auto=False)
    bringup = coord.d.status()["bringup"]
    assert sorted(p["address"] for p in bringup["peers"]) == sorted(
        p.address("localhost") for p in peers), bringup
    port = int(coord.serve_keys["port"])
    assert complete(port, "qwen3") == expected(model, PROMPT, 8)
    wait_for(lambda: "stages of router: 2 of 2 attached" in coord.d.ctl("status").stdout,
             10, "mlxctl status showing both stages attached (the router's stats, each 1 s)")


def test_a_cluster_toml_that_names_every_node_by_host_name(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    """`--distributed-config` (here `[daemon] distributed_config`) with every address
    `localhost:PORT`: the coordinator's router and the stages authenticate each other."""
    model = split_fixture_dir / "llama"
    ports = [free_port() for _ in range(3)]
    toml = tmp_path / "cluster.toml"
    (tmp_path / "secret").write_text(secrets.token_hex(16) + "\n")
    (tmp_path / "secret").chmod(0o600)
    toml.write_text(textwrap.dedent(f"""
        [cluster]
        name = "named"
        pipeline_parallel_size = 2
        model = "{model}"
        secret_file = "secret"

        [[nodes]]
        id = "coordinator"
        address = "localhost:{ports[0]}"
        role = "coordinator"

        [[nodes]]
        id = "stage-0"
        address = "localhost:{ports[1]}"
        role = "pipeline_stage"
        rank = 0
        layers = [0, 2]

        [[nodes]]
        id = "stage-1"
        address = "localhost:{ports[2]}"
        role = "pipeline_stage"
        rank = 1
        layers = [2, 4]
        """))
    hosts = {node: Host(daemons, node[:2], secret=None,
                        daemon={"distributed_config": str(toml), "node_id": node})
             for node in ("stage-0", "stage-1")}
    router_port = free_port()
    coord = Host(daemons, "co", secret=None,
                 daemon={"distributed_config": str(toml), "node_id": "coordinator"},
                 serve={"port": router_port})
    for h in (*hosts.values(), coord):
        h.start()
    for h in hosts.values():
        daemons.pids.add(h.d.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(coord.d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    assert complete(router_port, "llama") == expected(model, PROMPT, 8)
