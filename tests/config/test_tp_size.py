"""``--tp-size N`` and ``[serve] tp_size`` (config/tensor.py): parsed, bounded, carried to
the router's options, and refused by name beside what it does not go with or for a model
it does not split."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset
from mlxceld.roles.options import RouterOptions, parse_options

from helpers.daemons import Daemons
from helpers.hub import hub_cache
from helpers.keys import secret_file
from helpers.waiting import wait_for

EVENT_S = 30.0  # a reload's event; generous on a loaded machine


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None,
           daemon: dict[str, object] | None = None) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s"), **(daemon or {})},
            "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def checkpoint(root: Path, family: str) -> Path:
    """A directory holding only the ``tiny`` preset's config.json: the check reads no more
    (heads 4, KV heads 2, intermediate size 128)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(model_config(preset("tiny", family=family),
                                                              [1])))
    return root


def test_flag_and_key_set_it_and_the_router_gets_it(tmp_path: Path) -> None:
    assert config(tmp_path, []).serve.tp_size == 1
    by_flag = config(tmp_path, ["--tp-size", "4"])
    by_key = config(tmp_path, [], {"tp_size": 4})
    assert by_flag.serve.tp_size == by_key.serve.tp_size == 4
    assert config(tmp_path, ["--tp-size", "2"], {"tp_size": 4}).serve.tp_size == 2  # flag wins
    model = checkpoint(tmp_path / "llama", "llama")
    served = config(tmp_path, ["--model", str(model), "--tp-size", "2"]).serve
    options = router_options(served)
    assert options.tp_size == 2
    assert router_options(config(tmp_path, ["--model", str(model)]).serve).tp_size == 1


@pytest.mark.parametrize(("args", "serve", "named"), [
    (["--tp-size", "0"], {}, "--tp-size must be a whole number from 1 to 16"),
    (["--tp-size", "17"], {}, "--tp-size must be"),
    (["--tp-size", "-2"], {}, "--tp-size must be"),
    ([], {"tp_size": 0}, "'serve.tp_size' must be a whole number from 1 to 16"),
    ([], {"tp_size": 32}, "'serve.tp_size' must be"),
    ([], {"tp_size": "2"}, "'serve.tp_size' must be"),
    ([], {"tp_size": True}, "'serve.tp_size' must be"),
    ([], {"tp_size": 2.0}, "'serve.tp_size' must be"),
])
def test_a_size_out_of_bounds_is_refused_naming_the_flag_or_key(
        tmp_path: Path, args: list[str], serve: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, args, serve)
    assert named in err.value.message
    assert "--tp-size 2" in err.value.hint


