"""mx.array to and from envelope blobs. mlx is imported lazily, only when called.

bf16 and f16 travel as their raw 16 bits: viewed as uint16 on the way out and back.
"""

from __future__ import annotations

from typing import Any

from mlxceld.wire.envelope import Tensor

_TO_WIRE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
            "int16": "i16", "int8": "i8", "uint8": "u8", "uint32": "u32"}
_FROM_WIRE = {wire: name for name, wire in _TO_WIRE.items()}
_BITS = {"bf16": "uint16", "f16": "uint16"}  # memoryview has no 16-bit float format


def wire_dtype(dtype: Any) -> str | None:
    """The wire name of an mx.Dtype (``mx.bfloat16`` is "bf16"); None if it does not travel."""
    return _TO_WIRE.get(str(dtype).removeprefix("mlx.core."))


def to_blob(name: str, array: Any) -> tuple[str, str, tuple[int, ...], memoryview]:
    """``(name, dtype, shape, buffer)`` for ``encode_envelope`` from an mx.array."""
    import mlx.core as mx

    wire = wire_dtype(array.dtype)
    if wire is None:
        dtype_name = str(array.dtype).removeprefix("mlx.core.")
        raise ValueError(f"tensor {name!r}: dtype {dtype_name} does not travel on the wire")
    raw: Any = array.view(getattr(mx, _BITS[wire])) if wire in _BITS else array
    raw = mx.contiguous(raw)
    mx.eval(raw)
    return name, wire, tuple(array.shape), memoryview(raw).cast("B")


def from_blob(tensor: Tensor) -> Any:
    """An mx.array holding a copy of ``tensor``'s bytes with its dtype and shape."""
    import mlx.core as mx

    if tensor.dtype in _BITS:
        view: Any = tensor.data.cast(_format(_BITS[tensor.dtype]))
        bits = mx.array(view)
        flat = bits.view(getattr(mx, _FROM_WIRE[tensor.dtype]))
    else:
        view = tensor.data.cast(_format(_FROM_WIRE[tensor.dtype]))
        flat = mx.array(view)
    return flat.reshape(tensor.shape)


def _format(dtype_name: str) -> Any:  # a struct format; Any satisfies cast()'s Literal
    return {"float32": "f", "int32": "i", "int16": "h", "int8": "b",
            "uint8": "B", "uint32": "I", "uint16": "H"}[dtype_name]
