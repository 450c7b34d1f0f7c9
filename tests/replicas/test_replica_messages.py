"""The replica protocol's own messages (replicas/messages.py): each header is the one
``protocol.py``'s tables document, key for key and byte for byte once encoded (written out
here by hand, as the senders' literals were), and ``from_wire`` names the field it
refuses."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.engine.base import SamplingParams, TokenOutput
from mlxceld.engine.handoff import Mode
from mlxceld.replicas.messages import (
    Attached,
    Cancel,
    Expect,
    Generate,
    Handoff,
    Load,
    Prefill,
    Prefilled,
    first_field,
    parse_mode,
)
from mlxceld.wire import encode_envelope
from mlxceld.wire.messages import MessageError

PARAMS = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
          "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
          "repetition_penalty": 1.0, "logit_bias": [], "logprobs": None}
SAMPLING = SamplingParams(8, temperature=0.0)
CACHE = {"layers": 2, "tokens": 5}  # an encode_cache header, opaque here

SAME_BYTES: list[tuple[Any, dict[str, Any]]] = [
    (Generate("s1", SAMPLING), {"t": "generate", "seq": "s1", "params": PARAMS}),
    (Expect("s1", SAMPLING, "127.0.0.2:9000"),
     {"t": "expect", "prefill": "127.0.0.2:9000", "seq": "s1", "params": PARAMS}),
    (Prefill("s1", SAMPLING, "127.0.0.3:9000", Mode("int8", True)),
     {"t": "prefill", "decode_target": "127.0.0.3:9000", "compression": "int8+lz4",
      "seq": "s1", "params": PARAMS}),
    (Prefilled("s1", 4096, 1.5, 0.25),
     {"t": "prefilled", "seq": "s1", "bytes": 4096, "encode_ms": 1.5, "send_ms": 0.25}),
    (Handoff("s1", 0, 2, TokenOutput(7, None, -0.5, ((7, -0.5), (3, -1.0))), CACHE),
     {"t": "handoff", "seq": "s1", "part": 0, "parts": 2,
      "first": {"token": 7, "logprob": -0.5, "top": [[7, -0.5], [3, -1.0]],
                "finish_reason": None}, "cache": CACHE}),
    (Handoff("s1", 0, 1, TokenOutput(7, "length", None, (), cached=4), CACHE),
     {"t": "handoff", "seq": "s1", "part": 0, "parts": 1,
      "first": {"token": 7, "logprob": None, "top": [], "finish_reason": "length",
                "cached": 4}, "cache": CACHE}),
    (Handoff("s1", 1, 2), {"t": "handoff", "seq": "s1", "part": 1, "parts": 2}),
    (Cancel("s1"), {"t": "cancel", "seq": "s1"}),
    (Load(3, 8), {"t": "load", "sequences": 3, "max_batch": 8}),
    (Attached("node-a", "hybrid", "ab" * 32, 4096, 8),
     {"t": "attached", "node": "node-a", "role": "hybrid", "model": "ab" * 32,
      "context_length": 4096, "max_batch": 8}),
]


@pytest.mark.parametrize(("message", "literal"), SAME_BYTES)
def test_a_message_goes_out_as_the_literal_it_replaced(message: Any,
                                                      literal: dict[str, Any]) -> None:
    assert list(message.to_wire().items()) == list(literal.items())
    assert encode_envelope(message.to_wire()) == encode_envelope(literal)
    assert type(message).from_wire(literal) == message


GENERATE = {"t": "generate", "seq": "s1", "params": PARAMS}
PREFILL = {"t": "prefill", "decode_target": "127.0.0.3:9000", "compression": "none",
           "seq": "s1", "params": PARAMS}


@pytest.mark.parametrize(("kind", "header", "field", "words"), [
    (Generate, {**GENERATE, "seq": ""}, "seq", "'seq' must be 1-64 characters"),
    (Generate, {**GENERATE, "params": {**PARAMS, "top_k": -1}}, "params", "params.top_k"),
    (Expect, {**GENERATE, "t": "expect"}, "prefill", "'prefill' must be"),
    (Expect, {**GENERATE, "t": "expect", "prefill": ""}, "prefill", "'prefill' must be"),
    (Prefill, {**PREFILL, "decode_target": "nowhere"}, "decode_target",
     "'decode_target' must be the decode node's serving host:port"),
    (Prefill, {**PREFILL, "decode_target": 5}, "decode_target", "'decode_target'"),
    (Prefill, {**PREFILL, "compression": "zip"}, "compression", "is not one of none"),
    (Prefill, {**PREFILL, "compression": None}, "compression", "must be a string"),
    (Prefilled, {"t": "prefilled", "seq": "s1", "bytes": -1, "encode_ms": 1, "send_ms": 1},
     "bytes", "'bytes'"),
    (Prefilled, {"t": "prefilled", "seq": "s1", "bytes": 1, "send_ms": 1}, "encode_ms",
     "'encode_ms'"),
    (Prefilled, {"t": "prefilled", "seq": "s1", "bytes": 1, "encode_ms": 1,
                 "send_ms": True}, "send_ms", "'send_ms'"),
    (Handoff, {"t": "handoff", "seq": "s1", "part": 2, "parts": 2}, "part", "'part'"),
    (Handoff, {"t": "handoff", "seq": "s1", "part": 0, "parts": 1, "cache": {}}, "cache",
     "no 'cache' header or 'first'"),
    (Handoff, {"t": "handoff", "seq": "s1", "part": 0, "parts": 1, "cache": {},
               "first": {"token": -1}}, "first.token", "'first.token'"),
    (Handoff, {"t": "handoff", "part": 1, "parts": 2}, "seq", "'seq'"),
    (Cancel, {"t": "cancel"}, "seq", "'seq'"),
    (Load, {"t": "load", "sequences": -1, "max_batch": 1}, "sequences", "'sequences'"),
    (Load, {"t": "load", "sequences": 1}, "max_batch", "'max_batch'"),
    (Attached, {"t": "attached", "node": "n", "role": "hybrid", "model": "m",
                "max_batch": 8}, "context_length", "context_length and max_batch"),
    (Attached, {"t": "attached", "node": "n", "role": "hybrid", "model": "m",
                "context_length": 9, "max_batch": 0}, "max_batch", "max_batch"),
    (Attached, {"t": "attached", "node": "n", "model": "m", "context_length": 9,
                "max_batch": 8}, "role", "'role'"),
])
def test_from_wire_names_the_field_it_refuses(kind: Any, header: dict[str, Any], field: str,
                                               words: str) -> None:
    with pytest.raises(MessageError) as err:
        kind.from_wire(header)
    assert err.value.field == field
    assert words in err.value.reason


@pytest.mark.parametrize(("first", "field"), [
    ("x", "first"), ({"token": 1, "logprob": "a"}, "first.logprob"),
    ({"token": 1, "finish_reason": "eos"}, "first.finish_reason"),
    ({"token": 1, "cached": (1 << 20) + 1}, "first.cached"),
    ({"token": 1, "top": [[1, -1.0]] * 21}, "first.top"),
])
def test_a_handoffs_first_token_names_the_field_it_refuses(first: object, field: str) -> None:
    with pytest.raises(MessageError) as err:
        first_field(first)
    assert err.value.field == field


def test_compression_is_a_quantization_and_maybe_lz4() -> None:
    assert parse_mode("none") == Mode() and parse_mode("int4+lz4") == Mode("int4", True)
    assert str(parse_mode("int8")) == "int8"
