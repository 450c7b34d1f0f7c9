"""KV handoff for prefill/decode disaggregation: one host prefills a prompt, another decodes.

- ``check_handoff(model, family)``: whether every layer's cache is a plain mlx-lm
  ``KVCache`` (keys and values, one row per token, nothing else). Sliding windows
  (``RotatingKVCache``: gemma3, gpt_oss), recurrent state (``ArraysCache``), quantized,
  chunked or composite caches are refused with ``HandoffUnsupported``: such a model is
  served whole on hybrid nodes. Cheap (no arrays are made): call it per request.
- ``prefill(model, prompt, params, ...)``: the prompt through the model in chunks of
  ``prefill_step`` into a fresh cache (or on from a cached prefix's: the local engine's
  prompt cache, ``LocalEngine.prefill``), and its first token sampled as the local engine
  samples it (the same processors, constraint mask, sampler and log-probabilities, the
  prompt's last token run alone as ``BatchGenerator`` runs it): greedy gives the local
  engine's first token.
- ``encode_cache(cache, mode)`` / ``decode_cache(header, blobs, expect=, max_tokens=)``:
  the cache as a JSON-able header and named byte blobs (``Mode``: ``none``, ``int8``,
  ``int4``, each optionally lz4-compressed). The receiver checks every header field against
  the model it serves (``CacheLayout.of(model)``) and every blob's size against the header
  before it allocates: a peer's bytes are untrusted input. ``HandoffError`` names the field.
- ``resume_sampling(params, prompt, vocab_size, matching, eos_token_ids)``: the decoding
  host's sampler and processors advanced past the first token, as if it had sampled that
  token itself; ``LocalEngine.generate_from`` continues the sequence with them.

Blob layout (``handoff_specs`` gives the MXCL allow-list): for layer ``i``, ``k{i}`` and
``v{i}`` hold the keys and values trimmed to the cache's length, C order, shape
``[kv_heads, tokens, dim]`` (the batch axis of 1 dropped), little-endian:

- ``none``: the model's dtype, as the cache holds it (lossless).
- ``int8``: a signed byte per element; ``k{i}.s`` / ``v{i}.s`` hold float32 scales, one
  per group of ``group`` consecutive elements along ``dim`` (``[kv_heads, tokens,
  dim / group]``). Symmetric: ``q = round(x / s)`` with ``s = max|x| / 127`` over the group,
  so each element is off by at most ``s / 2`` (then rounded to the model's dtype).
- ``int4``: the same with ``s = max|x| / 7`` and ``q`` in ``[-7, 7]``, stored as
  ``q + 8`` in a nibble, two to a byte (the even element in the low nibble):
  ``[kv_heads, tokens, dim / 2]`` bytes.

``group`` is the first of ``QUANT_GROUPS`` (64, 32) that divides ``dim``, else ``dim``
itself (the header says which; a receiver takes any even divisor of ``dim``). With
``lz4``, each blob is one ``lz4.frame`` of those bytes; the header keeps the byte count
before (``raw``) and after (``sent``) compression for every blob.

Seeded sampling across a handoff: the decoding host's sampler starts from the request's
seed and is split once for the token the prefill host drew, so the key stream is the one
host's. Its tokens are deterministic given the seed and the handed-off cache; they equal
the one host's only where the logits do (``none``, and the same batch shapes), since a
quantized cache or a different batch changes the logits they are drawn from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import lz4.frame
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxceld.engine.base import EngineError, GenerationRequest, SamplingParams, TokenOutput
from mlxceld.engine.constraints import Matching
from mlxceld.engine.processors import LogitsProcessor, make_logits_processors
from mlxceld.engine.sampling import Sampler, make_sampler, read_logprobs
from mlxceld.wire import MessageSpec, TensorSpec

FORMAT: Final = 1  # the header's "v": a receiver refuses any other
DEFAULT_PREFILL_STEP: Final = 512  # tokens per prefill chunk (the pipeline's and the engine's)
QUANT_GROUPS: Final = (64, 32)  # elements along head_dim that share one scale, by preference
Quant = Literal["none", "int8", "int4"]
QUANTS: Final[tuple[Quant, ...]] = ("none", "int8", "int4")
DTYPES: Final = {"float32": (mx.float32, "<f4", 4), "float16": (mx.float16, "<f2", 2),
                 "bfloat16": (mx.bfloat16, "<u2", 2)}  # bfloat16 travels as its bits
_LEVELS: Final = {"int8": 127, "int4": 7}
# Why a cache kind cannot travel, by mlx-lm's class name (others: "cannot be handed off").
_WHY: Final = {
    "RotatingKVCache": "its sliding-window layers keep a RotatingKVCache (a ring of the "
                       "last tokens, not one row per token)",
    "ArraysCache": "its recurrent layers keep state in an ArraysCache, not keys and values",
    "MambaCache": "its recurrent layers keep state in a MambaCache, not keys and values",
    "QuantizedKVCache": "it keeps a QuantizedKVCache",
    "ChunkedKVCache": "its chunked-attention layers keep a ChunkedKVCache",
    "CacheList": "its layers keep composite caches (CacheList)",
}


class HandoffUnsupported(EngineError):
    """This model's cache cannot be handed off; serve it whole (hybrid nodes)."""


