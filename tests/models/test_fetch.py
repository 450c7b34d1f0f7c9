"""--model <hf-repo-id>: which files a host fetches, through a fake of our download seam
(a local directory stands in for the Hub), and through huggingface_hub's own code over a
cache laid out as it lays one out, with HF_HUB_OFFLINE=1: no network in tests."""

from __future__ import annotations

import fnmatch
import logging
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import huggingface_hub.constants
import pytest

from mlxceld.errors import ConfigError
from mlxceld.models import fetch, model_identity, preset, read_model_config, write_fixture
from mlxceld.models.fetch import (
    ALL_WEIGHTS,
    METADATA_PATTERNS,
    DownloadHeard,
    Progress,
    bytes_bar,
    fetch_model,
    fetch_stage,
    fetch_whole,
    is_repo_id,
    local_model,
    model_name,
    snapshot_of,
    weight_patterns,
)
from mlxceld.models.shards import read_index, stage_files

from helpers.hub import COMMIT, hub_cache, snapshot_dir
from helpers.waiting import wait_for

REPO = "owner/tiny-llama"


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
        self.revisions: list[str | None] = []

    def __call__(self, name: str, patterns: Sequence[str], *, revision: str | None = None,
                 progress: Progress | None = None) -> Path:
        assert name == "owner/tiny-llama"
        self.calls.append(list(patterns))
        self.revisions.append(revision)
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
    def nowhere(name: str, patterns: Sequence[str], *, revision: str | None = None,
                progress: Progress | None = None) -> Path:
        raise AssertionError("fetched")
    assert fetch_model(str(hub), (0, 1), download=nowhere) == hub


def test_neither_a_directory_nor_downloadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model '.*/nope' is not a local directory, nor a "
                       r"Hugging Face repo id") as info:
        fetch_model(str(tmp_path / "nope"))
    assert "mlx-community/" in info.value.hint

    def offline(name: str, patterns: Sequence[str], *, revision: str | None = None,
                progress: Progress | None = None) -> Path:
        raise OSError("Cannot reach https://huggingface.co: offline")
    with pytest.raises(ConfigError, match=r"model 'owner/none' is not a local directory, and "
                       r"cannot be fetched from Hugging Face: OSError: Cannot reach") as info:
        fetch_model("owner/none", download=offline)
    assert "network" in info.value.hint


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """huggingface_hub reading only the cache ``tmp_path / "hub"`` (what HF_HUB_CACHE and
    HF_HUB_OFFLINE=1 say to a process that imports it after they are set)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_repo_id_resolves_to_its_metadata_in_the_cache(hub: Path,
                                                         offline_cache: Path) -> None:
    """huggingface_hub's own code finds the snapshot: config, index and tokenizer only, whose
    identity is the whole checkpoint's; the name pushed to other hosts is the repo id."""
    snap = hub_cache(offline_cache, REPO, hub)
    local = local_model(REPO)
    assert local == snap and not list(local.glob("*.safetensors"))
    assert model_identity(local) == model_identity(hub)
    assert snapshot_of(local) == (REPO, COMMIT) and model_name(local) == REPO
    assert model_name(hub) == str(hub) and snapshot_of(hub) is None


def test_an_unknown_repo_offline_is_refused_naming_it(offline_cache: Path) -> None:
    with pytest.raises(ConfigError, match=r"model 'owner/absent' is not a local directory, "
                       r"and this host's Hugging Face cache does not hold it") as info:
        local_model("owner/absent")
    assert "hf download owner/absent" in info.value.hint


