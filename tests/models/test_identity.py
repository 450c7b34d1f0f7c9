"""Model identity and layer count, on real fixture checkpoints (copied before any change)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from mlxceld.errors import ConfigError
from mlxceld.models import (
    layer_count,
    model_identity,
    preset,
    read_model_config,
    write_fixture,
)


@pytest.fixture
def model(fixture_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny qwen3 fixture, free to change."""
    return Path(shutil.copytree(fixture_dir / "qwen3", tmp_path / "qwen3"))


TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
             "tiktoken.model", "chat_template.jinja")


def by_hand(path: Path, layers: int) -> str:
    """The definition in mlxceld/models/identity.py, written out once more."""
    def u64(n: int) -> bytes:
        return n.to_bytes(8, "big")

    def text(s: str) -> bytes:
        return u64(len(s.encode())) + s.encode()

    raw = (path / "config.json").read_bytes()
    msg = b"mlxceld model identity v2\n" + u64(len(raw)) + raw
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        msg += b"I" + u64(data["metadata"]["total_size"])
        for name, file in sorted(data["weight_map"].items()):
            msg += text(name) + text(file)
    else:
        msg += b"F"
        for name in sorted(p.name.encode() for p in path.glob("*.safetensors")):
            msg += u64(len(name)) + name + u64((path / name.decode()).stat().st_size)
    for name in TOKENIZER:
        if (path / name).exists():
            data_ = (path / name).read_bytes()
            msg += text(name) + u64(len(data_)) + data_
    return hashlib.sha256(msg + u64(layers)).hexdigest()


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    path = write_fixture(tmp_path / "sharded", preset("tiny", shard_bytes=64 * 1024))
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def test_identity_follows_its_definition_and_is_stable(fixture_dir: Path) -> None:
    path = fixture_dir / "qwen3"
    ident = model_identity(path)
    assert len(ident) == 64 and ident == ident.lower()
    assert ident == model_identity(path) == model_identity(Path(str(path) + "/"))
    assert ident == by_hand(path, 2)
    assert ident != model_identity(fixture_dir / "llama")


def test_identity_of_a_sharded_checkpoint(sharded: Path) -> None:
    assert model_identity(sharded) == by_hand(sharded, 2)


def test_a_host_with_only_some_shards_has_the_same_identity(sharded: Path,
                                                            tmp_path: Path) -> None:
    """Each host holds only its layers: the identity is made of what every host has."""
    partial = Path(shutil.copytree(sharded, tmp_path / "partial"))
    shards = sorted(partial.glob("*.safetensors"))
    for shard in shards[len(shards) // 2:]:
        shard.unlink()
    assert model_identity(partial) == model_identity(sharded)
    for shard in shards[:len(shards) // 2]:
        shard.unlink()  # none at all: a host that only routes, say
    assert model_identity(partial) == model_identity(sharded)


def test_identity_changes_with_the_index(sharded: Path) -> None:
    before = model_identity(sharded)
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    index.write_text(json.dumps(data))  # other bytes, the same index
    assert model_identity(sharded) == before
    name = sorted(data["weight_map"])[0]
    data["weight_map"][name] = "another.safetensors"  # another layout
    index.write_text(json.dumps(data))
    assert model_identity(sharded) != before
    data = json.loads(index.read_text())
    data["metadata"]["total_size"] += 1
    index.write_text(json.dumps(data))
    other = model_identity(sharded)
    assert other != before
    index.write_text("{")
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        model_identity(sharded)


def test_identity_changes_with_config_json(model: Path) -> None:
    before = model_identity(model)
    config = model / "config.json"
    config.write_bytes(config.read_bytes() + b"\n")  # same JSON, other bytes
    assert model_identity(model) != before


def test_identity_changes_with_the_tokenizer(model: Path) -> None:
    before = model_identity(model)
    tokenizer = model / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes() + b"\n")
    changed = model_identity(model)
    assert changed != before
    (model / "merges.txt").write_text("")  # one more tokenizer file
    assert model_identity(model) not in (before, changed)
    assert model_identity(model) == by_hand(model, 2)


def test_identity_changes_when_a_weight_file_is_renamed(model: Path) -> None:
    before = model_identity(model)
    (model / "model.safetensors").rename(model / "weights.safetensors")
    assert model_identity(model) != before


def test_identity_changes_when_a_weight_file_is_resized(model: Path) -> None:
    before = model_identity(model)
    with (model / "model.safetensors").open("ab") as f:
        f.write(b"\0")
    assert model_identity(model) != before


def test_identity_changes_when_a_weight_file_is_added(model: Path) -> None:
    before = model_identity(model)
    shutil.copy(model / "model.safetensors", model / "extra.safetensors")
    assert model_identity(model) != before


def test_identity_ignores_other_files_and_weight_contents(model: Path, sharded: Path) -> None:
    before = model_identity(model)
    (model / "README.md").write_text("notes")
    (model / "generation_config.json").write_text("{}")
    (model / "sub").mkdir()
    (model / "sub" / "more.safetensors").write_bytes(b"x")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same name, same size: the identity does not read weights
    weights.write_bytes(bytes(data))
    assert model_identity(model) == before
    before = model_identity(sharded)
    (sharded / "stray.safetensors").write_bytes(b"x")  # beside an index: not a shard
    assert model_identity(sharded) == before


def test_identity_follows_symlinked_weights(model: Path, tmp_path: Path) -> None:
    before = model_identity(model)
    blob = tmp_path / "blob"
    (model / "model.safetensors").rename(blob)
    os.symlink(blob, model / "model.safetensors")
    assert model_identity(model) == before
    blob.unlink()
    with pytest.raises(ConfigError, match=r"weight file .*model\.safetensors cannot be read"):
        model_identity(model)


def test_identity_refuses_a_directory_without_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"holds no \*\.safetensors files"):
        model_identity(model)


def test_layer_count(fixture_dir: Path) -> None:
    assert layer_count(read_model_config(fixture_dir / "llama")) == 2
    assert layer_count({"num_hidden_layers": 28}) == 28
    assert layer_count({"model_type": "vlm", "text_config": {"num_hidden_layers": 40}}) == 40
    assert layer_count({"num_hidden_layers": 4, "text_config": {"num_hidden_layers": 9}}) == 4


@pytest.mark.parametrize(("config", "message"), [
    ({}, r"^config\.json has no 'num_hidden_layers' \(nor 'text_config\.num_hidden_layers'\)"),
    ({"text_config": {}}, r"^config\.json has no 'num_hidden_layers'"),
    ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be a positive integer, not 0"),
    ({"num_hidden_layers": True}, r"'num_hidden_layers' must be a positive integer, not True"),
    ({"text_config": {"num_hidden_layers": "2"}},
     r"'text_config\.num_hidden_layers' must be a positive integer, not '2'"),
])
def test_layer_count_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        layer_count(config)
    assert err.value.hint


def test_identity_names_config_json_without_a_layer_count(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"^{model}/config\.json has no 'num_hidden_layers'"):
        model_identity(model)


def test_read_model_config_errors(model: Path, tmp_path: Path) -> None:
    assert read_model_config(model)["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match=rf"model directory {tmp_path}/nope does not exist"):
        read_model_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"is a file, not a model directory"):
        read_model_config(model / "config.json")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{model}/config\.json is not valid JSON"):
        model_identity(model)
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json must hold a JSON object, not list"):
        read_model_config(model)
    (model / "config.json").unlink()
    with pytest.raises(ConfigError, match=rf"model directory {model} has no config\.json") as e:
        read_model_config(model)
    assert "config.json" in e.value.hint
