"""A model named by its Hugging Face repo id: fetch what this host needs of it, no more.

A model is a local directory or, when no such path exists, a Hugging Face repo
id (``owner/name``). ``fetch_model(name, layers)`` fetches it in two steps,
each one ``huggingface_hub.snapshot_download`` with ``allow_patterns`` and
each logged as it starts and ends:

1. ``METADATA_PATTERNS``: config.json, the safetensors index, the tokenizer
   and chat template files; what every host holds, and what the model
   identity is made of (``identity.py``);
2. ``weight_patterns``: with ``layers`` (a stage's [start, end)), only the
   shards that hold what that stage keeps (``shards.stage_files``, read from
   the index fetched in step 1); without, every ``model*.safetensors`` (a
   host that serves the whole model, or plans it: the profile prices every
   layer from its shard's header).

Files land in huggingface_hub's cache (``HF_HOME``, ``HF_HUB_CACHE``; a file
already there is not fetched again, ``HF_HUB_OFFLINE=1`` uses only the cache)
and the snapshot directory is returned: a local directory, which everything
else reads as any other. huggingface_hub is installed with mlx-lm (through
transformers), and imported only here, only when a repo id is fetched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from mlxceld.errors import ConfigError
from mlxceld.models.identity import layer_count, read_model_config
from mlxceld.models.shards import read_index, stage_files

log = logging.getLogger(__name__)

METADATA_PATTERNS: Final = ("*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                            "*.txt", "*.jsonl", "*.jinja")
ALL_WEIGHTS: Final = ("model*.safetensors",)  # what mlx-lm's load_model reads
# Hugging Face's own rule for a repo id: owner/name, letters, digits, '-', '_', '.'.
_REPO_ID: Final = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")

# (repo id, allow_patterns) -> the local snapshot directory; huggingface_hub's by default.
Download = Callable[[str, Sequence[str]], Path]


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face repo id (``owner/name``)."""
    return (_REPO_ID.fullmatch(name) is not None and ".." not in name
            and not name.endswith((".", "-")))


def weight_patterns(path: Path, layers: tuple[int, int] | None) -> list[str]:
    """The weight files to fetch into ``path`` (which holds step 1's files) for a stage
    of ``layers``, or for the whole model (None); see the module docstring."""
    index = read_index(path)
    if layers is None or index is None:  # no index: one file, which every stage reads
        return list(ALL_WEIGHTS)
    config = read_model_config(path)
    start, end = layers
    return sorted(stage_files(index, config, start, end, layer_count(config)))


def fetch_model(name: str, layers: tuple[int, int] | None = None,
                download: Download | None = None) -> Path:
    """The local directory of model ``name``: itself when it is a path that exists, else
    what this host needs of the Hugging Face repo ``name`` (module docstring)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not is_repo_id(name):
        raise ConfigError(f"model {name!r} is not a local directory, nor a Hugging Face "
                          "repo id (owner/name)",
                          hint="give the path of an mlx-lm model directory, or a repo id "
                          "such as mlx-community/Qwen3-4B-4bit")
    get = download or _snapshot
    log.info("model %s: fetching its config, index and tokenizer", name)
    local = _fetch(get, name, METADATA_PATTERNS)
    patterns = weight_patterns(local, layers)
    which = "every layer" if layers is None else f"layers [{layers[0]}, {layers[1]})"
    log.info("model %s: fetching %d weight file pattern(s) for %s: %s", name, len(patterns),
             which, ", ".join(patterns[:4]) + (" ..." if len(patterns) > 4 else ""))
    local = _fetch(get, name, patterns)
    log.info("model %s: fetched into %s", name, local)
    return local


def _fetch(get: Download, name: str, patterns: Sequence[str]) -> Path:
    try:
        return get(name, patterns)
    except (OSError, ValueError) as exc:  # huggingface_hub's errors are one of them
        raise ConfigError(f"model {name!r} is not a local directory, and cannot be fetched "
                          f"from Hugging Face: {type(exc).__name__}: {exc}",
                          hint="check the repo id and this host's network (offline, give a "
                          "local directory, or set HF_HUB_OFFLINE=1 to use the cache)"
                          ) from exc


def _snapshot(name: str, patterns: Sequence[str]) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=list(patterns)))
