"""The words channel 1's two protocols share (wire/transport_messages.py): each message's
header is the one the stage and replica protocols document (``pipeline/protocol.py``'s and
``replicas/protocol.py``'s tables), key for key and byte for byte once encoded, and
``from_wire`` names the field it refuses. The expected headers are written out here from
those tables, not computed."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.wire import Envelope, encode_envelope
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import (
    LOGPROB_FLOOR,
    Attach,
    CodedError,
    Token,
    error_in,
    seq_field,
)

MODEL = "ab" * 32

SAME_BYTES: list[tuple[Any, dict[str, Any]]] = [
    # attach: model, cluster; a stage's also its prompt cache's epoch and bound
    (Attach(MODEL, "lab"), {"t": "attach", "model": MODEL, "cluster": "lab"}),
    (Attach(MODEL, "lab", "0123abcd0123abcd"),
     {"t": "attach", "model": MODEL, "cluster": "lab", "cache": "0123abcd0123abcd"}),
    (Attach(MODEL, "lab", "e1", 1 << 30),
     {"t": "attach", "model": MODEL, "cluster": "lab", "cache": "e1",
      "cache_bytes": 1 << 30}),
    # a stage's token: seq, step; logprob and top when asked
    (Token("s-1", 7), {"t": "token", "seq": "s-1", "step": 7}),
    (Token("s-1", 0, -0.25, ((4, -0.25), (9, -3.0))),
     {"t": "token", "seq": "s-1", "step": 0, "logprob": -0.25,
      "top": [[4, -0.25], [9, -3.0]]}),
    # a replica's token: seq; logprob and top; finish_reason on the last; cached on the first
    (Token("r.2"), {"t": "token", "seq": "r.2"}),
    (Token("r.2", logprob=-1.5, top=()), {"t": "token", "seq": "r.2", "logprob": -1.5,
                                          "top": []}),
    (Token("r.2", finish_reason="length"), {"t": "token", "seq": "r.2",
                                            "finish_reason": "length"}),
    (Token("r.2", None, -0.5, ((3, -0.5),), "stop", 12),
     {"t": "token", "seq": "r.2", "logprob": -0.5, "top": [[3, -0.5]],
      "finish_reason": "stop", "cached": 12}),
    # error: code, message; seq and step when it concerns one; retry_after_s (replicas)
    (CodedError("model_mismatch", "wrong model"),
     {"t": "error", "code": "model_mismatch", "message": "wrong model"}),
    (CodedError("downstream_unreachable", "stage s1 is gone", "s-1", 4),
     {"t": "error", "code": "downstream_unreachable", "message": "stage s1 is gone",
      "seq": "s-1", "step": 4}),
    (CodedError("busy", "full", "r.2"),
     {"t": "error", "code": "busy", "message": "full", "seq": "r.2"}),
    (CodedError("unavailable", "a stage is down", "r.2", retry_after_s=5),
     {"t": "error", "code": "unavailable", "message": "a stage is down", "seq": "r.2",
      "retry_after_s": 5}),
]


@pytest.mark.parametrize(("message", "literal"), SAME_BYTES)
def test_a_message_goes_out_as_the_literal_it_replaced(message: Any,
                                                      literal: dict[str, Any]) -> None:
    assert list(message.to_wire().items()) == list(literal.items())
    assert encode_envelope(message.to_wire()) == encode_envelope(literal)
    assert type(message).from_wire(literal) == message


def test_an_error_message_goes_out_cut_to_1000_characters() -> None:
    header = CodedError("internal", "x" * 1500, "s").to_wire()
    assert header == {"t": "error", "code": "internal", "message": "x" * 1000, "seq": "s"}


def test_an_error_names_whatever_seq_the_refused_message_named() -> None:
    """A refusal of a bad ``seq`` echoes it: the error's ``seq`` is any string."""
    header = {"t": "error", "code": "bad_message", "message": "no", "seq": "?" * 70}
    assert CodedError.from_wire(header).seq == "?" * 70


