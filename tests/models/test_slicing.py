"""Stages chained over our fixtures give mlx-lm's own tokens and log-probabilities."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxceld.errors import ConfigError
from mlxceld.models import preset, write_fixture
from mlxceld.models.slicing import SUPPORTED, StageModel, load_stage
from mlxceld.wire import EnvelopeError

LAYERS = 4
STEPS = 8
PROMPT = "Hello, world, and a prompt longer than the sliding window"
SPLITS = [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 3), (3, 4)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four-layer checkpoints: llama (untied head), qwen3 (tied), llama in bfloat16,
    and, their configs edited over llama's weights, llama with sliding-window
    layers and mistral (which mlx-lm loads with its llama classes)."""
    root = tmp_path_factory.mktemp("stages")
    paths = {family: write_fixture(root / family, preset("tiny", family=family, layers=LAYERS))
             for family in ("llama", "qwen3")}
    paths["bf16"] = write_fixture(root / "bf16", preset("tiny", family="llama", layers=LAYERS,
                                                        dtype="bfloat16"))
    paths["sliding"] = edited(paths["llama"], root / "sliding", sliding_window=4,
                              layer_types=["sliding_attention", "sliding_attention",
                                           "full_attention", "sliding_attention"])
    paths["mistral"] = edited(paths["llama"], root / "mistral", model_type="mistral")
    return paths


def edited(source: Path, target: Path, **config: Any) -> Path:
    shutil.copytree(source, target)
    path = target / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def reference(path: Path) -> tuple[list[int], list[int], list[Any]]:
    """The prompt, then mlx-lm's greedy tokens and log-probabilities on the whole model."""
    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(PROMPT)
    steps = list(generate_step(mx.array(prompt), model, max_tokens=STEPS))
    return prompt, [int(t) for t, _ in steps], [lp for _, lp in steps]


def run_pipeline(stages: list[StageModel], prompt: list[int],
                 overlap: bool = False) -> tuple[list[int], list[Any]]:
    """The prompt through every stage, then greedy decode steps, one cache per stage."""
    caches = [stage.make_cache() for stage in stages]
    x = mx.array([prompt], dtype=mx.int32)
    tokens, logprobs = [], []
    for _ in range(STEPS):
        h = x
        for stage, cache in zip(stages, caches, strict=True):
            h = stage.forward(h, cache, overlap=overlap)
            if not stage.last:
                assert h.shape == (1, x.shape[1], stage.hidden_size)
                assert h.dtype == stage.dtype
        assert h.shape == (1, stages[-1].vocab_size) and h.dtype == mx.float32
        token = int(mx.argmax(h, axis=-1).item())
        tokens.append(token)
        logprobs.append(h[0])
        x = mx.array([[token]], dtype=mx.int32)
    return tokens, logprobs


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "+".join(f"{a}-{b}" for a, b in s))
@pytest.mark.parametrize("name", ["llama", "qwen3", "sliding", "bf16", "mistral"])
def test_chained_stages_equal_mlx_lm(models: dict[str, Path], name: str,
                                     split: list[tuple[int, int]]) -> None:
    prompt, want_tokens, want_logprobs = reference(models[name])
    stages = [load_stage(models[name], start, end) for start, end in split]
    tokens, logprobs = run_pipeline(stages, prompt)
    assert tokens == want_tokens
    if name != "bf16":  # mlx-lm's bfloat16 log-probabilities are rounded to bfloat16
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert mx.allclose(got, want, atol=1e-4, rtol=0).item()


@pytest.mark.parametrize("name", ["qwen3", "sliding", "bf16"])
def test_overlapped_layers_give_the_same_results(models: dict[str, Path], name: str) -> None:
    """Handing each layer to mlx as it is built changes when it runs, not what it gives:
    the same tokens and bit-identical log-probabilities, prefill and decode."""
    prompt, want_tokens, _ = reference(models[name])
    stages = [load_stage(models[name], start, end) for start, end in [(0, 1), (1, 3), (3, 4)]]
    plain = run_pipeline(stages, prompt)
    overlapped = run_pipeline(stages, prompt, overlap=True)
    assert overlapped[0] == plain[0] == want_tokens
    for got, want in zip(overlapped[1], plain[1], strict=True):
        assert mx.array_equal(got, want).item()


def test_sliding_window_masks_matter(models: dict[str, Path]) -> None:
    """The sliding fixture generates differently from its full-attention twin, so
    the test above would catch a stage that ignored the window."""
    assert reference(models["sliding"])[1] != reference(models["llama"])[1]


