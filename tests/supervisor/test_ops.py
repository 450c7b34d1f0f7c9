"""The worker control channel's typed requests (supervisor/ops.py): each goes out as the
line it always was (its fields, then ``op``), and the worker's side names a bad field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxceld.supervisor.ops import (
    Activate,
    Drain,
    Health,
    KeyringUpdate,
    OpError,
    Pipeline,
    Replicas,
    Stats,
    Stop,
    StreamsUnder,
)

A, B = b"a" * 32, b"b" * 32


@pytest.mark.parametrize(("request_", "line"), [
    (Health(), {"op": "health"}),
    (Stats(), {"op": "stats"}),
    (Stop(), {"op": "stop"}),
    (Activate(), {"op": "activate"}),
    (KeyringUpdate.of(B, [A]), {"primary_hex": B.hex(), "accepted_hex": [A.hex()],
                                "op": "keyring"}),
    (StreamsUnder("00" * 8), {"kid": "00" * 8, "op": "streams"}),
    (Drain(({"node": "n1", "deadline": None},)), {"drains": [{"node": "n1",
                                                              "deadline": None}],
                                                  "op": "drain"}),
    (Replicas(({"node_id": "n1", "agent": "127.0.0.1:19000"},)),
     {"candidates": [{"node_id": "n1", "agent": "127.0.0.1:19000"}], "op": "replicas"}),
    (Pipeline({"model": "m"}), {"options": {"model": "m"}, "op": "pipeline"}),
])
def test_a_request_is_the_line_it_always_was(request_: Any, line: dict[str, Any]) -> None:
    # As channel.call wrote it before: {**args, "op": op}, the same bytes.
    assert json.dumps(request_.to_wire()) == json.dumps(line)


def test_the_workers_side_names_the_bad_field_never_a_secret() -> None:
    with pytest.raises(OpError) as err:
        StreamsUnder.from_wire({"op": "streams", "kid": "zz"})
    assert err.value.field == "kid"
    with pytest.raises(OpError) as err:
        KeyringUpdate.from_wire({"op": "keyring", "primary_hex": A.hex(),
                                 "accepted_hex": [B.hex()[:-2] + "zz"]})
    assert err.value.field == "accepted_hex" and A.hex() not in str(err.value)
    assert B.hex() not in repr(KeyringUpdate.of(B, [A]))
