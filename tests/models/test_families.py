"""Every family split into pipeline stages gives mlx-lm's own greedy tokens.

One random-weight fixture per family from our generator (4 layers, the ``tiny``
shapes, float32: mlx's CPU backend runs MoE kernels in float32 only), loaded by
plain ``mlx_lm.load`` for the reference, and by ``load_stage`` for each stage;
the stages are chained in this process (the network between them is tested
elsewhere).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxceld.errors import ConfigError
from mlxceld.models import layer_profile, preset, read_model_config, write_fixture
from mlxceld.models.fixtures.spec import FAMILIES as GENERATED
from mlxceld.models.shards import INDEX, read_index, stage_files
from mlxceld.models.slicing import SUPPORTED, load_stage

from helpers.models import chained_greedy, greedy_reference

LAYERS = 4
STEPS = 8
PROMPT = "Hello, world, and a prompt longer than the sliding window of a few tokens"
# Per family: changes to the tiny preset.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3_moe": {},
    "mixtral": {},
    "glm4_moe": {},
    "phi3": {},
    "gemma3_text": {"sliding_window": 8},  # shorter than the prompt: the window matters
    "gemma3": {"sliding_window": 8},  # the same, as Gemma 3 4B and up hold it
    "deepseek_v3": {},
    "gpt_oss": {"sliding_window": 8},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    paths = {family: write_fixture(root / family, preset("tiny", family=family, layers=LAYERS,
                                                         **changes))
             for family, changes in FAMILIES.items()}
    paths["qwen3_moe-4bit"] = write_fixture(
        root / "qwen3_moe-4bit", preset("tiny", family="qwen3_moe", layers=LAYERS,
                                        quantize_bits=4))
    # gpt-oss as published: mxfp4 (4-bit floats, 8-bit power-of-two scales, no biases)
    paths["gpt_oss-mxfp4"] = write_fixture(
        root / "gpt_oss-mxfp4", preset("tiny", family="gpt_oss", layers=LAYERS,
                                       sliding_window=8, quantize_bits=4, group_size=32,
                                       quantize_mode="mxfp4"))
    return paths


def test_the_hooks_cover_the_one_list_of_families() -> None:
    """slicing.FAMILIES (each family's hooks) and families.SUPPORTED (the one list the
    daemon reads without mlx) name the same families, in the same order."""
    from mlxceld.models import slicing

    assert tuple(slicing.FAMILIES) == SUPPORTED


def test_the_aliases_are_mlx_lm_s_own() -> None:
    """families.ALIASES (mlx-free) says what mlx-lm's MODEL_REMAPPING says for them."""
    from mlx_lm.utils import MODEL_REMAPPING

    from mlxceld.models.families import ALIASES

    assert all(MODEL_REMAPPING.get(a) == t and t in SUPPORTED for a, t in ALIASES.items())
    assert set(ALIASES) == {a for a, t in MODEL_REMAPPING.items()
                            if t in SUPPORTED and a not in SUPPORTED}