class HandoffError(EngineError):
    """A handed-off cache that does not fit this model or is malformed; names the field."""


@dataclass(frozen=True)
class Mode:
    """How a cache travels: ``quant`` (``none`` is lossless) and whether lz4 compresses."""

    quant: Quant = "none"
    lz4: bool = False

    def __str__(self) -> str:
        return self.quant + ("+lz4" if self.lz4 else "")


@dataclass(frozen=True)
class CacheLayout:
    """What a model's cache looks like: what a receiver checks a handed-off one against."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: str  # a key of DTYPES

    @classmethod
    def of(cls, model: Any) -> CacheLayout:
        """``model``'s layout from its config (mlx-lm's ``args``) and weights."""
        args = model.args
        heads = int(args.num_attention_heads)
        kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
        dim = int(getattr(args, "head_dim", None) or args.hidden_size // heads)
        leaves: Any = tree_flatten(model.parameters())
        dtype = next(v.dtype for _, v in leaves if mx.issubdtype(v.dtype, mx.floating))
        names = {d: n for n, (d, _, _) in DTYPES.items()}
        if dtype not in names:
            raise HandoffUnsupported(f"this model's dtype {dtype} cannot be handed off")
        return cls(len(model.layers), kv_heads, dim, dim, names[dtype])


# -- which models ---------------------------------------------------------------------------

def check_handoff(model: Any, family: str) -> None:
    """Raise ``HandoffUnsupported`` naming ``family`` and why unless every layer's cache is
    a plain ``KVCache``."""
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is not KVCache:
            kind = type(cache).__name__
            why = _WHY.get(kind, f"its layer {i} keeps a {kind}")
            raise HandoffUnsupported(f"{family}: {why}, which cannot be handed off; serve "
                                     f"it on hybrid nodes")


# -- prefill --------------------------------------------------------------------------------

def check_prefill(prompt: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` naming what keeps ``prompt`` and ``params`` from a prefill: an empty
    prompt, ``max_tokens`` below 1, a token id outside the vocabulary."""
    if not prompt:
        raise ValueError("the prompt is empty: there is nothing to prefill")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens is {params.max_tokens}; it must be at least 1")
    for what, ids in (("the prompt holds", prompt),
                      ("logit_bias names", [t for t, _ in params.logit_bias])):
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{what} token {outside[0]}, outside this model's vocabulary "
                             f"of {vocab_size} tokens")


