"""``[serve] kv_bits``, ``kv_group_size``, ``quantized_kv_start`` and their flags
(config/kvquant.py): parsed, carried to the router's options, and refused by name: a value
out of range, a group or start without bits, a router with no model, and a model whose cache
cannot be quantized (judged from its config.json: models/kvquant.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset
from mlxceld.roles.options import KVQuant, RouterOptions, options_json, parse_options


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None
           ) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def checkpoint(root: Path, family: str, **changes: Any) -> Path:
    """A directory holding only a ``tiny`` config.json: the check reads no more."""
    extra = changes.pop("config", {})
    root.mkdir(parents=True)
    cfg = model_config(preset("tiny", family=family, **changes), [1])
    (root / "config.json").write_text(json.dumps({**cfg, **extra}))
    return root


def test_keys_and_flags_set_it_and_the_router_gets_it(tmp_path: Path) -> None:
    assert config(tmp_path, []).serve.kv_quant is None  # full precision by default
    assert config(tmp_path, [], {"kv_bits": 8}).serve.kv_quant == KVQuant(8, 64, 0)
    assert config(tmp_path, ["--kv-bits", "4", "--kv-group-size", "32",
                             "--quantized-kv-start", "256"]).serve.kv_quant \
        == KVQuant(4, 32, 256)
    both = config(tmp_path, ["--kv-bits", "4"], {"kv_bits": 8, "kv_group_size": 128})
    assert both.serve.kv_quant == KVQuant(4, 128, 0)  # the flag wins, the rest from the file
    model = checkpoint(tmp_path / "llama", "llama", head_dim=64)
    options = router_options(config(tmp_path, ["--model", str(model), "--kv-bits", "8"]).serve)
    assert options.kv_quant == KVQuant(8, 64, 0)
    # across the bootstrap pipe and back
    assert parse_options("router", json.loads(json.dumps(options_json(options)))) == options
    with pytest.raises(ConfigError, match=r"option 'options\.kv_quant\.bits' must be one "
                                          r"of 4, 8, not 6"):
        parse_options("router", {**options_json(options),
                                 "kv_quant": {"bits": 6, "group_size": 64, "start": 0}})
    assert RouterOptions(model="m", model_name="m", host="h", port=1, max_batch=1,
                         max_queued=1).kv_quant is None


@pytest.mark.parametrize(("args", "serve", "named", "hint"), [
    (["--kv-bits", "6"], {}, "--kv-bits must be 4 or 8", "0.53"),
    ([], {"kv_bits": 16}, "'serve.kv_bits' must be 4 or 8", "full precision"),
    ([], {"kv_bits": "8"}, "'serve.kv_bits' must be 4 or 8", "full precision"),
    ([], {"kv_bits": True}, "'serve.kv_bits' must be 4 or 8", "full precision"),
    (["--kv-bits", "8", "--kv-group-size", "16"], {}, "--kv-group-size must be one of 32, "
     "64, 128", "64, mlx-lm's default"),
    ([], {"kv_bits": 8, "kv_group_size": 48}, "'serve.kv_group_size' must be one of",
     "mlx-lm's default"),
    ([], {"kv_bits": 8, "quantized_kv_start": -1}, "'serve.quantized_kv_start' must be a "
     "number of tokens, 0 or more", "5000"),
    ([], {"kv_bits": 8, "quantized_kv_start": 1.5}, "'serve.quantized_kv_start' must be",
     "5000"),
    ([], {"kv_group_size": 32}, "'serve.kv_group_size' means nothing without kv_bits",
     "set kv_bits = 4 or 8 too"),
    (["--quantized-kv-start", "100"], {}, "--quantized-kv-start means nothing without "
     "kv_bits", "leave quantized_kv_start out"),
    (["--kv-bits", "8", "--node-role", "router", "--replicas", "10.0.0.2"], {},
     "--kv-bits 8 with node_role router (--node-role): a router over replicas holds no "
     "model", "set kv_bits on the replicas"),
])
def test_a_bad_setting_is_refused_naming_the_flag_or_key(
        tmp_path: Path, args: list[str], serve: dict[str, object], named: str,
        hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, args, serve)
    assert named in err.value.message
    assert hint in (err.value.hint or "")


@pytest.mark.parametrize(("family", "changes", "reason"), [
    ("gemma3_text", {"head_dim": 64}, "its sliding-window layers keep a RotatingKVCache"),
    ("gemma3", {"head_dim": 64}, "its sliding-window layers keep a RotatingKVCache"),
    ("gpt_oss", {"head_dim": 64}, "its attention adds sinks"),
    ("deepseek_v3", {}, "its multi-head latent attention keeps a compressed latent"),
    ("llama", {"head_dim": 64, "config": {
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}},
     "its layer_types has sliding-window layers"),
])
def test_a_family_that_cannot_keep_a_quantized_cache_is_refused_at_start(
        tmp_path: Path, family: str, changes: dict[str, Any], reason: str) -> None:
    model = checkpoint(tmp_path / family, family, **changes)
    for args, serve, said in (
            (["--model", str(model), "--kv-bits", "8"], {}, "--kv-bits = 8"),
            (["--model", str(model)], {"kv_bits": 4}, "'serve.kv_bits' = 4")):
        with pytest.raises(ConfigError) as err:
            config(tmp_path, args, serve)
        message = err.value.message
        assert said in message and str(model / "config.json") in message, message
        assert f"model family {family!r} cannot keep a quantized KV cache" in message
        assert reason in message
        assert "leave kv_bits out" in (err.value.hint or "")
    assert config(tmp_path, ["--model", str(model)]).serve.kv_quant is None  # without: fine


def test_heads_the_group_size_does_not_divide_are_refused_naming_the_group(
        tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "llama", "llama")  # 16-element heads
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["--model", str(model), "--kv-bits", "8"])
    assert "its attention heads have 16 elements, which kv_group_size 64 does not divide" \
        in err.value.message
    assert "kv_group_size (--kv-group-size)" in (err.value.hint or "")
    wide = checkpoint(tmp_path / "wide", "qwen3", head_dim=32)
    assert config(tmp_path, ["--model", str(wide), "--kv-bits", "8", "--kv-group-size",
                             "32"]).serve.kv_quant == KVQuant(8, 32, 0)
