"""A quantized KV cache that batches (``[serve] kv_bits``): the local engine's, each
tensor-parallel rank's and each pipeline stage's.

mlx-lm 0.32.2 quantizes a cache only one sequence at a time: ``generate_step`` swaps a
layer's ``KVCache`` for its ``QuantizedKVCache`` (``maybe_quantize_kv_cache``), which has
no ``merge``, so its ``BatchGenerator`` cannot batch it (``mlx_lm.server`` stops batching
when kv_bits is set). Here:

- ``QuantizingKVCache`` is one sequence's cache of one layer: mlx-lm's ``KVCache`` until
  it holds ``start`` tokens, then mlx-lm's own ``QuantizedKVCache`` (made by
  ``KVCache.to_quantized``). It trims, deep-copies and counts its bytes as they do, so
  mlx-lm's ``LRUPromptCache`` (the local engine's prefix reuse) and
  ``can_trim_prompt_cache``/``trim_prompt_cache`` take it, and its ``merge`` makes a
- ``BatchQuantizingKVCache``: mlx-lm's ``BatchKVCache`` (left padding, ``prepare`` and
  ``finalize`` for right-padded prompts, ``filter``, ``extend``, ``extract``, ``trim``,
  ``make_mask``), holding either full-precision keys and values or each as mlx's
  (packed integers, scales, biases) triple. Quantized, it has ``bits`` and
  ``group_size``, so the model's attention (mlx-lm's ``scaled_dot_product_attention``)
  takes its quantized path, as for a ``QuantizedKVCache``.

When it quantizes (``quantized_kv_start``, mlx-lm's semantics): before a model step stores
tokens in a layer's cache, the cache is quantized if it already holds at least ``start``
tokens. mlx-lm checks after each step (so before the next) with the same test, so for
every ``start`` of 1 or more a sequence's cache is quantized at the same step as in
``generate_step(..., kv_bits=, kv_group_size=, quantized_kv_start=start)``, and greedy
tokens are that run's (same prefill chunks: the engine's ``prefill_step``). With ``start``
0, the default, a cache is quantized from its first token; mlx-lm's check, made only after
a step, leaves its first step (the first prefill chunk) at full precision, and quantizes
from the first token when handed ``QuantizedKVCache``s to begin with, which is the run our
tokens equal.

A batch's layer cache is one kind for all its rows: it is quantized as soon as one row
would be (merging or extending quantized rows with full-precision ones quantizes these; a
step stores quantized once any row holds ``start`` tokens), and it never goes back. So with
a ``start`` above 0, a sequence batched with a longer one may be quantized before it holds
``start`` tokens (its tokens may then differ from its tokens alone); with ``start`` 0 every
row is quantized from its first token and batching changes nothing (on mlx's CPU backend,
bit for bit: tests/engine/test_kvquant.py).

A pipeline stage runs one step of a sequence as one or two model calls (the last stage runs
a prompt chunk's last token apart): ``one_step`` holds every cache of a step to the kind it
had when the step began, so a stage's layers quantize at the steps the whole model would.

``kv_refusal`` judges a loaded model: every layer's cache a plain ``KVCache`` and its
attention taking a quantized one (a one-token forward over quantized caches, built and
never run: mlx raises while it builds the graph, and nothing is computed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from mlxceld.roles.options import KVQuant

# Keys or values: an array (full precision) or mlx's quantized triple (packed, scales,
# biases).
Parts = Any
STEP = 256  # tokens a batch cache grows by (mlx-lm's caches' step)


def _each(f: Callable[[mx.array], mx.array], x: Parts) -> Parts:
    """``f`` of an array, or of each of a quantized triple's (mlx-lm's own keep it as a
    list: ``mx.quantize``'s; ours a tuple)."""
    return tuple(f(a) for a in x) if isinstance(x, tuple | list) else f(x)


