"""The sampling parameters and logprobs on the stage protocol: carried whole, each checked."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.engine import SamplingParams
from mlxceld.pipeline import protocol as p
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import LOGPROB_FLOOR, Token

PARAMS = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1,
                        min_p=0.05, presence_penalty=-1.5, frequency_penalty=2.0,
                        repetition_penalty=1.3, logit_bias=((3, -100.0), (7, 5.5)),
                        logprobs=20)


def test_params_round_trip() -> None:
    assert p.params_from_wire(p.params_to_wire(PARAMS), vocab_size=8) == PARAMS
    assert p.params_from_wire(p.params_to_wire(SamplingParams(1))) == SamplingParams(1)
    held = SamplingParams(max_tokens=9, min_tokens=9, ignore_eos=True)
    wire = p.params_to_wire(held)
    assert (wire["min_tokens"], wire["ignore_eos"]) == (9, True)
    assert p.params_from_wire(wire) == held
    # unset, they are not sent: a stage of an older version takes the params as before
    assert "min_tokens" not in p.params_to_wire(PARAMS)
    assert "ignore_eos" not in p.params_to_wire(PARAMS)


@pytest.mark.parametrize(("change", "words"), [
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": float(p.MAX_PENALTY) + 1}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logit_bias": [[8, 1.0]]}, "logit_bias"),  # past the last stage's vocabulary
    ({"logit_bias": [[3, 1.0], [3, 2.0]]}, "logit_bias"),
    ({"logit_bias": [[3, 101]]}, "logit_bias"),
    ({"logit_bias": [[1, 1]] * (p.MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ({"seed": -1}, "seed"),
    ({"extra": 1}, "exactly"),
    ({"min_tokens": 10}, "min_tokens"),  # past max_tokens
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_params_refused(change: dict[str, Any], words: str) -> None:
    wire = {**p.params_to_wire(PARAMS), **change}
    with pytest.raises(p.ProtocolViolation) as caught:
        p.params_from_wire(wire, vocab_size=8)
    assert caught.value.code == p.ERR_BAD_MESSAGE and words in caught.value.message


def test_history_and_token_logprobs() -> None:
    assert p.history_of({}) == () and p.history_of({"history": [1, 2]}) == (1, 2)
    with pytest.raises(p.ProtocolViolation):
        p.history_of({"history": list(range(p.REPETITION_CONTEXT + 1))})
    header = {"t": "token", "seq": "s", "logprob": -0.25, "top": [[4, -0.25], [9, -3]]}
    assert Token.from_wire(header).logprobs(None) == (None, ())
    assert Token.from_wire(header).logprobs(2) == (-0.25, ((4, -0.25), (9, -3.0)))
    for bad in ({"logprob": 0.5, "top": []}, {"logprob": -1, "top": [[4, -1]] * 3},
                {"top": []}, {"logprob": -1, "top": [[-4, -1]]},
                {"logprob": LOGPROB_FLOOR - 1, "top": []}):
        with pytest.raises(MessageError):
            Token.from_wire({"t": "token", "seq": "s", **bad}).logprobs(2)
