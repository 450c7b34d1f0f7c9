"""Draft fixture pairs (``models/fixtures/pairs.py``): the agreeing pair's greedy tokens
are the same, token for token, and the unrelated draft's are not; both share the
target's tokenizer."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from mlxceld.errors import ConfigError
from mlxceld.models.fixtures import agreeing_pair, preset, unrelated_draft, write_fixture

N = 24


def _greedy(model: Path, prompt: list[int]) -> list[int]:
    m = mlx_lm.load(str(model))[0]
    return [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=N)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # untied and tied embeddings
def test_agreeing_pair_agrees_and_unrelated_does_not(tmp_path: Path, family: str) -> None:
    target, draft = agreeing_pair(preset("tiny", family=family, layers=3))
    write_fixture(tmp_path / "target", target)
    write_fixture(tmp_path / "draft", draft)
    write_fixture(tmp_path / "other", unrelated_draft(target))
    # The same tokenizer files in all three (trained from the vocabulary alone).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (tmp_path / "target" / name).read_text()
        assert (tmp_path / "draft" / name).read_text() == text
        assert (tmp_path / "other" / name).read_text() == text
    prompt = mlx_lm.load(str(tmp_path / "target"))[1].encode("The quick brown fox")
    want = _greedy(tmp_path / "target", prompt)
    assert _greedy(tmp_path / "draft", prompt) == want
    assert _greedy(tmp_path / "other", prompt) != want
    # The target computes its layers: they are there, with zeroed output projections.
    weights = mx.load(str(tmp_path / "target" / "model.safetensors"))
    assert isinstance(weights, dict)
    assert not mx.any(weights["model.layers.2.self_attn.o_proj.weight"]).item()
    assert not mx.any(weights["model.layers.2.mlp.down_proj.weight"]).item()
    assert mx.any(weights["model.layers.2.self_attn.q_proj.weight"]).item()


def test_a_draft_of_another_shape_is_refused() -> None:
    target = preset("tiny", family="llama")
    with pytest.raises(ConfigError, match=r"draft_of.*hidden"):
        preset("tiny", family="llama", hidden=128, layers=1, draft_of=target)
