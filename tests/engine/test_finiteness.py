"""Whether a JSON schema admits a finite value (engine/finiteness.py), and the refusal of one
that does not (``EndlessSchema``): a schema whose references loop with no way out compiles
in llguidance, but its mask then allows nothing but the end (an empty answer with
finish_reason "stop") or one object inside another until max_tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxceld.engine import Constraint
from mlxceld.engine.constraints import ConstraintError, EndlessSchema, compile_grammar
from mlxceld.engine.finiteness import endless

ENDLESS: dict[str, Any] = {
    "itself": {"$ref": "#"},
    "two defs naming each other": {"$defs": {"a": {"$ref": "#/$defs/b"},
                                             "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"},
    "a required property of itself": {"type": "object", "required": ["a"],
                                      "properties": {"a": {"$ref": "#"}}},
    "a non-empty array of itself": {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    "every anyOf branch loops": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    "a required extra property": {"type": "object", "required": ["x"],
                                  "additionalProperties": {"$ref": "#"}},
    "a tuple's second item": {"type": "array", "minItems": 2,
                             "prefixItems": [{"type": "integer"}, {"$ref": "#"}]},
}
FINITE: dict[str, Any] = {
    "plain": {"type": "object", "properties": {"a": {"type": "string"}}},
    "an optional property of itself": {"type": "object",
                                       "properties": {"a": {"$ref": "#"}}},
    "a tree": {"type": "object", "required": ["v", "kids"],
               "properties": {"v": {"type": "integer"},
                              "kids": {"type": "array", "items": {"$ref": "#"}}}},
    "a linked list ending in null": {
        "$defs": {"n": {"type": "object", "required": ["next"], "properties": {
            "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/n"},
    "an object or null": {"type": ["object", "null"], "required": ["a"],
                          "properties": {"a": {"$ref": "#"}}},
    "no type: any scalar": {"required": ["a"], "properties": {"a": {"$ref": "#"}}},
    "a const beside the loop": {"$ref": "#", "const": 1},
    "an enum": {"enum": [1, 2], "allOf": [{"$ref": "#"}]},
    "a reference it cannot resolve": {"$ref": "https://example.invalid/s.json"},
    "false is llguidance's to judge": {"anyOf": [False, {"$ref": "#"}]},
}


@pytest.mark.parametrize("name", ENDLESS)
def test_a_loop_with_no_way_out_is_endless_and_named(name: str) -> None:
    why = endless(ENDLESS[name])
    assert why is not None and "'$ref' '#" in why, why
    with pytest.raises(EndlessSchema) as refused:
        compile_grammar(Constraint("json_schema", json.dumps(ENDLESS[name])))
    assert str(refused.value).startswith("the JSON schema admits no finite value: its "
                                         "references loop with no way out")


@pytest.mark.parametrize("name", FINITE)
def test_a_schema_with_a_way_out_is_left_to_llguidance(name: str) -> None:
    assert endless(FINITE[name]) is None
    try:
        compile_grammar(Constraint("json_schema", json.dumps(FINITE[name])))
    except ConstraintError as exc:  # llguidance's own refusal, never ours
        assert not isinstance(exc, EndlessSchema)


def test_where_the_loop_is_is_named() -> None:
    why = endless(ENDLESS["two defs naming each other"])
    assert why is not None
    assert "'$ref' '#/$defs/b' at #/$defs/a" in why and "'$ref' '#/$defs/a' at #/$defs/b" in why
    why = endless(ENDLESS["a required property of itself"])
    assert why is not None and "'$ref' '#' at #/properties/a" in why


def test_a_long_chain_is_judged_in_linear_time() -> None:
    # 1,500 defs, each naming the next, the last naming the first: within the 48 KiB a
    # schema may have, judged in one pass over the worklist, not 1,500.
    n = 1500
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
    assert endless({"$defs": defs, "$ref": "#/$defs/d0"}) is not None
    defs[f"d{n - 1}"] = {"type": "integer"}
    assert endless({"$defs": defs, "$ref": "#/$defs/d0"}) is None
