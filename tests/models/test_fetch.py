"""--model <hf-repo-id>: which files a host fetches, through a fake of our download seam
(a local directory stands in for the Hub: no network in tests)."""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from mlxceld.errors import ConfigError
from mlxceld.models import model_identity, preset, read_model_config, write_fixture
from mlxceld.models.fetch import (
    ALL_WEIGHTS,
    METADATA_PATTERNS,
    fetch_model,
    is_repo_id,
    weight_patterns,
)
from mlxceld.models.shards import read_index, stage_files


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repo as the Hub holds it: a sharded four-layer checkpoint."""
    return write_fixture(tmp_path_factory.mktemp("hub") / "repo",
                         preset("tiny", family="llama", layers=4, shard_bytes=64 * 1024))


class FakeHub:
    """Our ``Download`` seam over a local directory: copies the files that match."""

    def __init__(self, repo: Path, into: Path) -> None:
        self.repo, self.into = repo, into
        self.calls: list[list[str]] = []

    def __call__(self, name: str, patterns: Sequence[str]) -> Path:
        assert name == "owner/tiny-llama"
        self.calls.append(list(patterns))
        self.into.mkdir(exist_ok=True)
        for file in self.repo.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in patterns):
                shutil.copy(file, self.into / file.name)
        return self.into


@pytest.mark.parametrize(("name", "ok"), [
    ("mlx-community/Qwen3-4B-4bit", True), ("a/b", True), ("owner/name.v2", True),
    ("name", False), ("a/b/c", False), ("/abs/path", False), ("./x/y", False),
    ("owner/..", False), ("owner/x y", False), ("-a/b", False), ("", False)])
def test_is_repo_id(name: str, ok: bool) -> None:
    assert is_repo_id(name) is ok


def test_weight_patterns(hub: Path, tmp_path: Path) -> None:
    index = read_index(hub)
    assert index is not None
    assert weight_patterns(hub, None) == list(ALL_WEIGHTS)
    stage = weight_patterns(hub, (1, 3))
    assert stage == sorted(stage_files(index, read_model_config(hub), 1, 3, 4))
    assert 0 < len(stage) < len(index.files)
    single = write_fixture(tmp_path / "single", preset("tiny", family="llama"))
    assert weight_patterns(single, (0, 1)) == list(ALL_WEIGHTS)  # one file: all of it


def test_a_stage_fetches_only_its_shards(hub: Path, tmp_path: Path) -> None:
    fake = FakeHub(hub, tmp_path / "snapshot")
    local = fetch_model("owner/tiny-llama", (1, 3), download=fake)
    assert local == tmp_path / "snapshot"
    assert fake.calls[0] == list(METADATA_PATTERNS)
    assert fake.calls[1] == weight_patterns(hub, (1, 3))
    held = {p.name for p in local.glob("*.safetensors")}
    assert held == set(fake.calls[1])
    assert model_identity(local) == model_identity(hub)  # what every host has


def test_a_local_directory_is_not_fetched(hub: Path) -> None:
    def nowhere(name: str, patterns: Sequence[str]) -> Path:
        raise AssertionError("fetched")
    assert fetch_model(str(hub), (0, 1), download=nowhere) == hub


def test_neither_a_directory_nor_downloadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model '.*/nope' is not a local directory, nor a "
                       r"Hugging Face repo id") as info:
        fetch_model(str(tmp_path / "nope"))
    assert "mlx-community/" in info.value.hint

    def offline(name: str, patterns: Sequence[str]) -> Path:
        raise OSError("Cannot reach https://huggingface.co: offline")
    with pytest.raises(ConfigError, match=r"model 'owner/none' is not a local directory, and "
                       r"cannot be fetched from Hugging Face: OSError: Cannot reach") as info:
        fetch_model("owner/none", download=offline)
    assert "network" in info.value.hint
