"""The tensor table of a safetensors file, read from its header alone.

A safetensors file is ``u64 n`` (little-endian) · ``n`` bytes of JSON · the
tensor data. The JSON maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets into the data, which starts right
after the header), plus an optional ``"__metadata__"`` of strings. Only the
8 bytes and the header are read, so a 20 GB shard costs one small read; the
tensor data is never touched. Every entry is checked against its dtype, shape
and the file's size, and every error names the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError

# A real header is a few MB at most (one entry per tensor); anything above this
# is a damaged or hostile file, refused before any allocation.
MAX_HEADER: Final = 100 * 1024 * 1024
# Bytes per element of each safetensors dtype (the format's own names).
DTYPE_BYTES: Final = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
FLOAT_DTYPES: Final = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
DAMAGED = "the checkpoint is damaged or incomplete; download it again"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it: ``nbytes`` is what it occupies."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_tensor_headers(path: Path) -> dict[str, TensorEntry]:
    """The tensors of the safetensors file ``path``, by name, from its header alone."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _damaged(path, f"is truncated: {len(prefix)} bytes, shorter than the "
                               "8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER:
                raise _damaged(path, f"declares a {n}-byte header, more than the "
                               f"{MAX_HEADER}-byte limit")
            if 8 + n > size:
                raise _damaged(path, f"is truncated: its header needs {8 + n} bytes, the "
                               f"file has {size}")
            raw = f.read(n)
    except OSError as exc:
        raise ConfigError(f"weight file {path} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    if len(raw) < n:
        raise _damaged(path, f"is truncated: its header needs {8 + n} bytes, the file has "
                       f"{8 + len(raw)}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _damaged(path, f"has a header that is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise _damaged(path, f"has a header that is a JSON {type(header).__name__}, "
                       "not an object")
    data_size = size - 8 - n
    return {name: _entry(path, name, value, data_size)
            for name, value in header.items() if name != "__metadata__"}


def _entry(path: Path, name: str, value: Any, data_size: int) -> TensorEntry:
    where = f"tensor {name!r}"
    if not isinstance(value, dict):
        raise _damaged(path, f"has {where} described by a {type(value).__name__}, "
                       "not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _damaged(path, f"has {where} of dtype {dtype!r}, which is not a safetensors "
                       "dtype")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise _damaged(path, f"has {where} with shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))
            and offsets[0] <= offsets[1]):
        raise _damaged(path, f"has {where} with data_offsets {offsets!r}, not [begin, end]")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise _damaged(path, f"has {where} ({dtype} {shape}: {nbytes} bytes) spanning "
                       f"{offsets[1] - offsets[0]} bytes")
    if offsets[1] > data_size:
        raise _damaged(path, f"is truncated: {where} ends at data byte {offsets[1]}, the "
                       f"file holds {data_size}")
    return TensorEntry(name, dtype, tuple(shape), nbytes)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _damaged(path: Path, what: str) -> ConfigError:
    return ConfigError(f"weight file {path} {what}", hint=DAMAGED)
