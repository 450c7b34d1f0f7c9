"""KV handoff cost (``mlxceld/engine/handoff.py``): what a prefilled cache weighs on the wire
and what encoding and decoding it cost, per mode, against sending it plain and against
prefilling the prompt again on the decoding host.

One run, one process: the ``small`` fixture (qwen3, 8 layers, 4 KV heads of 64, bfloat16),
a prompt of ``--tokens`` random token ids prefilled once (and timed once). For each mode
(none, int8, int4, each with and without lz4): the bytes sent (blobs plus the JSON
header), the encode and decode times (best of ``--repeat``), the largest error of any key
or value against the prefilled cache, and how many of the next ``--new`` greedy tokens
decoded from that cache equal those decoded from the prefilled one (counted up to the
first that differs). Ratios are to ``none`` (bytes) and to the prefill (time). The
fixture's weights are random: its keys and values look like noise to lz4, which real
models' may not.

    .venv/bin/python bench/handoff.py [--tokens 2000] [--new 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import mlx.core as mx
import mlx_lm

from mlxceld.engine import SamplingParams
from mlxceld.engine.handoff import (
    CacheLayout,
    Mode,
    check_handoff,
    decode_cache,
    encode_cache,
    prefill,
)
from mlxceld.models import fixture_cache, preset

MODES = [Mode(q, z) for q in ("none", "int8", "int4") for z in (False, True)]


def greedy(model: Any, cache: list[Any], first: int, n: int) -> list[int]:
    """``n`` greedy tokens after ``first``, decoding on ``cache`` (which it extends)."""
    out, token = [], first
    for _ in range(n):
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[:, -1, :]
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
    return out


def agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=True):
        if x != y:
            break
        n += 1
    return n


def max_error(a: list[Any], b: list[Any], tokens: int) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            diff = mx.abs(u[..., :tokens, :].astype(mx.float32) - v[..., :tokens, :]
                          .astype(mx.float32))
            worst = max(worst, float(mx.max(diff).item()))
    return worst


def best(repeat: int, fn: Any) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    path = fixture_cache(preset("small"))
    model, tokenizer = mlx_lm.load(str(path))[:2]
    check_handoff(model, "qwen3")
    layout = CacheLayout.of(model)
    vocab = int(model.args.vocab_size)
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
    params = SamplingParams(max_tokens=args.new + 1, temperature=0)
    eos = set(tokenizer.eos_token_ids)
    prefill_s, (first, cache) = best(1, lambda: prefill(
        model, prompt, params, vocab_size=vocab, eos_token_ids=eos))
    reference_cache = decode_cache(*encode_cache(cache, Mode()), expect=layout,
                                   max_tokens=args.tokens)
    reference = greedy(model, reference_cache, first.token, args.new)
    print(f"small fixture ({layout.layers} layers, {layout.kv_heads} KV heads of "
          f"{layout.key_dim}, {layout.dtype}), a {args.tokens}-token prompt: prefill "
          f"{prefill_s * 1e3:.0f} ms")
    print(f"{'mode':<10} {'bytes':>12} {'x none':>7} {'encode ms':>10} {'decode ms':>10} "
          f"{'(enc+dec)/prefill':>18} {'max |err|':>10} {'greedy':>8}")
    plain = 0
    for mode in MODES:
        enc_s, (header, blobs) = best(args.repeat, lambda m=mode: encode_cache(cache, m))
        size = sum(map(len, blobs.values())) + len(json.dumps(header))
        plain = plain or size
        dec_s, got = best(args.repeat, lambda h=header, b=blobs: decode_cache(
            h, b, expect=layout, max_tokens=args.tokens))
        err = max_error(cache, got, args.tokens)
        same = agreeing(reference, greedy(model, got, first.token, args.new))
        print(f"{mode!s:<10} {size:>12,} {size / plain:>7.3f} {enc_s * 1e3:>10.1f} "
              f"{dec_s * 1e3:>10.1f} {(enc_s + dec_s) / prefill_s:>18.3f} {err:>10.4f} "
              f"{same:>4}/{args.new}")


if __name__ == "__main__":
    main()