@pytest.mark.parametrize(("args", "serve", "daemon", "message"), [
    (["--tp-size", "2", "--node-role", "router", "--replicas", "10.0.0.2"], {}, {},
     r"^--tp-size 2 with node_role router \(--node-role\): a router over replicas holds "
     r"no model"),
    (["--tp-size", "2", "--node-role", "prefill"], {}, {},
     r"^--tp-size 2 with node_role prefill .*: tensor parallelism on a prefill node is not "
     r"built yet"),
    (["--node-role", "decode", "--prefill-peers", "10.0.0.21"], {"tp_size": 4}, {},
     r"'serve\.tp_size' 4 with node_role decode .*not built yet"),
    (["--tp-size", "2", "--pp-auto", "2"], {}, {},
     r"^--tp-size 2 with pp_auto \(--pp-auto\): the coordinator's router holds no layers"),
    ([], {"tp_size": 2}, {"pp_auto": 2}, r"'serve\.tp_size' 2 with pp_auto \(--pp-auto\)"),
    (["--tp-size", "3", "--pp-peer", "--tp-peers", "10.0.0.3"], {}, {},
     r"^--tp-peers names 1 rank host\(s\) and --tp-size is 3"),
])
def test_beside_what_it_does_not_go_with_it_is_refused(
        tmp_path: Path, args: list[str], serve: dict[str, object], daemon: dict[str, object],
        message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config(tmp_path, args, serve, daemon)
    assert "--tp-size" in err.value.hint


def test_a_stage_host_takes_it_and_a_coordinator_is_told_to_set_it_there(
        tmp_path: Path) -> None:
    peer = config(tmp_path, ["--tp-size", "2", "--pp-peer"])
    assert peer.pp_peer and peer.serve.tp_size == 2
    assert config(tmp_path, ["--pp-peer"], {"tp_size": 4}).serve.tp_size == 4
    # its group across hosts: one rank host per rank past its own
    across = config(tmp_path, ["--tp-size", "2", "--pp-peer", "--tp-peers", "10.0.0.3"])
    assert across.pp_peer and across.serve.tp_peers == ("10.0.0.3:19000",)
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--tp-size", "2", "--pp-auto", "2"])
    assert "set tp_size on the stage hosts" in err.value.hint


def test_tp_size_one_goes_with_everything(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["--tp-size", "1", "--node-role", "router", "--replicas",
                            "10.0.0.2"])
    assert cfg.serve.tp_size == 1
    assert config(tmp_path, ["--tp-size", "1", "--pp-peer"]).pp_peer


def test_a_local_model_is_judged_from_its_config_json(tmp_path: Path) -> None:
    llama, qwen3 = checkpoint(tmp_path / "llama", "llama"), checkpoint(tmp_path / "q", "qwen3")
    assert config(tmp_path, ["--model", str(llama), "--tp-size", "2"]).serve.tp_size == 2
    assert config(tmp_path, [], {"model": str(qwen3), "tp_size": 2}).serve.tp_size == 2
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--model", str(llama), "--tp-size", "4"])
    assert err.value.message.startswith(
        f"--model: {llama / 'config.json'}: tp_size 4 does not divide num_key_value_heads 2")
    assert "tp sizes that split this model: 1, 2;" in err.value.message
    gemma = checkpoint(tmp_path / "gemma", "gemma3")
    with pytest.raises(ConfigError) as err:
        config(tmp_path, [], {"model": str(gemma), "tp_size": 2})
    assert err.value.message.startswith(
        f"{tmp_path / 'm.toml'}: 'serve.model': {gemma / 'config.json'} says model_type "
        "'gemma3', a model family mlx-lm cannot split")
    assert config(tmp_path, [], {"model": str(gemma)}).serve.model == str(gemma)  # tp 1


def test_a_repo_id_is_left_to_the_fetch(tmp_path: Path) -> None:
    # Not a local directory: judged once its config is fetched (the daemon's start).
    cfg = config(tmp_path, ["--model", "mlx-community/Qwen3-0.6B-4bit", "--tp-size", "2"])
    assert (cfg.serve.model, cfg.serve.tp_size) == ("mlx-community/Qwen3-0.6B-4bit", 2)


def test_the_router_options_bound_it() -> None:
    base = {"model": "/m", "model_name": "m", "host": "127.0.0.1", "port": 8080,
            "max_batch": 8, "max_queued": 64}
    assert RouterOptions(**base, tp_size=16).tp_size == 16  # type: ignore[arg-type]
    for bad in (0, 17):
        with pytest.raises(ConfigError, match=r"'router\.tp_size' must be (in )?1-16"):
            parse_options("router", {**base, "tp_size": bad}, "router")


def hub_env(cache: Path) -> dict[str, str]:
    """A Hugging Face cache of our own, read offline (tests/helpers/hub.py)."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache)}


def test_a_daemon_started_with_a_repo_it_does_not_split_exits_2_naming_it(
        tmp_path: Path, daemons: Daemons) -> None:
    # A repo id is judged once its config is fetched, at the daemon's start.
    d = daemons.make()
    snap = hub_cache(tmp_path / "hf", "acme/tiny-llama", checkpoint(tmp_path / "m", "llama"))
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                          "--state-dir", str(d.state_dir), "--socket", str(d.socket),
                          "--model", "acme/tiny-llama", "--tp-size", "4"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **hub_env(tmp_path / "hf")})
    assert out.returncode == 2, out.stderr
    assert (f"mlxceld: error: the model acme/tiny-llama (with tp_size 4): "
            f"{snap / 'config.json'}: tp_size 4 does not divide num_key_value_heads 2"
            in out.stderr)
    assert "tp sizes that split this model: 1, 2;" in out.stderr


def test_mlxctl_serve_activate_and_a_reload_are_refused_changing_nothing(
        tmp_path: Path, daemons: Daemons) -> None:
    llama, gemma = checkpoint(tmp_path / "llama", "llama"), checkpoint(tmp_path / "g", "gemma3")
    snap = hub_cache(tmp_path / "hf", "acme/tiny-gemma", gemma)
    secret = secret_file(tmp_path, b"s" * 32)
    d = daemons.make(f'[daemon]\ncluster_secret_file = "{secret}"\n[serve]\ntp_size = 2\n')
    d.start(env=hub_env(tmp_path / "hf"))
    for model, config in ((str(gemma), gemma / "config.json"),
                          ("acme/tiny-gemma", snap / "config.json")):
        refused = d.ctl("serve", model)
        assert refused.returncode == 1
        assert (f"mlxctl serve {model} (with tp_size 2): {config} says model_type 'gemma3'"
                in refused.stderr)
    assert d.status()["serving"] is None  # no model: no router, as before
    assert not [e for e in d.events() if e["kind"] == "serve.changed"]
    pipeline = d.ctl("cluster", "activate", "--model", str(llama), "--stages", "2")
    assert pipeline.returncode != 0
    assert "this daemon runs with tp_size 2 (--tp-size, [serve] tp_size): a pipeline's " \
        "coordinator holds no layers to split" in pipeline.stderr
    d.config.write_text(f'[serve]\ntp_size = 4\nmodel = "{llama}"\n')
    os.kill(d.pid, signal.SIGHUP)
    failed = wait_for(lambda: [e for e in d.events() if e["kind"] == "daemon.reload_failed"],
                      EVENT_S, "the reload's refusal")
    assert "'serve.model': " in failed[0]["message"]
    assert "tp_size 4 does not divide num_key_value_heads 2" in failed[0]["message"]
    assert d.status()["serving"] is None and not d.status()["workers"]