def test_kimi_k2_is_split_as_deepseek_v3(models: dict[str, Path], tmp_path: Path) -> None:
    """Kimi K2's checkpoints say model_type kimi_k2, which mlx-lm loads as deepseek_v3: it
    is accepted where splits are judged, and split to mlx-lm's greedy tokens (those of
    the same weights as deepseek_v3: transformers' tokenizer loader does not know the
    type, and real Kimi checkpoints bring their own tokenizer code)."""
    from mlxceld.models.families import require_splittable

    path = tmp_path / "kimi_k2"
    shutil.copytree(models["deepseek_v3"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert require_splittable(path) == "kimi_k2"
    prompt, want, _ = greedy_reference(models["deepseek_v3"], PROMPT, STEPS)
    stages = [load_stage(path, 0, 1), load_stage(path, 1, LAYERS)]
    assert chained_greedy(stages, prompt, STEPS)[0] == want


def test_every_family_is_split_here_or_in_test_slicing() -> None:
    """A family added to SUPPORTED comes with its test (llama, qwen3 and mistral are in
    test_slicing.py), and the generator writes every family a pipeline splits."""
    assert set(SUPPORTED) == {*FAMILIES, "llama", "qwen3", "mistral"}
    assert set(GENERATED) == set(SUPPORTED) - {"mistral"}  # mistral loads as llama


def check_split(path: Path, split: list[tuple[int, int]]) -> list[int]:
    """The stages of ``split`` chained give mlx-lm's greedy tokens (and, within float32
    rounding, its log-probabilities); returns the tokens."""
    prompt, want_tokens, want_logprobs = greedy_reference(path, PROMPT, STEPS)
    stages = [load_stage(path, start, end) for start, end in split]
    tokens, logprobs = chained_greedy(stages, prompt, STEPS)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert mx.allclose(got, want, atol=1e-4, rtol=0).item()
    return tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_stages_give_mlx_lm_greedy_tokens(models: dict[str, Path], family: str) -> None:
    assert family in SUPPORTED
    tokens = check_split(models[family], [(0, 2), (2, LAYERS)])
    assert len(set(tokens)) >= 4, f"the fixture decodes degenerately: {tokens}"


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_windowed_and_global_layers_alternate(models: dict[str, Path], family: str,
                                              tmp_path: Path) -> None:
    """Each stage's layers get the family's own cache kinds (gemma3: every second layer
    global in our fixture; gpt_oss: layer_types, alternating), and the window changes
    what it generates: the split test above would catch a stage that ignored it."""
    stage = load_stage(models[family], 1, 3)
    assert [type(c).__name__ for c in stage.make_cache()] == ["KVCache", "RotatingKVCache"]
    assert stage.family.scaled_embeddings is (family == "gemma3_text")
    wide = tmp_path / "wide"
    shutil.copytree(models[family], wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    assert (greedy_reference(wide, PROMPT, STEPS)[1]
            != greedy_reference(models[family], PROMPT, STEPS)[1])


def decode(stages: list[Any], caches: list[list[list[Any]]], tokens: list[int]) -> list[int]:
    """One greedy step of each sequence (its caches per stage, its last token) batched as a
    stage's compute batches them: each layer's caches merged, then extracted again."""
    h = mx.array([[t] for t in tokens], dtype=mx.int32)
    for k, stage in enumerate(stages):
        per_seq = [seq[k] for seq in caches]
        merged = [per_seq[0][i].merge([c[i] for c in per_seq]) for i in range(len(per_seq[0]))]
        h = stage.forward(h, merged)
        for j, seq in enumerate(caches):
            seq[k] = [c.extract(j) for c in merged]
    return [int(t) for t in mx.argmax(h, axis=-1).tolist()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_decode_gives_each_sequence_its_own_tokens(models: dict[str, Path],
                                                           family: str) -> None:
    """Sequences of different lengths decoded in one batch, their caches merged (left
    padded) and split per step as a stage does, give in float32 the tokens each gets
    alone: every family's cache kinds and masks batch."""
    prompt, want, _ = greedy_reference(models[family], PROMPT, 3)
    stages = [load_stage(models[family], 0, 2), load_stage(models[family], 2, LAYERS)]
    prompts = [prompt, prompt[:5], prompt[3:]]
    alone = [chained_greedy(stages, p, 3)[0] for p in prompts]
    assert alone[0] == want
    caches = [[stage.make_cache() for stage in stages] for _ in prompts]
    tokens = []
    for p, seq in zip(prompts, caches, strict=True):
        h = mx.array([p], dtype=mx.int32)
        for stage, cache in zip(stages, seq, strict=True):
            h = stage.forward(h, cache)
        tokens.append(int(mx.argmax(h, axis=-1).item()))
    got = [[t] for t in tokens]
    for _ in range(2):
        tokens = decode(stages, caches, tokens)
        for g, t in zip(got, tokens, strict=True):
            g.append(t)
    assert got == alone


def test_moe_over_three_uneven_stages(models: dict[str, Path]) -> None:
    check_split(models["qwen3_moe"], [(0, 1), (1, 3), (3, LAYERS)])


@pytest.mark.parametrize(("name", "experts"), [
    ("qwen3_moe-4bit", "model.layers.0.mlp.switch_mlp.down_proj"),
    ("gpt_oss-mxfp4", "model.layers.0.mlp.experts.down_proj"),
])
def test_quantized_moe_splits(models: dict[str, Path], name: str, experts: str) -> None:
    path = models[name]
    check_split(path, [(0, 3), (3, LAYERS)])
    stage = load_stage(path, 0, 2)
    dtypes = {name: value.dtype for name, value in tree_flatten(stage.model.parameters())}
    assert dtypes[f"{experts}.weight"] == mx.uint32  # packed
    # affine scales are floats; mxfp4's are 8-bit exponents, with no biases
    assert dtypes[f"{experts}.scales"] == (mx.uint8 if "mxfp4" in name else mx.float32)
    assert stage.dtype == mx.float32  # the activations', as the first layer's norms


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe-4bit", "gpt_oss-mxfp4"])
def test_profile_prices_each_stage_as_loaded(models: dict[str, Path], family: str) -> None:
    """The profile's per-layer bytes, from the safetensors headers, are what a loaded
    stage holds: expert, router and shared weights all sorted to their layer."""
    profile = layer_profile(models[family])
    assert profile.num_layers == LAYERS
    for start, end in [(0, 1), (1, 3), (3, LAYERS), (0, LAYERS)]:
        assert profile.weight_bytes(start, end) == load_stage(models[family], start,
                                                              end).nbytes


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "gpt_oss-mxfp4"])
def test_profile_kv_bytes_are_what_the_cache_holds(models: dict[str, Path],
                                                   family: str) -> None:
    """deepseek_v3's latent cache (kv_lora_rank + qk_rope_head_dim a token), priced as
    what mlx-lm's cache holds; gpt_oss's full layers as any other's."""
    stage = load_stage(models[family], 0, LAYERS)
    cache = stage.make_cache()
    stage.forward(mx.array([[1, 2, 3]], dtype=mx.int32), cache)
    full = next(c for c in cache if type(c).__name__ == "KVCache")
    assert full.keys.shape[2] == full.values.shape[2] == 256  # room for 256 tokens
    per_token = (full.keys.nbytes + full.values.nbytes) // 256
    assert layer_profile(models[family]).kv_bytes_per_token == per_token


def test_multi_token_prediction_layers_are_not_a_stage_s(models: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """GLM-4.5 (and DeepSeek-V3) as published hold a layer past the last, for multi-token
    prediction, which mlx-lm drops while loading: the profile leaves it out as
    config.json's num_nextn_predict_layers says, and stages load around it."""
    path = tmp_path / "glm4_moe-mtp"
    shutil.copytree(models["glm4_moe"], path)
    mx.save_safetensors(str(path / "model-mtp.safetensors"),
                        {f"model.layers.{LAYERS}.input_layernorm.weight": mx.ones((64,))})
    with pytest.raises(ConfigError, match=f"belongs to layer {LAYERS}, but"):
        layer_profile(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert layer_profile(path) == layer_profile(models["glm4_moe"])
    assert load_stage(path, 2, LAYERS).nbytes == layer_profile(path).weight_bytes(2, LAYERS)


def test_a_vision_tower_is_not_a_stage_s(models: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 3 4B and up hold a vision tower beside the text model, which mlx-lm drops
    while loading: the profile leaves it out, and the stages load without it."""
    path = tmp_path / "gemma3-vision"
    shutil.copytree(models["gemma3"], path)
    mx.save_safetensors(str(path / "model-vision.safetensors"),
                        {"vision_tower.encoder.weight": mx.ones((64, 64)),
                         "multi_modal_projector.weight": mx.ones((64,))})
    assert layer_profile(path) == layer_profile(models["gemma3"])
    stage = load_stage(path, 0, 2)
    assert stage.nbytes == layer_profile(path).weight_bytes(0, 2)
    assert not any(name.startswith(("vision_tower", "language_model.vision"))
                   for name, _ in tree_flatten(stage.model.parameters()))
    # Sharded, with an index: no stage's shards include the vision tower's, and a stage
    # loads from a directory without it.
    weight_map = {name: file.name for file in sorted(path.glob("model*.safetensors"))
                  for name in mx.load(str(file))}
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index = read_index(path)
    assert index is not None and "model-vision.safetensors" in index.files
    config = read_model_config(path)
    for start, end in ((0, 2), (2, LAYERS)):
        assert "model-vision.safetensors" not in stage_files(index, config, start, end, LAYERS)
    (path / "model-vision.safetensors").unlink()
    assert load_stage(path, 0, 2).nbytes == stage.nbytes


@pytest.mark.parametrize(("family", "changes", "field"), [
    ("llama", {"experts": 4}, "experts"),
    ("qwen3_moe", {"experts": 2, "experts_per_token": 3}, "experts_per_token"),
    ("qwen3_moe", {"experts": 0}, "experts"),
    ("mixtral", {"head_dim": 32}, "head_dim"),
    ("phi3", {"head_dim": 8}, "head_dim"),
    ("glm4_moe", {"tie_embeddings": True}, "tie_embeddings"),
    ("glm4_moe", {"head_dim": 6}, "head_dim"),
    ("qwen3", {"sliding_window": 8}, "sliding_window"),
    ("gemma3_text", {"sliding_window": 0}, "sliding_window"),
    ("gemma3_text", {"layers": 1}, "layers"),
])
def test_bad_family_shapes_are_named(family: str, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"fixture spec: {field} ") as info:
        preset("tiny", family=family, **changes)
    assert info.value.hint


def test_experts_mlx_cannot_run_here_are_refused_at_load(tmp_path: Path) -> None:
    """bfloat16 experts: refused before any weight is read where mlx's gather_mm runs in
    float32 only (its CPU backend), with what to do; loaded where it can run them."""
    path = write_fixture(tmp_path / "bf16", preset("tiny", family="mixtral", layers=2,
                                                   dtype="bfloat16"))
    probe = mx.zeros((1, 1, 2), mx.bfloat16)
    try:
        mx.eval(mx.gather_mm(probe, mx.zeros((1, 2, 2), mx.bfloat16),
                             rhs_indices=mx.array([0], dtype=mx.uint32)))
    except RuntimeError:
        with pytest.raises(ConfigError, match=r"experts are mlx\.core\.bfloat16") as info:
            load_stage(path, 0, 1)
        assert "float32" in info.value.hint
    else:
        assert load_stage(path, 0, 1).dtype == mx.bfloat16
