"""A constraint in ``prepare``'s params (pipeline/protocol.py): it travels, and a bad one is
refused before the last stage compiles anything."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.engine import Constraint, SamplingParams
from mlxceld.engine.constraints import MAX_CONSTRAINT_BYTES
from mlxceld.pipeline import protocol as p


@pytest.mark.parametrize("constraint", [
    None, Constraint("json_object"), Constraint("json_schema", '{"type": "object"}'),
    Constraint("lark", 'start: "a" | "b"'),
])
def test_params_with_a_constraint_cross_the_wire(constraint: Constraint | None) -> None:
    params = SamplingParams(max_tokens=9, temperature=0.5, seed=3, constraint=constraint)
    wire = p.params_to_wire(params)
    assert ("constraint" in wire) == (constraint is not None)  # absent: as before it existed
    assert p.params_from_wire(wire) == params


@pytest.mark.parametrize(("constraint", "says"), [
    ({"kind": "regex", "text": "a+"}, "kind"),
    ({"kind": "lark"}, "exactly kind and text"),
    ({"kind": "lark", "text": 7}, "text"),
    ({"kind": "lark", "text": '"' * (MAX_CONSTRAINT_BYTES // 2)}, "at most"),  # escaped: 2x
    ("json", "exactly kind and text"),
])
def test_a_bad_constraint_is_refused(constraint: Any, says: str) -> None:
    wire = p.params_to_wire(SamplingParams(max_tokens=9))
    wire["constraint"] = constraint
    with pytest.raises(p.ProtocolViolation, match=says) as caught:
        p.params_from_wire(wire)
    assert caught.value.code == p.ERR_BAD_MESSAGE