def _arrays(x: Parts) -> tuple[mx.array, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _ints(a: mx.array) -> list[int]:
    """A 1-d integer array's values (evaluated)."""
    return [int(v) for v in cast(list[int], a.tolist())]


def _kv_cache() -> Any:
    """An empty mlx-lm ``KVCache`` (untyped)."""
    return KVCache()  # type: ignore[no-untyped-call]


def _roll(a: mx.array, shifts: mx.array) -> mx.array:
    """mlx-lm's ``dynamic_roll`` along the token axis (each row by its own shift)."""
    rolled: mx.array = dynamic_roll(a, shifts, axis=2)  # type: ignore[no-untyped-call]
    return rolled


def _quantize(x: mx.array, kv: KVQuant) -> tuple[mx.array, mx.array, mx.array]:
    q, scales, biases = mx.quantize(x, group_size=kv.group_size, bits=kv.bits)
    return q, scales, biases


class _Width:
    """``bits`` and ``group_size``, only once quantized: the model's attention asks
    ``hasattr(cache, "bits")`` to take its quantized path."""

    kv: KVQuant

    def _width(self, name: str) -> int:
        if not getattr(self, "quantized"):  # noqa: B009  # a property here, a field there
            raise AttributeError(name)
        return int(getattr(self.kv, name))

    @property
    def bits(self) -> int:
        return self._width("bits")

    @property
    def group_size(self) -> int:
        return self._width("group_size")


class QuantizingKVCache(_Width):
    """One sequence's cache of one layer: mlx-lm's ``KVCache``, then (holding ``kv.start``
    tokens as a step begins) its ``QuantizedKVCache`` (see the module docstring)."""

    def __init__(self, kv: KVQuant, inner: Any = None) -> None:
        self.kv = kv
        self.held = False  # one_step: no change of kind within a step
        if inner is None:
            inner = QuantizedKVCache(kv.group_size, kv.bits) if kv.start == 0 else _kv_cache()
        self.inner = inner

    @property
    def quantized(self) -> bool:
        return isinstance(self.inner, QuantizedKVCache)

    @property
    def offset(self) -> int:
        return int(self.inner.offset)

    @offset.setter
    def offset(self, value: int) -> None:
        self.inner.offset = value

    @property
    def keys(self) -> Parts:
        return self.inner.keys

    @property
    def values(self) -> Parts:
        return self.inner.values

    def due(self) -> bool:
        """Whether a step beginning now stores quantized tokens (and is not yet so)."""
        return not self.quantized and self.inner.offset >= self.kv.start

    def quantize(self) -> None:
        if not self.quantized:
            self.inner = self.inner.to_quantized(group_size=self.kv.group_size,
                                                 bits=self.kv.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if not self.held and self.due():
            self.quantize()
        return self.inner.update_and_fetch(keys, values)

    def content(self, quantized: bool) -> tuple[Parts, Parts] | None:
        """Its keys and values, ``offset`` rows of them (quantized when asked: a
        full-precision cache's are quantized here); None when empty."""
        if self.inner.keys is None or self.offset == 0:
            return None
        n = self.offset
        keys, values = (_each(lambda a: a[..., :n, :], x)
                        for x in (self.inner.keys, self.inner.values))
        if quantized and not self.quantized:
            return _quantize(keys, self.kv), _quantize(values, self.kv)
        return keys, values

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, v: Any) -> None:
        self.inner.state = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return int(self.inner.trim(n))

    def size(self) -> int:
        return self.offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_mask(*args, **kwargs)

    def empty(self) -> bool:
        return bool(self.inner.keys is None)

    @property
    def nbytes(self) -> int:
        if self.inner.keys is None:
            return 0
        return sum(a.nbytes for x in (self.inner.keys, self.inner.values)
                   for a in _arrays(x))

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizingKVCache:
        return BatchQuantizingKVCache.merge(caches)


class BatchQuantizingKVCache(_Width):
    """Several sequences' caches of one layer, left-padded to one length, for a batched
    step: mlx-lm's ``BatchKVCache``, its keys and values full-precision arrays or quantized
    triples (see the module docstring)."""

    def __init__(self, kv: KVQuant, left_padding: list[int], *,
                 quantized: bool = False) -> None:
        self.kv = kv
        self.keys: Parts = None
        self.values: Parts = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.quantized = quantized or kv.start == 0
        self.held = False

    def due(self) -> bool:
        """Any row holds ``kv.start`` tokens as a step begins (and the batch is not yet
        quantized)."""
        if self.quantized:
            return False
        return self._idx > 0 and max(_ints(self.offset)) >= self.kv.start

    def quantize(self) -> None:
        if self.quantized:
            return
        if self.keys is not None:
            self.keys = _quantize(self.keys, self.kv)
            self.values = _quantize(self.values, self.kv)
        self.quantized = True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if not self.held and self.due():
            self.quantize()
        new_k: Parts = _quantize(keys, self.kv) if self.quantized else keys
        new_v: Parts = _quantize(values, self.kv) if self.quantized else values
        n = keys.shape[2]
        prev = self._idx
        if self.keys is None or prev + n > _arrays(self.keys)[0].shape[2]:
            grow = (STEP + n - 1) // STEP * STEP

            def room(a: mx.array) -> mx.array:
                return mx.zeros((a.shape[0], a.shape[1], grow, a.shape[3]), a.dtype)

            if self.keys is None:
                self.keys, self.values = _each(room, new_k), _each(room, new_v)
            else:
                if prev % STEP != 0:
                    self.keys, self.values = (_each(lambda a: a[..., :prev, :], x)
                                              for x in (self.keys, self.values))
                self.keys = _each2(lambda a, b: mx.concatenate([a, b], axis=2),
                                   self.keys, _each(room, new_k))
                self.values = _each2(lambda a, b: mx.concatenate([a, b], axis=2),
                                     self.values, _each(room, new_v))
        self.offset = self.offset + n
        self._idx += n
        for dst, src in zip(_arrays(self.keys) + _arrays(self.values),
                            _arrays(new_k) + _arrays(new_v), strict=True):
            dst[..., prev:self._idx, :] = src
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        i = self._idx
        return (_each(lambda a: a[..., :i, :], self.keys),
                _each(lambda a: a[..., :i, :], self.values))

    def prepare(self, *, left_padding: list[int] | None = None,
                lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys, self.values = (
                _each(lambda a: _roll(a, pad[:, None]), x)
                for x in (self.keys, self.values))
            self.offset = self.offset - pad
            self.left_padding = self.left_padding + pad
            self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                  **kwargs)

    def filter(self, batch_indices: Any) -> None:
        """Keep only the rows ``batch_indices``, in place."""
        if self.keys is not None:
            self.keys, self.values = (_each(lambda a: a[batch_indices], x)
                                      for x in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(_ints(self.left_padding))
        if least > 0:
            if self.keys is not None:
                self.keys, self.values = (_each(lambda a: a[..., least:, :], x)
                                          for x in (self.keys, self.values))
            self._idx -= least
            self.left_padding = self.left_padding - least

    def extend(self, other: BatchQuantizingKVCache) -> None:
        """Add ``other``'s rows after this one's, in place (both quantized if either is)."""
        if self.quantized or other.quantized:
            self.quantize()
            other.quantize()
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        template = self if self.keys is not None else other
        most = max(self._idx, other._idx)
        size = max(_arrays(c.keys)[0].shape[2] for c in (self, other) if c.keys is not None)

        def padded(c: BatchQuantizingKVCache) -> tuple[Parts, Parts, mx.array, mx.array]:
            rows = c.offset.shape[0]
            keys = c.keys if c.keys is not None else _each(
                lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype), template.keys)
            values = c.values if c.values is not None else _each(
                lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype),
                template.values)
            left = most - c._idx
            right = size - _arrays(keys)[0].shape[2] - left
            if right < 0:
                keys, values = (_each(lambda a: a[..., :right, :], x) for x in (keys, values))
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                keys, values = (_each(lambda a: mx.pad(a, widths), x) for x in (keys, values))
            return keys, values, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = padded(self), padded(other)
        join = _cat2
        self.keys, self.values = join(k1, k2), join(v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = most

    def extract(self, idx: int) -> QuantizingKVCache:
        """Row ``idx`` as one sequence's cache (its own, contiguous arrays)."""
        pad = _ints(self.left_padding)[idx]
        end = self._idx
        keys, values = (_each(lambda a: mx.contiguous(a[idx:idx + 1, :, pad:end]), x)
                        for x in (self.keys, self.values))
        if self.quantized:
            inner: Any = QuantizedKVCache(self.kv.group_size, self.kv.bits)
        else:
            inner = _kv_cache()
        inner.keys, inner.values = keys, values
        inner.offset = end - pad
        return QuantizingKVCache(self.kv, inner)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizingKVCache:
        """One batch cache of ``caches`` (``QuantizingKVCache``s of one layer, one per
        sequence), left-padded to the longest."""
        kv = caches[0].kv
        quantized = any(c.quantized for c in caches)
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(kv, padding if longest else [0] * len(caches), quantized=quantized)
        contents = [c.content(batch.quantized) for c in caches]
        shown = next((x for x in contents if x is not None), None)
        if shown is None:
            return batch
        rows = len(caches)

        def room(a: mx.array) -> mx.array:
            return mx.zeros((rows, a.shape[1], longest, a.shape[3]), a.dtype)

        keys, values = _each(room, shown[0]), _each(room, shown[1])
        for i, (pad, got) in enumerate(zip(padding, contents, strict=True)):
            if got is None:
                continue
            for dst, src in zip(_arrays(keys) + _arrays(values),
                                _arrays(got[0]) + _arrays(got[1]), strict=True):
                dst[i:i + 1, :, pad:pad + lengths[i]] = src
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for x in (self.keys, self.values) for a in _arrays(x))


