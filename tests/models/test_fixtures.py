"""The fixture generator against the real thing: unmodified mlx_lm.load and generate."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.nn.layers.quantized import QuantizedLinear
from mlx_lm.utils import get_total_parameters

from mlxceld.errors import ConfigError
from mlxceld.models import (
    CACHE_ENV,
    PRESETS,
    FixtureSpec,
    fixture_cache,
    model_config,
    preset,
    run_cli,
    write_fixture,
)
from mlxceld.models.fixtures import tokenizer as fixture_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Teal."},
    {"role": "user", "content": [{"type": "text", "text": "Another?"}]},
]
UNICODE = "Grüße, 世界! 🙂🇫🇷 e\u0301 \x00\t\r\n  trailing  \U0010fffd ﷽ Ωμέγα"


def load(directory: Path) -> tuple[Any, Any]:
    """``mlx_lm.load``, unmodified; typed loosely (it returns a 2- or 3-tuple)."""
    model, tokenizer = mlx_lm.load(str(directory))[:2]
    return model, tokenizer


def params(model: Any) -> int:
    return int(get_total_parameters(model))  # type: ignore[no-untyped-call]


def greedy(model: Any, tokenizer: Any, prompt: list[int], n: int = 32) -> list[int]:
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)]


def chat_prompt(tokenizer: Any) -> list[int]:
    ids: list[int] = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return ids


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("tiny") / request.param,
                         preset("tiny", family=request.param))


def test_tiny_loads_and_generates_varied_tokens(tiny: Path) -> None:
    model, tokenizer = load(tiny)
    text = mlx_lm.generate(model, tokenizer, "The quick brown fox", max_tokens=20)
    assert isinstance(text, str) and text
    ids = greedy(model, tokenizer, chat_prompt(tokenizer))
    assert len(set(ids)) >= 8, f"greedy decoding is degenerate: {ids}"
    assert json.loads((tiny / "config.json").read_text())["max_position_embeddings"] == 2048


def test_tiny_chat_template_renders_chatml(tiny: Path) -> None:
    _, tokenizer = load(tiny)
    text = tokenizer.decode(chat_prompt(tokenizer))
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nName a colour.<|im_end|>\n"
                    "<|im_start|>assistant\nTeal.<|im_end|>\n"
                    "<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert chat_prompt(tokenizer).count(im_start) == 5  # special tokens are single ids


def test_tiny_tokenizer_round_trips_any_text(tiny: Path) -> None:
    _, tokenizer = load(tiny)
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    assert tokenizer.decode(ids) == UNICODE
    assert len(ids) < len(UNICODE.encode())  # merges were learned, not just bytes


def test_eos_ids_per_family(tiny: Path) -> None:
    _, tokenizer = load(tiny)
    ids = {t: tokenizer.convert_tokens_to_ids(t)
           for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert list(ids.values()) == [509, 510, 511]  # after the trained tokens, as in Qwen
    if tiny.name == "qwen3":
        assert tokenizer.eos_token == "<|im_end|>"
        assert tokenizer.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    else:
        assert tokenizer.eos_token == "<|endoftext|>"
        assert tokenizer.eos_token_ids == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    assert tokenizer.pad_token == "<|endoftext|>"


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_spec_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    spec = preset("tiny", family="llama")
    first = files(write_fixture(tmp_path / "a", spec))
    fixture_tokenizer.train.cache_clear()  # train the tokenizer again, too
    assert files(write_fixture(tmp_path / "b", spec)) == first
    other = files(write_fixture(tmp_path / "c", dataclasses.replace(spec, seed=1)))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    here = hashlib.sha256(fixture_tokenizer.train(512).json_text.encode()).hexdigest()
    code = ("import hashlib; from mlxceld.models.fixtures.tokenizer import train; "
            "print(hashlib.sha256(train(512).json_text.encode()).hexdigest())")
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == here


def test_forced_sharding_loads_the_same_model(tmp_path: Path, tiny: Path) -> None:
    spec = dataclasses.replace(preset("tiny", family=tiny.name), shard_bytes=100_000)
    sharded = write_fixture(tmp_path / "sharded", spec)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    model, tokenizer = load(sharded)
    whole, _ = load(tiny)
    prompt = chat_prompt(tokenizer)
    assert greedy(model, tokenizer, prompt, 12) == greedy(whole, tokenizer, prompt, 12)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_tiny_loads_and_generates(tmp_path: Path, bits: int) -> None:
    directory = write_fixture(tmp_path / "q", preset("tiny", quantize_bits=bits))
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    model, tokenizer = load(directory)
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    ids = greedy(model, tokenizer, chat_prompt(tokenizer), 20)
    assert len(set(ids)) >= 5, ids
    assert mlx_lm.generate(model, tokenizer, "hello", max_tokens=5)


def test_quantization_group_size_must_divide_dims() -> None:
    with pytest.raises(ConfigError, match=r"group_size \(--group-size\) = 128 .*hidden = 64"):
        preset("tiny", quantize_bits=4, group_size=128)
    with pytest.raises(ConfigError, match="quantize_bits"):
        preset("tiny", quantize_bits=7)


def test_mxfp4_is_four_bits_in_groups_of_32(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--quantize-mode mxfp4 sets what mxfp4 stores; a spec that says otherwise, or a mode
    without quantization, is refused naming the field."""
    with pytest.raises(ConfigError, match=r"group_size \(--group-size\) = 64 is not what "
                                          r"mxfp4 stores"):
        preset("tiny", quantize_bits=4, quantize_mode="mxfp4")
    with pytest.raises(ConfigError, match=r"quantize_bits \(--quantize\) = 8"):
        preset("tiny", quantize_bits=8, group_size=32, quantize_mode="mxfp4")
    with pytest.raises(ConfigError, match=r"quantize_mode \(--quantize-mode\) = 'mxfp4' is "
                                          r"for a quantized fixture"):
        preset("tiny", quantize_mode="mxfp4")
    target = tmp_path / "mx"
    assert run_cli([str(target), "--quantize-mode", "mxfp4"]) == 0
    assert "4-bit mxfp4" in capsys.readouterr().out
    config = json.loads((target / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    model, tokenizer = load(target)
    assert mlx_lm.generate(model, tokenizer, "hello", max_tokens=5)


def test_padding_ids_are_never_emitted(tmp_path: Path) -> None:
    spec = preset("tiny", vocab=1024, tokenizer_vocab=512)
    model, tokenizer = load(write_fixture(tmp_path / "p", spec))
    assert len(tokenizer) == 512
    assert max(greedy(model, tokenizer, chat_prompt(tokenizer))) < 512


def test_refuses_a_non_empty_directory_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"{target} is not empty") as err:
        write_fixture(target, preset("tiny"))
    assert "--overwrite" in err.value.hint
    assert (target / "notes.txt").exists()
    write_fixture(target, preset("tiny"), overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging left behind


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> list[str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fixture_tokenizer, "write_tokenizer", broken)
    with pytest.raises(ConfigError, match="No space left on device"):
        write_fixture(tmp_path / "model", preset("tiny"))
    assert list(tmp_path.iterdir()) == []


def test_bad_presets_and_fields_are_named() -> None:
    with pytest.raises(ConfigError, match="preset 'huge' does not exist") as err:
        preset("huge")
    assert "tiny" in err.value.hint
    with pytest.raises(ConfigError, match="no field 'width'"):
        preset("tiny", width=3)
    with pytest.raises(ConfigError, match=r"kv_heads \(--kv-heads\) = 3"):
        preset("tiny", kv_heads=3)
    with pytest.raises(ConfigError, match="family"):
        preset("tiny", family="gpt2")
    with pytest.raises(ConfigError, match=r"layers \(--layers\) = 0"):
        preset("small", layers=0)


def test_fixture_cache_writes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    spec = preset("tiny", seed=7)
    results: list[Path] = []
    racers = [threading.Thread(target=lambda: results.append(fixture_cache(spec)))
              for _ in range(3)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [path.name]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert fixture_cache(spec) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert fixture_cache(dataclasses.replace(spec, seed=8)) != path


def test_small_preset_writes_and_loads(tmp_path: Path) -> None:
    spec = PRESETS["small"]
    model, tokenizer = load(write_fixture(tmp_path / "small", spec))
    per_layer = (2 * spec.hidden * spec.hidden + 2 * spec.hidden * spec.kv_heads * spec.head_size
                 + 3 * spec.hidden * spec.intermediate + 2 * spec.hidden + 2 * spec.head_size)
    expected = spec.vocab * spec.hidden + spec.layers * per_layer + spec.hidden
    assert params(model) == expected == 25_699_840
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert len(tokenizer) == 4096
    assert len(greedy(model, tokenizer, [1, 2, 3], 3)) == 3


def test_qwen3_06b_shape_without_weights() -> None:
    spec = PRESETS["qwen3-0.6b"]
    config = model_config(spec, [151645, 151643])
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "vocab_size", "tie_word_embeddings", "torch_dtype")} == {
        "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs.from_dict(config)  # type: ignore[no-untyped-call]
    lazy = qwen3.Model(args)  # never evaluated: no memory
    assert params(lazy) == 596_049_920  # Qwen3-0.6B's published count


def test_spec_is_frozen_and_keyed() -> None:
    spec = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.layers = 3  # type: ignore[misc]
    assert spec.key() == FixtureSpec(**dataclasses.asdict(spec)).key()
    assert spec.key() != preset("tiny", seed=1).key()


def test_cli_writes_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli"
    assert run_cli([str(target), "--family", "llama", "--layers", "3", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {target}: llama, 3 layers" in out and "model.safetensors" in out
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 3
    assert run_cli([str(target)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert run_cli([str(tmp_path / "x"), "--preset", "huge"]) == 2
    assert run_cli([str(tmp_path / "y"), "--kv-heads", "3"]) == 2
    assert "--kv-heads" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_tools_template_gives_mlx_lm_tool_calling_and_thinking(tmp_path: Path,
                                                                  tiny: Path) -> None:
    target = tmp_path / "tools"
    assert run_cli([str(target), "--chat-template", "tools"]) == 0
    _, tokenizer = load(target)
    assert tokenizer.has_tool_calling and tokenizer.has_thinking
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert len(tokenizer.tool_call_start_tokens) == len(tokenizer.think_start_tokens) == 1
    assert tokenizer.tool_parser('{"name": "f", "arguments": {"x": 1}}') == \
        {"name": "f", "arguments": {"x": 1}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "f", "arguments": {"x": 1}}}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": None,
                                             "tool_calls": calls},
         {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        tools=tools, add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function"' in text
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # the answer opens thinking
    closed = tokenizer.apply_chat_template([{"role": "user", "content": "go"}],
                                           add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n")
    _, plain = load(tiny)  # the default template: neither
    assert not plain.has_tool_calling and not plain.has_thinking
    with pytest.raises(ConfigError, match="chat_template"):
        preset("tiny", chat_template="jinja")
