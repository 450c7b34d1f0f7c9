"""Each host needs only its layers: which shards a stage reads, and a stage loaded from
a directory that holds only those (beside config.json, the index and the tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxceld.errors import ConfigError
from mlxceld.models import model_identity, preset, read_model_config, write_fixture
from mlxceld.models.profile import layer_profile
from mlxceld.models.shards import (
    Layout,
    WeightIndex,
    layout_of,
    read_index,
    stage_files,
    tensor_part,
)
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
    tied = {"tie_word_embeddings": True}  # the embeddings on the last stage; no head
    assert stage_files(index, tied, 2, 3, 3) == {"a", "c", "d", "f"}


def test_gemma3_text_model_prefix_and_no_vision_tower() -> None:
    """A multimodal checkpoint: the text model under ``language_model.``, placed as any
    model's; the vision tower's shards on no stage."""
    index = WeightIndex({
        "language_model.model.embed_tokens.weight": "a",
        "language_model.model.layers.0.mlp.weight": "a",
        "language_model.model.layers.1.mlp.weight": "b",
        "language_model.model.norm.weight": "b",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": "v",
        "vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight": "v1",
        "multi_modal_projector.mm_input_projection_weight": "p"}, 0)
    config = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 2}}
    assert stage_files(index, config, 0, 1, 2) == {"a"}
    assert stage_files(index, config, 1, 2, 2) == {"a", "b"}  # tied: the embeddings too
    layout = Layout(2, 0, True)
    assert tensor_part("vision_tower.vision_model.encoder.layers.0.x", layout) == ("dropped", -1)
    assert tensor_part("language_model.model.layers.1.x", layout) == ("layer", 1)
    assert tensor_part("language_model.lm_head.weight", layout) == ("dropped", -1)


def test_multi_token_prediction_layers_belong_to_no_stage() -> None:
    """deepseek_v3 as published: layer 3 of 3 predicts the next tokens; no stage needs it."""
    index = WeightIndex({
        "model.embed_tokens.weight": "a", "model.layers.0.mlp.weight": "a",
        "model.layers.1.mlp.weight": "b", "model.layers.2.mlp.weight": "c",
        "model.layers.3.mlp.experts.0.weight": "mtp", "model.layers.3.eh_proj.weight": "mtp",
        "model.norm.weight": "c", "lm_head.weight": "c"}, 0)
    config = {"num_hidden_layers": 3, "num_nextn_predict_layers": 1,
              "tie_word_embeddings": False}
    assert stage_files(index, config, 0, 2, 3) == {"a", "b"}
    assert stage_files(index, config, 2, 3, 3) == {"c"}
    assert tensor_part("model.layers.3.eh_proj.weight", Layout(3, 1, False)) == ("dropped", -1)
    assert tensor_part("model.layers.4.x", Layout(3, 1, False)) == ("layer", 4)  # damaged


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stage_files_hold_what_the_profile_prices(sharded: dict[str, Path],
                                                  family: str) -> None:
    """The one rule: each stage's shards hold every tensor of its layers, and the
    profile prices those layers from the same parts."""
    full = sharded[family]
    index = read_index(full)
    assert index is not None
    config = read_model_config(full)
    layout = layout_of(config, LAYERS, index.weight_map)
    profile = layer_profile(full)
    assert profile.tied is layout.tied
    for a, b in SPLIT:
        files = stage_files(index, config, a, b, LAYERS)
        for name, file in index.weight_map.items():
            part, layer = tensor_part(name, layout)
            if part == "layer" and a <= layer < b:
                assert file in files, name
        assert profile.weight_bytes(a, b) > 0


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