def _each2(f: Callable[[mx.array, mx.array], mx.array], x: Parts, y: Parts) -> Parts:
    if isinstance(x, tuple | list):
        return tuple(f(a, b) for a, b in zip(x, y, strict=True))
    return f(x, y)


def _cat2(x: Parts, y: Parts) -> Parts:
    return _each2(lambda a, b: mx.concatenate([a, b]), x, y)


def quantizing_caches(model: Any, kv: KVQuant) -> list[QuantizingKVCache]:
    """A fresh ``QuantizingKVCache`` per layer of ``model`` (whose every layer keeps a plain
    ``KVCache``: ``kv_refusal``)."""
    return quantizing(make_prompt_cache(model), kv)


def quantizing(caches: Sequence[Any], kv: KVQuant) -> list[QuantizingKVCache]:
    """``caches`` (one sequence's, a ``KVCache`` per layer, empty or not) as
    ``QuantizingKVCache``s, each holding what its ``KVCache`` held (quantized at the next
    step when it holds ``kv.start`` tokens); ``ValueError`` naming a layer whose cache is
    another kind."""
    out = []
    for i, c in enumerate(caches):
        if isinstance(c, QuantizingKVCache):
            out.append(c)
        elif type(c) is KVCache:
            out.append(QuantizingKVCache(kv, None if c.keys is None and kv.start == 0 else c))
        else:
            raise ValueError(f"layer {i} keeps a {type(c).__name__}, which mlx-lm cannot "
                             "quantize")
    return out


