"""A tensor group across hosts' messages (wire/tensor_messages.py): each header and back,
and every field out of bounds refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.wire.messages import MessageError, decode
from mlxceld.wire.tensor_messages import (
    TENSOR_ANSWERED,
    TENSOR_ASKED,
    TensorJoin,
    TensorJoined,
    TensorReserve,
    TensorReserved,
)

MODEL = "ab" * 32
RING = ("10.0.0.10:40000", "10.0.0.11:40001")
HOST = {"system": "darwin", "macos": [26, 2], "jaccl": True, "devices": ["rdma_en3"]}


@pytest.mark.parametrize(("message", "header"), [
    (TensorReserve(MODEL, 1, 2), {"t": "tensor_reserve", "model": MODEL, "rank": 1,
                                  "size": 2}),
    (TensorReserved("10.0.0.11:40001"), {"t": "tensor_reserved", "ring": "10.0.0.11:40001"}),
    (TensorReserved("10.0.0.11:40001", HOST), {"t": "tensor_reserved",
                                               "ring": "10.0.0.11:40001", "host": HOST}),
    (TensorJoin(MODEL, 1, RING, 8), {"t": "tensor_join", "model": MODEL, "rank": 1,
                                     "hosts": list(RING), "max_batch": 8}),
    # a pipeline stage's group: its layers and node ride along
    (TensorJoin(MODEL, 1, RING, 8, (2, 4), "stage-1"),
     {"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": list(RING), "max_batch": 8,
      "layers": [2, 4], "node_id": "stage-1"}),
    (TensorJoined(1), {"t": "tensor_joined", "rank": 1}),
])
def test_each_message_goes_out_as_its_header_and_comes_back(message: Any,
                                                            header: dict[str, Any]) -> None:
    assert message.to_wire() == header
    assert decode(header, TENSOR_ASKED | TENSOR_ANSWERED) == message


@pytest.mark.parametrize(("header", "field"), [
    ({"t": "tensor_reserve", "model": "AB" * 32, "rank": 1, "size": 2}, "model"),
    ({"t": "tensor_reserve", "model": MODEL, "rank": 2, "size": 2}, "rank"),  # rank 0 is us
    ({"t": "tensor_reserve", "model": MODEL, "rank": 0, "size": 2}, "rank"),
    ({"t": "tensor_reserve", "model": MODEL, "rank": 1, "size": 17}, "size"),
    ({"t": "tensor_reserve", "model": MODEL, "rank": True, "size": 2}, "rank"),
    ({"t": "tensor_reserved", "ring": "nowhere"}, "ring"),
    ({"t": "tensor_reserved", "ring": RING[1], "host": "darwin"}, "host"),
    ({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": [RING[0]], "max_batch": 8},
     "hosts"),
    ({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": [RING[0], RING[0]],
      "max_batch": 8}, "hosts"),
    ({"t": "tensor_join", "model": MODEL, "rank": 2, "hosts": list(RING), "max_batch": 8},
     "rank"),
    ({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": list(RING), "max_batch": 0},
     "max_batch"),
    *(({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": list(RING), "max_batch": 8,
        "layers": layers, "node_id": "stage-1"}, "layers")
      for layers in ([4, 2], [2], [-1, 2], [0, True], "0-2", [0.0, 2])),
    ({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": list(RING), "max_batch": 8,
      "layers": [0, 2]}, "node_id"),
    ({"t": "tensor_join", "model": MODEL, "rank": 1, "hosts": list(RING), "max_batch": 8,
      "layers": [0, 2], "node_id": ""}, "node_id"),
    ({"t": "tensor_joined", "rank": 0}, "rank"),
])
def test_a_field_out_of_bounds_is_refused_by_name(header: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageError) as err:
        decode(header, TENSOR_ASKED | TENSOR_ANSWERED)
    assert err.value.field == field
