"""Typed MXCL messages (wire/messages.py, wire/agent_messages.py): each one's header is the
dict that has always gone out, byte for byte once encoded, and ``from_wire`` names the
field it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.wire import encode_envelope
from mlxceld.wire.agent_messages import (
    ANSWERED,
    ASKED,
    AssignmentRequest,
    Inventory,
    InventoryRequest,
    KeyInstall,
    KeyRemove,
    KeyReport,
    KeyState,
    KeyUse,
    Plan,
    PlanRequest,
    PlanStage,
    Serving,
    ServingRequest,
)
from mlxceld.wire.assignment_messages import (
    Abort,
    Accepted,
    Activate,
    Commit,
    Deactivate,
    Deactivated,
    Decision,
    DecisionQuery,
    Preparing,
    Refused,
)
from mlxceld.wire.messages import Error, MessageError, Ping, Pong, decode

INVENTORY = {"t": "inventory", "node": "host-a", "version": "1.0",
             "platform": {"system": "darwin", "machine": "arm64"}, "memory_total": 64,
             "memory_available": 32, "model": None, "ports": [40001, 40002], "agent":
             "127.0.0.1:19000", "key_id": "00112233445566ff"}

# Each message and the literal it replaced, as the code wrote it before.
SAME_BYTES: list[tuple[Any, dict[str, Any]]] = [
    (Ping(7), {"t": "ping", "id": 7}),
    (Pong(7), {"t": "pong", "id": 7}),
    (Error("bad envelope: x"), {"t": "error", "reason": "bad envelope: x"}),
    (InventoryRequest(), {"t": "inventory"}),
    (ServingRequest(), {"t": "serving"}),
    (Serving("hybrid", 4000, "a" * 64), {"t": "serving", "role": "hybrid", "port": 4000,
                                         "model": "a" * 64}),
    (KeyInstall("ab" * 16), {"t": "key_install", "secret_hex": "ab" * 16}),
    (KeyUse("00" * 8), {"t": "key_use", "kid": "00" * 8}),
    (KeyRemove("00" * 8), {"t": "key_remove", "kid": "00" * 8}),
    (KeyReport(), {"t": "key_report"}),
    (PlanRequest(), {"t": "plan"}),
    (AssignmentRequest(), {"t": "assignment"}),
    (KeyState("00" * 8, ("00" * 8, "11" * 8)), {"t": "key_state", "primary": "00" * 8,
                                               "ids": ["00" * 8, "11" * 8]}),
    (Inventory.from_wire(INVENTORY), INVENTORY),
    (Commit(3), {"t": "commit", "epoch": 3}),
    (Activate(3), {"t": "activate", "epoch": 3}),
    (DecisionQuery(3), {"t": "query", "epoch": 3}),
    (Abort(3, "peer x: gone"), {"t": "abort", "epoch": 3, "summary": "peer x: gone"}),
    (Abort(3), {"t": "abort", "epoch": 3}),  # re-sent over a new connection
    (Accepted(3), {"t": "accepted", "epoch": 3}),
    (Deactivated(3, "the stage is stopped"), {"t": "deactivated", "epoch": 3,
                                              "reason": "the stage is stopped"}),
    (Deactivate(3, "ended"), {"t": "deactivate", "epoch": 3, "reason": "ended"}),
    (Decision(3, "commit"), {"t": "decision", "epoch": 3, "decision": "commit"}),
    (Refused(3, "busy", "plan 2 is committed here", final=False),
     {"t": "refused", "epoch": 3, "code": "busy", "final": False,
      "reason": "plan 2 is committed here"}),
    (Preparing(3), {"t": "preparing", "epoch": 3}),
    (Preparing(3, "", 5, 10, 1.5, "loading"), {"t": "preparing", "epoch": 3, "done": 5,
                                               "total": 10, "elapsed_s": 1.5,
                                               "step": "loading"}),
]


@pytest.mark.parametrize(("message", "literal"), SAME_BYTES)
def test_a_message_goes_out_as_the_literal_it_replaced(message: Any,
                                                      literal: dict[str, Any]) -> None:
    assert encode_envelope(message.to_wire()) == encode_envelope(literal)
    assert type(message).from_wire(literal) == message


def test_the_bare_questions_differ_by_their_type_alone() -> None:
    """The questions that are their type alone (``BareQuestion``): one each in ``ASKED``,
    none equal to another."""
    kinds = (InventoryRequest, ServingRequest, KeyReport, PlanRequest, AssignmentRequest)
    assert [ASKED[k.T] for k in kinds] == list(kinds)
    assert len({k() for k in kinds}) == len(kinds)


def test_decode_picks_the_class_by_type_and_direction() -> None:
    assert decode({"t": "inventory"}, ASKED) == InventoryRequest()
    assert decode(INVENTORY, ANSWERED) == Inventory.from_wire(INVENTORY)
    assert decode({"t": "error", "reason": "no"}, ANSWERED) == Error("no")
    with pytest.raises(MessageError, match="unexpected message type 'offer'") as err:
        decode({"t": "offer"}, ASKED)
    assert err.value.field == "t"


@pytest.mark.parametrize(("kind", "header", "field"), [
    (KeyUse, {"t": "key_use"}, "kid"),
    (KeyInstall, {"t": "key_install", "secret_hex": "zz"}, "secret_hex"),
    (KeyState, {"t": "key_state", "primary": None}, "ids"),
    (Serving, {"t": "serving", "role": "hybrid", "port": 0, "model": None}, "port"),
    (Inventory, {**INVENTORY, "memory_available": 65}, "memory_available"),
    (Inventory, {**INVENTORY, "node": ""}, "node"),
    (Ping, {"t": "ping", "id": True}, "id"),
])
def test_from_wire_names_the_field_it_refuses(kind: Any, header: dict[str, Any],
                                               field: str) -> None:
    with pytest.raises(MessageError) as err:
        kind.from_wire(header)
    assert err.value.field == field
    assert err.value.kind == "bad_envelope"  # a peer's fault, as any envelope's


def test_a_key_install_never_shows_its_secret() -> None:
    assert "ab" * 16 not in repr(KeyInstall("ab" * 16))


PLAN = {"t": "plan", "epoch": 4, "cluster": "lab", "model": "b" * 64,
        "stages": [{"node": "s0", "address": "10.0.0.2:4000", "rank": 0, "layers": [0, 2]},
                   {"node": "s1", "address": "10.0.0.3:4000", "rank": 1, "layers": [2, 4]}]}


def test_a_plan_answer_round_trips_and_no_plan_is_empty() -> None:
    plan = Plan.from_wire(PLAN)
    assert plan.to_wire() == PLAN and plan.stages[1] == PlanStage("s1", "10.0.0.3:4000", 1,
                                                                  (2, 4))
    assert decode({"t": "plan"}, ASKED) == PlanRequest()
    assert decode(PLAN, ANSWERED) == plan
    none = {"t": "plan", "epoch": None, "cluster": None, "model": None, "stages": []}
    assert Plan.from_wire(none).stages == ()


MESH_PLAN = {**PLAN, "stages": [{**s, "tp_group": [f"10.0.0.{2 + 2 * i}:19000",
                                                    f"10.0.0.{3 + 2 * i}:19000"]}
                                 for i, s in enumerate(PLAN["stages"])]}


def test_a_mesh_plan_carries_each_stages_group_and_round_trips() -> None:
    """A 2D mesh's stages carry ``tp_group`` (every rank's agent); a pipeline's leave the
    key out, so its answer is the one of before key for key."""
    plan = Plan.from_wire(MESH_PLAN)
    assert plan.to_wire() == MESH_PLAN and plan.tp_size == 2
    assert plan.stages[1].tp_group == ("10.0.0.4:19000", "10.0.0.5:19000")
    assert decode(MESH_PLAN, ANSWERED) == plan
    assert Plan.from_wire(PLAN).tp_size == 1 and "tp_group" not in str(
        Plan.from_wire(PLAN).to_wire())


@pytest.mark.parametrize(("header", "field"), [
    ({**MESH_PLAN, "stages": [{**PLAN["stages"][0], "tp_group": ["10.0.0.2:19000"]}]},
     "tp_group"),  # a group of one
    ({**MESH_PLAN, "stages": [{**PLAN["stages"][0], "tp_group": "10.0.0.2:19000"}]},
     "tp_group"),
    ({**MESH_PLAN, "stages": [{**PLAN["stages"][0], "tp_group": ["a"] * 17}]}, "tp_group"),
    ({**MESH_PLAN, "stages": [MESH_PLAN["stages"][0], PLAN["stages"][1]]}, "tp_group"),
    ({**PLAN, "stages": PLAN["stages"][::-1]}, "stages"),  # out of rank order
    ({**PLAN, "model": None}, "model"),  # stages of no model
    ({**PLAN, "epoch": -1}, "epoch"),
    ({**PLAN, "stages": [{**PLAN["stages"][0], "layers": [2, 2]}]}, "stages"),
    ({**PLAN, "stages": [{"node": "s0"}]}, "stages"),
    ({**PLAN, "extra": 1}, "t"),
])
def test_a_plan_out_of_bounds_is_refused_naming_the_field(header: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(MessageError) as err:
        Plan.from_wire(header)
    assert err.value.field == field


def test_the_assignment_answer_round_trips_and_is_checked() -> None:
    """Channel 3's ``assignment`` (cluster/fencing.py): the peer's newest plan and whose."""
    from mlxceld.wire.agent_messages import Assignment

    held = Assignment(17, "10.0.0.5:19000", "active")
    assert Assignment.from_wire(held.to_wire()) == held
    assert Assignment.from_wire(Assignment(None, None, None).to_wire()).epoch is None
    for bad, field in (({**held.to_wire(), "epoch": -1}, "epoch"),
                       ({**held.to_wire(), "coordinator": None}, "coordinator"),
                       ({**held.to_wire(), "extra": 1}, None)):
        with pytest.raises(MessageError) as err:
            Assignment.from_wire(bad)
        assert field is None or err.value.field == field, err.value
    # With its lease (cluster/lease.py); a peer of an older release sends none of it.
    leased = Assignment(17, "10.0.0.5:19000", "active", "10.0.0.1:19000", 16, 0.5, 9.5)
    assert Assignment.from_wire(leased.to_wire()) == leased
    old = {k: v for k, v in held.to_wire().items() if k in ("t", "epoch", "coordinator", "state")}
    assert Assignment.from_wire(old) == held and held.lease_s is None
    for bad, field in (({**leased.to_wire(), "lease_s": -1}, "lease_s"),
                       ({**leased.to_wire(), "holder": None}, "coordinator"),
                       ({**leased.to_wire(), "held": "x"}, "held")):
        with pytest.raises(MessageError) as err:
            Assignment.from_wire(bad)
        assert err.value.field == field, err.value