@contextlib.contextmanager
def one_step(caches: Sequence[Any]) -> Iterator[None]:
    """Run one step of a sequence (or a batch) over ``caches``, however many model calls
    it takes: caches due are quantized as it begins, and none changes kind within it."""
    ours = [c for c in caches if isinstance(c, QuantizingKVCache | BatchQuantizingKVCache)]
    for c in ours:
        if c.due():
            c.quantize()
        c.held = True
    try:
        yield
    finally:
        for c in ours:
            c.held = False


def kv_refusal(model: Any, kv: KVQuant) -> str | None:
    """Why ``model`` (loaded, mlx-lm's) cannot keep ``kv``'s cache, or None: a layer's cache
    that is not a plain ``KVCache``, or attention that refuses a quantized one (a one-token
    forward over quantized caches is built, never evaluated: nothing runs, nothing is
    exchanged between tensor-parallel ranks)."""
    caches = make_prompt_cache(model)
    for i, c in enumerate(caches):
        if type(c) is not KVCache:
            return (f"its layer {i} keeps a {type(c).__name__}, which mlx-lm cannot "
                    "quantize")
    probe = [QuantizingKVCache(KVQuant(kv.bits, kv.group_size, 0)) for _ in caches]
    try:
        model(mx.array([[0]], dtype=mx.int32), cache=probe)
    except (ValueError, TypeError, AttributeError, IndexError, NotImplementedError) as exc:
        return f"its attention does not take a quantized KV cache ({exc})"
    return None
