"""``--node-role`` and ``--replicas`` ([serve] node_role, replicas): parsed, normalized,
and refused by name where they do not go together (config/replicas.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.errors import ConfigError


def parse(args: list[str]) -> Overrides:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        return overrides(ctx.params)


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None,
           daemon: dict[str, object] | None = None) -> Config:
    data = {"daemon": {"state_dir": str(tmp_path / "s"), **(daemon or {})},
            "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", parse(args))


def test_hybrid_is_the_default_and_takes_no_replicas(tmp_path: Path) -> None:
    cfg = config(tmp_path, [])
    assert (cfg.serve.node_role, cfg.serve.replicas) == ("hybrid", ())
    assert config(tmp_path, ["--node-role", "hybrid"]).serve.node_role == "hybrid"


def test_replicas_are_agent_addresses_a_host_alone_on_the_default_port(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["--node-role", "router", "--replicas",
                            "Studio-2.local, 10.0.0.3:19001,[fd00::13],localhost:19000,"
                            "10.0.0.3:19001"])
    assert cfg.serve.node_role == "router"
    assert cfg.serve.replicas == ("studio-2.local:19000", "10.0.0.3:19001",
                                  "[fd00::13]:19000", "localhost:19000")
    by_file = config(tmp_path, [], {"node_role": "router", "replicas": ["10.0.0.2", "mac-3"]})
    assert by_file.serve.replicas == ("10.0.0.2:19000", "mac-3:19000")
    flag_wins = config(tmp_path, ["--replicas", "10.0.0.9"],
                       {"node_role": "router", "replicas": ["10.0.0.2"]})
    assert flag_wins.serve.replicas == ("10.0.0.9:19000",)


@pytest.mark.parametrize(("args", "serve", "message"), [
    (["--node-role", "router"], {},
     r"^--node-role router without --replicas \(\[serve\] replicas\) finds its replicas "
     r"by discovery, and this daemon discovers nothing"),
    ([], {"node_role": "router"},
     r"'serve\.node_role' router without --replicas .* discovers nothing"),
    (["--replicas", "10.0.0.2"], {},
     r"^--replicas is for --node-role router \(\[serve\] node_role = \"router\"\) only"),
    ([], {"replicas": ["10.0.0.2"]}, r"'serve\.replicas' is for --node-role router"),
    (["--node-role", "broker"], {},
     r"^--node-role: 'broker' is not a node role; the roles are hybrid, router, prefill, "
     r"decode, tensor_parallel_rank$"),
    ([], {"node_role": 1}, r"'serve\.node_role': 1 is not a node role"),
    (["--node-role", "router", "--replicas", "fd00::13"], {},
     r"^--replicas: peer 'fd00::13' .*write an IPv6 address in brackets"),
    (["--node-role", "router", "--replicas", "0.0.0.0:19000"], {},
     r"^--replicas: replica '0\.0\.0\.0:19000' is a wildcard"),
    (["--node-role", "router", "--replicas", "10.0.0.2:0"], {}, r"port 0, outside 1-65535"),
    (["--node-role", "router", "--replicas", "a,,b"], {}, r"an empty entry"),
    ([], {"node_role": "router", "replicas": "10.0.0.2"},
     r"'serve\.replicas' must be a list of agent addresses"),
])
def test_refusals_name_what_is_wrong(tmp_path: Path, args: list[str],
                                     serve: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config(tmp_path, args, serve)
    assert err.value.hint


def test_router_without_replicas_says_how_to_be_found(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--node-role", "router"])
    assert "--cluster-peers" in err.value.hint and "--replicas" in err.value.hint


@pytest.mark.parametrize("args", [["--cluster-peers", "10.0.0.2:19000"],
                                  ["--cluster-discovery", "mdns"]])
def test_router_without_replicas_finds_them_by_discovery(tmp_path: Path,
                                                         args: list[str]) -> None:
    cfg = config(tmp_path, ["--node-role", "router", *args])
    assert cfg.serve.node_role == "router" and cfg.serve.replicas == ()


@pytest.mark.parametrize(("args", "daemon", "named"), [
    (["--pp-auto", "2"], {}, "pp_auto (--pp-auto)"),
    (["--pp-peer"], {}, "pp_peer (--pp-peer)"),
    ([], {"distributed_config": "c.toml", "node_id": "n"},
     "distributed_config (--distributed-config)"),
])
def test_a_router_takes_no_pipeline(tmp_path: Path, args: list[str],
                                    daemon: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--node-role", "router", "--replicas", "10.0.0.2", *args],
               daemon=daemon)
    assert err.value.message == (f"node_role router (--node-role) excludes {named}: a router "
                                 "over replicas runs no pipeline of its own")


def test_the_wire_knows_the_node_roles_the_config_does() -> None:
    """The wire imports nothing of ours: its copy of the node roles (the ``serving``
    answer's) is held to the one in mlxceld/types.py here."""
    from mlxceld.types import NODE_ROLES
    from mlxceld.wire import agent_messages

    assert frozenset(NODE_ROLES) == agent_messages.NODE_ROLES
