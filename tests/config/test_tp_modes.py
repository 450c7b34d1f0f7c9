"""``--tp-moe-mode``, ``--tp-embedding-mode``, ``--tp-lm-head-mode`` and their ``[serve]``
keys (config/tensor_modes.py): what mlx-lm's split does is honoured, the other value is
refused naming the flag or key, the value and why; none of them goes without a group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.changes import config_changes
from mlxceld.config.daemon import Config, build_config
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset
from mlxceld.models.tensor_modes import TensorModes

from helpers.daemons import Daemons
from helpers.hub import hub_cache


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def checkpoint(root: Path, family: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(model_config(preset("tiny", family=family),
                                                              [1])))
    return root


def qwen35(root: Path, *, tied: bool) -> Path:
    """config.json of a qwen3.5 checkpoint (its text model under ``text_config``)."""
    root.mkdir(parents=True)
    text = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "tie_word_embeddings": tied}
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                  "text_config": text}))
    return root


def test_flags_and_keys_that_name_what_mlx_lm_does_are_kept(tmp_path: Path) -> None:
    llama = str(checkpoint(tmp_path / "llama", "llama"))
    by_flag = config(tmp_path, ["--model", llama, "--tp-size", "2", "--tp-moe-mode", "shard",
                                "--tp-embedding-mode", "replicate",
                                "--tp-lm-head-mode", "replicate"]).serve
    by_key = config(tmp_path, [], {"model": llama, "tp_size": 2, "tp_moe_mode": "shard",
                                   "tp_embedding_mode": "replicate",
                                   "tp_lm_head_mode": "replicate"}).serve
    assert by_flag.tp_modes == by_key.tp_modes == TensorModes("shard", "replicate", "replicate")
    assert config(tmp_path, ["--tp-size", "2"]).serve.tp_modes == TensorModes()  # not said


@pytest.mark.parametrize(("args", "serve", "message"), [
    (["--tp-moe-mode", "replicate"], {},
     "--tp-moe-mode replicate: mlx-lm's tensor-parallel split cuts every expert's weights"),
    ([], {"tp_moe_mode": "replicate"},
     "'serve.tp_moe_mode' replicate: mlx-lm's tensor-parallel split cuts every expert's"),
    (["--tp-embedding-mode", "shard"], {},
     "--tp-embedding-mode shard: mlx-lm's tensor-parallel split keeps the token embedding "
     "whole"),
    ([], {"tp_embedding_mode": "shard"}, "'serve.tp_embedding_mode' shard: "),
    (["--tp-lm-head-mode", "sharded"], {},
     "--tp-lm-head-mode must be replicate or shard, not 'sharded'"),
    ([], {"tp_lm_head_mode": 1}, "'serve.tp_lm_head_mode' must be replicate or shard, not 1"),
    (["--tp-moe-mode", "Shard"], {}, "--tp-moe-mode must be replicate or shard, not 'Shard'"),
])
def test_a_mode_mlx_lm_never_gives_is_refused_naming_it(
        tmp_path: Path, args: list[str], serve: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--tp-size", "2", *args], serve)
    assert message in err.value.message
    assert "leave the mode out" in err.value.hint


@pytest.mark.parametrize(("args", "serve", "named"), [
    (["--tp-moe-mode", "shard"], {}, "--tp-moe-mode shard"),
    (["--tp-size", "1", "--tp-lm-head-mode", "replicate"], {}, "--tp-lm-head-mode replicate"),
    ([], {"tp_embedding_mode": "replicate"}, "'serve.tp_embedding_mode' replicate"),
])
def test_a_mode_without_a_group_is_refused(
        tmp_path: Path, args: list[str], serve: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, args, serve)
    assert f"{named} without a tensor-parallel group" in err.value.message
    assert "--tp-size 2" in err.value.hint


def test_the_head_is_judged_by_the_models_family(tmp_path: Path) -> None:
    llama = str(checkpoint(tmp_path / "llama", "llama"))
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--model", llama, "--tp-size", "2", "--tp-lm-head-mode", "shard"])
    assert err.value.message.startswith(
        f"--model ({llama}): --tp-lm-head-mode shard: mlx-lm's tensor-parallel split of "
        "model_type 'llama' keeps its head whole on every rank; leave it out (or give "
        "--tp-lm-head-mode replicate)")
    untied = str(qwen35(tmp_path / "q", tied=False))
    said = config(tmp_path, [], {"model": untied, "tp_size": 2, "tp_lm_head_mode": "shard"})
    assert said.serve.tp_lm_head_mode == "shard"
    with pytest.raises(ConfigError) as err:
        config(tmp_path, [], {"model": untied, "tp_size": 2, "tp_lm_head_mode": "replicate"})
    assert ("'serve.tp_lm_head_mode' replicate: mlx-lm's tensor-parallel split of model_type "
            "'qwen3_5' cuts its head by vocabulary across the ranks" in err.value.message)
    tied = str(qwen35(tmp_path / "t", tied=True))  # the head is the embedding: whole
    assert config(tmp_path, ["--model", tied, "--tp-size", "2", "--tp-lm-head-mode",
                             "replicate"]).serve.tp_lm_head_mode == "replicate"


def test_a_repo_id_is_judged_once_fetched(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["--model", "acme/tiny", "--tp-size", "2",
                            "--tp-lm-head-mode", "shard"])
    assert cfg.serve.tp_lm_head_mode == "shard"  # daemon/serving.py's split_check judges it


def test_a_reload_names_the_key_that_changed(tmp_path: Path) -> None:
    old = config(tmp_path, ["--tp-size", "2"])
    new = config(tmp_path, ["--tp-size", "2"], {"tp_moe_mode": "shard"})
    assert [c["key"] for c in config_changes(old, new)] == ["serve.tp_moe_mode"]


def test_check_config_exits_2_naming_the_flag(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text("")
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--check-config",
                          "--state-dir", str(tmp_path / "s"), "--config",
                          str(tmp_path / "m.toml"), "--tp-size", "2",
                          "--tp-embedding-mode", "shard"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "mlxceld: error: --tp-embedding-mode shard: mlx-lm's tensor-parallel split keeps " \
        "the token embedding whole on every rank" in out.stderr


def hub_env(cache: Path) -> dict[str, str]:
    """A Hugging Face cache of our own, read offline (tests/helpers/hub.py)."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache)}


