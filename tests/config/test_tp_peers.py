"""``--tp-peers`` / ``[serve] tp_peers`` and ``--node-role tensor_parallel_rank``
(config/tensor.py): a tensor-parallel group across hosts, said whole on rank 0's daemon
and left to rank 0 on a rank host; each refusal names the flag or key, and a daemon of
either side without the cluster secret exits 2 naming the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.config.tensor import across_hosts, check_tp_reload
from mlxceld.daemon.roster import Situation, draw_roster
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset
from mlxceld.roles.options import RouterOptions, TensorOptions

from helpers.daemons import Daemons


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def checkpoint(root: Path, family: str) -> Path:
    """A directory holding only the ``tiny`` preset's config.json (heads 4, KV heads 2)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(model_config(preset("tiny", family=family),
                                                              [1])))
    return root


def test_flag_and_key_name_the_rank_hosts_in_order(tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "llama", "llama"))
    by_flag = config(tmp_path, ["--tp-size", "3", "--tp-peers",
                                "10.0.0.12,10.0.0.11:19001"]).serve
    assert by_flag.tp_peers == ("10.0.0.12:19000", "10.0.0.11:19001")
    by_key = config(tmp_path, ["--model", model],
                    {"tp_size": 2, "tp_peers": ["10.0.0.11"]}).serve
    assert by_key.tp_peers == ("10.0.0.11:19000",)
    assert config(tmp_path, ["--model", model]).serve.tp_peers == ()
    assert across_hosts(by_flag.node_role, by_flag.tp_peers) == "--tp-peers"


@pytest.mark.parametrize(("args", "serve", "said"), [
    (["--tp-size", "3", "--tp-peers", "10.0.0.11"], {},
     "--tp-peers names 1 rank host(s) and --tp-size is 3"),
    (["--tp-peers", "10.0.0.11"], {},
     "--tp-peers names 1 rank host(s) and FILE: 'serve.tp_size' is 1"),
    ([], {"tp_size": 2, "tp_peers": "10.0.0.11"}, "'serve.tp_peers' must be a list"),
    (["--tp-size", "2", "--tp-peers", "0.0.0.0"], {}, "--tp-peers: '0.0.0.0:19000' is a "
     "wildcard"),
    (["--node-role", "tensor_parallel_rank", "--tp-size", "2"], {},
     "--tp-size 2 with node_role tensor_parallel_rank (--node-role): a rank host takes"),
    (["--node-role", "tensor_parallel_rank", "--tp-peers", "10.0.0.11"], {},
     "--tp-peers with node_role tensor_parallel_rank"),
])
def test_a_group_not_said_whole_is_refused_naming_the_setting(
        tmp_path: Path, args: list[str], serve: dict[str, object], said: str) -> None:
    model = str(checkpoint(tmp_path / "llama", "llama"))
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--model", model, *args], serve)
    assert said in err.value.message.replace(str(tmp_path / "m.toml"), "FILE")


def test_a_rank_host_needs_its_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"node_role tensor_parallel_rank \(--node-role\) "
                                          r"needs the model \(--model or \[serve\] model\)"):
        config(tmp_path, ["--node-role", "tensor_parallel_rank"])
    rank = config(tmp_path, ["--node-role", "tensor_parallel_rank", "--model",
                             str(checkpoint(tmp_path / "llama", "llama"))])
    assert rank.serve.node_role == "tensor_parallel_rank"
    assert across_hosts(rank.serve.node_role, ()) == "--node-role tensor_parallel_rank"


def test_the_roster_runs_rank_0_once_formed_and_a_rank_host_its_rank_once_asked(
        tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "llama", "llama"))
    c = config(tmp_path, ["--model", model, "--tp-size", "2", "--tp-peers", "10.0.0.11"])
    assert draw_roster(Situation(c, c.serve)) == []  # not formed: no router
    ring = ("10.0.0.10:40000", "10.0.0.11:40001")
    [router] = draw_roster(Situation(c, c.serve, tp_hosts=ring))
    assert isinstance(router.options, RouterOptions)
    assert router.name == "router" and router.group is None  # no rank of it runs here
    assert router.options.tp_size == 2 and router.options.tp_hosts == ring
    r = config(tmp_path, ["--model", model, "--node-role", "tensor_parallel_rank"])
    assert draw_roster(Situation(r, r.serve)) == []  # not asked yet: no worker, no router
    asked = TensorOptions(model=model, model_name="llama", rank=1, tp_hosts=ring, max_batch=8)
    [rank] = draw_roster(Situation(r, r.serve, tensor_rank=asked))
    assert rank.name == "tp-1" and rank.options == asked and rank.secret is None


@pytest.mark.parametrize("args", [
    ["--tp-size", "2", "--tp-peers", "127.0.0.3"],
    ["--node-role", "tensor_parallel_rank"],
])
def test_without_the_cluster_secret_the_daemon_exits_2_naming_the_setting(
        tmp_path: Path, daemons: Daemons, args: list[str]) -> None:
    d = daemons.make()
    model = str(checkpoint(tmp_path / "llama", "llama"))
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                          "--state-dir", str(d.state_dir), "--socket", str(d.socket),
                          "--model", model, *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    setting = "--tp-peers" if "--tp-peers" in args else "--node-role tensor_parallel_rank"
    assert f"{setting} needs the cluster secret: the ring's ports and ranks travel" \
        in out.stderr, out.stderr


def test_a_reload_keeps_the_peers_and_the_rank_role() -> None:
    check_tp_reload(("10.0.0.11:19000",), "hybrid", ("10.0.0.11:19000",), "hybrid")
    check_tp_reload((), "hybrid", (), "router")  # no group across hosts: not this rule's
    for old, new in [((("10.0.0.11:19000",), "hybrid"), (("10.0.0.12:19000",), "hybrid")),
                     (((), "tensor_parallel_rank"), ((), "hybrid"))]:
        with pytest.raises(ConfigError, match=r"a reload cannot change serve\.tp_peers "
                                              r"\(--tp-peers\) or a node_role of "
                                              r"tensor_parallel_rank"):
            check_tp_reload(*old, *new)