def prefill(model: Any, prompt: Sequence[int], params: SamplingParams, *, vocab_size: int,
            eos_token_ids: set[int], matching: Matching | None = None,
            prefill_step: int = DEFAULT_PREFILL_STEP, cache: list[Any] | None = None
            ) -> tuple[TokenOutput, list[Any]]:
    """``prompt``'s cache and its first token (see the module docstring). ``matching``: the
    request's fresh constraint matcher, if it has one; ``cache``: the KV of a prefix of
    ``prompt`` shorter than it (its ``offset`` tokens: a prompt cache's), prefilled on
    from there and returned; None: a fresh one. Call ``check_handoff`` first."""
    check_prefill(prompt, params, vocab_size)
    if cache is None:
        cache = [_layer() for _ in model.layers]
    elif not 0 <= cache[0].offset < len(prompt):
        raise ValueError(f"the cached prefix holds {cache[0].offset} tokens; the prompt has "
                         f"{len(prompt)}")
    head = mx.array([list(prompt[cache[0].offset:-1])], dtype=mx.int32)
    while head.shape[1] > 0:
        model(head[:, :prefill_step], cache=cache)
        mx.eval([c.state for c in cache])
        head = head[:, prefill_step:]
    logits = model(mx.array([[prompt[-1]]], dtype=mx.int32), cache=cache)[:, -1, :]
    processors = make_logits_processors(params, eos_token_ids) + \
        ([] if matching is None else [matching])
    context = mx.array(list(prompt), dtype=mx.int32)
    for processor in processors:
        logits = processor(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampled = make_sampler(params, vocab_size)(logprobs)
    mx.eval(sampled, logprobs, [c.state for c in cache])
    token = int(sampled.item())  # type: ignore[arg-type]  # an int: a token id
    reason: Literal["stop", "length"] | None = None
    if token in eos_token_ids:
        reason = "stop"
    elif params.max_tokens == 1:
        reason = "length"
    if params.logprobs is None:
        return TokenOutput(token, reason), cache
    logprob, top = read_logprobs(logprobs[0], token, params.logprobs)
    return TokenOutput(token, reason, logprob, top), cache


def check_resumable(request: GenerationRequest, first: TokenOutput, cache: Sequence[Any],
                    layers: int, vocab_size: int) -> None:
    """Refuse (``ValueError``, naming what is wrong) a handed-off sequence a model of
    ``layers`` and ``vocab_size`` cannot continue: ``cache`` must be the prompt's, per
    layer, and ``first`` a token of the vocabulary, with room for more unless it ended."""
    if len(cache) != layers:
        raise ValueError(f"the handed-off cache has {len(cache)} layers; this model "
                         f"has {layers}")
    length = cache[0].offset
    if length != len(request.prompt_tokens):
        raise ValueError(f"the handed-off cache holds {length} tokens; the prompt has "
                         f"{len(request.prompt_tokens)}")
    if not 0 <= first.token < vocab_size:
        raise ValueError(f"the first token {first.token} is outside this model's "
                         f"vocabulary of {vocab_size} tokens")
    if first.finish_reason is None and request.params.max_tokens < 2:
        raise ValueError(f"max_tokens is {request.params.max_tokens} and the first "
                         f"token did not finish the sequence")


def snapshot(cache: Sequence[Any]) -> list[Any]:
    """A copy of ``cache`` (every layer a ``KVCache``, as ``check_handoff`` checks) that
    costs no memory: new ``KVCache`` objects over views of the same arrays, trimmed to
    their tokens. Extending either in place (``update_and_fetch``) leaves the other as it
    was: mlx copies an array's buffer on write while another array views it."""
    copies = []
    for layer in cache:
        view = _layer()
        if layer.keys is not None:
            tokens = layer.offset
            view.state = (layer.keys[..., :tokens, :], layer.values[..., :tokens, :], tokens)
        copies.append(view)
    return copies


def resume_sampling(params: SamplingParams, prompt: Sequence[int], vocab_size: int,
                    matching: Matching | None, eos_token_ids: Iterable[int]
                    ) -> tuple[Sampler, list[LogitsProcessor]]:
    """The sampler and processors of a sequence whose first token another host sampled,
    each called once as that host called them (on the prompt), so that the next call sees
    the prompt and first token as on one host: the penalties count the first token, a
    constraint's fresh ``matching`` consumes it, a seeded sampler's key is split past it,
    ``min_tokens`` counts it (``eos_token_ids``: the model's)."""
    sampler = make_sampler(params, vocab_size)
    processors = make_logits_processors(params, eos_token_ids) + \
        ([] if matching is None else [matching])
    context = mx.array(list(prompt), dtype=mx.int32)
    blank = mx.zeros((1, vocab_size), dtype=mx.float32)
    for processor in processors:
        processor(context, blank)  # for its state only; the logits are never evaluated
    if params.temperature != 0:
        sampler(blank)  # splits a seeded sampler's key; the draw is never evaluated
    return sampler, processors


# -- serialize ------------------------------------------------------------------------------

def encode_cache(cache: Sequence[Any], mode: Mode) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``cache`` (one sequence's, every layer a ``KVCache``) as a header and blobs."""
    if not cache or cache[0].keys is None:
        raise ValueError("the cache is empty: prefill a prompt first")
    tokens = cache[0].offset
    first_keys = cache[0].keys
    _, heads, _, key_dim = first_keys.shape
    value_dim = cache[0].values.shape[3]
    dtype = {d: n for n, (d, _, _) in DTYPES.items()}[first_keys.dtype]
    group_k, group_v = _group(key_dim), _group(value_dim)
    blobs: dict[str, bytes] = {}
    raw: dict[str, int] = {}
    for i, layer in enumerate(cache):
        if layer.offset != tokens:
            raise ValueError(f"layer {i} holds {layer.offset} tokens, layer 0 {tokens}")
        for kind, array, group in (("k", layer.keys, group_k), ("v", layer.values, group_v)):
            part = array[0, :, :tokens, :]
            for name, data in _pack(f"{kind}{i}", part, mode.quant, group, dtype):
                raw[name] = len(data)
                blobs[name] = lz4.frame.compress(data) if mode.lz4 else data
    header = {"v": FORMAT, "quant": mode.quant, "lz4": mode.lz4, "dtype": dtype,
              "layers": len(cache), "kv_heads": int(heads), "key_dim": int(key_dim),
              "value_dim": int(value_dim), "tokens": int(tokens),
              "group": {"k": group_k, "v": group_v} if mode.quant != "none" else None,
              "raw": raw, "sent": {name: len(b) for name, b in blobs.items()}}
    return header, blobs


def _layer() -> Any:
    """An empty mlx-lm ``KVCache`` (untyped)."""
    return KVCache()  # type: ignore[no-untyped-call]


def _group(dim: int) -> int:
    return next((g for g in QUANT_GROUPS if dim % g == 0), dim)


def _pack(name: str, part: mx.array, quant: Quant, group: int, dtype: str
          ) -> list[tuple[str, bytes]]:
    if quant == "none":
        return [(name, _to_bytes(part, DTYPES[dtype][1]))]
    heads, tokens, dim = part.shape
    x = part.astype(mx.float32).reshape(heads, tokens, dim // group, group)
    levels = _LEVELS[quant]
    scale = mx.max(mx.abs(x), axis=-1) / levels
    safe = mx.where(scale > 0, scale, mx.array(1.0, dtype=mx.float32))
    q = mx.clip(mx.round(x / safe[..., None]), -levels, levels).reshape(heads, tokens, dim)
    if quant == "int8":
        data = _to_bytes(q.astype(mx.int8), "<i1")
    else:
        nibbles = (q + 8).astype(mx.uint8)
        data = _to_bytes(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), "<u1")
    return [(name, data), (name + ".s", _to_bytes(scale, "<f4"))]


def _to_bytes(array: mx.array, wire: str) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array).astype(wire, copy=False).tobytes()


def decode_cache(header: Mapping[str, Any], blobs: Mapping[str, bytes], *,
                 expect: CacheLayout, max_tokens: int) -> list[Any]:
    """The cache ``encode_cache`` wrote, checked against ``expect`` (the receiving model's
    ``CacheLayout``) and ``max_tokens`` (its context) before anything is allocated;
    ``HandoffError`` names the first field at fault."""
    h = _checked_header(header, expect, max_tokens)
    names = _blob_names(h)
    extra = sorted(set(blobs) - set(names))
    if extra:
        raise HandoffError(f"blob {extra[0]!r} is not part of a {h.quant} cache")
    for name, size in names.items():
        _check_blob(name, size, header, blobs, lz4_on=h.lz4)
    cache = []
    for i in range(expect.layers):
        layer = _layer()
        keys = _unpack(f"k{i}", blobs, h, expect.key_dim, h.group_k)
        values = _unpack(f"v{i}", blobs, h, expect.value_dim, h.group_v)
        layer.state = (keys, values, h.tokens)
        cache.append(layer)
    mx.eval([c.state for c in cache])
    return cache


@dataclass(frozen=True)
class _Header:
    quant: Quant
    lz4: bool
    dtype: str
    tokens: int
    group_k: int
    group_v: int
    expect: CacheLayout


def _checked_header(header: Mapping[str, Any], expect: CacheLayout, max_tokens: int
                    ) -> _Header:
    if not isinstance(header, Mapping):
        raise HandoffError("the handoff header is not an object")
    if _field(header, "v", int) != FORMAT:
        raise HandoffError(f"header field 'v' is {header['v']!r}; this node reads format "
                           f"{FORMAT}: upgrade the older node")
    quant = _field(header, "quant", str)
    if quant not in QUANTS:
        raise HandoffError(f"header field 'quant' is {quant!r}; expected one of "
                           f"{', '.join(QUANTS)}")
    lz4_on = _field(header, "lz4", bool)
    for name, want in (("dtype", expect.dtype), ("layers", expect.layers),
                       ("kv_heads", expect.kv_heads), ("key_dim", expect.key_dim),
                       ("value_dim", expect.value_dim)):
        got = _field(header, name, type(want))
        if got != want:
            raise HandoffError(f"header field {name!r} is {got!r}; this model's cache has "
                               f"{want!r}: the prefill node serves another model")
    tokens = _field(header, "tokens", int)
    if not 1 <= tokens <= max_tokens:
        raise HandoffError(f"header field 'tokens' is {tokens}; allowed 1..{max_tokens}")
    group_k = group_v = 0
    if quant != "none":
        groups = _field(header, "group", dict)
        group_k, group_v = (_group_field(groups, kind, dim) for kind, dim in
                            (("k", expect.key_dim), ("v", expect.value_dim)))
    for name in ("raw", "sent"):
        _field(header, name, dict)
    return _Header(cast(Quant, quant), lz4_on, expect.dtype, tokens, group_k, group_v, expect)


def _field(header: Mapping[str, Any], name: str, kind: type) -> Any:
    if name not in header:
        raise HandoffError(f"header field {name!r} is missing")
    value = header[name]
    if type(value) is not kind:  # bool is not an int here
        raise HandoffError(f"header field {name!r} is {value!r}; expected a {kind.__name__}")
    return value


def _group_field(groups: Mapping[str, Any], kind: str, dim: int) -> int:
    group = groups.get(kind)
    if type(group) is not int or group < 2 or group % 2 or dim % group:
        raise HandoffError(f"header field 'group.{kind}' is {group!r}; it must be an even "
                           f"divisor of {dim}")
    return group


def _blob_names(h: _Header) -> dict[str, int]:
    """Every blob the header implies, and its size in bytes before compression."""
    e = h.expect
    sizes: dict[str, int] = {}
    for i in range(e.layers):
        for kind, dim, group in (("k", e.key_dim, h.group_k), ("v", e.value_dim, h.group_v)):
            elements = e.kv_heads * h.tokens * dim
            if h.quant == "none":
                sizes[f"{kind}{i}"] = elements * DTYPES[h.dtype][2]
            else:
                sizes[f"{kind}{i}"] = elements if h.quant == "int8" else elements // 2
                sizes[f"{kind}{i}.s"] = 4 * elements // group
    return sizes


def _check_blob(name: str, size: int, header: Mapping[str, Any], blobs: Mapping[str, bytes],
                *, lz4_on: bool) -> None:
    if name not in blobs:
        raise HandoffError(f"blob {name!r} is missing")
    for field in ("raw", "sent"):
        stated = header[field].get(name)
        if type(stated) is not int:
            raise HandoffError(f"header field '{field}.{name}' is {stated!r}; expected the "
                               f"blob's byte count")
    if header["raw"][name] != size:
        raise HandoffError(f"header field 'raw.{name}' is {header['raw'][name]}; the shapes "
                           f"make it {size} bytes")
    if header["sent"][name] != len(blobs[name]):
        raise HandoffError(f"blob {name!r} is {len(blobs[name])} bytes; header field "
                           f"'sent.{name}' says {header['sent'][name]} (truncated?)")
    if not lz4_on and len(blobs[name]) != size:
        raise HandoffError(f"blob {name!r} is {len(blobs[name])} bytes; the shapes make it "
                           f"{size}")


def _unpack(name: str, blobs: Mapping[str, bytes], h: _Header, dim: int, group: int
            ) -> mx.array:
    heads = h.expect.kv_heads
    mx_dtype, wire, _ = DTYPES[h.dtype]
    if h.quant == "none":
        return _from_bytes(_plain(name, blobs, h), wire, mx_dtype, (1, heads, h.tokens, dim))
    scale = _from_bytes(_plain(name + ".s", blobs, h), "<f4", mx.float32,
                        (heads, h.tokens, dim // group, 1))
    data = _plain(name, blobs, h)
    if h.quant == "int8":
        q = _from_bytes(data, "<i1", mx.int8, (heads, h.tokens, dim)).astype(mx.float32)
    else:
        packed = _from_bytes(data, "<u1", mx.uint8, (heads, h.tokens, dim // 2))
        low = (packed & 0xF).astype(mx.float32) - 8
        high = (packed >> 4).astype(mx.float32) - 8
        q = mx.stack([low, high], axis=-1).reshape(heads, h.tokens, dim)
    x = q.reshape(heads, h.tokens, dim // group, group) * scale
    return x.reshape(1, heads, h.tokens, dim).astype(mx_dtype)


def _plain(name: str, blobs: Mapping[str, bytes], h: _Header) -> bytes:
    """The blob's bytes, decompressed (at most its stated raw size: a bomb is refused)."""
    data = blobs[name]
    if not h.lz4:
        return data
    limit = _blob_names(h)[name]
    frame = lz4.frame.LZ4FrameDecompressor()
    try:
        out = frame.decompress(data, max_length=limit + 1)
    except RuntimeError as exc:
        raise HandoffError(f"blob {name!r} is not a valid lz4 frame: {exc}") from None
    if len(out) != limit:
        raise HandoffError(f"blob {name!r} decompresses to {len(out)} bytes or more; the "
                           f"shapes make it {limit}")
    if not frame.eof or frame.unused_data:
        raise HandoffError(f"blob {name!r} is not one whole lz4 frame (cut short, or bytes "
                           f"after its end)")
    return bytes(out)


def _from_bytes(data: bytes, wire: str, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    array = mx.array(np.frombuffer(data, dtype=wire).reshape(shape))
    return array.view(mx.bfloat16) if dtype == mx.bfloat16 else array


def handoff_specs(expect: CacheLayout, max_tokens: int, mode: Mode) -> MessageSpec:
    """The MXCL allow-list of a message carrying a cache in ``mode``: each blob a ``u8``
    vector of at most its size at ``max_tokens`` tokens (plus lz4's worst-case growth)."""
    h = _Header(mode.quant, mode.lz4, expect.dtype, max_tokens, _group(expect.key_dim),
                _group(expect.value_dim), expect)
    tensors = {}
    for name, size in _blob_names(h).items():
        bound = size + size // 255 + 64 if mode.lz4 else size
        tensors[name] = TensorSpec(frozenset({"u8"}), ((0, bound),))
    return MessageSpec(tensors)


__all__ = ["CacheLayout", "HandoffError", "HandoffUnsupported", "Mode", "check_handoff",
           "check_prefill", "decode_cache", "encode_cache", "handoff_specs", "prefill",
           "resume_sampling", "snapshot"]
