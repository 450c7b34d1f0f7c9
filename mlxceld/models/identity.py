"""Which checkpoint a model directory holds: its identity, and its layer count.

Two hosts agree that they serve the same model when their identities are equal.
The identity is made of what every host holds, whichever shards it keeps: a host
that runs layers [0, 20) of a sharded checkpoint may hold only the shards of
those layers (``slicing.load_stage`` reads no other), and its identity is still
that of the whole checkpoint. It is the lowercase hex SHA-256 of this message
(``u64`` is an unsigned 64-bit big-endian integer, ``str`` is ``u64 len · UTF-8``)::

    b"mlxceld model identity v2\n"
    u64 len(config) · config                 the raw bytes of config.json
    with model.safetensors.index.json (a sharded checkpoint):
        b"I" · u64 total_size                its metadata.total_size (0 if absent)
        for each tensor of its weight_map, sorted by the UTF-8 bytes of its name:
            str name · str file              the tensor and the shard that holds it
    without one (a single-file checkpoint, which every host holds whole):
        b"F"
        for each *.safetensors file, sorted by the UTF-8 bytes of its name:
            str name · u64 size              the file name, no directory; its size
    for each of TOKENIZER_FILES the directory holds, in that order:
        str name · u64 len(data) · data      the file's bytes
    u64 layers                               layer_count(config.json)

So the weights themselves are never read (a 100 GB checkpoint costs a few small
files), and the index is hashed as its content, not its bytes (re-indented, it
is the same index). It says "these are the same files", not "these bytes were
verified": a shard rewritten in place under the same name keeps the identity.
A different config.json, index or tokenizer is a different model: every host
holds the same config, index and tokenizer files (``--model <hf-repo-id>``
fetches them on every host, ``fetch.py``). Other files (README, the
generation config, stray ``*.safetensors`` beside an index) do not count.

The digest is kept per directory while none of the files it hashed changed
(size, mtime, inode; not kept for files changed in the last ``RACY_NS``): the
daemon asks for it at every inventory poll and offer.
"""

from __future__ import annotations

import hashlib
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.shards import INDEX, read_index, read_json_object

DOMAIN: Final = b"mlxceld model identity v2\n"
CONFIG: Final = "config.json"
WEIGHTS_SUFFIX: Final = ".safetensors"
# The tokenizer files that count (those a directory holds), in the order they are hashed.
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                          "special_tokens_map.json", "added_tokens.json", "vocab.json",
                          "merges.txt", "tiktoken.model", "chat_template.jinja")

RACY_NS: Final = 2_000_000_000  # files changed more lately than this: the digest is not kept
_Seen = tuple[tuple[tuple[str, int, int, int], ...], tuple[tuple[bytes, int], ...]]
# path -> (what was seen of the files hashed, the digest); see the module docstring.
_known: dict[Path, tuple[_Seen, str]] = {}


def model_identity(path: Path) -> str:
    """The identity of the checkpoint in ``path`` (see the module docstring)."""
    path = Path(path)
    raw, config = _read_config(path)
    layers = layer_count(config, source=str(path / CONFIG))
    seen = _seen(path)
    known = _known.get(path)
    if known is not None and known[0] == seen:
        return known[1]
    h = hashlib.sha256(DOMAIN)
    h.update(_u64(len(raw)) + raw)
    index = read_index(path)
    if index is not None:
        h.update(b"I" + _u64(index.total_size))
        for name in sorted(index.weight_map, key=_utf8):
            h.update(_str(name) + _str(index.weight_map[name]))
    else:
        h.update(b"F")
        for raw_name, size in seen[1]:
            h.update(_u64(len(raw_name)) + raw_name + _u64(size))
    for name in TOKENIZER_FILES:
        data = _tokenizer_file(path / name)
        if data is not None:
            h.update(_str(name) + _u64(len(data)) + data)
    h.update(_u64(layers))
    digest = h.hexdigest()
    # Kept only when nothing changed while it was read and nothing changed lately: a file
    # rewritten within the clock's tick (a few ms) would keep its size and mtime.
    newest = max(st[2] for st in seen[0])
    if seen == _seen(path) and newest < time.time_ns() - RACY_NS:
        _known[path] = (seen, digest)
    return digest


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
    read = read_json_object(path / CONFIG, missing=ConfigError(
        f"model directory {path} has no {CONFIG}",
        hint="is this the checkpoint's top directory? an mlx-lm model has "
        f"{CONFIG} beside its weights"))
    assert read is not None
    raw, config = read
    return raw, config


def _tokenizer_file(file: Path) -> bytes | None:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"tokenizer file {file} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions; the model identity hashes it") from exc


def _seen(path: Path) -> _Seen:
    """(name, size, mtime_ns, inode) of each file the identity may read, present or not
    (-1s), and without an index, the weight files' names and sizes."""
    out = []
    for name in (CONFIG, INDEX, *TOKENIZER_FILES):
        try:
            st = (path / name).stat()
        except OSError:
            out.append((name, -1, -1, -1))
        else:
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    sharded = out[1][1] >= 0
    return tuple(out), (() if sharded else tuple(_weight_files(path)))


def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def _str(s: str) -> bytes:
    try:
        b = s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{s!r} in {INDEX} is not UTF-8",
                          hint="the index is damaged; download it again") from exc
    return _u64(len(b)) + b


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")
