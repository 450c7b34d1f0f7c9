"""The layer profile of real fixture checkpoints against the bytes mlx loads."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxceld.errors import ConfigError
from mlxceld.models import preset, write_fixture
from mlxceld.models.profile import LayerProfile, layer_profile
from mlxceld.models.slicing import load_stage
from mlxceld.models.tensor_headers import MAX_HEADER, TensorEntry, read_tensor_headers

from helpers.hub import COMMIT, hub_cache

LAYERS = 4
SPECS = {
    "llama": preset("tiny", family="llama", layers=LAYERS),  # untied head
    "qwen3": preset("tiny", layers=LAYERS),  # tied
    "llama-q4": preset("tiny", family="llama", layers=LAYERS, quantize_bits=4),
    "qwen3-q8-bf16": preset("tiny", layers=LAYERS, quantize_bits=8, dtype="bfloat16"),
    "sharded": preset("tiny", family="llama", layers=LAYERS, shard_bytes=64 * 1024),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("profile")
    return {name: write_fixture(root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture
def copy(models: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the sharded fixture, free to damage."""
    return Path(shutil.copytree(models["sharded"], tmp_path / "model"))


def loaded_bytes(path: Path) -> tuple[list[int], dict[str, int]]:
    """Per-layer and per-part bytes of every tensor mx.load reads from the files."""
    layers = [0] * LAYERS
    parts = {"embed": 0, "norm": 0, "head": 0}
    for file in path.glob("model*.safetensors"):
        for name, array in mx.load(str(file)).items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m:
                layers[int(m.group(1))] += array.nbytes
            else:
                part = {"model.embed_tokens": "embed", "model.norm": "norm",
                        "lm_head": "head"}[name.rsplit(".", 1)[0]]
                parts[part] += array.nbytes
    return layers, parts


@pytest.mark.parametrize("name", list(SPECS))
def test_bytes_are_those_mlx_loads(models: dict[str, Path], name: str) -> None:
    profile = layer_profile(models[name])
    layers, parts = loaded_bytes(models[name])
    assert list(profile.layer_bytes) == layers
    assert (profile.embed_bytes, profile.norm_bytes, profile.head_bytes) == \
        (parts["embed"], parts["norm"], parts["head"])
    assert profile.other_bytes == 0
    assert profile.num_layers == LAYERS
    assert profile.tied == SPECS[name].tied
    assert profile.hidden_size == 64


def test_tied_and_quantized_parts(models: dict[str, Path]) -> None:
    llama, qwen3 = layer_profile(models["llama"]), layer_profile(models["qwen3"])
    assert llama.head_bytes == llama.embed_bytes > 0 and qwen3.head_bytes == 0
    q4 = layer_profile(models["llama-q4"])
    assert 0 < q4.layer_bytes[0] < llama.layer_bytes[0] / 4  # packed weights + scales
    assert q4.dtype_bytes == 4  # from the float32 scales
    assert layer_profile(models["qwen3-q8-bf16"]).dtype_bytes == 2
    assert layer_profile(models["sharded"]) == llama  # same model, 13 files


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-q4"])
def test_stage_bytes_are_what_a_loaded_stage_holds(models: dict[str, Path], name: str) -> None:
    profile = layer_profile(models[name])
    for start, end in [(0, LAYERS), (0, 1), (1, 3), (3, LAYERS)]:
        assert profile.weight_bytes(start, end) == load_stage(models[name], start, end).nbytes
    assert profile.total_bytes == profile.weight_bytes(0, LAYERS)
    with pytest.raises(ValueError, match=r"\[2, 2\)"):
        profile.weight_bytes(2, 2)


def test_kv_bytes_per_token_are_what_the_cache_holds(models: dict[str, Path]) -> None:
    for name in ("llama", "qwen3-q8-bf16"):
        profile = layer_profile(models[name])
        model, _ = load(str(models[name]))
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3]]), cache=cache)
        keys, values = cache[0].keys, cache[0].values  # room for 256 tokens at a time
        assert keys.shape[2] == values.shape[2] == 256
        assert (keys.nbytes + values.nbytes) // 256 == profile.kv_bytes_per_token
        spec = SPECS[name]
        assert profile.kv_bytes_per_token == 2 * spec.kv_heads * spec.head_size * \
            profile.dtype_bytes


