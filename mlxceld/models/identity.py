"""Which checkpoint a model directory holds: its identity, and its layer count.

Two hosts agree that they serve the same model when their identities are equal.
The identity is the lowercase hex SHA-256 of this message (``u64`` is an
unsigned 64-bit big-endian integer)::

    b"mlxceld model identity v1\\n"
    u64 len(config) · config                 the raw bytes of config.json
    for each *.safetensors file, sorted by the UTF-8 bytes of its name:
        u64 len(name) · name                 the file name (UTF-8), no directory
        u64 size                             the file's size in bytes
    u64 layers                               layer_count(config.json)

Every ``*.safetensors`` entry of the directory counts (a symlink counts as the
file it points at, as mlx-lm loads it); nothing else does: the tokenizer, the
index file and any other file may differ between hosts. The weights themselves
are never read, so the identity of a 100 GB checkpoint costs a directory
listing and one small file. It says "these are the same files", not "these
bytes were verified": a shard rewritten in place with the same size and name
keeps the identity.
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxceld.errors import ConfigError

DOMAIN = b"mlxceld model identity v1\n"
CONFIG = "config.json"
WEIGHTS_SUFFIX = ".safetensors"


def model_identity(path: Path) -> str:
    """The identity of the checkpoint in ``path`` (see the module docstring)."""
    raw, config = _read_config(Path(path))
    layers = layer_count(config, source=str(Path(path) / CONFIG))
    h = hashlib.sha256(DOMAIN)
    h.update(_u64(len(raw)) + raw)
    for name, size in _weight_files(Path(path)):
        h.update(_u64(len(name)) + name + _u64(size))
    h.update(_u64(layers))
    return h.hexdigest()


def read_model_config(path: Path) -> dict[str, Any]:
    """config.json of the model directory ``path``, as a dict."""
    return _read_config(Path(path))[1]


def layer_count(config: Mapping[str, Any], *, source: str = CONFIG) -> int:
    """``num_hidden_layers``, at the top or under ``text_config`` (multimodal checkpoints).

    ``source`` names the file in errors.
    """
    text = config.get("text_config")
    for where, table in (("", config), ("text_config.", text)):
        if isinstance(table, Mapping) and "num_hidden_layers" in table:
            value = table["num_hidden_layers"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{source}: '{where}num_hidden_layers' must be a positive integer, "
                    f"not {value!r}",
                    hint="the checkpoint's config.json is damaged; download it again")
            return value
    raise ConfigError(
        f"{source} has no 'num_hidden_layers' (nor 'text_config.num_hidden_layers')",
        hint="mlxceld splits decoder layers across stages, and needs to know how many "
        "there are; is this a decoder-only LLM checkpoint?")


def _weight_files(path: Path) -> list[tuple[bytes, int]]:
    """``(UTF-8 name, size)`` of every ``*.safetensors`` file in ``path``, sorted by name."""
    found = []
    try:
        entries = list(path.iterdir())
    except OSError as exc:
        raise ConfigError(f"model directory {path} cannot be listed: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    for entry in entries:
        if not entry.name.endswith(WEIGHTS_SUFFIX):
            continue
        try:
            name = entry.name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"weight file {entry} has a name that is not UTF-8",
                              hint="rename it; the model identity hashes names as UTF-8"
                              ) from exc
        try:
            st = entry.stat()
        except OSError as exc:
            raise ConfigError(f"weight file {entry} cannot be read: {exc.strerror or exc}",
                              hint="a dangling symlink? download the checkpoint again"
                              ) from exc
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"weight file {entry} is not a regular file",
                              hint=f"move it away: every *{WEIGHTS_SUFFIX} entry is a weight "
                              "file to mlx-lm")
        found.append((name, st.st_size))
    if not found:
        raise ConfigError(f"model directory {path} holds no *{WEIGHTS_SUFFIX} files",
                          hint="an mlx-lm checkpoint has config.json and safetensors weights "
                          "side by side")
    return sorted(found)


def _read_config(path: Path) -> tuple[bytes, dict[str, Any]]:
    if not path.exists():
        raise ConfigError(f"model directory {path} does not exist",
                          hint="give a local mlx-lm model directory (python -m "
                          "mlxceld.models.fixtures DIR writes a test model)")
    if not path.is_dir():
        raise ConfigError(f"model {path} is a file, not a model directory",
                          hint=f"point it at the directory holding {CONFIG}")
    file = path / CONFIG
    try:
        raw = file.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"model directory {path} has no {CONFIG}",
                          hint="is this the checkpoint's top directory? an mlx-lm model has "
                          f"{CONFIG} beside its weights") from exc
    except OSError as exc:
        raise ConfigError(f"{file} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}",
                          hint="the checkpoint is damaged; download it again") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{file} must hold a JSON object, not {type(config).__name__}",
                          hint="the checkpoint is damaged; download it again")
    return raw, config


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")
