"""Memory for a plan: what a peer reports available (``MLXCELD_TEST_MEMORY_AVAILABLE``) so
that a model fits in two stages on two hosts but not in one stage on one."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.cluster.plan.model import PlanNode, usable_memory
from mlxceld.cluster.plan.solver import plan_stages
from mlxceld.errors import PlanRefused
from mlxceld.models.profile import layer_profile


def two_stages_but_not_one(model: Path) -> int:
    """Memory available (bytes) with which two stages of ``model`` fit on two hosts, one
    stage on one host does not (the default reserve, as the daemon plans)."""
    profile = layer_profile(model)

    def nodes(n: int, usable: int) -> list[PlanNode]:
        return [PlanNode(f"n{i}", f"127.0.0.{i + 2}:19000", usable, 19100) for i in range(n)]

    big = 1 << 50
    one = plan_stages(profile, 1, nodes(1, big)).stages[0].needed_bytes
    two = max(s.needed_bytes for s in plan_stages(profile, 2, nodes(2, big)).stages)
    assert two < one
    target = (one + two) // 2
    available = target
    while usable_memory(available) < target:
        available += 1 + (target - usable_memory(available))
    plan_stages(profile, 2, nodes(2, usable_memory(available)))  # fits
    with pytest.raises(PlanRefused):
        plan_stages(profile, 1, nodes(1, usable_memory(available)))
    return available