def test_synthetic_profile_weight_bytes() -> None:
    p = LayerProfile(layer_bytes=(10, 20, 30), embed_bytes=100, head_bytes=0, norm_bytes=1,
                     other_bytes=5, tied=True, dtype_bytes=2, hidden_size=8,
                     kv_bytes_per_token=32)
    assert p.weight_bytes(0, 1) == 10 + 5 + 100
    assert p.weight_bytes(1, 2) == 20 + 5
    assert p.weight_bytes(2, 3) == 30 + 5 + 100 + 1  # tied: the embeddings are the head
    assert p.total_bytes == 60 + 5 + 100 + 1


def first_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[0]


def damaged(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        layer_profile(path.parent)
    assert str(path) in info.value.message
    assert "download it again" in info.value.hint
    return info.value.message


def test_truncated_header_length(copy: Path) -> None:
    assert "truncated" in damaged(first_shard(copy), b"\x10\x00\x00")


def test_header_length_over_the_limit(copy: Path) -> None:
    message = damaged(first_shard(copy), (MAX_HEADER + 1).to_bytes(8, "little") + b"{}")
    assert f"{MAX_HEADER + 1}-byte header" in message


def test_header_longer_than_the_file(copy: Path) -> None:
    message = damaged(first_shard(copy), (1000).to_bytes(8, "little") + b"{}")
    assert "truncated" in message and "1008 bytes" in message


def test_header_not_json(copy: Path) -> None:
    assert "not valid JSON" in damaged(first_shard(copy), (3).to_bytes(8, "little") + b"{x}")
    assert "not an object" in damaged(first_shard(copy), (2).to_bytes(8, "little") + b"[]")


def test_tensor_data_cut_short(copy: Path) -> None:
    shard = first_shard(copy)
    whole = shard.read_bytes()
    message = damaged(shard, whole[:-1])
    assert "truncated" in message and "ends at data byte" in message


def test_entry_inconsistent_with_its_dtype(copy: Path) -> None:
    shard = first_shard(copy)
    header = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    message = damaged(shard, len(raw).to_bytes(8, "little") + raw + bytes(8))
    assert "tensor 't' (F32 [2, 2]: 16 bytes) spanning 8 bytes" in message
    header = {"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}
    raw = json.dumps(header).encode()
    assert "'Q4'" in damaged(shard, len(raw).to_bytes(8, "little") + raw + bytes(1))


def test_headers_only_are_read(copy: Path) -> None:
    """The data is never read: zeroed data profiles the same."""
    shard = first_shard(copy)
    before = layer_profile(copy)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    shard.write_bytes(raw[:8 + n] + bytes(len(raw) - 8 - n))
    assert layer_profile(copy) == before
    assert read_tensor_headers(shard)  # and the table is there


def test_a_host_with_only_some_shards_cannot_plan(copy: Path) -> None:
    """The decision in profile.py: planning needs every shard's header; a partial
    directory is refused with what it lacks named."""
    shard = first_shard(copy)
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"holds 12 of the 13 shards its "
                       rf"model\.safetensors\.index\.json names \(missing: {shard.name}\)"
                       ) as info:
        layer_profile(copy)
    assert "whole checkpoint" in info.value.hint


def test_a_repo_ids_missing_shards_are_priced_from_the_hubs_headers(
        models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host that plans a model named by its repo id holds its config, index and
    tokenizer (and maybe a stage's shards): the others are priced from the Hub's headers
    (here a fake of that seam over the whole checkpoint), as if it held them all; offline,
    refused naming them."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    full = models["sharded"]
    snap = hub_cache(tmp_path / "hub", "owner/sharded", full, [first_shard(full).name])
    asked: list[list[str]] = []

    def headers(repo: str, commit: str, files: Sequence[str]
                ) -> dict[str, dict[str, TensorEntry]]:
        assert (repo, commit) == ("owner/sharded", COMMIT)
        asked.append(list(files))
        return {f: read_tensor_headers(full / f) for f in files}

    assert layer_profile(snap, headers) == layer_profile(full)
    assert len(asked) == 1 and len(asked[0]) == 12 and first_shard(full).name not in asked[0]
    assert layer_profile(snap, headers) == layer_profile(full)
    assert len(asked) == 1  # kept per process
    other = hub_cache(tmp_path / "hub2", "owner/other", full)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"model owner/other: pricing its layers needs the "
                       r"headers of 13 shard\(s\) .* HF_HUB_OFFLINE is set") as info:
        layer_profile(other, headers)
    assert "hf download owner/other" in info.value.hint


def test_layer_without_tensors(copy: Path) -> None:
    config = copy / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 5}))
    with pytest.raises(ConfigError, match="layer 4 has no tensors"):
        layer_profile(copy)


def test_no_weight_files(tmp_path: Path, models: dict[str, Path]) -> None:
    shutil.copy(models["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"holds no model\*\.safetensors files"):
        layer_profile(tmp_path)
