"""The stage protocol's own messages (pipeline/messages.py): each header is the one
``protocol.py``'s table documents, key for key and byte for byte once encoded (written
out here by hand, as the senders' literals were), and ``from_wire`` names the field it
refuses, in the words the stage has always answered with."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.engine.base import SamplingParams
from mlxceld.pipeline.messages import (
    Act,
    Adopt,
    Adopted,
    Attached,
    Cache,
    Forget,
    Next,
    Prepare,
    Prepared,
    Release,
    Run,
)
from mlxceld.roles.options import KVQuant
from mlxceld.wire import encode_envelope
from mlxceld.wire.messages import MessageError

PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
          "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
          "repetition_penalty": 1.0, "logit_bias": [], "logprobs": None}

SAME_BYTES: list[tuple[Any, dict[str, Any]]] = [
    (Prepare("s1", SamplingParams(3, temperature=0.0), (2, 7)),
     {"t": "prepare", "seq": "s1", "params": PARAMS, "eos": [2, 7]}),
    (Prepare("s1", SamplingParams(3, temperature=0.0), (2,), (5, 6), KVQuant(4, 32, 7), "e2",
             ("e1", 9)),
     {"t": "prepare", "seq": "s1", "params": PARAMS, "eos": [2], "history": [5, 6],
      "kv": {"bits": 4, "group_size": 32, "start": 7}, "keep_prompt": "e2",
      "reuse": {"entry": "e1", "tokens": 9}}),
    (Prepared("s1", 0), {"t": "prepared", "seq": "s1", "reused": 0}),
    (Prepared("s1", 9), {"t": "prepared", "seq": "s1", "reused": 9}),
    (Run("s1", 0, False), {"t": "run", "seq": "s1", "step": 0, "sample": False}),
    (Act("s1", 3, True), {"t": "act", "seq": "s1", "step": 3, "sample": True}),
    (Next("s1", 4), {"t": "next", "seq": "s1", "step": 4}),
    (Next("s1", 4, 17), {"t": "next", "seq": "s1", "step": 4, "pos": 17}),
    (Act("s1", 5, True, 17), {"t": "act", "seq": "s1", "step": 5, "sample": True,
                              "pos": 17}),
    (Release("s1"), {"t": "release", "seq": "s1"}),
    (Release("s1", ("e3", 12)), {"t": "release", "seq": "s1",
                                 "keep": {"entry": "e3", "tokens": 12}}),
    (Forget(("e1", "e2")), {"t": "forget", "entries": ["e1", "e2"]}),
    (Cache(0, 0), {"t": "cache", "bytes": 0, "entries": 0, "evicted": []}),
    (Cache(4096, 2, ("e1",), "e3", True, True),
     {"t": "cache", "bytes": 4096, "entries": 2, "evicted": ["e1"], "entry": "e3",
      "kept": True, "trimmable": True}),
    (Cache(0, 0, (), "e3", False, False, "over the bound"),
     {"t": "cache", "bytes": 0, "entries": 0, "evicted": [], "entry": "e3", "kept": False,
      "trimmable": False, "why": "over the bound"}),
    (Adopt("s1"), {"t": "adopt", "seq": "s1"}),
    (Adopted("s1"), {"t": "adopted", "seq": "s1"}),
    (Attached("stage-0", 0, (0, 2), "ab" * 32, "lab", 1 << 30),
     {"t": "attached", "stage": "stage-0", "rank": 0, "layers": [0, 2], "model": "ab" * 32,
      "cluster": "lab", "cache_bytes": 1 << 30}),
]


@pytest.mark.parametrize(("message", "literal"), SAME_BYTES)
def test_a_message_goes_out_as_the_literal_it_replaced(message: Any,
                                                      literal: dict[str, Any]) -> None:
    assert list(message.to_wire().items()) == list(literal.items())
    assert encode_envelope(message.to_wire()) == encode_envelope(literal)
    assert type(message).from_wire(literal) == message


PREPARE = {"t": "prepare", "seq": "s1", "params": PARAMS, "eos": [2]}


@pytest.mark.parametrize(("kind", "header", "field", "words"), [
    (Prepare, {**PREPARE, "seq": "a b"}, "seq", "'seq' must be 1-64 characters"),
    (Prepare, {**PREPARE, "params": {}}, "params", "'params' must hold exactly"),
    (Prepare, {**PREPARE, "history": [-1]}, "history", "'history' must be a list"),
    (Prepare, {**PREPARE, "keep_prompt": ""}, "keep_prompt", "'keep_prompt' must be 1-64"),
    (Prepare, {**PREPARE, "kv": {"bits": 6, "group_size": 64, "start": 0}}, "kv",
     "'kv.bits' must"),
    (Prepare, {**PREPARE, "eos": [2**31]}, "eos", "'eos' must be a list"),
    (Prepare, {**PREPARE, "reuse": {"entry": "e1", "tokens": 0}}, "reuse",
     "'reuse' must be {entry, tokens} with tokens >= 1"),
    (Prepare, {**PREPARE, "reuse": {"entry": "e 1", "tokens": 1}}, "entry",
     "'entry' must be 1-64"),
    (Prepared, {"t": "prepared", "seq": "s1", "reused": -1}, "reused", "'reused'"),
    (Prepared, {"t": "prepared", "reused": 0}, "seq", "'seq'"),
    (Run, {"t": "run", "seq": "s1"}, "step", "'step' must be an integer in [0, 2**31)"),
    (Run, {"t": "run", "seq": "s1", "step": 0, "sample": 1}, "sample",
     "'sample' must be true or false"),
    (Act, {"t": "act", "seq": "s1", "step": -1}, "step", "'step'"),
    (Next, {"t": "next", "step": 1}, "seq", "'seq'"),
    (Next, {"t": "next", "seq": "s1", "step": 1, "pos": -1}, "pos", "'pos'"),
    (Act, {"t": "act", "seq": "s1", "step": 1, "pos": "3"}, "pos", "'pos'"),
    (Release, {"t": "release", "seq": "s1", "keep": {"entry": "e1"}}, "keep", "'keep'"),
    (Forget, {"t": "forget", "entries": ["e1"] * 257}, "entries", "at most 256 entry ids"),
    (Forget, {"t": "forget"}, "entries", "'entries'"),
    (Cache, {"t": "cache", "entries": 0, "evicted": []}, "bytes", "'bytes'"),
    (Cache, {"t": "cache", "bytes": 0, "entries": -1, "evicted": []}, "entries", "'entries'"),
    (Cache, {"t": "cache", "bytes": 0, "entries": 0}, "evicted", "'evicted'"),
    (Cache, {"t": "cache", "bytes": 0, "entries": 0, "evicted": [], "kept": 1}, "kept",
     "'kept'"),
    (Adopt, {"t": "adopt", "seq": 3}, "seq", "'seq'"),
    (Attached, {"t": "attached", "stage": "s", "rank": 0, "layers": [0], "model": "m",
                "cluster": "c", "cache_bytes": 0}, "layers", "'layers'"),
    (Attached, {"t": "attached", "stage": "s", "rank": 0, "layers": [0, 2], "model": "m",
                "cluster": "c"}, "cache_bytes", "'cache_bytes'"),
    (Attached, {"t": "attached", "stage": "s", "layers": [0, 2], "model": "m",
                "cluster": "c", "cache_bytes": 0}, "rank", "'rank'"),
])
def test_from_wire_names_the_field_it_refuses(kind: Any, header: dict[str, Any], field: str,
                                               words: str) -> None:
    with pytest.raises(MessageError) as err:
        kind.from_wire(header)
    assert err.value.field == field
    assert words in err.value.reason


def test_a_prepare_checks_logit_bias_against_the_last_stage_s_vocabulary() -> None:
    header = {**PREPARE, "params": {**PARAMS, "logit_bias": [[9, 1.0]]}}
    assert Prepare.from_wire(header).params.logit_bias == ((9, 1.0),)
    with pytest.raises(MessageError) as err:
        Prepare.from_wire(header, vocab_size=8)
    assert err.value.field == "params"