def test_a_repo_ids_head_is_judged_at_start_once_fetched(
        tmp_path: Path, daemons: Daemons) -> None:
    d = daemons.make()
    snap = hub_cache(tmp_path / "hf", "acme/tiny-llama", checkpoint(tmp_path / "m", "llama"))
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                          "--state-dir", str(d.state_dir), "--socket", str(d.socket),
                          "--model", "acme/tiny-llama", "--tp-size", "2",
                          "--tp-lm-head-mode", "shard"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **hub_env(tmp_path / "hf")})
    assert out.returncode == 2, out.stderr
    assert (f"mlxceld: error: the model acme/tiny-llama ({snap}): tp_lm_head_mode "
            "(--tp-lm-head-mode) shard: mlx-lm's tensor-parallel split of model_type 'llama' "
            "keeps its head whole on every rank" in out.stderr)


def test_mlxctl_serve_of_a_model_the_head_mode_does_not_fit_is_refused(
        tmp_path: Path, daemons: Daemons) -> None:
    llama = checkpoint(tmp_path / "llama", "llama")
    d = daemons.make('[serve]\ntp_size = 2\ntp_lm_head_mode = "shard"\n')
    d.start()
    refused = d.ctl("serve", str(llama))
    assert refused.returncode == 1
    assert (f"mlxctl serve {llama} ({llama}): tp_lm_head_mode (--tp-lm-head-mode) shard: "
            "mlx-lm's tensor-parallel split of model_type 'llama' keeps its head whole"
            in refused.stderr)
    assert d.status()["serving"] is None  # nothing changed: no model, no router
