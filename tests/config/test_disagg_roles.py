"""``--node-role prefill|decode``, ``--prefill-peers``, ``--decode-peers`` and
``--kv-compression`` ([serve] keys): parsed, and refused by name where they do not go
together (config/disagg.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.errors import ConfigError


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def test_a_router_over_both_pools_with_or_without_replicas(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["--node-role", "router", "--prefill-peers", "10.0.0.21",
                            "--decode-peers", "10.0.0.22,10.0.0.23:19001",
                            "--kv-compression", "int4+lz4"])
    s = cfg.serve
    assert (s.prefill_peers, s.decode_peers, s.replicas, s.kv_compression) == (
        ("10.0.0.21:19000",), ("10.0.0.22:19000", "10.0.0.23:19001"), (), "int4+lz4")
    both = config(tmp_path, [], {"node_role": "router", "prefill_peers": ["10.0.0.21"],
                                 "decode_peers": ["10.0.0.22"], "replicas": ["10.0.0.30"]})
    assert both.serve.replicas == ("10.0.0.30:19000",)
    assert both.serve.kv_compression == "none"
    decode = config(tmp_path, ["--node-role", "decode", "--prefill-peers", "10.0.0.21"])
    assert decode.serve.node_role == "decode"
    assert config(tmp_path, ["--node-role", "prefill"]).serve.node_role == "prefill"


@pytest.mark.parametrize(("args", "serve", "message"), [
    (["--node-role", "router", "--prefill-peers", "10.0.0.21"], {},
     r"^--prefill-peers needs --decode-peers too"),
    ([], {"node_role": "router", "decode_peers": ["10.0.0.22"]},
     r"'serve\.decode_peers' needs --prefill-peers too"),
    (["--node-role", "decode"], {}, r"^--node-role decode needs --prefill-peers"),
    (["--node-role", "decode", "--prefill-peers", "10.0.0.21", "--decode-peers",
      "10.0.0.22"], {}, r"^--node-role decode takes no --decode-peers or --replicas"),
    (["--node-role", "prefill", "--decode-peers", "10.0.0.22"], {},
     r"^--decode-peers is for a router or a decode node; this node's role is prefill"),
    (["--prefill-peers", "10.0.0.21"], {}, r"^--prefill-peers is for a router or a decode"),
    (["--node-role", "router", "--replicas", "10.0.0.2", "--kv-compression", "int2"], {},
     r"^--kv-compression: 'int2' is not a KV compression"),
    ([], {"kv_compression": "int8+zstd"}, r"'serve\.kv_compression': 'int8\+zstd' is not"),
    ([], {"node_role": "router", "prefill_peers": "10.0.0.21", "decode_peers": ["x"]},
     r"'serve\.prefill_peers' must be a list of agent addresses"),
])
def test_refusals_name_what_is_wrong(tmp_path: Path, args: list[str],
                                     serve: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config(tmp_path, args, serve)
    assert err.value.hint


def test_prefill_and_decode_nodes_take_no_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"node_role prefill \(--node-role\) excludes "
                       r"pp_auto \(--pp-auto\): a prefill node runs no pipeline"):
        config(tmp_path, ["--node-role", "prefill", "--pp-auto", "2"])
