"""Each host needs only its layers: which shards a stage reads, and a stage loaded from
a directory that holds only those (beside config.json, the index and the tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxceld.errors import ConfigError
from mlxceld.models import model_identity, preset, read_model_config, write_fixture
from mlxceld.models.shards import WeightIndex, read_index, stage_files
from mlxceld.models.slicing import StageModel, load_stage

LAYERS = 4
SPLIT = [(0, 1), (1, 3), (3, 4)]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four-layer checkpoints in many small shards: llama (untied head), qwen3 (tied)."""
    root = tmp_path_factory.mktemp("shards")
    return {family: write_fixture(root / family, preset("tiny", family=family, layers=LAYERS,
                                                        shard_bytes=64 * 1024))
            for family in ("llama", "qwen3")}


def partial(full: Path, target: Path, start: int, end: int) -> Path:
    """A copy of ``full`` holding only the shards of layers [start, end)."""
    index = read_index(full)
    assert index is not None
    keep = stage_files(index, read_model_config(full), start, end, LAYERS)
    shutil.copytree(full, target, ignore=lambda _, names: [
        n for n in names if n.endswith(".safetensors") and n not in keep])
    return target


def logits(stages: list[StageModel], prompt: list[int]) -> mx.array:
    h = mx.array([prompt], dtype=mx.int32)
    for stage in stages:
        h = stage.forward(h, stage.make_cache())
    return h


def test_stage_files_follow_what_a_stage_keeps() -> None:
    index = WeightIndex({
        "model.embed_tokens.weight": "a", "model.layers.0.mlp.weight": "a",
        "model.layers.1.mlp.weight": "b", "model.layers.1.attn.weight": "c",
        "model.layers.2.mlp.weight": "c", "model.layers.3.mlp.weight": "mtp",  # past the end
        "model.norm.weight": "d", "lm_head.weight": "e", "model.rotary.scale": "f"}, 0)
    assert stage_files(index, {}, 0, 1, 3) == {"a", "f"}
    assert stage_files(index, {}, 1, 2, 3) == {"b", "c", "f"}
    assert stage_files(index, {}, 2, 3, 3) == {"c", "d", "e", "f"}
    tied = {"tie_word_embeddings": True}  # the last stage needs the embeddings too
    assert stage_files(index, tied, 2, 3, 3) == {"a", "c", "d", "e", "f"}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stages_from_only_their_shards_equal_the_whole_directory(
        sharded: dict[str, Path], family: str, tmp_path: Path) -> None:
    full = sharded[family]
    shards = {p.name for p in full.glob("*.safetensors")}
    prompt = [1, 5, 9, 2, 7]
    whole = [load_stage(full, a, b) for a, b in SPLIT]
    parts = []
    for a, b in SPLIT:
        path = partial(full, tmp_path / f"{a}-{b}", a, b)
        held = {p.name for p in path.glob("*.safetensors")}
        assert held < shards  # only some of them
        assert model_identity(path) == model_identity(full)
        parts.append(load_stage(path, a, b))
    for got, want in zip(parts, whole, strict=True):
        assert got.nbytes == want.nbytes
    assert mx.array_equal(logits(parts, prompt), logits(whole, prompt)).item()


def test_a_stage_missing_one_of_its_shards_is_refused(sharded: dict[str, Path],
                                                      tmp_path: Path) -> None:
    path = partial(sharded["llama"], tmp_path / "p", 1, 3)
    index = read_index(path)
    assert index is not None
    lost = index.weight_map["model.layers.2.mlp.down_proj.weight"]
    (path / lost).unlink()
    with pytest.raises(ConfigError, match=rf"stage layers \[1, 3\) need \d+ of the \d+ shards"
                       rf" .* 1 of them are missing: {lost}") as info:
        load_stage(path, 1, 3)
    assert "copy them into the model directory" in info.value.hint


def test_load_reports_its_progress(sharded: dict[str, Path]) -> None:
    seen: list[tuple[int, int]] = []
    stage = load_stage(sharded["qwen3"], 1, 4, progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, stage.nbytes) and seen[-1] == (stage.nbytes, stage.nbytes)
    done = [d for d, _ in seen]
    assert done == sorted(done) and len(set(done)) >= 3 + 1  # a step per layer
