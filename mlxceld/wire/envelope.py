"""The message envelope of PROTOCOL.md section 4: ``header_len u32 · header · blobs``.

Pure bytes and memoryviews (no mlx here; see ``mx_tensors``). A receiver parses
with an allow-list per message type; every tensor's name, dtype, rank and
per-dimension bounds are checked, and the exact payload length verified, before
any blob is sliced. Blobs come back as memoryviews of the payload: no copies.

Readings where the page is loose (the stricter one): the header must be UTF-8
JSON of an object without duplicate keys or NaN/Infinity; ``tensors``, where
present, is a list of objects with exactly the keys ``name``, ``dtype`` and
``shape`` (a list of non-negative integers), with unique names; a message type
missing from the allow-list is refused; a tensor the allow-list requires must
be present.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from mlxceld.wire.crypto import Buffer
from mlxceld.wire.errors import EnvelopeError

ITEMSIZE: Final = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "u32": 4}
_LEN: Final = struct.Struct(">I")
MAX_HEADER_LEN: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one named tensor may look like: dtypes, and (lo, hi) bounds per dimension."""

    dtypes: frozenset[str]
    dims: tuple[tuple[int, int], ...]
    required: bool = True

    def check(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        if dtype not in self.dtypes:
            raise EnvelopeError(f"tensor {name!r}: dtype {dtype} not allowed")
        if len(shape) != len(self.dims):
            raise EnvelopeError(f"tensor {name!r}: rank {len(shape)}, expected {len(self.dims)}")
        for i, (n, (lo, hi)) in enumerate(zip(shape, self.dims, strict=True)):
            if not lo <= n <= hi:
                raise EnvelopeError(f"tensor {name!r}: dim {i} is {n}, allowed {lo}..{hi}")


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """The tensors a message type may carry (none by default)."""

    tensors: Mapping[str, TensorSpec] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # raw little-endian C-contiguous bytes, a view of the payload


@dataclass(frozen=True, slots=True)
class Envelope:
    type: str
    header: dict[str, Any]
    tensors: dict[str, Tensor]


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return ITEMSIZE[dtype] * math.prod(shape)


def encode_envelope(header: Mapping[str, Any],
                    tensors: Sequence[tuple[str, str, Sequence[int], Buffer]] = ()) -> bytes:
    """The payload for ``header`` (which needs a string ``t``) and ``tensors`` in order."""
    if not isinstance(header.get("t"), str):
        raise ValueError("an envelope header needs a string field 't'")
    full = dict(header)
    blobs: list[memoryview] = []
    if tensors:
        specs = []
        for name, dtype, shape, buf in tensors:
            if dtype not in ITEMSIZE:
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
            view = memoryview(buf)
            if not view.c_contiguous:
                raise ValueError(f"tensor {name!r}: buffer is not C-contiguous")
            view = view.cast("B")
            if len(view) != nbytes(dtype, shape):
                raise ValueError(f"tensor {name!r}: {len(view)} bytes, shape and dtype "
                                 f"say {nbytes(dtype, shape)}")
            specs.append({"name": name, "dtype": dtype, "shape": [int(n) for n in shape]})
            blobs.append(view)
        full["tensors"] = specs
    head = _ENCODER.encode(full).encode("utf-8")
    return b"".join([_LEN.pack(len(head)), head, *blobs])


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise EnvelopeError(f"duplicate key {key!r} in the header")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise EnvelopeError(f"{name} in the header")


# Made once: ``json.dumps``/``json.loads`` with options build a new coder every call,
# a measurable share of a small message's cost.
_ENCODER: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False)
_DECODER: Final = json.JSONDecoder(object_pairs_hook=_no_duplicates,
                                   parse_constant=_no_constant)


def _parse_header(raw: memoryview) -> dict[str, Any]:
    try:
        text = bytes(raw).decode("utf-8")
        header = _DECODER.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, EnvelopeError):
            raise
        raise EnvelopeError("header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise EnvelopeError("header is not a JSON object")
    if not isinstance(header.get("t"), str):
        raise EnvelopeError("header has no string field 't'")
    return header


def _tensor_list(header: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = header.get("tensors", [])
    if not isinstance(entries, list):
        raise EnvelopeError("'tensors' is not a list")
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape"}:
            raise EnvelopeError("a tensor entry needs exactly name, dtype and shape")
        name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise EnvelopeError("a tensor entry has a bad name or dtype")
        if not isinstance(shape, list) or not all(
                type(n) is int and n >= 0 for n in shape):
            raise EnvelopeError(f"tensor {name!r}: shape is not a list of non-negative ints")
        out.append((name, dtype, tuple(shape)))
    return out


def parse_envelope(payload: Buffer, specs: Mapping[str, MessageSpec],
                   max_header_len: int = MAX_HEADER_LEN) -> Envelope:
    """Parse and check ``payload`` against the allow-list ``specs`` (by message type)."""
    view = memoryview(payload).cast("B")
    if len(view) < _LEN.size:
        raise EnvelopeError("payload shorter than its header length")
    (header_len,) = _LEN.unpack_from(view)
    if header_len > max_header_len or _LEN.size + header_len > len(view):
        raise EnvelopeError(f"header length {header_len} out of bounds")
    header = _parse_header(view[_LEN.size:_LEN.size + header_len])
    spec = specs.get(header["t"])
    if spec is None:
        raise EnvelopeError(f"message type {header['t']!r} is not allowed here")
    entries = _tensor_list(header)
    seen: set[str] = set()
    total = 0
    for name, dtype, shape in entries:
        tspec = spec.tensors.get(name)
        if tspec is None or name in seen:
            raise EnvelopeError(f"tensor {name!r} is not allowed (or repeated) in "
                                f"{header['t']!r}")
        tspec.check(name, dtype, shape)
        seen.add(name)
        total += nbytes(dtype, shape)
    missing = [n for n, t in spec.tensors.items() if t.required and n not in seen]
    if missing:
        raise EnvelopeError(f"{header['t']!r} lacks tensors {missing}")
    if _LEN.size + header_len + total != len(view):
        raise EnvelopeError(f"payload is {len(view)} bytes, header says "
                            f"{_LEN.size + header_len + total}")
    tensors: dict[str, Tensor] = {}
    offset = _LEN.size + header_len
    for name, dtype, shape in entries:
        size = nbytes(dtype, shape)
        tensors[name] = Tensor(name, dtype, shape, view[offset:offset + size])
        offset += size
    return Envelope(header["t"], header, tensors)
