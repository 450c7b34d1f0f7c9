"""A Hugging Face cache laid out as huggingface_hub lays it out, so that its own code, with
HF_HUB_OFFLINE=1, resolves a repo id from it: no network in tests.

``<cache>/models--owner--name/refs/main`` names the commit, ``snapshots/<commit>/<file>``
links to ``blobs/<sha256>`` (huggingface_hub's cache layout, HF_HUB_CACHE)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def snapshot_dir(cache: Path, repo: str, commit: str = COMMIT) -> Path:
    owner, name = repo.split("/")
    return cache / f"models--{owner}--{name}" / "snapshots" / commit


def hub_cache(cache: Path, repo: str, model: Path, shards: Iterable[str] = ()) -> Path:
    """``cache`` holding of ``repo`` (whose files are those of the directory ``model``)
    every file but the weights, and the weight files ``shards``; its snapshot directory."""
    snap = snapshot_dir(cache, repo)
    store = snap.parent.parent
    (store / "refs").mkdir(parents=True, exist_ok=True)
    (store / "refs" / "main").write_text(COMMIT)
    (store / "blobs").mkdir(exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    keep = set(shards)
    for file in sorted(model.iterdir()):
        if file.is_file() and (not file.name.endswith(".safetensors") or file.name in keep):
            data = file.read_bytes()
            blob = store / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = snap / file.name
            if not link.is_symlink():
                link.symlink_to(Path("..", "..", "blobs", blob.name))
    return snap