def test_a_stage_fetches_only_the_shards_it_lacks(hub: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """At the snapshot's own commit, with the bytes reported; nothing when it lacks none."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = tmp_path / "hub"
    needed = weight_patterns(hub, (1, 3))
    snap = hub_cache(cache, REPO, hub, needed[:1])
    heard: list[tuple[int, int]] = []

    def fetch(name: str, patterns: Sequence[str], *, revision: str | None = None,
              progress: Progress | None = None) -> Path:
        assert (name, revision) == (REPO, COMMIT) and progress is not None
        for file in patterns:
            shutil.copy(hub / file, snap / file)
            progress((snap / file).stat().st_size, 1 << 20)
        return snap

    assert fetch_stage(snap, (1, 3), lambda d, t: heard.append((d, t)), fetch) == snap
    assert sorted(p.name for p in snap.glob("*.safetensors")) == needed
    assert len(heard) == len(needed) - 1 and heard[0][1] == 1 << 20

    def nowhere(name: str, patterns: Sequence[str], *, revision: str | None = None,
                progress: Progress | None = None) -> Path:
        raise AssertionError("fetched")
    assert fetch_stage(snap, (1, 3), None, nowhere) == snap  # it has them all now
    assert fetch_stage(hub, (0, 1), None, nowhere) == hub  # not a snapshot: never fetched


def test_a_single_host_fetches_every_shard_it_lacks(hub: Path, offline_cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A router serving a repo id whole: every file of the index, at the snapshot's
    commit, with progress; offline, the ones its cache lacks named."""
    monkeypatch.setattr(fetch, "_local", {})  # what this process resolved before: another cache
    index = read_index(hub)
    assert index is not None and len(index.files) > 2
    held = sorted(index.files)[:1]
    snap = hub_cache(offline_cache, REPO, hub, held)
    lacking = sorted(index.files - set(held))
    with pytest.raises(ConfigError, match=rf"model {REPO} needs {len(lacking)} file\(s\) "
                       rf"that this host's Hugging Face cache .* lacks: {lacking[0]}"):
        fetch_whole(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    heard: list[tuple[int, int]] = []

    def download(name: str, patterns: Sequence[str], *, revision: str | None = None,
              progress: Progress | None = None) -> Path:
        assert (name, revision, sorted(patterns)) == (REPO, COMMIT, lacking)
        assert progress is not None
        for i, file in enumerate(patterns):
            shutil.copy(hub / file, snap / file)
            progress(i + 1, len(lacking))
        return snap

    assert fetch_whole(REPO, lambda d, t: heard.append((d, t)), download) == snap
    assert {p.name for p in snap.glob("*.safetensors")} == index.files
    assert heard and heard[-1][0] <= len(lacking) and heard[0][1] == len(lacking)


def test_a_stage_offline_without_one_of_its_shards_names_it(hub: Path,
                                                            offline_cache: Path) -> None:
    needed = weight_patterns(hub, (1, 3))
    snap = hub_cache(offline_cache, REPO, hub, needed[1:])
    with pytest.raises(ConfigError, match=rf"stage layers \[1, 3\) of {REPO} need 1 file\(s\) "
                       rf"that this host's Hugging Face cache .* lacks: {needed[0]}; "
                       "HF_HUB_OFFLINE is set") as info:
        fetch_stage(snap, (1, 3))
    assert f"hf download {REPO} {needed[0]} --revision {COMMIT}" in info.value.hint
    assert snapshot_dir(offline_cache, REPO) == snap


def test_a_token_never_shows_in_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_0123456789secret")

    def refused(name: str, patterns: Sequence[str], *, revision: str | None = None,
                progress: Progress | None = None) -> Path:
        raise OSError("401 Unauthorized: Bearer hf_0123456789secret")
    with pytest.raises(ConfigError) as info:
        local_model("owner/private", refused)
    assert "hf_0123456789secret" not in info.value.message + info.value.hint
    assert "401 Unauthorized: Bearer <token>" in info.value.message


def test_huggingface_hubs_own_bars_drive_the_progress() -> None:
    """snapshot_download's bar helpers over our stand-in for tqdm: the bytes written
    ("Reconstructing": each file adds its size to the total, each chunk its bytes) reach
    ``progress``; the network bar and the files bar (run by hf_thread_map) are dropped."""
    from huggingface_hub.utils.tqdm import _create_progress_bar, hf_thread_map

    heard: list[tuple[int, int]] = []
    bar = bytes_bar(lambda done, total: heard.append((done, total)))
    common = {"total": 0, "initial": 0, "unit": "B", "unit_scale": True}
    transfer = _create_progress_bar(cls=bar, log_level=logging.INFO, name="t",
                                    desc="Downloading bytes", **common)
    written = _create_progress_bar(cls=bar, log_level=logging.INFO, name="w",
                                   desc="Reconstructing (incomplete total...)", **common)

    def one(size: int) -> None:  # what snapshot_download's _AggregatedTqdm does per file
        written.total = (written.total or 0) + size
        written.refresh()
        written.update(size // 2)
        transfer.update(size)
        written.update(size - size // 2)

    hf_thread_map(one, [100, 300], max_workers=1, tqdm_class=bar, desc="Fetching 2 files")
    assert heard[0] == (0, 0) and heard[-1] == (400, 400)
    assert all(done <= total for done, total in heard) and len(heard) == 7


def test_a_stage_whose_shards_cannot_be_fetched_names_them(
        hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    needed = weight_patterns(hub, (1, 3))
    snap = hub_cache(tmp_path / "hub", REPO, hub)

    def down(name: str, patterns: Sequence[str], *, revision: str | None = None,
             progress: Progress | None = None) -> Path:
        raise OSError("Connection reset by peer")
    with pytest.raises(ConfigError, match=rf"stage layers \[1, 3\) of {REPO}: its shards "
                       rf"{needed[0]}.*: cannot be fetched from Hugging Face: OSError: "
                       "Connection reset by peer") as info:
        fetch_stage(snap, (1, 3), None, down)
    assert "network" in info.value.hint


def test_a_download_whose_bars_say_nothing_still_advances(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should huggingface_hub feed our bar no bytes, the cache's blobs growing (a file being
    downloaded is ``*.incomplete`` there) still reach ``progress``: a stage that downloads
    is never failed for silence."""
    monkeypatch.setattr(fetch, "WATCH_S", 0.02)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "before").write_bytes(b"x" * 10)  # what the cache held already: not counted
    heard: list[tuple[int, int]] = []
    watched = DownloadHeard(lambda done, total: heard.append((done, total)), blobs)
    watcher = threading.Thread(target=watched.watch)
    watcher.start()
    try:
        for size in (100, 300):
            (blobs / "abc.incomplete").write_bytes(b"y" * size)
            wait_for(lambda size=size: heard and heard[-1] == (size, size), 10,
                     f"{size} bytes heard")
        watched.bar(50, 1000)  # the bars say less than the disk: the disk's bytes, their total
        assert heard[-1] == (300, 1000)
    finally:
        watched.stop.set()
        watcher.join(5)
