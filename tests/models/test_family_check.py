"""The one check of a model's family (``models.families``): what it reads, what it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxceld.errors import ConfigError, UnsupportedFamily
from mlxceld.models.families import SUPPORTED, family_problem, require_splittable


def checkpoint(root: Path, **config: object) -> Path:
    """A directory holding only config.json: the check reads nothing else."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 4, **config}))
    return root


@pytest.mark.parametrize("family", SUPPORTED)
def test_each_supported_family_passes(tmp_path: Path, family: str) -> None:
    assert require_splittable(checkpoint(tmp_path / family, model_type=family)) == family


@pytest.mark.parametrize(("config", "named"), [
    ({"model_type": "mamba"}, "model_type 'mamba'"),
    ({"model_type": "rwkv7"}, "model_type 'rwkv7'"),
    ({}, "no 'model_type'"),
    ({"model_type": 3}, "no 'model_type'"),
])
def test_another_is_refused_naming_it_and_the_supported_ones(
        tmp_path: Path, config: dict[str, object], named: str) -> None:
    path = checkpoint(tmp_path / "m", **config)
    with pytest.raises(UnsupportedFamily) as info:
        require_splittable(path, "--model")
    err = info.value
    assert err.code == "unsupported_family" and isinstance(err, ConfigError)
    assert err.message.startswith(f"--model: {path / 'config.json'} says {named}")
    assert all(f in err.message and f in err.hint for f in SUPPORTED), err
    assert "mlxctl serve" in err.hint
    assert err.supported == SUPPORTED
    assert err.family == (config.get("model_type") if isinstance(config.get("model_type"), str)
                          else None)


def test_it_is_judged_from_config_json_alone(tmp_path: Path) -> None:
    # A weight file that is no safetensors at all: never opened, the family is refused.
    path = checkpoint(tmp_path / "m", model_type="mamba")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UnsupportedFamily):
        require_splittable(path)


def test_an_unreadable_config_is_a_config_error_not_a_family(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json") as info:
        require_splittable(tmp_path)
    assert not isinstance(info.value, UnsupportedFamily)


def test_family_problem_is_the_judges_reason() -> None:
    assert family_problem("qwen3", "x") is None
    reason = family_problem("mamba2", "this node's config.json")
    assert reason is not None and "'mamba2'" in reason and SUPPORTED[0] in reason