def parameter_groups(stage: StageModel) -> set[str]:
    """Parameter names, with every layer folded into ``model.layers``."""
    return {name.split(".layers.")[0] + ".layers" if ".layers." in name else name
            for name, _ in tree_flatten(stage.model.parameters())}


def layer_numbers(stage: StageModel) -> set[int]:
    return {int(name.split(".")[2]) for name, _ in tree_flatten(stage.model.parameters())
            if name.startswith("model.layers.")}


@pytest.mark.parametrize(("name", "tied"), [("llama", False), ("qwen3", True)])
def test_stage_holds_only_its_parameters(models: dict[str, Path], name: str,
                                         tied: bool) -> None:
    first, middle, last = (load_stage(models[name], a, b) for a, b in [(0, 1), (1, 3), (3, 4)])
    whole = load_stage(models[name], 0, LAYERS)
    assert (first.first, first.last, last.first, last.last) == (True, False, False, True)
    assert parameter_groups(first) == {"model.embed_tokens.weight", "model.layers"}
    assert parameter_groups(middle) == {"model.layers"}
    head = {"model.embed_tokens.weight"} if tied else {"lm_head.weight"}
    assert parameter_groups(last) == {"model.layers", "model.norm.weight", *head}
    assert parameter_groups(whole) == {"model.layers", "model.norm.weight",
                                       "model.embed_tokens.weight", *head}
    for stage in (first, middle, last, whole):
        assert len(stage.layers) == len(stage.make_cache()) == stage.end - stage.start
        assert stage.num_layers == LAYERS and stage.tied is tied
        assert layer_numbers(stage) == set(range(stage.end - stage.start))  # renumbered
    assert first.nbytes + middle.nbytes + last.nbytes - whole.nbytes == (
        first.model.model.embed_tokens.weight.nbytes if tied else 0)



def test_make_cache_follows_the_layer_types(models: dict[str, Path]) -> None:
    stage = load_stage(models["sliding"], 1, 3)
    assert [type(c).__name__ for c in stage.make_cache()] == ["RotatingKVCache", "KVCache"]


def test_dtype_and_input_spec(models: dict[str, Path]) -> None:
    first, last = load_stage(models["bf16"], 0, 2), load_stage(models["bf16"], 2, 4)
    assert (last.dtype, last.wire_dtype, last.hidden_size) == (mx.bfloat16, "bf16", 64)
    assert load_stage(models["llama"], 2, 4).wire_dtype == "f32"
    first.input_spec().check("tokens", "i32", (1, 7))
    last.input_spec(max_tokens=16).check("hidden", "bf16", (1, 16, 64))
    bad = [("i32", (1, 3, 64)), ("f32", (1, 3, 64)), ("bf16", (2, 3, 64)),
           ("bf16", (1, 17, 64)), ("bf16", (1, 3, 32)), ("bf16", (1, 0, 64))]
    for dtype, shape in bad:
        with pytest.raises(EnvelopeError):
            last.input_spec(max_tokens=16).check("hidden", dtype, shape)
    with pytest.raises(EnvelopeError):
        first.input_spec().check("tokens", "f32", (1, 7))


def test_forward_refuses_wrong_inputs(models: dict[str, Path]) -> None:
    first, last = load_stage(models["llama"], 0, 2), load_stage(models["llama"], 2, 4)
    with pytest.raises(ValueError, match=r"expected \[b, n\] int32"):
        first.forward(mx.zeros((1, 3, 64)), first.make_cache())
    with pytest.raises(ValueError, match=r"expected \[b, n, 64\]"):
        last.forward(mx.zeros((1, 3), dtype=mx.int32), last.make_cache())
    with pytest.raises(ValueError, match="1 caches for 2 layers"):
        last.forward(mx.zeros((1, 3, 64)), last.make_cache()[:1])


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (0, 5), (2, 2), (3, 1), (4, 5)])
def test_range_outside_the_model(models: dict[str, Path], start: int, end: int) -> None:
    with pytest.raises(ConfigError, match=rf"\[{start}, {end}\) .* its 4 layers"):
        load_stage(models["qwen3"], start, end)


def test_unsupported_model_type(models: dict[str, Path], tmp_path: Path) -> None:
    path = edited(models["llama"], tmp_path / "mamba", model_type="mamba")
    with pytest.raises(ConfigError, match="model_type 'mamba'") as info:
        load_stage(path, 0, 2)
    assert all(family in info.value.hint for family in SUPPORTED)


def test_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config\.json"):
        load_stage(tmp_path, 0, 1)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                      "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="mlx-lm cannot load it"):
        load_stage(tmp_path, 0, 1)