@pytest.mark.parametrize(("kind", "header", "field"), [
    (Attach, {"t": "attach", "cluster": "lab"}, "model"),
    (Attach, {"t": "attach", "model": 5, "cluster": "lab"}, "model"),
    (Attach, {"t": "attach", "model": MODEL}, "cluster"),
    (Attach, {"t": "attach", "model": MODEL, "cluster": "lab", "cache": "a b"}, "cache"),
    (Attach, {"t": "attach", "model": MODEL, "cluster": "lab", "cache_bytes": -1},
     "cache_bytes"),
    (Attach, {"t": "attach", "model": MODEL, "cluster": "lab", "cache_bytes": True},
     "cache_bytes"),
    (Token, {"t": "token"}, "seq"),
    (Token, {"t": "token", "seq": ""}, "seq"),
    (Token, {"t": "token", "seq": "x" * 65}, "seq"),
    (Token, {"t": "token", "seq": "a/b"}, "seq"),
    (Token, {"t": "token", "seq": "s", "step": -1}, "step"),
    (Token, {"t": "token", "seq": "s", "step": 2**31}, "step"),
    (Token, {"t": "token", "seq": "s", "step": 1.0}, "step"),
    (Token, {"t": "token", "seq": "s", "logprob": 0.5, "top": []}, "logprob"),
    (Token, {"t": "token", "seq": "s", "logprob": LOGPROB_FLOOR - 1, "top": []}, "logprob"),
    (Token, {"t": "token", "seq": "s", "top": []}, "logprob"),
    (Token, {"t": "token", "seq": "s", "logprob": -1}, "logprob"),
    (Token, {"t": "token", "seq": "s", "logprob": -1, "top": [[-4, -1]]}, "logprob"),
    (Token, {"t": "token", "seq": "s", "logprob": -1, "top": [[4, 1]]}, "logprob"),
    (Token, {"t": "token", "seq": "s", "logprob": -1, "top": [[4]]}, "logprob"),
    (Token, {"t": "token", "seq": "s", "finish_reason": "eos"}, "finish_reason"),
    (Token, {"t": "token", "seq": "s", "cached": -1}, "cached"),
    (Token, {"t": "token", "seq": "s", "cached": True}, "cached"),
    (CodedError, {"t": "error", "message": "no"}, "code"),
    (CodedError, {"t": "error", "code": "busy"}, "message"),
    (CodedError, {"t": "error", "code": "busy", "message": 3}, "message"),
    (CodedError, {"t": "error", "code": "busy", "message": "no", "seq": 1}, "seq"),
    (CodedError, {"t": "error", "code": "busy", "message": "no", "step": "1"}, "step"),
    (CodedError, {"t": "error", "code": "busy", "message": "no", "retry_after_s": "5"},
     "retry_after_s"),
])
def test_from_wire_names_the_field_it_refuses(kind: Any, header: dict[str, Any],
                                               field: str) -> None:
    with pytest.raises(MessageError) as err:
        kind.from_wire(header)
    assert err.value.field == field
    assert err.value.kind == "bad_envelope"  # a peer's fault, as any envelope's


def test_a_sequence_id_is_1_to_64_characters_of_its_alphabet() -> None:
    for good in ("a", "A-z_0.9", "x" * 64):
        assert seq_field({"seq": good}) == good
    with pytest.raises(MessageError, match="'entry' must be 1-64 characters"):
        seq_field({"entry": "é"}, "entry")


def test_a_token_gives_its_logprobs_only_as_asked() -> None:
    token = Token("s", 1, -0.25, ((4, -0.25), (9, -3.0)))
    assert token.logprobs(None) == (None, ())
    assert token.logprobs(2) == (-0.25, ((4, -0.25), (9, -3.0)))
    for wanted, bad in ((1, token), (2, Token("s", 1))):
        with pytest.raises(MessageError, match=f"at most {wanted} alternatives") as err:
            bad.logprobs(wanted)
        assert err.value.field == "logprob"


def test_a_refusal_is_read_leniently_where_it_is_only_said() -> None:
    """``error_in``: an error as sent; another message in its place as its type; an error
    that does not read as one says so; no code but a real one."""
    said = {"t": "error", "code": "standby", "message": "not active yet"}
    assert error_in(Envelope("error", said, {})) == CodedError("standby", "not active yet")
    assert error_in(Envelope("prepared", {"t": "prepared"}, {})) == CodedError("", "prepared")
    bad = error_in(Envelope("error", {"t": "error", "code": 3}, {}))
    assert bad.code == "" and "'code'" in bad.message
